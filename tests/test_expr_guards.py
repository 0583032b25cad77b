"""Guards of the expression bias language (posgen/spec/expr.py, expr_values.py and the
spec model's finiteness check) that a reviewer found missing:

- a parameter whose gradient is NaN or infinite at the initial parameters is refused,
  in particular through where(), whose unselected branch torch computes too and whose
  zero gradient times that branch's -inf, NaN or infinite slope is NaN;
- a nonzero number literal that float64 rounds to 0 is refused, as a YAML number is;
- the node limit counts names, numbers, operators and calls, not the tree's Load
  contexts and operator tokens.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from posgen.codegen.inmemory import encoding_class, module_from_spec
from posgen.spec.expr import MAX_EXPR_NODES, ExprError, ParamInfo, parse_expr
from posgen.spec.loader import SpecError, load_spec
from tests.conftest import expr_bias_spec

SCALAR_A = "{a: {shape: [], init: 1.0}}"


def _problem(path: Path) -> str | None:
    """The spec's diagnostics, one a line; None where it loads."""
    try:
        load_spec(path)
    except SpecError as error:
        return "\n".join(str(diagnostic) for diagnostic in error.diagnostics)
    return None


# --------------------------------------------------------------------------- where()


@pytest.mark.parametrize(
    ("expr", "safe_form"),
    [
        # log(0) = -inf on the diagonal, log(negative) NaN above it, neither selected
        ("where(i > j, -a * log(i - j), 0)", "log(where(i > j, i - j, 1))"),
        # sqrt(negative) = NaN above the diagonal
        ("where(i >= j, -a * sqrt(i - j), 0)", "sqrt(where(i >= j, i - j, 1))"),
        # finite (sqrt(0) = 0) but infinitely steep on the diagonal
        ("where(i > j, sqrt(a * (i - j)), 0)", "sqrt(where(i > j, a * (i - j), 1))"),
        # the unselected branch second: the guard keeps the condition's order
        ("where(i <= j, 0, -a * log(i - j))", "log(where(i <= j, 1, i - j))"),
        # one side each: log1p(i - j) is -inf at j = i + 1, log1p(j - i) at i = j + 1
        (
            "where(i > j, -a * log1p(i - j), -a * log1p(j - i))",
            "log1p(where(i > j, i - j, 1))",
        ),
        # a division by 0 inside exp(-inf) = 0: the value is finite, its gradient is not
        ("where(i > j, exp(-a / (i - j)), 0)", "-a / where(i > j, i - j, 1)"),
    ],
)
def test_a_where_branch_that_poisons_a_gradient_is_refused(
    tmp_path: Path, expr: str, safe_form: str
) -> None:
    problem = _problem(expr_bias_spec(tmp_path, "poisoned", expr, params=SCALAR_A))
    assert problem is not None, expr
    assert "terms.position_position.bias.expr" in problem
    assert "the gradient of parameter 'a' is nan" in problem
    assert "unselected" in problem
    assert f"Guard the argument instead: {safe_form}" in problem


@pytest.mark.parametrize(
    "expr",
    [
        "-a * log(where(i > j, i - j, 1))",  # the argument guarded, not the result
        "-a * sqrt(where(i >= j, i - j, 0) + 1)",
        "where(i > j, -a * (i - j), 0)",  # an unselected branch that is finite and smooth
        "where(i > j, -a * log1p(abs(i - j)), -2 * a * log1p(abs(i - j)))",
        "-a * abs(i - j) + where(i > j, log(i - j), 0)",  # a branch without a parameter
        "-abs(i - j) ** a",  # pow's gradient to its exponent at base 0 is 0 in torch
    ],
)
def test_safe_forms_are_accepted_and_train_with_finite_gradients(tmp_path: Path, expr: str) -> None:
    path = expr_bias_spec(tmp_path, "safe", expr, params=SCALAR_A)
    assert _problem(path) is None, expr
    cls = encoding_class(module_from_spec(path))
    for backend in ("eager", "sdpa"):
        torch.manual_seed(0)
        module = cls(heads=2, head_dim=8)
        q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
        module(q, k, v, causal=True, backend=backend).sum().backward()
        gradient = module.expr_a.grad
        assert gradient is not None and torch.isfinite(gradient).all(), (expr, backend)


