"""Templates make no decisions of their own: every branch tests a value the plan computed.

A template may test booleans and None, iterate tuples and render values; it may not
compare anything against a word (``==``, ``!=``, ``in``, ``not in``), probe for
attributes (``is defined``), call string methods such as ``startswith``, or look words
up in a dict literal. Those decisions belong to posgen/codegen, where they are typed.
"""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest
from jinja2 import nodes

from posgen.codegen import blocks
from tests.conftest import ROOT

TEMPLATES = ROOT / "templates"
TEMPLATE_FILES = sorted(TEMPLATES.rglob("*.jinja"))
WORD_OPERATORS = {"eq", "ne", "in", "notin"}
STRING_METHODS = {"startswith", "endswith", "find", "count"}


def _parse(path: Path) -> nodes.Template:
    return jinja2.Environment().parse(path.read_text(encoding="utf-8"))


def _is_string(node: nodes.Node) -> bool:
    return isinstance(node, nodes.Const) and isinstance(node.value, str)


def _where(path: Path, node: nodes.Node) -> str:
    return f"{path.relative_to(ROOT)}:{node.lineno}"


def _string_comparisons(path: Path, tree: nodes.Template) -> list[str]:
    found = []
    for compare in tree.find_all(nodes.Compare):
        operands = [compare.expr, *(operand.expr for operand in compare.ops)]
        if any(_is_string(operand) for operand in operands):
            found.append(f"{_where(path, compare)}: comparison with a string literal")
    return found


def _word_comparisons(path: Path, tree: nodes.Template) -> list[str]:
    found = []
    for compare in tree.find_all(nodes.Compare):
        operators = {operand.op for operand in compare.ops}
        if operators & WORD_OPERATORS:
            found.append(f"{_where(path, compare)}: {sorted(operators)} comparison")
    return found


def _defined_tests(path: Path, tree: nodes.Template) -> list[str]:
    return [
        f"{_where(path, test)}: `is {test.name}` probe"
        for test in tree.find_all(nodes.Test)
        if test.name in ("defined", "undefined")
    ]


def _string_method_calls(path: Path, tree: nodes.Template) -> list[str]:
    return [
        f"{_where(path, call)}: .{call.node.attr}() call"
        for call in tree.find_all(nodes.Call)
        if isinstance(call.node, nodes.Getattr) and call.node.attr in STRING_METHODS
    ]


def _word_tables(path: Path, tree: nodes.Template) -> list[str]:
    return [f"{_where(path, table)}: dict literal" for table in tree.find_all(nodes.Dict)]


def test_there_are_templates_to_check() -> None:
    assert len(TEMPLATE_FILES) > 10
    assert TEMPLATES / "module.py.jinja" in TEMPLATE_FILES


@pytest.mark.parametrize(
    "path", TEMPLATE_FILES, ids=[str(p.relative_to(TEMPLATES)) for p in TEMPLATE_FILES]
)
def test_template_never_compares_a_string_or_probes_an_attribute(path: Path) -> None:
    tree = _parse(path)
    problems = _string_comparisons(path, tree) + _defined_tests(path, tree)
    assert problems == []


@pytest.mark.parametrize(
    "path", TEMPLATE_FILES, ids=[str(p.relative_to(TEMPLATES)) for p in TEMPLATE_FILES]
)
def test_template_only_tests_values_the_plan_computed(path: Path) -> None:
    """No equality or membership test at all (word fields compare as words too)."""
    tree = _parse(path)
    problems = (
        _word_comparisons(path, tree) + _string_method_calls(path, tree) + _word_tables(path, tree)
    )
    assert problems == []


def _concrete(base: type) -> list[type]:
    found = []
    for cls in base.__subclasses__():
        found.extend(_concrete(cls))
        if "template" in vars(cls):
            found.append(cls)
    return found


# The macros each kind of plan part's file exposes (InputTable: also note or summary).
MACROS = {
    blocks.Block: {"helpers", "init", "methods", "weights"},
    blocks.InputTable: {"helpers", "init", "lookup", "weights"},
    blocks.RelativeIndex: {"helpers"},
    blocks.RelativeTable: {"helpers", "init", "rows", "weights"},
    blocks.FrequencyPlan: {"helpers"},
}
RENDERED = sorted(_concrete(blocks.Rendered), key=lambda cls: cls.__name__)


@pytest.mark.parametrize("part", RENDERED, ids=[cls.__name__ for cls in RENDERED])
def test_each_plan_part_names_a_macro_file_with_its_macros(part: type) -> None:
    path = TEMPLATES / part.template
    assert path.is_file(), part.template
    macros = {macro.name for macro in _parse(path).find_all(nodes.Macro)}
    (expected,) = [names for base, names in MACROS.items() if issubclass(part, base)]
    assert expected <= macros, sorted(expected - macros)
    if issubclass(part, blocks.InputTable):
        assert macros & {"note", "summary"}


def test_the_checks_catch_what_they_forbid() -> None:
    """Each check finds its own kind of decision in a small template."""
    source = (
        '{% if a.kind == "x" %}{% endif %}{% if "key" in b %}{% endif %}'
        "{% if c is defined %}{% endif %}{% if d.startswith(e) %}{% endif %}"
        '{% if f != g %}{% endif %}{{ {"a": 1}[h] }}'
    )
    tree = jinja2.Environment().parse(source)
    path = TEMPLATES / "example.jinja"
    assert len(_string_comparisons(path, tree)) == 2
    assert len(_defined_tests(path, tree)) == 1
    assert len(_string_method_calls(path, tree)) == 1
    assert len(_word_comparisons(path, tree)) == 3
    assert len(_word_tables(path, tree)) == 1
