"""``posgen new``: a scaffold that validates and checks, a renamed copy, and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from posgen.cli import main
from posgen.spec.loader import load_spec
from tests.conftest import SPECS


@pytest.fixture
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.chdir(tmp_path)
    return CliRunner()


def test_the_blank_scaffold_validates_and_checks(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(main, ["new", "my_idea"])
    assert result.exit_code == 0, result.output
    path = tmp_path / "specs" / "my_idea.yaml"
    spec = load_spec(path).spec
    assert spec.name == "my_idea" and spec.claims.relative is True
    assert "# " in path.read_text(encoding="utf-8")  # commented for the reader
    check = runner.invoke(main, ["check", str(path), "--max-examples", "5"])
    assert check.exit_code == 0, check.output


@pytest.mark.parametrize("name", ["x", "gauss_bias", "a" * 27, "a" * 28, "a" * 64])
def test_the_scaffold_comments_line_up_whatever_the_name(
    runner: CliRunner, tmp_path: Path, name: str
) -> None:
    """The ``name:`` line's comment starts in the column of the others (the scaffold
    padded it for a name of 6 characters), or one space past a name too long for it."""
    assert runner.invoke(main, ["new", name]).exit_code == 0
    lines = (tmp_path / "specs" / f"{name}.yaml").read_text(encoding="utf-8").splitlines()
    name_line = next(line for line in lines if line.startswith("name:"))
    references_line = next(line for line in lines if line.startswith("references:"))
    column = references_line.index("#")
    expected = max(column, len(f"name: {name} "))
    assert name_line.index("#") == expected, name_line


def test_from_copies_an_existing_spec_under_the_new_name(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(main, ["new", "alibi_inside", "--from", str(SPECS / "alibi.yaml")])
    assert result.exit_code == 0, result.output
    copied = load_spec(tmp_path / "specs" / "alibi_inside.yaml").spec
    original = load_spec(SPECS / "alibi.yaml").spec
    assert copied.name == "alibi_inside"
    assert original.models and copied.models == []  # no model uses the new encoding yet
    assert copied.model_dump(exclude={"name", "models"}) == original.model_dump(
        exclude={"name", "models"}
    )


@pytest.mark.parametrize(
    "written",
    [
        "name: 'alibi'  # quoted, with a comment",
        'name: "alibi"',
        "name:    alibi",
        "flow",  # the whole spec as one flow mapping (JSON)
        "block models",  # models as a block list with comments after it
    ],
)
def test_from_renames_a_name_written_in_any_style(
    runner: CliRunner, tmp_path: Path, written: str
) -> None:
    text = (SPECS / "alibi.yaml").read_text(encoding="utf-8")
    if written == "flow":
        text = json.dumps(yaml.safe_load(text)) + "\n"  # JSON is a YAML flow mapping
        assert text.startswith('{"name": "alibi"')
    elif written == "block models":
        listed = "models: [BLOOM, MPT-7B, BloombergGPT, Baichuan-13B]\n"
        assert text.count(listed) == 1
        text = text.replace(listed, "models:\n  - BLOOM\n  - MPT-7B  # 7B\n\n# kept\n")
    else:
        text = text.replace("name: alibi\n", written + "\n")
    source = tmp_path / "theirs" / "alibi.yaml"
    source.parent.mkdir()
    source.write_text(text, encoding="utf-8")
    result = runner.invoke(main, ["new", "alibi_copy", "--from", str(source)])
    assert result.exit_code == 0, result.output
    copied = load_spec(tmp_path / "specs" / "alibi_copy.yaml").spec
    original = load_spec(SPECS / "alibi.yaml").spec
    assert copied.name == "alibi_copy" and copied.models == []
    assert copied.model_dump(exclude={"name", "models"}) == original.model_dump(
        exclude={"name", "models"}
    )
    if written == "block models":
        copied_text = (tmp_path / "specs" / "alibi_copy.yaml").read_text(encoding="utf-8")
        assert "models: []  # 7B\n\n# kept\ndefaults:" in copied_text


def test_new_refuses_to_overwrite_and_bad_names(runner: CliRunner, tmp_path: Path) -> None:
    mine = tmp_path / "specs" / "taken.yaml"
    mine.parent.mkdir()
    mine.write_text("my own notes\n", encoding="utf-8")
    taken = runner.invoke(main, ["new", "taken"])
    assert taken.exit_code == 2 and "never overwrites" in taken.output
    assert mine.read_text(encoding="utf-8") == "my own notes\n"
    bad = runner.invoke(main, ["new", "Bad-Name"])
    assert bad.exit_code == 2 and "invalid NAME 'Bad-Name'" in bad.output
    assert not (tmp_path / "specs" / "Bad-Name.yaml").exists()
    unknown = runner.invoke(main, ["new", "x", "--from", "no_such_spec"])
    assert unknown.exit_code == 2 and "no spec named" in unknown.output
    for result in (taken, bad, unknown):
        assert "Traceback" not in result.output


BAD_NAMES = {
    "x\\1": "lower-case ASCII words",  # was a regex error (a group reference)
    "a: b": "lower-case ASCII words",  # was an invalid-YAML error about the scaffold
    "../escape": "lower-case ASCII words",  # would have written specs/../escape.yaml
    "x" * 65: "at most 64 characters",
    "os": "would shadow it",
    "class": "'class' is a Python keyword",  # was named at a file never written
    "match": "'match' is a Python keyword",  # a soft keyword
    "print": "'print' is a Python builtin name",
}


@pytest.mark.parametrize("name", sorted(BAD_NAMES))
def test_a_bad_name_is_named_before_anything_is_read_or_written(
    runner: CliRunner, tmp_path: Path, name: str
) -> None:
    """NAME is checked first, by the spec model's rule for ``name``."""
    for args in ([], ["--from", "alibi"], ["--from", "alibi", "--out", "x.yaml"]):
        result = runner.invoke(main, ["new", name, *args])
        assert isinstance(result.exception, SystemExit), repr(result.exception)
        assert result.exit_code == 2, result.output
        assert "invalid NAME" in result.stderr and BAD_NAMES[name] in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_renamed_copy_takes_the_name_literally(tmp_path: Path) -> None:
    """The name is never a regex replacement template (backslashes stay as written)."""
    from posgen.scaffold import scaffold_text

    text = scaffold_text("a\\1\\g<0>", SPECS / "alibi.yaml")
    assert "\nname: a\\1\\g<0>\n" in text


