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
import copy
import math
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
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


ParamValues = Mapping[str, float | Sequence[float]]
"""Each parameter's value: one for every head, or one per head (indexed by h)."""


def values_at_head(params: ParamValues, h: int) -> dict[str, float]:
    """Each parameter's value at head ``h``: its own where it has one per head."""
    return {
        name: float(value) if isinstance(value, (int, float)) else float(value[h])
        for name, value in params.items()
    }


def first_non_finite(
    tree: ast.Expression,
    params: ParamValues,
    positions: Iterable[int],
    heads: Iterable[int],
) -> NonFinite | None:
    """The first (i, j, h) over ``positions`` x ``positions`` x ``heads`` at which the
    expression is NaN or infinite, with ``params`` (name -> value, one for every head of
    a per-head parameter or one per head): in float64 first, then with every step in float32 (a
    module's default dtype); None where it is finite in both."""
    points = list(positions)
    for float32 in (False, True):
        for h in heads:
            at_head = values_at_head(params, h)
            for i in points:
                for j in points:
                    names = {"i": i, "j": j, "h": h}
                    value = expression_value(tree, names, at_head, float32=float32)
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
    seen: dict[int, float] | None = None,
) -> float:
    """The value of ``node``, each step passed through ``rounded``; ``seen``, where
    given, receives every node's value by ``id`` (what a backward pass reads)."""
    value = _node_value(node, names, params, rounded, seen)
    if seen is not None:
        seen[id(node)] = value
    return value


def _node_value(
    node: ast.expr,
    names: Mapping[str, float],
    params: Mapping[str, float],
    rounded: Callable[[float], float],
    seen: dict[int, float] | None,
) -> float:
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
        operand = _value(node.operand, names, params, rounded, seen)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        left = _value(node.left, names, params, rounded, seen)
        right = _value(node.right, names, params, rounded, seen)
        return rounded(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.Compare):
        left = _value(node.left, names, params, rounded, seen)
        right = _value(node.comparators[0], names, params, rounded, seen)
        return float(_COMPARE[type(node.ops[0])](left, right))
    if isinstance(node, ast.Call):
        assert isinstance(node.func, ast.Name)
        arguments = [_value(argument, names, params, rounded, seen) for argument in node.args]
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


# --------------------------------------------------------------------------- gradients


class NonFiniteGradient(NamedTuple):
    """Where a trained parameter's gradient is first NaN or infinite, and why.

    ``culprit``: the operation whose value is not finite, or whose slope is infinite
    (sqrt at 0), where the backward pass first turns a finite gradient into a
    non-finite one (None where no single operation does, e.g. a sum that overflows);
    ``culprit_value``: its value there. ``masked_by``: the where() whose unselected
    branch holds the culprit (torch computes both branches, and backward multiplies
    that branch's zero gradient by the culprit's infinite or NaN factor: 0 * inf =
    NaN), with ``branch`` the index (1 or 2) of that argument; None where no where()
    selects the culprit away."""

    i: int
    j: int
    h: int
    param: str
    gradient: float
    float32: bool
    culprit: ast.expr | None
    culprit_value: float
    masked_by: ast.Call | None
    branch: int


def first_non_finite_gradient(
    tree: ast.Expression,
    params: ParamValues,
    trained: Iterable[str],
    positions: Iterable[int],
    heads: Iterable[int],
) -> NonFiniteGradient | None:
    """The first (i, j, h), over the points ``first_non_finite`` checks, at which the
    gradient of the expression with respect to a ``trained`` parameter is NaN or
    infinite: in float64 first, then with every step in float32; None where every
    such gradient is finite. Call it where the expression's value is finite there.

    The backward pass follows torch's autograd formulas for the module's torch calls
    (derivatives.yaml), seeded with a gradient of 1: the module's upstream gradient
    is finite, 0 at masked scores, and a product with a non-finite factor is
    non-finite for any such seed (0 * inf = NaN). where() gives its unselected branch
    a zero gradient, so a branch that is -inf, NaN or infinitely steep where it is not
    selected poisons the parameters it reads although the bias itself is finite."""
    needs = _reading(tree.body, frozenset(trained))
    if not needs:
        return None
    points = list(positions)
    head_list = list(heads)
    for float32 in (False, True):
        for h in head_list:
            at_head = values_at_head(params, h)
            for i in points:
                for j in points:
                    names = {"i": i, "j": j, "h": h}
                    backward = _backward(tree, names, at_head, needs, float32)
                    for name, gradient in backward.gradients.items():
                        if not math.isfinite(gradient):
                            return backward.problem(i, j, h, name, gradient, float32)
    return None


