"""Bad specs are reported as ``file:line:col: field: message``, exit 2, no traceback.

tests/specs/invalid/ holds one broken spec per rule; expected.txt pins the first
diagnostic of each (reviewed by hand: position of the offending value, the field path,
what is allowed, and the closest valid name for typos).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from posgen.cli import main
from posgen.spec.diagnostics import SpecError
from posgen.spec.loader import load_specs

INVALID = Path(__file__).parent / "specs" / "invalid"
EXPECTED = dict(
    (line.split(":", 1)[0], line)
    for line in (INVALID / "expected.txt").read_text(encoding="utf-8").splitlines()
)


def test_every_invalid_spec_has_a_pinned_message() -> None:
    assert sorted(EXPECTED) == sorted(p.name for p in INVALID.glob("*.yaml"))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_invalid_spec_message(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(INVALID)
    result = CliRunner().invoke(main, ["validate", name])
    assert result.exit_code == 2
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.output.splitlines()
    assert lines[0] == EXPECTED[name]
    assert lines[-1].endswith("nothing written.")


def test_all_errors_of_all_specs_are_reported_together(monkeypatch) -> None:
    monkeypatch.chdir(INVALID)
    with pytest.raises(SpecError) as caught:
        load_specs(sorted(INVALID.glob("*.yaml")))
    reported = {d.path for d in caught.value.diagnostics}
    assert reported == set(EXPECTED)


def test_real_process_prints_no_traceback() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "posgen", "validate", "unknown_key.yaml", "odd_buckets.yaml"],
        cwd=INVALID,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stderr.splitlines()[:2] == [
        EXPECTED["odd_buckets.yaml"],
        EXPECTED["unknown_key.yaml"],
    ]


def test_several_errors_in_one_spec_are_all_reported(tmp_path: Path) -> None:
    spec = (INVALID / "unknown_key.yaml").read_text()
    spec = spec.replace("name: unknown_key", "name: several").replace("heads: 8", 'heads: "8"')
    (tmp_path / "several.yaml").write_text(spec)
    with pytest.raises(SpecError) as caught:
        load_specs([tmp_path / "several.yaml"])
    fields = [d.field for d in caught.value.diagnostics]
    assert fields == ["defaults.heads", "terms.position_position.bias.index.bukets"]


def test_an_unknown_key_and_a_bad_value_in_one_mapping_are_both_reported(
    tmp_path: Path,
) -> None:
    """The other keys of a mapping with an unknown key are still validated; a required
    field the unknown key misspells is not reported missing as well."""
    spec = (INVALID / "unknown_key.yaml").read_text()
    spec = spec.replace("name: unknown_key", "name: typo_and_value")
    spec = spec.replace("recipe: t5", "recipe: t6").replace("max_distance: 128", "max_distnce: 128")
    (tmp_path / "typo_and_value.yaml").write_text(spec)
    with pytest.raises(SpecError) as caught:
        load_specs([tmp_path / "typo_and_value.yaml"])
    reported = {(d.line, d.col, d.field): d.message for d in caught.value.diagnostics}
    at = "terms.position_position.bias.index"
    assert sorted(reported) == [
        (15, 17, f"{at}.recipe"),
        (16, 9, f"{at}.bukets"),
        (17, 9, f"{at}.max_distnce"),
    ]
    assert "(did you mean 'max_distance'?)" in reported[(17, 9, f"{at}.max_distnce")]
    assert reported[(15, 17, f"{at}.recipe")].startswith("got 't6'; allowed:")


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(main, ["validate", str(tmp_path / "nope.yaml")]).exit_code == 2
    assert runner.invoke(main, ["generate", "--bogus"]).exit_code == 2
    assert runner.invoke(main, ["explain", "no_such_encoding"]).exit_code == 2


def test_specs_whose_class_names_collide_are_rejected(tmp_path: Path) -> None:
    """'a_1' and 'a1' would both generate class A1: the second is reported at its name."""
    nope = (Path(__file__).parent.parent / "specs" / "nope.yaml").read_text(encoding="utf-8")
    for name in ("layer_1", "layer1"):
        (tmp_path / f"{name}.yaml").write_text(
            nope.replace("name: nope", f"name: {name}"), encoding="utf-8"
        )
    with pytest.raises(SpecError) as caught:
        load_specs(sorted(tmp_path.glob("*.yaml")))
    (diagnostic,) = caught.value.diagnostics
    assert diagnostic.field == "name" and diagnostic.line == 2
    assert "duplicate class name 'Layer1'" in diagnostic.message


CATALOGUE = Path(__file__).parent.parent / "specs"


@pytest.mark.parametrize(
    ("file_name", "name_field"),
    [("alibi.yaml\u00e9", "alibi"), ("alibi.txt", "alibi"), ("alibi\n.yaml", '"alibi\\n"')],
)
def test_a_spec_whose_file_is_not_name_dot_yaml_is_refused_before_generation(
    tmp_path: Path, file_name: str, name_field: str
) -> None:
    """The generated header names the spec file, so validation refuses a file name that
    is not the spec's name plus .yaml or .yml (a name ending in a newline included):
    exit 2 at the name, no traceback, nothing written, for validate and generate alike."""
    text = (CATALOGUE / "alibi.yaml").read_text(encoding="utf-8")
    path = tmp_path / file_name
    path.write_text(text.replace("name: alibi", f"name: {name_field}"), encoding="utf-8")
    out = tmp_path / "out"
    for command in (["validate", str(path)], ["generate", str(path), "--out", str(out)]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 2, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)
        assert ":2:7: name: " in result.output or ":1:7: name: " in result.output
        if name_field == "alibi":  # the name is right, the suffix is not
            assert "(rename the file 'alibi.yaml')" in result.output
        assert not out.exists()


def test_a_symlinked_spec_is_named_by_the_link_not_its_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """specs/rope.yaml linking to store/rope-v2.yaml generates the bytes of the catalogue's
    rope.py (its header names rope.yaml), and messages show the link's path."""
    (tmp_path / "store").mkdir()
    (tmp_path / "specs").mkdir()
    target = tmp_path / "store" / "rope-v2.yaml"
    target.write_bytes((CATALOGUE / "rope.yaml").read_bytes())
    (tmp_path / "specs" / "rope.yaml").symlink_to(target)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["validate", "specs/rope.yaml"])
    assert result.exit_code == 0 and "specs/rope.yaml" in result.output, result.output
    result = CliRunner().invoke(main, ["generate", "specs/rope.yaml", "--out", "out"])
    assert result.exit_code == 0, result.output
    generated = Path(__file__).parent.parent / "generated" / "rope.py"
    assert (tmp_path / "out" / "rope.py").read_bytes() == generated.read_bytes()


