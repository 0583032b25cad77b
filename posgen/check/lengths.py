"""The lengths a spec names: where its module may start to treat positions differently.

A claim about shifts (``relative``) breaks where the module changes with the absolute
position: a rope scaling's switch at ``original_max_positions``, a clip, a table's end,
or a threshold written into an expression bias (``where(i > 300000, 1, 0)``). The
checker cannot try every shift, so its far shifts go past every length the spec names
(``relative.far_shift``) and, where one lies past what it can try, it says so instead of
confirming the claim. Two sources:

* stated fields (``LENGTH_FIELDS``: ``max_positions``, ``original_max_positions``,
  ``max_distance``, a query scale's ``floor_scale``), anywhere in the spec;
* the numbers of every ``kind: expr`` bias (``expression_numbers``): each number literal
  and each constant sub-expression folded in float64 (``1000000 * 17`` is 17000000,
  ``2 ** 20`` is 1048576; the grammar caps a literal at 10^6, so only a folded product
  or power lies past it). A number below 1 in magnitude counts as its reciprocal, a
  scale (the 0.000001 of ``i * 0.000001``: that product reaches 1 at position 10^6).
  Zero and non-finite numbers name no length. An expression that reads i and j only
  through j - i (posgen's drift analysis, ``posgen.spec.expr_shift``) names none, and
  neither does a number whose enclosing operation is unchanged by a shift (the
  ``1000000`` of ``abs(i - j) > 1000000``): only numbers that meet a position count.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from posgen.check.probe import stated
from posgen.spec.expr_shift import ARITHMETIC, drift, fold_numbers
from posgen.spec.model import Spec, SpecModel
from posgen.spec.model.biases import ExprBias

LENGTH_FIELDS = ("max_positions", "original_max_positions", "max_distance", "floor_scale")


@dataclass(frozen=True)
class Length:
    """One length the spec names, and where (for the evidence)."""

    value: float
    source: str  # "original_max_positions 4096", "the bias expression's 1000000 * 17"

    def describe(self) -> str:
        """The length in evidence text: its source, and its value where folded."""
        value = number_text(self.value)
        return self.source if self.source.endswith(f" {value}") else f"{self.source} = {value}"


def spec_lengths(spec: Spec) -> list[Length]:
    """Every length the spec names: stated fields, then expression numbers."""
    found = [
        Length(float(value), f"{name} {value}")
        for name in LENGTH_FIELDS
        for value in stated(spec, name)
    ]
    for bias in expression_biases(spec):
        parsed = bias.parsed()
        for text, value in expression_numbers(parsed.tree.body, parsed.of_difference):
            found.append(Length(value, f"the bias expression's {text}"))
    return found


def expression_biases(model: Any) -> Iterator[ExprBias]:
    """Every ``kind: expr`` bias in a spec (or any part of one)."""
    if isinstance(model, ExprBias):
        yield model
    elif isinstance(model, SpecModel):
        for name in type(model).model_fields:
            yield from expression_biases(getattr(model, name))
    elif isinstance(model, (list, tuple)):
        for item in model:
            yield from expression_biases(item)
    elif isinstance(model, dict):
        for item in model.values():
            yield from expression_biases(item)


def expression_numbers(body: ast.expr, of_difference: bool = False) -> list[tuple[str, float]]:
    """The lengths a checked bias expression names: (its text, its magnitude) for every
    number literal and every folded constant sub-expression whose enclosing operation
    moves when i and j shift together, a magnitude below 1 as its reciprocal; none where
    the whole expression reads j - i only (``of_difference``)."""
    if of_difference:
        return []
    found: dict[float, str] = {}
    for parent in ast.walk(body):
        if drift(parent) == 0:  # unchanged by a shift: its numbers meet no position
            continue
        for child in ast.iter_child_nodes(parent):
            _fold_into(child, found)
    return [(text, value) for value, text in sorted(found.items())]


def _fold_into(node: ast.AST, found: dict[float, str]) -> None:
    """Add the constant ``node`` and every constant part of it to ``found``."""
    value = constant_value(node)
    if value is None:
        return
    magnitude = abs(value)
    if magnitude != 0 and math.isfinite(magnitude):
        text = ast.unparse(node)
        length = magnitude if magnitude >= 1 else 1 / magnitude
        if magnitude < 1:
            text = f"{text} (a scale: 1 / {text})"
        if math.isfinite(length):
            found.setdefault(length, text)
    for child in ast.iter_child_nodes(node):
        _fold_into(child, found)


def constant_value(node: ast.AST) -> float | None:
    """The float64 value of a subtree of numbers, unary signs and + - * / ** %, or None
    (it reads a name, or is not a real number: a division by 0, a negative base's
    fractional power). An overflow is infinite (``10 ** 10 ** 10``); Python floats
    throughout, so no power builds a huge integer."""
    return fold_numbers(node, float, _binary)


def _binary(op: ast.operator, left: float, right: float) -> float | None:
    """``left op right`` in Python floats: inf on overflow, None where undefined."""
    try:
        apply = ARITHMETIC.get(type(op))
        if apply is not None:
            result: float = apply(left, right)
            return result
        if isinstance(op, ast.Mod):
            return left % right
        if isinstance(op, ast.Pow):
            result = left**right
            return result if isinstance(result, float) else None  # complex: not real
    except (ZeroDivisionError, ValueError):
        return None
    except OverflowError:
        return math.inf
    return None


def number_text(value: float) -> str:
    """A length in evidence text: an integer as digits, else 4 significant digits."""
    return str(int(value)) if value.is_integer() else f"{value:.4g}"
