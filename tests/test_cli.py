"""The CLI's read-only commands: list, explain, schema, and help texts."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from posgen.cli import main
from posgen.spec.model import Spec
from tests.conftest import ROOT, spec_names


@pytest.fixture()
def run(monkeypatch):
    monkeypatch.chdir(ROOT)
    runner = CliRunner()

    def invoke(*args: str):
        result = runner.invoke(main, list(args))
        assert result.exception is None or isinstance(result.exception, SystemExit), result.output
        return result

    return invoke


def test_list_shows_every_encoding_with_terms_and_models(run) -> None:
    result = run("list")
    assert result.exit_code == 0
    for name in spec_names():
        assert any(line.startswith(name + " ") for line in result.output.splitlines())
    t5_line = next(line for line in result.output.splitlines() if line.startswith("t5 "))
    assert t5_line.split()[1:5] == ["keep", "drop", "drop", "bias"]
    assert "used by: BLOOM, MPT" in result.output


def test_list_by_model(run) -> None:
    result = run("list", "--models")
    assert result.exit_code == 0
    rows = {line.split("  ")[0].strip(): line for line in result.output.splitlines()}
    assert rows["BLOOM"].endswith("alibi")
    assert rows["GPT-2"].endswith("learned_absolute")


@pytest.mark.parametrize("name", spec_names())
def test_explain_renders_the_decomposition(run, name: str) -> None:
    result = run("explain", name)
    assert result.exit_code == 0
    for term in ("content_content", "content_position", "position_content", "position_position"):
        assert term in result.output
    assert "scale:" in result.output and "references:" in result.output
    assert run("explain", f"specs/{name}.yaml").output == result.output


def test_explain_t5_in_words(run) -> None:
    output = run("explain", "t5").output
    assert "table[bucket(j - i), h], t5 log buckets: 32 bidirectional, max_distance 128" in output
    assert "scale: none" in output


@pytest.mark.parametrize("command", ["generate", "validate", "list", "explain", "schema"])
def test_every_command_help_has_an_example(run, command: str) -> None:
    result = run(command, "--help")
    assert result.exit_code == 0
    assert "Example:" in result.output and f"posgen {command}" in result.output


def test_schema_is_the_spec_models_json_schema(run, tmp_path) -> None:
    result = run("schema")
    assert json.loads(result.output) == Spec.model_json_schema()
    committed = json.loads((ROOT / "specs" / "schema.json").read_text())
    assert committed == Spec.model_json_schema(), "run `posgen schema --out specs/schema.json`"


def test_paths_with_terminal_controls_are_escaped_in_every_command(tmp_path) -> None:
    """A folder name holding an OSC sequence and a bidi override is shown escaped."""
    import shutil

    from tests.conftest import SPECS

    hostile = tmp_path / "out\x1b]0;pwned\x07\u202edir"
    specs = tmp_path / "specs\x1b[31m"
    specs.mkdir()
    shutil.copy(SPECS / "alibi.yaml", specs / "alibi.yaml")
    runner = CliRunner()
    calls = [
        ["generate", str(specs), "--out", str(hostile)],
        ["generate", str(specs), "--out", str(hostile), "--check"],
        ["generate", str(specs), "--standalone", "alibi", "--out", str(hostile / "a.py")],
        ["validate", str(specs / "alibi.yaml")],
        ["explain", str(specs / "alibi.yaml")],
        ["list", "--specs", str(specs)],
        ["generate", str(specs / "missing.yaml")],
    ]
    for args in calls:
        result = runner.invoke(main, args)
        shown = result.output + (result.stderr if result.stderr_bytes else "")
        assert "\x1b" not in shown and "\x07" not in shown and "\u202e" not in shown, args
        assert "Traceback" not in shown, args
