"""specs/schema.json, the JSON Schema an editor checks a spec against (a spec's first line
names it), takes every spec the loader takes and refuses the values of a wrong form.

The model reads some values in a short form (``scale: none`` for ``scale: {kind: none}``);
a schema that did not show them marked every catalogue spec as wrong in an editor. The
rules the model's own validators check (across fields, expressions, free text, reserved
names) are mostly beyond the schema, so invalid specs are checked where they fail on a
form, and on the few rules of one field that the schema states too.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from posgen.cli import main
from posgen.spec.loader import SPEC_SUFFIXES
from posgen.spec.model import Spec
from posgen.spec.yaml_source import YamlError, load_yaml
from tests.conftest import ROOT, SPECS

TEST_SPECS = ROOT / "tests" / "specs"
INVALID = TEST_SPECS / "invalid"

MODEL_RULES = frozenset({"cross_field", "expr", "free_text", "module_name"})
"""The error types of the model's own validators: rules the schema does not state."""
SAME_IN_JSON = frozenset({"float_for_int.yaml"})
"""Invalid specs a JSON Schema cannot refuse: JSON has one kind of number, so 32.0 is an
integer to the schema where the loader refuses a float for an int field."""


def _spec_files(folder: Path, recursive: bool = False) -> list[Path]:
    found = folder.rglob("*") if recursive else folder.glob("*")
    return sorted(path for path in found if path.suffix in SPEC_SUFFIXES)


def _parsed(path: Path) -> Any:
    """The spec's data as the loader parses it, or None where the loader refuses the file
    itself (not UTF-8, or YAML that specs forbid)."""
    try:
        return load_yaml(path.read_text(encoding="utf-8"), path.name).data
    except (UnicodeDecodeError, YamlError):
        return None


def _model_error_types(data: Any) -> frozenset[str]:
    """The types of the errors the spec model finds in ``data``: empty where it is valid."""
    try:
        Spec.model_validate(data)
    except ValidationError as error:
        return frozenset(item["type"] for item in error.errors())
    return frozenset()


def _shown(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


CATALOGUE = _spec_files(SPECS)
TEST_SPEC_FILES = [(path, _parsed(path)) for path in _spec_files(TEST_SPECS, recursive=True)]
ACCEPTED = [
    path for path, data in TEST_SPEC_FILES if data is not None and not _model_error_types(data)
]
WRONG_FORM = [
    path
    for path, data in TEST_SPEC_FILES
    if path.parent == INVALID
    and data is not None
    and path.name not in SAME_IN_JSON
    and (types := _model_error_types(data))
    and not types & MODEL_RULES
]


@cache
def _validator() -> jsonschema.Draft202012Validator:
    """A validator of specs/schema.json, the file the specs' first line names."""
    schema = json.loads((SPECS / "schema.json").read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)  # pydantic writes draft 2020-12
    return jsonschema.Draft202012Validator(schema)


def _schema_errors(data: Any) -> list[str]:
    """Where and why specs/schema.json refuses ``data`` (empty where it takes it)."""
    errors = sorted(_validator().iter_errors(data), key=lambda e: list(map(str, e.path)))
    return [f"{'.'.join(map(str, e.path)) or '<spec>'}: {e.message[:200]}" for e in errors]


def test_the_spec_files_are_found() -> None:
    assert len(CATALOGUE) >= 40 and SPECS / "alibi.yaml" in CATALOGUE
    # every test spec outside invalid/ is a valid spec (false_claims: claims that are wrong)
    outside = [path for path, _ in TEST_SPEC_FILES if path.parent != INVALID]
    assert outside and set(outside) <= set(ACCEPTED), sorted(set(outside) - set(ACCEPTED))


@pytest.mark.parametrize("path", CATALOGUE + ACCEPTED, ids=_shown)
def test_the_schema_takes_every_spec_the_model_takes(path: Path) -> None:
    data = _parsed(path)
    assert not _model_error_types(data)
    assert _schema_errors(data) == [], "run `posgen schema --out specs/schema.json`?"


def test_the_schema_takes_the_scaffold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["new", "my_idea"])
    assert result.exit_code == 0, result.output
    data = _parsed(tmp_path / "specs" / "my_idea.yaml")
    assert data is not None and not _model_error_types(data)
    assert _schema_errors(data) == []


@pytest.mark.parametrize("path", WRONG_FORM, ids=_shown)
def test_the_schema_refuses_a_value_of_a_wrong_form(path: Path) -> None:
    assert _schema_errors(_parsed(path)) != []


def test_the_wrong_forms_include_unknown_fields_wrong_types_and_wrong_keywords() -> None:
    names = {path.name for path in WRONG_FORM}
    assert {
        "unknown_key.yaml",  # an unknown field (buckets misspelt)
        "untied_unknown_key.yaml",  # an unknown field beside an untied term
        "string_number.yaml",  # a string for an integer
        "yes_is_not_a_bool.yaml",  # a string for a boolean
        "scale_number.yaml",  # a number where a keyword or a mapping belongs
        "untied_bad_norm.yaml",  # a keyword that is not one of the norm's kinds
        "query_scale_keyword.yaml",  # a keyword where only a mapping belongs
        "bad_term_form.yaml",  # a term's keyword that is not one of its forms
    } <= names


@pytest.mark.parametrize(
    "name",
    [
        "double__underscore.yaml",  # a name is lower-case words joined by single underscores
        "odd_relative_buckets.yaml",  # symmetric log buckets: an even count
        "sandwich_odd_dim.yaml",  # Sandwich's d' is even
        "hierarchical_alpha_half.yaml",  # a hierarchical table's alpha is not 0.5
        "untied_sinusoidal_table.yaml",  # an untied table is a learned one
    ],
)
def test_the_schema_states_the_model_rules_of_one_field(name: str) -> None:
    data = _parsed(INVALID / name)
    types = _model_error_types(data)
    assert types and types <= MODEL_RULES  # refused by a rule of the model's own
    assert _schema_errors(data) != []
