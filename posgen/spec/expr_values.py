"""The value of a checked bias expression at given positions, in Python floats.

The spec layer refuses a bias that is not finite where every model reads it (near
distance 0, with the parameters at their initial values): -log(abs(i - j)) is -inf on the
diagonal, and a row whose logits are -inf or NaN is masked or poisoned, not biased. The
generated module computes the expression with torch; this evaluator follows torch's IEEE
conventions where Python's own raise or go complex (log(0) = -inf, x / 0 = ±inf, 0 / 0 =
NaN, x % 0 = NaN, a negative number to a fractional power = NaN, sign(NaN) = 0), so that
a value is finite here exactly where the module's float64 value is. Evaluated again with
every intermediate value rounded to float32 (``to_float32``), it is finite where the
module's float32 value is: (i + 1) ** 40 / (i + 1) ** 40 is 1 in float64 and NaN in
float32, whose range (3.4e38) the numerator leaves at i = 9.
"""

from __future__ import annotations

import ast
import math
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

_INF = math.inf
_NAN = math.nan
_FLOAT32 = struct.Struct("f")


class NonFinite(NamedTuple):
    """Where a bias expression is first not finite, and in which precision."""

    i: int
    j: int
    h: int
    value: float
    float32: bool  # finite in float64, not with every step rounded to float32


def to_float32(x: float) -> float:
    """x rounded to the nearest float32 (IEEE round-to-nearest-even), ±inf past its range."""
    try:
        rounded: float = _FLOAT32.unpack(_FLOAT32.pack(x))[0]
    except OverflowError:  # rounds past float32's largest finite value
        return math.copysign(_INF, x)
    return rounded


def _exact(x: float) -> float:
    return x


def first_non_finite(
    tree: ast.Expression,
    params: Mapping[str, float],
    positions: Iterable[int],
    heads: Iterable[int],
) -> NonFinite | None:
    """The first (i, j, h) over ``positions`` x ``positions`` x ``heads`` at which the
    expression is NaN or infinite, with ``params`` (name -> value, one for every head of
    a per-head parameter): in float64 first, then with every step in float32 (a
    module's default dtype); None where it is finite in both."""
    points = list(positions)
    for float32 in (False, True):
        for h in heads:
            for i in points:
                for j in points:
                    names = {"i": i, "j": j, "h": h}
                    value = expression_value(tree, names, params, float32=float32)
                    if not math.isfinite(value):
                        return NonFinite(i, j, h, value, float32)
    return None


def expression_value(
    tree: ast.Expression,
    names: Mapping[str, float],
    params: Mapping[str, float],
    float32: bool = False,
) -> float:
    """The expression's value with the names (i, j, h) and parameters bound: in float64,
    or with every input and every intermediate value rounded to float32."""
    return _value(tree.body, names, params, to_float32 if float32 else _exact)


def _value(
    node: ast.expr,
    names: Mapping[str, float],
    params: Mapping[str, float],
    rounded: Callable[[float], float],
) -> float:
    """The value of ``node``, each step passed through ``rounded``."""
    if isinstance(node, ast.Constant):  # an int or float (checked by the parser)
        assert isinstance(node.value, (int, float))
        return rounded(float(node.value))
    if isinstance(node, ast.Name):
        value = names[node.id] if node.id in names else params[node.id]
        return rounded(float(value))
    if isinstance(node, ast.Subscript):  # name[h]: every head starts from one value
        assert isinstance(node.value, ast.Name)
        return rounded(float(params[node.value.id]))
    if isinstance(node, ast.UnaryOp):
        operand = _value(node.operand, names, params, rounded)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        left = _value(node.left, names, params, rounded)
        right = _value(node.right, names, params, rounded)
        return rounded(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.Compare):
        left = _value(node.left, names, params, rounded)
        right = _value(node.comparators[0], names, params, rounded)
        return float(_COMPARE[type(node.ops[0])](left, right))
    if isinstance(node, ast.Call):
        assert isinstance(node.func, ast.Name)
        arguments = [_value(argument, names, params, rounded) for argument in node.args]
        return rounded(_FUNCTIONS[node.func.id](*arguments))
    raise AssertionError(f"not a checked expression node: {type(node).__name__}")


def _divide(a: float, b: float) -> float:
    if b != 0:
        return a / b
    if a == 0 or math.isnan(a):
        return _NAN
    return math.copysign(_INF, a) * math.copysign(1.0, b)


def _remainder(a: float, b: float) -> float:
    """torch.remainder: the sign of the divisor (Python's %), NaN for a zero divisor."""
    if b == 0 or math.isinf(a) or math.isnan(a) or math.isnan(b):
        return _NAN
    return a % b


def _power(a: float, b: float) -> float:
    try:
        result = a**b
    except ZeroDivisionError:  # 0 ** negative
        return _INF
    except OverflowError:
        return _INF
    return _NAN if isinstance(result, complex) else float(result)


def _log(x: float) -> float:
    return math.log(x) if x > 0 and math.isfinite(x) else _edge_log(x, 0.0)


def _log1p(x: float) -> float:
    return math.log1p(x) if x > -1 and math.isfinite(x) else _edge_log(x, -1.0)


def _edge_log(x: float, zero_at: float) -> float:
    """log at its edges: -inf at the pole, NaN below it, inf at inf, NaN at NaN."""
    if x == zero_at:
        return -_INF
    if x == _INF:
        return _INF
    return _NAN


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return _INF


def _sqrt(x: float) -> float:
    return math.sqrt(x) if x >= 0 else _NAN


def _periodic(function: Callable[[float], float]) -> Callable[[float], float]:
    def value(x: float) -> float:
        return function(x) if math.isfinite(x) else _NAN

    return value


def _sign(x: float) -> float:
    if math.isnan(x) or x == 0:
        return 0.0
    return math.copysign(1.0, x)


def _floor(x: float) -> float:
    return float(math.floor(x)) if math.isfinite(x) else x


def _minimum(a: float, b: float) -> float:
    return _NAN if math.isnan(a) or math.isnan(b) else min(a, b)


def _maximum(a: float, b: float) -> float:
    return _NAN if math.isnan(a) or math.isnan(b) else max(a, b)


def _clamp(x: float, low: float, high: float) -> float:
    return _minimum(_maximum(x, low), high)


def _where(condition: float, a: float, b: float) -> float:
    return a if condition else b


_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: _divide,
    ast.Pow: _power,
    ast.Mod: _remainder,
}
_COMPARE: dict[type[ast.cmpop], Callable[[float, float], bool]] = {
    ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b,
    ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b,
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
}
_FUNCTIONS: dict[str, Callable[..., float]] = {
    "abs": abs,
    "log": _log,
    "log1p": _log1p,
    "exp": _exp,
    "sqrt": _sqrt,
    "sin": _periodic(math.sin),
    "cos": _periodic(math.cos),
    "sign": _sign,
    "floor": _floor,
    "minimum": _minimum,
    "maximum": _maximum,
    "clamp": _clamp,
    "where": _where,
}
