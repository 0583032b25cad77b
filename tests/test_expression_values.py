"""The spec layer's float evaluator of bias expressions (posgen/spec/expr_values.py)
against torch in float64 and in float32, the arithmetic a generated module runs: the
same value where torch's is finite, and non-finite exactly where torch's is (log(0),
x / 0, 0 / 0, x % 0, negative bases to fractional powers, overflow, and in float32
an intermediate value past float32's range)."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from posgen.spec.expr import ParamInfo, parse_expr
from posgen.spec.expr_values import expression_value, first_non_finite, to_float32
from posgen.spec.loader import SpecError, load_spec
from posgen.spec.model.biases import checked_heads
from tests.conftest import expr_bias_spec

# the functions of the expression language as torch calls, written here from torch's API
TORCH_FUNCTIONS = {
    "abs": torch.abs,
    "log": torch.log,
    "log1p": torch.log1p,
    "exp": torch.exp,
    "sqrt": torch.sqrt,
    "sin": torch.sin,
    "cos": torch.cos,
    "sign": torch.sign,
    "floor": torch.floor,
    "minimum": torch.minimum,
    "maximum": torch.maximum,
    "clamp": lambda x, low, high: torch.minimum(torch.maximum(x, low), high),
    "where": torch.where,
}
PARAMS = {"a": ParamInfo(per_head=False), "c": ParamInfo(per_head=True)}
VALUES = {"a": 0.5, "c": -2.0}


def torch_value(
    expr: str, i: float, j: float, h: float, dtype: torch.dtype = torch.float64
) -> float:
    """The expression evaluated by torch, 0-d tensors of ``dtype`` throughout."""

    def scalar(value: float) -> torch.Tensor:
        return torch.tensor(value, dtype=dtype)

    class PerHead:  # c[h]: one value for every head
        def __getitem__(self, _: object) -> torch.Tensor:
            return scalar(VALUES["c"])

    names = {"i": scalar(i), "j": scalar(j), "h": scalar(h), "a": scalar(VALUES["a"])}
    scope = {**TORCH_FUNCTIONS, **names, "c": PerHead(), "__builtins__": {}}
    # number literals become tensors too, so that 1 / 0 is torch's division
    wrapped = _Literals().visit(ast.parse(expr, mode="eval"))
    ast.fix_missing_locations(wrapped)
    result = eval(compile(wrapped, "<expr>", "eval"), {**scope, "_t": scalar})  # noqa: S307
    return float(result)


class _Literals(ast.NodeTransformer):
    """Each number literal n as _t(float(n)): a float64 tensor."""

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        return ast.Call(ast.Name("_t", ast.Load()), [ast.Constant(float(node.value))], [])


EXPRESSIONS = [
    "-a * abs(i - j)",
    "-c[h] * log1p(a * abs(j - i))",
    "log(abs(i - j))",
    "log(i - j)",
    "log1p(i - j - 1)",
    "log1p(j - i)",
    "1 / (i - j)",
    "(i - j) / (j - i)",
    "(i - j) % (j - i)",
    "(i - j) % 3",
    "(i - j) ** 0.5",
    "(i - j) ** -1",
    "(j - i) ** 3",
    "sign(0 * log(i - j))",
    "floor(1 / (i - j))",
    "floor(0.5 * (i - j))",
    "exp(100 * abs(i - j))",
    "-exp(800 * abs(i - j))",
    "sqrt(i - j)",
    "sin(1 / (i - j))",
    "cos(i - j) * h",
    "clamp(0 / (i - j), 0, 1)",
    "clamp(i - j, -1, 1)",
    "minimum(log(i - j), 1)",
    "maximum(i, j) - minimum(i, j)",
    "where(i > j, 1 / (i - j), 0)",
    "where(i == j, 0, log(abs(i - j)))",
    "2 ** (-h) * abs(i - j)",
    "10 ** (i - j)",
    # finite in float64; an intermediate value leaves float32's range (3.4e38)
    "(i + 1) ** 40 / (i + 1) ** 40 - abs(i - j)",
    "exp(90 * abs(i - j)) / exp(90 * abs(i - j))",
    "1 / exp(-100 * abs(i - j))",
    "exp(88.5 + i - j) - exp(88.5 + i - j)",
]
POINTS = [(0.0, 0.0), (3.0, 1.0), (1.0, 3.0), (7.0, 2.0), (5.0, 0.0)]


@pytest.mark.parametrize("expr", EXPRESSIONS)
def test_the_evaluator_matches_torch_in_float64(expr: str) -> None:
    tree = parse_expr(expr, PARAMS).tree
    for i, j in POINTS:
        for h in (0.0, 3.0):
            got = expression_value(tree, {"i": i, "j": j, "h": h}, VALUES)
            want = torch_value(expr, i, j, h)
            if math.isnan(want):
                assert math.isnan(got), (expr, i, j, h, got)
            else:
                assert got == pytest.approx(want, rel=1e-12, abs=1e-300), (expr, i, j, h)


@pytest.mark.parametrize("expr", EXPRESSIONS)
def test_the_evaluator_in_float32_matches_torch_in_float32(expr: str) -> None:
    tree = parse_expr(expr, PARAMS).tree
    for i, j in POINTS:
        for h in (0.0, 3.0):
            got = expression_value(tree, {"i": i, "j": j, "h": h}, VALUES, float32=True)
            want = torch_value(expr, i, j, h, torch.float32)
            if math.isnan(want):
                assert math.isnan(got), (expr, i, j, h, got)
            else:
                assert got == pytest.approx(want, rel=1e-5, abs=1e-37), (expr, i, j, h)


def test_float32_rounding_is_ieee() -> None:
    assert to_float32(0.1) == float(torch.tensor(0.1, dtype=torch.float32))
    assert to_float32(3.4028235e38) == float(torch.finfo(torch.float32).max)
    assert to_float32(3.5e38) == math.inf and to_float32(-3.5e38) == -math.inf
    assert to_float32(1e-46) == 0.0 and math.isnan(to_float32(math.nan))


def test_the_first_non_finite_point_is_named() -> None:
    tree = parse_expr("-log(abs(i - j) - 2)", PARAMS).tree  # log(0) at distance 2
    bad = first_non_finite(tree, VALUES, positions=range(5), heads=(0,))
    assert bad is not None and (bad.i, bad.j, bad.h) == (0, 0, 0)
    assert math.isnan(bad.value)  # log(-2) at distance 0, met first
    finite = parse_expr("-a * log1p(abs(i - j))", PARAMS).tree
    assert first_non_finite(finite, VALUES, positions=range(17), heads=range(8)) is None
    huge = parse_expr("exp(90 * abs(i - j))", PARAMS).tree  # e^90: finite, not in float32
    bad = first_non_finite(huge, VALUES, positions=range(3), heads=(0,))
    assert bad is not None and (bad.i, bad.j) == (0, 1) and bad.float32
    assert bad.value == math.inf
    # 1 in float64 everywhere; NaN in float32 where (i + 1) ** 40 passes 3.4e38 (i = 9)
    cancelled = parse_expr("(i + 1) ** 40 / (i + 1) ** 40", PARAMS).tree
    bad = first_non_finite(cancelled, VALUES, positions=range(17), heads=(0,))
    assert bad is not None and (bad.i, bad.j, bad.float32) == (9, 0, True)
    assert math.isnan(bad.value)


def _spec_problem(path: Path) -> str | None:
    try:
        load_spec(path)
    except SpecError as error:
        return "\n".join(str(diagnostic) for diagnostic in error.diagnostics)
    return None


def test_the_finiteness_check_reads_heads_as_the_specs_head_count(tmp_path: Path) -> None:
    # NaN in every row of a 16-head module: refused, naming the head count it used
    problem = _spec_problem(
        expr_bias_spec(tmp_path, "heads_16", "-abs(i - j) / (heads - 16)", heads=16)
    )
    assert problem is not None
    assert "terms.position_position.bias.expr" in problem
    assert "heads = 16 (defaults.heads)" in problem and "nan" in problem
    # finite for the spec's 4 heads, whatever it would be for 8
    assert (
        _spec_problem(expr_bias_spec(tmp_path, "heads_4", "-abs(i - j) / (heads - 8)", heads=4))
        is None
    )


def test_the_finiteness_check_reaches_the_last_heads(tmp_path: Path) -> None:
    problem = _spec_problem(
        expr_bias_spec(tmp_path, "heads_40", "-abs(i - j) / (h - 38)", heads=40)
    )
    assert problem is not None and "h = 38" in problem
    assert (
        _spec_problem(expr_bias_spec(tmp_path, "heads_12", "-abs(i - j) / (h - 12)", heads=12))
        is None
    )
    assert (
        _spec_problem(expr_bias_spec(tmp_path, "heads_12", "-abs(i - j) / (h - 11)", heads=12))
        is not None
    )


def test_the_checked_heads_are_all_or_both_ends() -> None:
    assert checked_heads(1) == [0]
    assert checked_heads(16) == list(range(16))
    assert checked_heads(40) == [*range(8), *range(32, 40)]