def parameter_gradients(
    tree: ast.Expression,
    names: Mapping[str, float],
    params: Mapping[str, float],
    trained: Iterable[str],
    float32: bool = False,
) -> dict[str, float]:
    """d expression / d parameter for each ``trained`` parameter the expression reads,
    at one point, as torch's backward computes it from a gradient of 1 (in float64, or
    with every step rounded to float32); a per-head parameter's for the head read."""
    needs = _reading(tree.body, frozenset(trained))
    if not needs:
        return {}
    return _backward(tree, names, params, needs, float32).gradients


def _backward(
    tree: ast.Expression,
    names: Mapping[str, float],
    params: Mapping[str, float],
    needs: frozenset[int],
    float32: bool,
) -> _Backward:
    """The forward and the backward pass at one point."""
    rounded = to_float32 if float32 else _exact
    seen: dict[int, float] = {}
    _value(tree.body, names, params, rounded, seen)
    backward = _Backward(seen, rounded, needs)
    backward.run(tree.body, 1.0, None)
    return backward


def _reading(body: ast.expr, trained: frozenset[str]) -> frozenset[int]:
    """The ids of the nodes whose value depends on a trained parameter (the operands
    autograd differentiates: a comparison's operands are not among them)."""
    needs: set[int] = set()

    def visit(node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            reads = node.id in trained
        elif isinstance(node, ast.Subscript):
            reads = isinstance(node.value, ast.Name) and node.value.id in trained
        elif isinstance(node, ast.Compare):  # a boolean: no gradient flows through it
            reads = False
        else:
            reads = False
            for child in _operands(node):
                reads = visit(child) or reads
        if reads:
            needs.add(id(node))
        return reads

    visit(body)
    return frozenset(needs)


def _operands(node: ast.expr) -> list[ast.expr]:
    """The operands of a checked expression node, in order."""
    if isinstance(node, ast.UnaryOp):
        return [node.operand]
    if isinstance(node, ast.BinOp):
        return [node.left, node.right]
    if isinstance(node, ast.Compare):
        return [node.left, node.comparators[0]]
    if isinstance(node, ast.Call):
        return list(node.args)
    return []


class _Backward:
    """One reverse pass over a checked expression at one point: ``gradients`` by
    parameter name, and the first node at which a finite gradient became non-finite."""

    def __init__(
        self, values: dict[int, float], rounded: Callable[[float], float], needs: frozenset[int]
    ) -> None:
        self.values = values
        self.rounded = rounded
        self.needs = needs
        self.gradients: dict[str, float] = {}
        self.origins: list[tuple[ast.expr, tuple[ast.Call, int] | None]] = []

    def run(self, node: ast.expr, gradient: float, masked: tuple[ast.Call, int] | None) -> None:
        """Propagate ``gradient`` (d bias / d node) into ``node``'s operands; ``masked``:
        the innermost where() (and argument index) whose unselected branch holds it."""
        if id(node) not in self.needs:
            return
        name = _parameter_name(node)
        if name is not None:
            previous = self.gradients.get(name)
            total = gradient if previous is None else self.rounded(previous + gradient)
            self.gradients[name] = total
            return
        for child, child_gradient, child_masked in self._operand_gradients(node, gradient):
            if math.isfinite(gradient) and not math.isfinite(child_gradient):
                self.origins.append((node, child_masked if child_masked else masked))
            self.run(child, child_gradient, child_masked if child_masked else masked)

    def _operand_gradients(
        self, node: ast.expr, gradient: float
    ) -> list[tuple[ast.expr, float, tuple[ast.Call, int] | None]]:
        """(operand, its gradient, the where() masking it if this node does) for each
        operand that depends on a parameter, by torch's formula for the node."""
        value, r = self.values, self.rounded
        formulas: list[tuple[ast.expr, float]]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "where":  # the unselected branch gets an exact 0
                chosen = 1 if value[id(node.args[0])] else 2
                branches: list[tuple[ast.expr, float, tuple[ast.Call, int] | None]] = []
                for index in (1, 2):
                    branch = node.args[index]
                    if id(branch) not in self.needs:
                        continue
                    if index == chosen:
                        branches.append((branch, gradient, None))
                    else:
                        branches.append((branch, 0.0, (node, index)))
                return branches
            arguments = [value[id(argument)] for argument in node.args]
            slopes = _CALL_GRADIENTS[node.func.id](gradient, arguments, value[id(node)], r)
            formulas = list(zip(node.args, slopes, strict=True))
        elif isinstance(node, ast.UnaryOp):
            negate = isinstance(node.op, ast.USub)
            formulas = [(node.operand, -gradient if negate else gradient)]
        elif isinstance(node, ast.BinOp):
            left, right = value[id(node.left)], value[id(node.right)]
            slopes = _BINARY_GRADIENTS[type(node.op)](gradient, left, right, value[id(node)], r)
            formulas = [(node.left, slopes[0]), (node.right, slopes[1])]
        else:
            formulas = []
        return [(child, g, None) for child, g in formulas if id(child) in self.needs]

    def problem(
        self, i: int, j: int, h: int, name: str, gradient: float, float32: bool
    ) -> NonFiniteGradient:
        """The report of a non-finite gradient of ``name``: its cause within a where()'s
        unselected branch where there is one, else the first cause met."""
        origins = sorted(self.origins, key=lambda origin: origin[1] is None)
        if not origins:
            return NonFiniteGradient(i, j, h, name, gradient, float32, None, _NAN, None, 0)
        node, masked = origins[0]
        culprit = self._culprit(node)
        where, branch = masked if masked is not None else (None, 0)
        value = self.values[id(culprit)]
        return NonFiniteGradient(i, j, h, name, gradient, float32, culprit, value, where, branch)

    def _culprit(self, node: ast.expr) -> ast.expr:
        """The innermost non-finite operand below ``node``; ``node`` itself where its
        operands are finite (its value or its slope is not)."""
        while True:
            bad = [child for child in _operands(node) if not math.isfinite(self.values[id(child)])]
            if not bad:
                return node
            node = bad[0]


def _parameter_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        return node.value.id
    return None


_Round = Callable[[float], float]


def _floor_divide(a: float, b: float) -> float:
    """torch's a.div(b, rounding_mode="floor"): a / b where b is 0."""
    if b == 0:
        return _divide(a, b)
    return a // b


def _pow_gradients(g: float, base: float, exponent: float, result: float, r: _Round) -> list[float]:
    """pow_backward_self: 0 where the exponent is 0, else g * exponent * base ** (exponent
    - 1); pow_backward_exponent: 0 where base == 0 and exponent >= 0, else g * result *
    log(base)."""
    to_base = 0.0 if exponent == 0 else r(g * r(exponent * r(_power(base, r(exponent - 1)))))
    masked = base == 0 and exponent >= 0
    to_exponent = r(g * (0.0 if masked else r(result * _log(base))))
    return [to_base, to_exponent]


_BINARY_GRADIENTS: dict[
    type[ast.operator], Callable[[float, float, float, float, _Round], list[float]]
] = {
    ast.Add: lambda g, a, b, out, r: [g, g],
    ast.Sub: lambda g, a, b, out, r: [g, -g],
    ast.Mult: lambda g, a, b, out, r: [r(g * b), r(g * a)],
    ast.Div: lambda g, a, b, out, r: [r(_divide(g, b)), r(-g * r(_divide(r(_divide(a, b)), b)))],
    ast.Pow: _pow_gradients,
    ast.Mod: lambda g, a, b, out, r: [g, r(-g * r(_floor_divide(a, b)))],
}


def _minimum_gradients(g: float, a: float, b: float, r: _Round) -> list[float]:
    """where(a == b, g / 2, g), masked to 0 for the larger operand (NaN: neither)."""
    shared = r(g / 2) if a == b else g
    return [0.0 if a > b else shared, 0.0 if a < b else shared]


def _maximum_gradients(g: float, a: float, b: float, r: _Round) -> list[float]:
    shared = r(g / 2) if a == b else g
    return [0.0 if a < b else shared, 0.0 if a > b else shared]


def _clamp_gradients(g: float, x: float, low: float, high: float) -> list[float]:
    """clamp_backward and clamp_backward_min_max: each operand gets g where it is the
    one the result is, else 0."""
    return [
        g if low <= x <= high else 0.0,
        g if x < low and low < high else 0.0,
        g if x > high or high < low else 0.0,
    ]


_CALL_GRADIENTS: dict[str, Callable[[float, list[float], float, _Round], list[float]]] = {
    "abs": lambda g, x, out, r: [r(g * _sign(x[0]))],
    "log": lambda g, x, out, r: [r(_divide(g, x[0]))],
    "log1p": lambda g, x, out, r: [r(_divide(g, r(x[0] + 1)))],
    "exp": lambda g, x, out, r: [r(g * out)],
    "sqrt": lambda g, x, out, r: [r(_divide(g, r(2 * out)))],
    "sin": lambda g, x, out, r: [r(g * r(_FUNCTIONS["cos"](x[0])))],
    "cos": lambda g, x, out, r: [r(g * -r(_FUNCTIONS["sin"](x[0])))],
    "sign": lambda g, x, out, r: [0.0],
    "floor": lambda g, x, out, r: [0.0],
    "minimum": lambda g, x, out, r: _minimum_gradients(g, x[0], x[1], r),
    "maximum": lambda g, x, out, r: _maximum_gradients(g, x[0], x[1], r),
    "clamp": lambda g, x, out, r: _clamp_gradients(g, *x),
}


def guarded_form(culprit: ast.expr, where: ast.Call, branch: int) -> str | None:
    """``culprit`` with the operand that leaves its domain guarded by ``where``'s
    condition, so that the unselected positions read 1 there: log(x) becomes
    log(where(cond, x, 1)) for branch 1 (where(cond, 1, x) for branch 2), likewise
    for every one-argument function; x / y and x % y guard y, x ** y guards x. None for
    another operation (a sum or product that overflows)."""
    guarded = copy.deepcopy(culprit)
    condition = copy.deepcopy(where.args[0])

    def guard(operand: ast.expr) -> ast.Call:
        one = ast.Constant(1)
        arguments = [condition, operand, one] if branch == 1 else [condition, one, operand]
        return ast.Call(func=ast.Name("where", ast.Load()), args=arguments, keywords=[])

    if isinstance(guarded, ast.Call) and len(guarded.args) == 1:
        guarded.args = [guard(guarded.args[0])]
    elif isinstance(guarded, ast.BinOp) and isinstance(guarded.op, (ast.Div, ast.Mod)):
        guarded.right = guard(guarded.right)
    elif isinstance(guarded, ast.BinOp) and isinstance(guarded.op, ast.Pow):
        guarded.left = guard(guarded.left)
    else:
        return None
    return ast.unparse(guarded)