def test_a_gradient_poisoned_outside_any_where_is_refused_too(tmp_path: Path) -> None:
    # sqrt(0) is finite, its slope is not: every step's gradient of a is NaN
    problem = _problem(expr_bias_spec(tmp_path, "steep", "-sqrt(a * abs(i - j))", params=SCALAR_A))
    assert problem is not None and "the gradient of parameter 'a' is nan" in problem
    assert "sqrt(a * abs(i - j)) = 0.0, whose slope there is not finite" in problem


# the backward pass of the spec check against torch's autograd, point by point
GRADIENT_EXPRESSIONS = [
    "-a * abs(i - j)",
    "-c[h] * log1p(a * abs(j - i))",
    "where(i > j, -a * log(i - j), 0)",
    "where(i >= j, -a * sqrt(i - j), 0)",
    "where(i > j, sqrt(a * (i - j)), 0)",
    "-a * log(where(i > j, i - j, 1))",
    "sqrt(a * abs(i - j))",
    "(i - j) ** a",
    "abs(i - j) ** a",
    "a ** (i - j)",
    "(a * (i - j)) ** 0.5",
    "a / (i - j + 0.5)",
    "(i - j) / a",
    "(a * (i - j)) % 3",
    "(i - j + 7) % (a + 1)",
    "exp(-a / abs(i - j))",
    "sin(a * (i - j)) + cos(a * j)",
    "sign(a * (i - j)) + floor(a * i)",
    "minimum(a * i, j) + maximum(c[h], i - j)",
    "clamp(a * (i - j), -1, 1)",
    "clamp(i - j, -a, a)",
    "clamp(i - j, c[h], a)",
    "abs(a * (i - j)) + a * a - +a",
    "where(i > j, where(i > j + 1, log(a * (i - j - 1)), 0), 0)",
    "exp(a * 95 * (i - j))",  # past float32's range at distance 1 (e^95)
]
POINTS = [(0.0, 0.0), (3.0, 1.0), (1.0, 3.0), (2.0, 1.0), (5.0, 0.0)]
VALUES = {"a": 0.5, "c": -2.0}


def _torch_gradients(expr: str, i: float, j: float, dtype: torch.dtype) -> dict[str, float]:
    """d expr / d a and d c by torch's autograd, every value a 0-d tensor of ``dtype``."""
    scalar = lambda value: torch.tensor(value, dtype=dtype)  # noqa: E731
    params = {
        name: torch.tensor(value, dtype=dtype, requires_grad=True) for name, value in VALUES.items()
    }

    class PerHead:
        def __getitem__(self, _: object) -> torch.Tensor:
            return params["c"]

    functions = {
        "abs": torch.abs, "log": torch.log, "log1p": torch.log1p, "exp": torch.exp,
        "sqrt": torch.sqrt, "sin": torch.sin, "cos": torch.cos, "sign": torch.sign,
        "floor": torch.floor, "minimum": torch.minimum, "maximum": torch.maximum,
        "clamp": torch.clamp, "where": torch.where,
    }  # fmt: skip
    scope = {**functions, "i": scalar(i), "j": scalar(j), "h": scalar(0.0), "a": params["a"]}
    tree = _Literals().visit(ast.parse(expr, mode="eval"))
    ast.fix_missing_locations(tree)
    code = compile(tree, "<expr>", "eval")
    result = eval(code, {**scope, "c": PerHead(), "_t": scalar, "__builtins__": {}})  # noqa: S307
    result.backward()
    return {name: float(tensor.grad) for name, tensor in params.items() if tensor.grad is not None}


