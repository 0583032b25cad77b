"""Generated code is ruff-clean as rendered, and a wheel install still finds templates."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import GENERATED, ROOT, RUNTIME_FILES, spec_names

RUFF = shutil.which("ruff")


@pytest.mark.skipif(RUFF is None, reason="ruff (the pinned dev dependency) is not installed")
@pytest.mark.parametrize("command", [["format", "--check"], ["check"]])
def test_generated_code_is_ruff_stable(command: list[str]) -> None:
    result = subprocess.run(
        [RUFF, *command, "--config", str(ROOT / "pyproject.toml"), str(GENERATED)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(RUFF is None, reason="ruff (the pinned dev dependency) is not installed")
@pytest.mark.parametrize("command", [["format", "--check"], ["check"]])
def test_hand_written_code_is_formatted_and_passes_the_linter(command: list[str]) -> None:
    folders = [str(ROOT / name) for name in ("posgen", "tests", "benchmarks", "templates")]
    result = subprocess.run(
        [RUFF, *command, "--config", str(ROOT / "pyproject.toml"), *folders],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_modules_import_only_torch_and_stdlib() -> None:
    """Module-level imports are torch and the standard library; triton (optional) is
    imported only inside functions, by the runtime's fused rotary kernel."""
    import ast

    for path in GENERATED.glob("*.py"):
        tree = ast.parse(path.read_text())
        top_level = set(tree.body)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            allowed = {
                "__future__",
                "collections",
                "contextlib",
                "functools",
                "math",
                "typing",
                "torch",
                "warnings",
                "weakref",
            }
            if node not in top_level:
                allowed.add("triton")
            assert roots <= allowed, (path.name, roots)


@pytest.mark.slow
def test_wheel_install_finds_its_templates(tmp_path: Path) -> None:
    """A non-editable install carries the templates and the catalogue, from any cwd."""
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
    )
    if built.returncode != 0:
        pytest.skip(f"could not build a wheel here: {built.stderr[-300:]}")
    (wheel,) = tmp_path.glob("posgen-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        assert "posgen/_templates/module.py.jinja" in names
        assert {f"posgen/_templates/runtime/{name}" for name in RUNTIME_FILES} <= names
        assert "posgen/_specs/t5.yaml" in names
        archive.extractall(tmp_path / "site")
    script = (
        "import pathlib, posgen.codegen.render as r;"
        "assert pathlib.Path(r.__file__).is_relative_to(pathlib.Path(r'%s'));"
        "print(r.templates_dir())" % (tmp_path / "site")
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "site" / "posgen" / "_templates")
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "posgen",
            "generate",
            str(ROOT / "specs" / "t5.yaml"),
            "--out",
            str(tmp_path / "gen"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"},
    )
    assert gen.returncode == 0, gen.stderr
    assert (tmp_path / "gen" / "t5.py").read_text().count("class T5(PositionalAttention)") == 1
    written = sorted(path.name for path in (tmp_path / "gen").glob("*.py"))
    assert written == sorted([*RUNTIME_FILES, "__init__.py", "t5.py"])  # a registry: new folder
    _installed_wheel_finds_its_catalogue(tmp_path / "site", tmp_path / "elsewhere")


def _installed_wheel_finds_its_catalogue(site: Path, cwd: Path) -> None:
    """From a folder without specs/, list, explain and check use the packaged catalogue."""
    cwd.mkdir()
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}

    def posgen(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "posgen", *args]
        return subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env)

    listed = posgen("list")
    assert listed.returncode == 0, listed.stderr
    for name in spec_names():
        assert any(line.startswith(name + " ") for line in listed.stdout.splitlines()), name
    explained = posgen("explain", "t5")
    assert explained.returncode == 0 and "content_content" in explained.stdout, explained.stderr
    found = subprocess.run(
        [sys.executable, "-c", "import posgen.cli_paths as p; print(p.spec_files(())[0])"],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
    )  # what `posgen check` with no SPECS would check
    assert found.stdout.strip() == str(site / "posgen" / "_specs" / "alibi.yaml"), found.stderr
    generated = posgen("generate")  # no ./specs here: a clear usage error, nothing written
    assert generated.returncode == 2 and "no ./specs folder here" in generated.stderr
    assert str(site / "posgen" / "_specs") in generated.stderr
    assert list(cwd.iterdir()) == []
