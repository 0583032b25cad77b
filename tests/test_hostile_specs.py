"""No spec can inject code: hostile text is escaped, hostile names and numbers rejected."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from posgen.codegen.inmemory import encoding_class, module_from_spec
from posgen.codegen.plan import PlanError, docstring_lines, literal
from posgen.spec.diagnostics import SpecError
from posgen.spec.loader import load_spec
from posgen.spec.names import UnsafeName, identifier
from tests.conftest import RUNTIME_FILES

TEMPLATE = """\
name: {name}
title: {title}
references: [{reference}]
models: [{model}]
defaults: {{heads: 2, head_dim: 8}}
scale: inv_sqrt_head_dim
terms:
  content_content:
    rotate: {{base: {base}, pairing: half}}
  content_position: drop
  position_content: drop
  position_position: drop
claims: {{}}
"""

HOSTILE_TEXT = [
    '\'"""; import os; os.system("echo pwned"); """\'',
    "'\\\\'",  # a lone backslash at the end of the docstring
    '"ends with a quote \\""',
    '"line\\u2028separator and paragraph\\u2029separator"',
    '"next line\\x85here"',
    "'ｆｕｌｌ－ｗｉｄｔｈ ｌｅｔｔｅｒｓ'",
    '"tab\\there"',
    "'{{ jinja }} {% raw %} ${shell} %(fmt)s'",
    '"#\\U0001F600 emoji"',
]


def write(tmp_path: Path, name: str = "hostile", **fields: str) -> Path:
    values = {"name": name, "title": "ok", "reference": "ok", "model": "ok", "base": "10000"}
    values.update(fields)
    path = tmp_path / f"{name}.yaml"
    path.write_text(TEMPLATE.format(**values), encoding="utf-8")
    return path


def _only_expected_top_level(source_tree: ast.Module) -> None:
    allowed = (ast.ImportFrom, ast.Import, ast.Assign, ast.FunctionDef, ast.ClassDef)
    body = source_tree.body
    assert isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    for node in body[1:]:
        assert isinstance(node, allowed), ast.dump(node)
        if isinstance(node, ast.ImportFrom) and node.level:
            assert node.level == 1 and f"{node.module}.py" in RUNTIME_FILES  # the runtime
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            assert module.split(".")[0] in ("__future__", "math", "torch")


@pytest.mark.parametrize("text", HOSTILE_TEXT)
@pytest.mark.parametrize("field", ["title", "reference", "model"])
def test_hostile_free_text_is_escaped(tmp_path: Path, field: str, text: str) -> None:
    path = write(tmp_path, **{field: text})
    try:
        loaded = load_spec(path)
    except SpecError as error:  # control characters are refused outright: also safe
        assert "title" in str(error) or "references" in str(error) or "models" in str(error)
        return
    module = module_from_spec(path)
    original = {
        "title": loaded.spec.title,
        "reference": loaded.spec.references[0],
        "model": loaded.spec.models[0],
    }[field]
    words = original.split()
    doc = " ".join(module.__doc__.split())
    assert " ".join(words) in doc  # the text survives, exactly, inside the docstring
    _only_expected_top_level(ast.parse(_source_of(loaded)))
    encoding_class(module)()  # and the module still works


def _source_of(loaded) -> str:
    from posgen.codegen.render import render_module
    from posgen.codegen.writing import plan_for

    return render_module(plan_for(loaded))


@pytest.mark.parametrize(
    "name",
    [
        "'x; import os'",
        "'ｔ5'",
        "'Upper'",
        "'1abc'",
        "'class'",
        "'match'",
        "'print'",
        "'__import__'",
        "'a-b'",
        "'a b'",
        "''",
    ],
)
def test_hostile_names_are_rejected(tmp_path: Path, name: str) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(
        TEMPLATE.format(name=name, title="t", reference="r", model="m", base="10000"),
        encoding="utf-8",
    )
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert caught.value.diagnostics[0].field == "name"


@pytest.mark.parametrize(
    "base", ["1e309", ".nan", "-.inf", "'1e4'", "0x10", "1_0000_0000_0000_0000_0000j", "true"]
)
def test_hostile_numbers_are_rejected(tmp_path: Path, base: str) -> None:
    with pytest.raises(SpecError) as caught:
        load_spec(write(tmp_path, base=base))
    assert caught.value.diagnostics[0].line == 9


def test_escaper_output_is_a_safe_string_body() -> None:
    text = 'a"""b\\c\r\x0b\u2028\x85"' + "ｚ" * 50
    lines = docstring_lines(text, width=20)
    body = "\n".join(lines)
    assert all(len(line) <= 20 for line in lines)
    assert all(ch.isascii() and (ch.isprintable()) for ch in body.replace("\n", ""))
    value = ast.literal_eval('"""' + body + '"""')
    assert "".join(value.split()) == "".join(text.split())  # long words wrap, nothing lost


def test_plan_primitives_refuse_unsafe_values() -> None:
    for bad in ("os.system", "import", "print", "ａ", "x y", ""):
        with pytest.raises(UnsafeName):
            identifier(bad)
    for bad in (float("inf"), float("nan"), object(), [1], {"a": 1}, (1, float("nan"))):
        with pytest.raises(PlanError):
            literal(bad)
    assert literal(1e-3) == "0.001" and literal(True) == "True" and literal(None) == "None"
    assert literal('say "hi"\n') == '"say \\"hi\\"\\n"'  # double quotes, escaped
    assert literal("\u202e") == '"\\u202e"'  # pure ASCII
    assert literal((1, 2.5, "half")) == '(1, 2.5, "half")' and literal((3,)) == "(3,)"
