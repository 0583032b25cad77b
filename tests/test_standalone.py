"""A standalone module (runtime inlined) behaves exactly as the packaged one."""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from posgen.codegen.render import render_standalone
from posgen.codegen.writing import plan_for
from posgen.spec.loader import load_spec
from tests.conftest import ROOT, SPECS, generated_class, spec_names

RUFF = shutil.which("ruff")
CHECKED = ["alibi", "t5", "rope_gptj", "shaw", "transformer_xl", "tupe_r", "floater"]


def _write_standalone(name: str, folder: Path) -> Path:
    path = folder / f"standalone_{name}.py"
    path.write_text(render_standalone(plan_for(load_spec(SPECS / f"{name}.yaml"))), "utf-8")
    return path


def _import_file(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", CHECKED)
def test_standalone_file_matches_the_packaged_module(name: str, tmp_path: Path) -> None:
    module = _import_file(_write_standalone(name, tmp_path))
    (class_name,) = module.__all__
    packaged_cls = generated_class(name)
    assert class_name == packaged_cls.__name__
    packaged = packaged_cls(heads=2, head_dim=8).double()
    standalone = getattr(module, class_name)(heads=2, head_dim=8).double()
    standalone.load_state_dict(packaged.state_dict())  # the same weight layout
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 5, 8, generator=generator, dtype=torch.float64)
    k = torch.randn(2, 2, 6, 8, generator=generator, dtype=torch.float64)
    v = torch.randn(2, 2, 6, 8, generator=generator, dtype=torch.float64)
    for backend in ("eager", "sdpa"):
        for causal in (False, True):
            want = packaged(q, k, v, causal=causal, backend=backend)
            got = standalone(q, k, v, causal=causal, backend=backend)
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_standalone_imports_only_torch_and_the_standard_library(tmp_path: Path) -> None:
    """At module level; the optional triton is imported only inside the fused rotation."""
    source = _write_standalone("deberta", tmp_path).read_text("utf-8")
    tree = ast.parse(source)
    top_level = set(tree.body)
    for node in ast.walk(tree):
        optional = set() if node in top_level else {"triton"}
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a standalone file has no sibling runtime"
            root = (node.module or "").split(".")[0]
            assert root in {"__future__", "collections", "typing", "torch"} | optional
        elif isinstance(node, ast.Import):
            roots = {alias.name.split(".")[0] for alias in node.names}
            assert (
                roots
                <= {"contextlib", "functools", "math", "torch", "warnings", "weakref"} | optional
            )
    assert "class PositionalAttention(SdpaBackend, FlexBackend):" in source


@pytest.mark.skipif(RUFF is None, reason="ruff (the pinned dev dependency) is not installed")
def test_standalone_files_are_ruff_clean(tmp_path: Path) -> None:
    for name in spec_names():
        _write_standalone(name, tmp_path)
    config = str(ROOT / "pyproject.toml")
    for command in (["format", "--check"], ["check"]):
        result = subprocess.run(
            [RUFF, *command, "--config", config, str(tmp_path)], capture_output=True, text=True
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_cli_writes_a_standalone_file_that_imports_from_any_folder(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from posgen.cli import main

    out = tmp_path / "copied" / "alibi_attention.py"
    out.parent.mkdir()
    runner = CliRunner()
    specs = str(SPECS)
    result = runner.invoke(main, ["generate", specs, "--standalone", "alibi", "--out", str(out)])
    assert result.exit_code == 0, result.output
    check = runner.invoke(
        main, ["generate", specs, "--standalone", "alibi", "--out", str(out), "--check"]
    )
    assert check.exit_code == 0, check.output
    module = _import_file(out)
    pe, packaged = module.Alibi(heads=4, head_dim=8), generated_class("alibi")(heads=4, head_dim=8)
    q, k, v = (torch.randn(1, 4, 6, 8) for _ in range(3))
    torch.testing.assert_close(pe(q, k, v, causal=True), packaged(q, k, v, causal=True))


def test_cli_standalone_refuses_bad_targets(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from posgen.cli import main

    runner = CliRunner()
    specs = str(SPECS)
    mine = tmp_path / "mine.py"
    mine.write_text("x = 1\n")
    for args in (
        ["--standalone", "alibi", "--out", str(mine)],  # a file posgen did not write
        ["--standalone", "alibi", "--out", str(tmp_path)],  # a folder
        ["--standalone", "alibi"],  # no --out FILE
        ["--standalone", "no_such_spec", "--out", str(tmp_path / "x.py")],
    ):
        result = runner.invoke(main, ["generate", specs, *args])
        assert result.exit_code == 2, (args, result.output)
        assert "Traceback" not in result.output
    assert mine.read_text() == "x = 1\n"
    assert not (tmp_path / "x.py").exists()


def test_catalogue_names_reach_generate_from_a_project_with_its_own_specs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a project whose ./specs holds only its own specs, ``--standalone alibi`` and
    ``generate alibi`` take alibi from the catalogue, as ``explain alibi`` does; they
    said "no spec named 'alibi'; known: mine" and "no such spec file: alibi"."""
    from click.testing import CliRunner

    from posgen.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "specs").mkdir()
    mine = (SPECS / "nope.yaml").read_text(encoding="utf-8").replace("name: nope\n", "name: mine\n")
    (tmp_path / "specs" / "mine.yaml").write_text(mine, encoding="utf-8")
    runner = CliRunner()
    result = runner.invoke(main, ["generate", "--standalone", "alibi", "--out", "alibi_pe.py"])
    assert result.exit_code == 0, result.output
    assert _import_file(tmp_path / "alibi_pe.py").Alibi.__name__ == "Alibi"
    result = runner.invoke(main, ["generate", "alibi", "mine"])  # a subset run, by name
    assert result.exit_code == 0, result.output
    assert {"alibi.py", "mine.py"} <= {path.name for path in (tmp_path / "generated").iterdir()}
    # a subset run into a folder without a registry writes one of the modules it wrote
    registry = (tmp_path / "generated" / "__init__.py").read_text(encoding="utf-8")
    assert "from .alibi import Alibi" in registry and "from .mine import Mine" in registry
    result = runner.invoke(main, ["generate", "--standalone", "nosuch", "--out", "x.py"])
    assert result.exit_code == 2 and "no spec named 'nosuch'" in result.output, result.output
