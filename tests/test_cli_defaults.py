"""Defaults and ranges of the command line: the built-in catalogue from any working
directory, ./specs for generate, and check's seed range (issue 11, items 14 and 18)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from posgen.cli import main
from posgen.cli_paths import spec_files
from posgen.codegen.render import catalogue_dir
from tests.conftest import SPECS, spec_names


def invoke(*args: str) -> Result:
    """Run the CLI in-process; anything but a clean exit (a traceback) fails the test."""
    result = CliRunner().invoke(main, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"{type(result.exception).__name__}: {result.exception}\n{result.output}"
    )
    return result


# --------------------------------------------------------------------------- item 18


def test_the_catalogue_is_the_checkouts_specs_folder_here() -> None:
    """In a checkout (editable install) the catalogue is specs/; a wheel packs it."""
    assert catalogue_dir() == SPECS


def test_a_bare_name_is_a_spec_name_even_beside_a_file_of_that_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only an argument ending in .yaml/.yml or holding a path separator is a path."""
    (tmp_path / "rope").mkdir()
    (tmp_path / "alibi").write_text("my notes\n")
    (tmp_path / "my_idea").write_text("name: my_idea\n")
    monkeypatch.chdir(tmp_path)
    for name in ("rope", "alibi"):
        explained = invoke("explain", name)
        assert explained.exit_code == 0 and "content_content" in explained.stdout, name
    copied = invoke("new", "my_rope", "--from", "rope", "--out", "my_rope.yaml")
    assert copied.exit_code == 0, copied.output
    as_path = invoke("explain", "./rope")  # a path: the folder, which is no spec
    assert as_path.exit_code == 2 and "not a regular file" in as_path.stderr
    unknown = invoke("explain", "my_idea")  # a file here, but no spec name: a hint
    assert unknown.exit_code == 2 and "no spec named 'my_idea'" in unknown.stderr
    assert "for the file here, write ./my_idea" in unknown.stderr


def test_list_explain_and_check_find_the_catalogue_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    listed = invoke("list")
    assert listed.exit_code == 0, listed.output
    for name in spec_names():
        assert any(line.startswith(name + " ") for line in listed.stdout.splitlines()), name
    explained = invoke("explain", "t5")
    assert explained.exit_code == 0 and "content_content" in explained.stdout
    # what `posgen check` with no SPECS checks
    assert [path.name for path in spec_files(())] == [f"{name}.yaml" for name in spec_names()]


def test_check_and_plot_take_a_spec_name_as_explain_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name that is no file here is looked up (./specs, then the catalogue); a file or
    folder of that name here is still the path it names."""
    (tmp_path / "specs").mkdir()
    local = (SPECS / "alibi.yaml").read_text().replace("claims: {", "claims: {unique: true, ")
    (tmp_path / "specs" / "alibi.yaml").write_text(local)
    monkeypatch.chdir(tmp_path)
    local_check = invoke("check", "alibi", "--only", "unique", "--max-examples", "5", "--json")
    assert local_check.exit_code == 1, local_check.output  # the local copy's false claim
    catalogue = invoke("check", "t5", "--only", "slopes", "--json")
    assert catalogue.exit_code == 0, catalogue.output
    (checked,) = json.loads(catalogue.stdout)["specs"]
    assert Path(checked["path"]) == SPECS / "t5.yaml"
    unknown = invoke("check", "no_such_encoding")
    assert unknown.exit_code == 2 and "no spec named 'no_such_encoding'" in unknown.output
    (tmp_path / "t5").mkdir()  # a folder here: the path, and it holds no spec
    folder = invoke("check", "t5")
    assert folder.exit_code == 2 and "no spec files" in folder.output
    plotted = invoke("plot", "no_such_encoding")
    assert plotted.exit_code == 2 and "no spec named 'no_such_encoding'" in plotted.output


def test_a_local_specs_folder_comes_first_and_explain_still_knows_the_catalogue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "specs").mkdir()
    shutil.copy(SPECS / "alibi.yaml", tmp_path / "specs" / "alibi.yaml")
    monkeypatch.chdir(tmp_path)
    rows = invoke("list").stdout.splitlines()
    assert [row.split()[0] for row in rows[2:] if not row.startswith(" ")] == ["alibi"]
    assert invoke("explain", "t5").exit_code == 0
    unknown = invoke("explain", "no_such_encoding")
    assert unknown.exit_code == 2 and "no spec named 'no_such_encoding'" in unknown.output


def test_yml_specs_in_a_folder_are_found_by_folder_and_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``NAME.yml`` spec is a spec wherever a ``NAME.yaml`` one is: a folder argument
    expands to it, a bare name finds it, and a second file of the same name is refused."""
    specs = tmp_path / "specs"
    specs.mkdir()
    shutil.copy(SPECS / "alibi.yaml", specs / "alibi.yml")
    shutil.copy(SPECS / "t5.yaml", specs / "t5.yaml")
    monkeypatch.chdir(tmp_path)
    assert [path.name for path in spec_files(())] == ["alibi.yml", "t5.yaml"]
    generated = invoke("generate", "--out", "gen")
    assert generated.exit_code == 0, generated.output
    assert (tmp_path / "gen" / "alibi.py").is_file() and (tmp_path / "gen" / "t5.py").is_file()
    explained = invoke("explain", "alibi")
    assert explained.exit_code == 0 and "ALiBi" in explained.stdout
    twin = invoke("new", "alibi")  # specs/alibi.yaml would be a second spec 'alibi'
    assert twin.exit_code == 2 and "specs/alibi.yml already holds spec 'alibi'" in twin.stderr
    assert not (specs / "alibi.yaml").exists()
    shutil.copy(SPECS / "alibi.yaml", specs / "alibi.yaml")
    ambiguous = invoke("explain", "alibi")
    assert ambiguous.exit_code == 2 and "spec 'alibi' is ambiguous" in ambiguous.stderr
    both = invoke("validate", "specs")
    assert both.exit_code == 2 and "duplicate spec name 'alibi'" in both.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = invoke("validate", str(empty))
    assert nothing.exit_code == 2 and "no spec files (*.yaml or *.yml)" in nothing.stderr


