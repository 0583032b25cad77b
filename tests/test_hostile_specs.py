"""No spec can inject code: hostile text is escaped, hostile names and numbers rejected."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from posgen.cli import main
from posgen.codegen.inmemory import encoding_class, module_from_spec
from posgen.codegen.plan import PlanError, docstring_lines, literal
from posgen.spec.diagnostics import SpecError
from posgen.spec.loader import load_spec
from posgen.spec.names import UnsafeName, identifier
from tests.conftest import ROOT, RUNTIME_FILES

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
        "'triton'",
        "'torch'",
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


def test_every_package_the_runtime_imports_is_a_reserved_module_name() -> None:
    """A spec named after a package the runtime imports (at any depth: triton is imported
    inside the kernels' functions) would give a module that shadows it where generated/
    is on the import path; ``triton`` was accepted."""
    import ast

    from posgen.spec.model import RESERVED_MODULE_NAMES

    packages: set[str] = set()
    for runtime in (ROOT / "templates" / "runtime").glob("_*.py"):
        for node in ast.walk(ast.parse(runtime.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                packages.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                packages.add(node.module.split(".")[0])
    assert "triton" in packages and "torch" in packages
    assert packages <= RESERVED_MODULE_NAMES, packages - RESERVED_MODULE_NAMES


@pytest.mark.parametrize(
    "name", ["typing_extensions", "sympy", "filelock", "networkx", "jinja2", "fsspec", "yaml"]
)
def test_a_package_torch_or_posgen_imports_is_refused_as_a_spec_name(name: str) -> None:
    """A spec named after a package that ``import torch`` loads gave a module that,
    with generated/ as the working directory, broke ``import torch``; it is refused."""
    from posgen.spec.model.spec import spec_name_problem

    problem = spec_name_problem(name)
    assert problem is not None and "torch or posgen imports" in problem, problem


def test_a_spec_named_after_a_dependency_would_break_import_torch(tmp_path: Path) -> None:
    """Why the names above are refused, shown on this environment: a file
    ``typing_extensions.py`` in the working directory makes ``import torch`` fail (one
    named sympy or jinja2 breaks torch.compile later, where torch imports them lazily);
    and every distribution that torch and posgen require (transitively, extras left out)
    has its modules in the refused list."""
    import importlib.metadata as metadata
    import sys

    from packaging.requirements import Requirement

    from posgen.spec.model import RESERVED_MODULE_NAMES

    (tmp_path / "typing_extensions.py").write_text(
        "raise ImportError('shadowed')\n", encoding="utf-8"
    )
    result = subprocess.run(
        [sys.executable, "-c", "import torch"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0 and "shadowed" in result.stderr, result.stderr[-500:]

    seen: set[str] = set()
    pending = ["torch", "posgen"]
    while pending:
        distribution = pending.pop()
        if distribution in seen:
            continue
        seen.add(distribution)
        for line in metadata.requires(distribution) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name.lower())
    for distribution in seen - {"posgen"}:
        top_level = metadata.distribution(distribution).read_text("top_level.txt")
        files = metadata.files(distribution) or []
        modules = set((top_level or "").split()) | {
            file.parts[0].removesuffix(".py")
            for file in files
            if len(file.parts) > 1 or file.suffix == ".py"
        }
        modules = {
            module
            for module in modules
            if module.isidentifier() and not module.endswith((".dist-info", "__pycache__"))
        }
        assert modules & RESERVED_MODULE_NAMES, (distribution, modules)


@pytest.mark.parametrize(
    "name", ["tomllib", "annotationlib", "compression", "distutils", "telnetlib"]
)
def test_a_standard_module_of_any_supported_python_is_reserved(name: str) -> None:
    """Names of standard modules that some supported Python (3.10 to 3.14) lacks are
    refused on every version: a spec valid on 3.11 (annotationlib, added in 3.14) or on
    3.13 (telnetlib, removed in it) was refused on another."""
    from posgen.spec.model.spec import spec_name_problem

    problem = spec_name_problem(name)
    assert problem is not None and "standard-library" in problem, problem


@pytest.mark.parametrize(
    "base",
    ["1e309", "1e-400", ".nan", "-.inf", "'1e4'", "0x10", "1_0000_0000_0000_0000_0000j", "true"],
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


# --------------------------------------------------------------------------- expressions

EXPRESSION_SPEC = """\
name: {name}
title: an expression
references: [ok]
defaults: {{heads: 2, head_dim: 8}}
scale: inv_sqrt_head_dim
terms:
  content_content: {content}
  content_position: drop
  position_content: drop
  position_position: {position}
claims: {{}}
"""
RUFF = shutil.which("ruff")


def write_expression(
    folder: Path, name: str, expr: str, params: str = "{}", frequencies: bool = False
) -> tuple[Path, int, int]:
    """A spec with ``expr`` as its position_position bias (or, with ``frequencies``, as
    its rotation's schedule); returns its path and the line and column of the
    expression's first character."""
    if frequencies:
        schedule = f'{{kind: expr, expr: "{expr}"}}'
        content = f"{{rotate: {{base: 10000, pairing: half, frequencies: {schedule}}}}}"
        position = "drop"
    else:
        content = "keep"
        position = (
            f'{{bias: {{kind: expr, expr: "{expr}", params: {params}, placement: after_scale}}}}'
        )
    text = EXPRESSION_SPEC.format(name=name, content=content, position=position)
    path = folder / f"{name}.yaml"
    path.write_text(text, encoding="utf-8")
    (line,) = (row for row, line in enumerate(text.splitlines(), 1) if 'expr: "' in line)
    column = text.splitlines()[line - 1].index('expr: "') + len('expr: "') + 1
    return path, line, column


COMPARISONS = "(< <= > >= == !=)"
BADLY_TYPED = [
    ("where(i, j, h)", 6, "where()'s first argument must be a comparison"),
    ("where(i - j, 1.0, 0.0)", 6, "where()'s first argument must be a comparison"),
    ("abs(i > j)", 4, "abs() takes numbers only"),
    ("floor(i > j)", 6, "floor() takes numbers only"),
    ("maximum(h, i == j) * 0.5", 11, "maximum() takes numbers only"),
    ("-(i > j)", 2, "unary - takes numbers only"),
    ("+(i > j)", 2, "unary + takes numbers only"),
    ("(i > j) - (j > i)", 1, "operator - takes numbers only"),
    ("i - (j > i)", 5, "operator - takes numbers only"),
    ("(i > j) ** 2", 1, "operator ** takes numbers only"),
    ("i % (j > i)", 5, "operator % takes numbers only"),
    ("where(i < j, i < j, 1)", 13, "where() after its condition takes numbers only"),
    ("(i < j) < 1", 1, "a comparison takes numbers only"),
    ("i > j", 0, "the expression must be a number"),
]


@pytest.mark.parametrize(("expr", "offset", "message"), BADLY_TYPED)
@pytest.mark.parametrize("command", ["validate", "generate"])
def test_a_badly_typed_expression_is_a_spec_error_at_its_sub_expression(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    expr: str,
    offset: int,
    message: str,
) -> None:
    """A boolean (a comparison) where a number belongs, or a number as where()'s
    condition, is refused at the offending sub-expression (it would fail on every
    call): exit 2, file:line:col, the field, what is allowed; nothing written."""
    path, line, column = write_expression(tmp_path, "typed", expr)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    arguments = [path.name] + (["--out", str(out)] if command == "generate" else [])
    result = CliRunner().invoke(main, [command, *arguments])
    assert result.exit_code == 2, result.output
    first = result.output.splitlines()[0]
    prefix = f"typed.yaml:{line}:{column + offset}: terms.position_position.bias.expr: "
    assert first.startswith(prefix), first
    assert message in first and COMPARISONS in first
    assert "Traceback" not in result.output
    assert not out.exists()


def test_a_boolean_frequency_schedule_is_a_spec_error(tmp_path: Path) -> None:
    path, line, column = write_expression(tmp_path, "typed", "k < 3", frequencies=True)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["generate", str(path), "--out", str(out)])
    assert result.exit_code == 2, result.output
    field = "terms.content_content.rotate.frequencies.expr"
    assert f"typed.yaml:{line}:{column}: {field}: the expression must be a number" in (
        result.output
    )
    assert "Traceback" not in result.output and not out.exists()


# each reads only some of i, j, h (or k, d, base) and raises powers of every operand form
RUFF_CLEAN_EXPRESSIONS = [
    ("query_only", "-0.1 * i", "{}"),
    ("key_only", "-0.1 * j", "{}"),
    ("head_only", "c[h] * h", "{c: {shape: [heads], init: 0.5}}"),
    ("parameter_only", "a ** 2 - 1", "{a: {shape: [], init: 0.5}}"),
    (
        "powers",
        "-(i - j) ** 2 + a ** h + 2 ** -abs(i - j) + (-i) ** j + c[h] ** 0.5",
        "{a: {shape: [], init: 0.5}, c: {shape: [heads], init: 0.5, positive: true}}",
    ),
]
RUFF_CLEAN_SCHEDULES = [
    ("pairs_only", "0.5 ** k"),
    ("schedule", "base ** (-2 * k / d)"),
    # longer than one line holds: FREQUENCY_EXPR is split into implicit concatenation
    ("long_schedule", "where(k < 4, base ** (-2 * k / d), 0.5 * base ** (-2 * k / d)) + 0 * k"),
    ("longer_schedule", f"base ** (-2.{'0' * 50} * k / d) + 0.{'0' * 50} * k"),  # 3 pieces
]


@pytest.mark.skipif(RUFF is None, reason="ruff (the pinned dev dependency) is not installed")
def test_generated_expression_code_is_ruff_clean(tmp_path: Path) -> None:
    """Modules and standalone files of expressions that leave names unread or raise
    powers pass ``ruff format --check`` and ``ruff check`` (no unused local, no
    spaced power of names)."""
    specs, out, standalone = tmp_path / "specs", tmp_path / "out", tmp_path / "standalone"
    specs.mkdir()
    standalone.mkdir()
    for name, expr, params in RUFF_CLEAN_EXPRESSIONS:
        write_expression(specs, name, expr, params)
    for name, expr in RUFF_CLEAN_SCHEDULES:
        write_expression(specs, name, expr, frequencies=True)
    runner = CliRunner()
    result = runner.invoke(main, ["generate", str(specs), "--out", str(out)])
    assert result.exit_code == 0, result.output
    names = [name for name, *_ in RUFF_CLEAN_EXPRESSIONS + RUFF_CLEAN_SCHEDULES]
    for name in names:
        target = standalone / f"{name}_attention.py"
        arguments = ["generate", str(specs), "--standalone", name, "--out", str(target)]
        result = runner.invoke(main, arguments)
        assert result.exit_code == 0, result.output
    assert RUFF is not None
    config = str(ROOT / "pyproject.toml")
    for command in (["format", "--check"], ["check"]):
        checked = subprocess.run(
            [RUFF, *command, "--config", config, str(out), str(standalone)],
            capture_output=True,
            text=True,
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