class _Literals(ast.NodeTransformer):
    """Each number literal n as _t(float(n)): a tensor, as the generated steps have it."""

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        return ast.Call(ast.Name("_t", ast.Load()), [ast.Constant(float(node.value))], [])


@pytest.mark.parametrize("expr", GRADIENT_EXPRESSIONS)
@pytest.mark.parametrize("float32", [False, True])
def test_the_checked_gradients_are_torchs(expr: str, float32: bool) -> None:
    from posgen.spec.expr_values import parameter_gradients  # the check's backward pass

    tree = parse_expr(expr, {"a": ParamInfo(False), "c": ParamInfo(True)}).tree
    dtype = torch.float32 if float32 else torch.float64
    for i, j in POINTS:
        got = parameter_gradients(tree, {"i": i, "j": j, "h": 0.0}, VALUES, VALUES, float32)
        want = _torch_gradients(expr, i, j, dtype)
        assert set(got) == set(want), (expr, i, j)
        for name, gradient in want.items():
            if math.isnan(gradient):
                assert math.isnan(got[name]), (expr, i, j, name, got[name])
            else:
                tolerance = 1e-5 if float32 else 1e-12
                assert got[name] == pytest.approx(gradient, rel=tolerance), (expr, i, j, name)


# --------------------------------------------------------------------------- numbers


def test_a_literal_that_underflows_to_zero_is_refused(tmp_path: Path) -> None:
    expr = "-abs(i - j) + i * 1e-400"
    with pytest.raises(ExprError) as caught:
        parse_expr(expr, {})
    assert caught.value.message == (
        "number '1e-400' underflows to 0 (float64 reaches down to ~5e-324)"
    )
    assert caught.value.offset == expr.index("1e-400")
    problem = _problem(expr_bias_spec(tmp_path, "underflow", expr))
    assert problem is not None and "terms.position_position.bias.expr" in problem
    assert "number '1e-400' underflows to 0" in problem
    # a zero is written as one, and the smallest subnormal is not zero
    for fine in ("-abs(i - j) + i * 0e5", "-abs(i - j) + i * 0.000", "-abs(i - j) + i * 5e-324"):
        parse_expr(fine, {})


# --------------------------------------------------------------------------- size


def _node_limit_problem(expr: str) -> str | None:
    try:
        parse_expr(expr, {"r": ParamInfo(per_head=True)})
    except ExprError as error:
        return error.message
    return None


def test_the_node_limit_counts_names_numbers_operators_and_calls() -> None:
    # 5 nodes each (unary -, abs(), -, i, j): 7 of them and 6 additions are 41 (the
    # tree's Load contexts and operator tokens made it 89, past the limit)
    assert _node_limit_problem(" + ".join(["-abs(i - j)"] * 7)) is None
    assert MAX_EXPR_NODES == 64
    # 10 terms and 9 additions are 59; + abs(r[h] * i) adds 5 (a call, a parameter read,
    # *, i and the +): 64 in all
    ten = " + ".join(["-abs(i - j)"] * 10)
    assert _node_limit_problem(f"{ten} + abs(r[h] * i)") is None
    assert _node_limit_problem(f"{ten} + -abs(r[h] * i)") == (
        "65 syntax nodes, past the limit of 64 (names, numbers, operators and calls): "
        "split the idea into a built-in kind or a shorter formula"
    )
    assert _node_limit_problem(f"{ten} + abs(r[h] * i * 2)") is not None  # 66


def test_the_counted_nodes() -> None:
    from posgen.spec.expr import count_nodes

    def count(expr: str) -> int:
        return count_nodes(ast.parse(expr, mode="eval").body)

    assert count("-abs(i - j)") == 5
    assert count("-r1[h] * log1p(r2[h] * abs(i - j))") == 10
    assert count("where(i > j, 1.0, 0)") == 6  # where(), >, i, j, 1.0, 0