def test_generate_without_a_specs_folder_says_so_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for args in (["generate"], ["generate", "--check"]):
        result = invoke(*args)
        assert result.exit_code == 2
        assert "no ./specs folder here" in result.stderr
        assert str(catalogue_dir()) in result.stderr
    assert list(tmp_path.iterdir()) == []
    # one named module, standalone, comes from the catalogue
    standalone = invoke("generate", "--standalone", "t5", "--out", "t5_attention.py")
    assert standalone.exit_code == 0, standalone.output
    assert [path.name for path in tmp_path.iterdir()] == ["t5_attention.py"]


# --------------------------------------------------------------------------- item 14


@pytest.mark.parametrize("seed", [str(2**64), str(2**32), "-1"])
def test_check_refuses_a_seed_out_of_range(seed: str) -> None:
    result = invoke("check", str(SPECS / "alibi.yaml"), "--seed", seed)
    assert result.exit_code == 2
    assert "Invalid value for '--seed'" in result.stderr


def test_check_takes_the_largest_seed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """hypothesis and torch (which also take seed + 1) accept the top of the range."""
    monkeypatch.setenv("HYPOTHESIS_STORAGE_DIRECTORY", str(tmp_path))
    args = ["--seed", str(2**32 - 1), "--max-examples", "2", "--only", "backends", "--json"]
    result = invoke("check", str(SPECS / "alibi.yaml"), *args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["seed"] == 2**32 - 1 and report["ok"] is True


@pytest.mark.parametrize("seed", ["999999999999999999999999", str(2**64), str(2**32), "-1"])
def test_plot_refuses_a_seed_out_of_range(seed: str, tmp_path: Path) -> None:
    result = invoke("plot", str(SPECS / "alibi.yaml"), "--out", str(tmp_path), "--seed", seed)
    assert result.exit_code == 2
    assert "Invalid value for '--seed'" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_plot_of_a_folder_is_a_usage_error(tmp_path: Path) -> None:
    """plot draws one spec: a folder is refused, of many specs (it plotted the first
    alone) or of one."""
    single = tmp_path / "single"
    single.mkdir()
    (single / "alibi.yaml").write_bytes((SPECS / "alibi.yaml").read_bytes())
    for folder in (SPECS, single):
        result = invoke("plot", str(folder), "--out", str(tmp_path / "plots"))
        assert result.exit_code == 2
        assert f"plot draws one spec: name one file, not the folder {folder}" in result.stderr
    assert not (tmp_path / "plots").exists()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["generate", "--out", ""], "an empty path"),
        (["generate", "", "--out", "out"], "an empty path"),
        (["validate", ""], "an empty path"),
        (["schema", "--out", ""], "an empty path"),
        (["plot", "", "--out", "out"], "an empty path"),
        (["explain", ""], "an empty spec name or path"),
        (["new", "foo", "--from", ""], "an empty spec name or path"),
    ],
)
def test_an_empty_path_or_name_is_a_usage_error(
    arguments: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Path('') is the current folder: `--out ''` wrote into (and pruned) the cwd, and an
    empty spec name hinted at a file './'."""
    monkeypatch.chdir(tmp_path)
    result = invoke(*arguments)
    assert result.exit_code == 2
    assert message in result.stderr
    assert list(tmp_path.iterdir()) == []
