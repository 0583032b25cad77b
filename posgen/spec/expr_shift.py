"""Which checked expressions are functions of the relative position alone.

An expression f(i, j) of the query position i and the key position j reads them only
through their difference where shifting both by the same c leaves it unchanged:
f(i + c, j + c) = f(i, j). Such an expression equals f(0, j - i), so a bias written
with it is a vector over the key-minus-query distance (Shaw et al. 2018; the
relative-position premise of ALiBi and KERPLE) and takes the per-distance paths.

The test is a small abstract interpretation over the syntax tree. Each node gets its
*drift*: the exact rational d with node(i + c, j + c) = node(i, j) + d * c for every
c, or ``None`` where no such d is known:

- ``i`` and ``j`` drift by 1; numbers, ``h`` and parameters by 0;
- sums and differences add and subtract drifts; a product or quotient with a number
  scales the other operand's drift; ``minimum`` and ``maximum`` of operands that drift
  alike, and ``where`` with an unmoved condition between values that drift alike, drift
  with them; any other product, quotient, power, remainder or function call drifts by 0
  when every operand does, else unknown;
- a comparison ``x < y`` is unchanged by a shift where x and y drift alike (x - y does
  not move).

The expression is a function of j - i when its drift is 0. So ``(i + 1) - j``,
``2 * i - 2 * j``, ``abs(i - j) * (j - i)``, ``minimum(i, j) - j`` and
``where(i < j, ...)`` qualify, and
``i * a - j * a`` does not (a parameter's value is unknown; the test is sound, not
complete). Numbers are taken exactly (``fractions.Fraction`` of the float), so a
drift of 0 is never an artefact of rounding.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from fractions import Fraction
from typing import Any, TypeVar

Drift = Fraction | None

_POSITIONS = ("i", "j")


def reads_difference_only(body: ast.AST) -> bool:
    """Whether the checked expression ``body`` is unchanged when i and j shift together
    (its drift is 0): a function of the key minus query position, the head and the
    parameters alone."""
    return drift(body) == 0


def drift(node: ast.AST) -> Drift:
    """How ``node`` moves when i and j both move by c: node + drift * c, exactly, or
    None where that is not known (see the module docstring)."""
    if isinstance(node, ast.Name):
        return Fraction(1) if node.id in _POSITIONS else Fraction(0)
    if isinstance(node, (ast.Constant, ast.Subscript)):
        return Fraction(0)  # a number, or a [heads] parameter read as name[h]
    if isinstance(node, ast.UnaryOp):
        inner = drift(node.operand)
        if inner is None:
            return None
        return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.BinOp):
        return _binary_drift(node)
    if isinstance(node, ast.Compare):
        left, right = drift(node.left), drift(node.comparators[0])
        return Fraction(0) if left is not None and left == right else None
    if isinstance(node, ast.Call):
        return _call_drift(node)
    return None


def _binary_drift(node: ast.BinOp) -> Drift:
    left, right = drift(node.left), drift(node.right)
    if left is None or right is None:
        return None
    if isinstance(node.op, (ast.Add, ast.Sub)):
        return _exact(node.op, left, right)  # (x + a c) +- (y + b c)
    if isinstance(node.op, ast.Mult):
        left_number, right_number = number_value(node.left), number_value(node.right)
        if left_number is not None:
            return left_number * right
        if right_number is not None:
            return left * right_number
    if isinstance(node.op, ast.Div):
        divisor = number_value(node.right)
        if divisor is not None and divisor != 0:
            return left / divisor
    return Fraction(0) if left == 0 and right == 0 else None


def _call_drift(node: ast.Call) -> Drift:
    name = node.func.id if isinstance(node.func, ast.Name) else ""
    drifts = [drift(argument) for argument in node.args]
    if name in ("minimum", "maximum") and drifts[0] == drifts[1]:
        return drifts[0]  # min(x + d c, y + d c) = min(x, y) + d c
    if name == "where" and drifts[0] == 0 and drifts[1] == drifts[2]:
        return drifts[1]  # an unmoved condition picks between values that move alike
    return Fraction(0) if all(value == 0 for value in drifts) else None


Number = TypeVar("Number", Fraction, float)


def fold_numbers(
    node: ast.AST,
    leaf: Callable[[int | float], Number],
    binary: Callable[[ast.operator, Number, Number], Number | None],
    name: Callable[[ast.expr], Number | None] | None = None,
) -> Number | None:
    """The value of a subtree made of number literals (each read by ``leaf``), unary
    signs and binary operators (each applied by ``binary``, None where it is undefined),
    or None: a subtree that reads a name or another literal, or an undefined operation.
    Where ``name`` is given, it values names and ``p[h]`` reads (None: not a number)."""
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            return None
        return leaf(node.value)
    if isinstance(node, (ast.Name, ast.Subscript)):
        return None if name is None else name(node)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = fold_numbers(node.operand, leaf, binary, name)
        if inner is None:
            return None
        return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.BinOp):
        left = fold_numbers(node.left, leaf, binary, name)
        right = fold_numbers(node.right, leaf, binary, name)
        if left is None or right is None:
            return None
        return binary(node.op, left, right)
    return None


def number_value(node: ast.AST) -> Fraction | None:
    """The exact value of a subtree made of numbers, + - * / and unary signs alone, or
    None (a subtree that reads a name, or divides by zero)."""
    return fold_numbers(node, Fraction, _exact)


# + - * / of the expression grammar, by operator node type
ARITHMETIC: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def _exact(op: ast.operator, left: Fraction, right: Fraction) -> Fraction | None:
    """left op right for + - * /, exactly; None for another operator or a division by 0."""
    apply = ARITHMETIC.get(type(op))
    if apply is None or (isinstance(op, ast.Div) and right == 0):
        return None
    result: Fraction = apply(left, right)
    return result