@pytest.mark.parametrize(
    "command",
    [
        ["validate", "specs"],
        ["generate", "specs/alibi.yaml", "--out", "out"],
        ["check", "specs/alibi.yaml"],
        ["list", "--specs", "specs"],
        ["plot", "specs/alibi.yaml"],
    ],
)
def test_a_symbolic_link_loop_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str]
) -> None:
    """specs/alibi.yaml linking to itself: exit 2, the link named as unreadable, no
    traceback, nothing written (Path.resolve raised RuntimeError on the loop)."""
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "alibi.yaml").symlink_to("alibi.yaml")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "specs/alibi.yaml" in result.output and "symbolic link" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["specs"]


def test_a_dangling_link_in_a_folder_of_specs_is_one_error_among_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dangling link and a link loop beside an invalid spec and a folder named like a
    spec: each is reported at its file, every error of the others too (the first link
    was a usage error that hid them), exit 2, nothing written."""
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "bad.yaml").write_text("name: bad\n", encoding="utf-8")
    (specs / "dang.yaml").symlink_to("gone.yaml")
    (specs / "loop.yaml").symlink_to("loop.yaml")
    (specs / "dir.yaml").mkdir()
    monkeypatch.chdir(tmp_path)
    for command in (["validate", "specs"], ["generate", "specs", "--out", "out"]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output and "Usage:" not in result.output
        lines = result.output.splitlines()
        for name in ("dang", "loop"):
            assert f"specs/{name}.yaml:1:1: <file>: a symbolic link to nothing" in result.output
        assert any(line.startswith("specs/bad.yaml:1:1: title: ") for line in lines)
        assert "specs/dir.yaml:1:1: <file>: not a regular file (a directory)" in result.output
        assert not (tmp_path / "out").exists()


def test_a_flow_list_entry_split_at_an_unquoted_comma_is_refused(tmp_path: Path) -> None:
    """models: [Llama 3.1 (8B, 70B)] loads as two entries, "Llama 3.1 (8B" and "70B)":
    each half's unmatched bracket is refused at its own column, with the remedy; the
    quoted entry is one model."""
    text = (CATALOGUE / "rope_llama3.yaml").read_text(encoding="utf-8")
    models = next(line for line in text.splitlines() if line.startswith("models: "))
    line_number = text.splitlines().index(models) + 1
    spec = tmp_path / "rope_llama3.yaml"
    spec.write_text(text.replace(models, "models: [Llama 3.1 (8B, 70B)]"), encoding="utf-8")
    result = CliRunner().invoke(main, ["validate", str(spec)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.output.splitlines()
    assert f":{line_number}:10: models[0]: unmatched '(' at character 11: " in lines[0]
    assert f":{line_number}:25: models[1]: unmatched ')' at character 4: " in lines[1]
    assert 'quote the entry ("b (c, d)")' in lines[0]
    spec.write_text(text.replace(models, 'models: ["Llama 3.1 (8B, 70B)"]'), encoding="utf-8")
    (loaded,) = load_specs([spec])
    assert loaded.spec.models == ["Llama 3.1 (8B, 70B)"]


@pytest.mark.parametrize("invisible", ["\u200b", "\ufeff", "\u00ad", "\u2062", "\U000e0041"])
def test_free_text_refuses_invisible_characters(tmp_path: Path, invisible: str) -> None:
    """A title that shows as 'ALiBi bias' but holds an invisible character is refused
    at the character's column (title: ALiBi| bias), naming what it is."""
    text = (CATALOGUE / "alibi.yaml").read_text(encoding="utf-8")
    title = next(line for line in text.splitlines() if line.startswith("title: "))
    line_number = text.splitlines().index(title) + 1
    spec = tmp_path / "alibi.yaml"
    spec.write_text(text.replace(title, f"title: ALiBi{invisible} bias"), encoding="utf-8")
    result = CliRunner().invoke(main, ["validate", str(spec)])
    assert result.exit_code == 2, result.output
    first = result.output.splitlines()[0]
    assert f":{line_number}:8: title: an invisible character (U+{ord(invisible):04X}) " in first
    assert "at character 6" in first


def test_a_missing_kind_lists_the_kinds_of_the_union_the_mapping_is_in(tmp_path: Path) -> None:
    """An untied term's bias allows fewer kinds than a bias term's: without its kind, the
    message lists the untied term's (the kinds of every position_position form, before)."""
    text = (CATALOGUE / "tupe_r.yaml").read_text(encoding="utf-8")
    assert text.count("kind: learned_table") == 1
    lines = [line for line in text.splitlines() if "kind: learned_table" not in line]
    spec = tmp_path / "tupe_r.yaml"
    spec.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = CliRunner().invoke(main, ["validate", str(spec)])
    assert result.exit_code == 2
    assert result.output.splitlines()[0].endswith(
        "terms.position_position.bias: 'kind' is required; allowed kinds: 'learned_table', "
        "'linear_slopes'"
    ), result.output