@pytest.mark.parametrize("out", ["other.yaml", "my_idea.txt", "sub/My_idea.yaml"])
def test_out_must_be_the_spec_file_of_name(runner: CliRunner, tmp_path: Path, out: str) -> None:
    """A spec's name is its file's name, so ``--out`` of another name is a usage error
    that says which file the spec goes in (not a diagnostic in a file never written)."""
    result = runner.invoke(main, ["new", "my_idea", "--out", out])
    assert result.exit_code == 2
    assert f"--out {out}: spec 'my_idea' goes in a file named my_idea.yaml" in result.output
    assert list(tmp_path.iterdir()) == []
    written = runner.invoke(main, ["new", "my_idea", "--out", "sub/my_idea.yml"])
    assert written.exit_code == 0, written.output
    assert load_spec(tmp_path / "sub" / "my_idea.yml").spec.name == "my_idea"


def test_new_writes_the_schema_its_first_line_names(runner: CliRunner, tmp_path: Path) -> None:
    """The scaffold starts ``# yaml-language-server: $schema=schema.json``; no such file
    was written, so an editor found none. ``new`` now writes it beside the spec where
    there is none, and leaves a schema.json that is there alone."""
    first = runner.invoke(main, ["new", "my_bias"])
    assert first.exit_code == 0, first.output
    spec_text = (tmp_path / "specs" / "my_bias.yaml").read_text(encoding="utf-8")
    assert spec_text.startswith("# yaml-language-server: $schema=schema.json\n")
    schema = tmp_path / "specs" / "schema.json"
    printed = runner.invoke(main, ["schema"]).output
    assert schema.read_text(encoding="utf-8") == printed
    assert json.loads(printed)["title"] == "Spec"
    schema.write_text("my own schema\n", encoding="utf-8")
    second = runner.invoke(main, ["new", "other", "--from", "alibi"])
    assert second.exit_code == 0, second.output
    assert schema.read_text(encoding="utf-8") == "my own schema\n"
    assert "schema.json" not in second.output
