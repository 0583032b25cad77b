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
  Parameters, ``h`` and ``heads`` fold as the values the module under test holds (the
  spec's ``init``, or the trained values of ``--weights``), head by head: the
  ``p * 1000`` of ``where(i > p * 1000, 1, 0)`` is 300000 where p is 300.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from posgen.check.probe import stated
from posgen.check.search import spread
from posgen.check.turns import condition_turns
from posgen.spec.expr_shift import ARITHMETIC, drift, fold_numbers
from posgen.spec.model import Spec, SpecModel
from posgen.spec.model.biases import ExprBias

LENGTH_FIELDS = ("max_positions", "original_max_positions", "max_distance", "floor_scale")
TURN_HEADS = 8  # heads whose values the search for turning conditions tries


@dataclass(frozen=True)
class Length:
    """One length the spec names, and where (for the evidence)."""

    value: float
    source: str  # "original_max_positions 4096", "the bias expression's 1000000 * 17"

    def describe(self) -> str:
        """The length in evidence text: its source, and its value where folded."""
        value = number_text(self.value)
        return self.source if self.source.endswith(f" {value}") else f"{self.source} = {value}"


# per name an expression reads besides i and j (its parameters, h, heads): one value,
# or one per head
Values = Mapping[str, Sequence[float]]


def spec_lengths(spec: Spec, parameters: Values | None = None) -> list[Length]:
    """Every length the spec names: stated fields, then expression numbers, with the
    expression's parameters at ``parameters`` (as the module reads them), by default
    at their ``init``."""
    found = [
        Length(float(value), f"{name} {value}")
        for name in LENGTH_FIELDS
        for value in stated(spec, name)
    ]
    for bias in expression_biases(spec):
        parsed = bias.parsed()
        # the module under test has the spec's defaults
        values = bound_names(bias, parameters, spec.defaults.heads)
        for text, value in expression_numbers(parsed.tree.body, parsed.of_difference, values):
            found.append(Length(value, f"the bias expression's {text}"))
        if not parsed.of_difference:
            found.extend(_turns(parsed.tree.body, values))
    return found


def bound_names(
    bias: ExprBias, parameters: Values | None, heads: int
) -> dict[str, Sequence[float]]:
    """The values an expression's names take in a module of ``heads`` heads: each
    parameter at ``parameters`` (as the module reads them), by default at its ``init``;
    ``heads``; ``h`` head by head."""
    values: dict[str, Sequence[float]] = {
        name: p.initial if isinstance(p.initial, tuple) else (p.initial,)
        for name, p in bias.params.items()
    }
    values.update(parameters or {})
    values.update(heads=(float(heads),), h=tuple(float(head) for head in range(heads)))
    return values


def assignments_of(body: ast.expr, values: Values) -> list[dict[str, float]]:
    """``head_values`` of the names ``body`` reads."""
    read = {node.id for node in ast.walk(body) if isinstance(node, ast.Name)}
    return head_values({name: given for name, given in values.items() if name in read})


def length_of(value: float | None) -> float | None:
    """The length a constant names: its magnitude, or the reciprocal of a magnitude
    below 1 (a scale: i * 0.001 reaches 1 at 1000); None for 0, None or non-finite."""
    if value is None or value == 0 or not math.isfinite(value):
        return None
    magnitude = abs(value)
    length = magnitude if magnitude >= 1 else 1 / magnitude
    return length if math.isfinite(length) else None


def _turns(body: ast.expr, values: Values) -> list[Length]:
    """Where the expression's conditions turn under a shift (``posgen.check.turns``),
    for at most ``TURN_HEADS`` heads' values spread over the heads (the first and the
    last among them)."""
    found: dict[int, str] = {}
    for assignment in spread(assignments_of(body, values), TURN_HEADS):
        for text, shift in condition_turns(body, assignment):
            found.setdefault(shift, f"the bias expression's {text}, which turns at shift {shift}")
    return [Length(float(shift), source) for shift, source in sorted(found.items())]


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


def expression_numbers(
    body: ast.expr, of_difference: bool = False, values: Values | None = None
) -> list[tuple[str, float]]:
    """The lengths a checked bias expression names: (its text, its magnitude) for every
    number literal and every folded constant sub-expression whose enclosing operation
    moves when i and j shift together, a magnitude below 1 as its reciprocal; none where
    the whole expression reads j - i only (``of_difference``). Names in ``values``
    (parameters, h, heads) fold as their values, head by head (``head_values``)."""
    if of_difference:
        return []
    # the operands of every operation a shift moves: their numbers meet a position
    operands = [
        child
        for parent in ast.walk(body)
        if drift(parent) != 0
        for child in ast.iter_child_nodes(parent)
    ]
    found: dict[float, str] = {}
    for assignment in assignments_of(body, values or {}):
        for operand in operands:
            _fold_into(operand, found, assignment)
    return [(text, value) for value, text in sorted(found.items())]


def head_values(values: Values) -> list[dict[str, float]]:
    """One assignment of ``values`` per head that differs from the others: a name with
    one value per head takes head h's, a name with one value takes it everywhere."""
    heads = max((len(given) for given in values.values()), default=1)
    assignments: list[dict[str, float]] = []
    for head in range(heads):
        assignment = {
            name: float(given[head if len(given) > 1 else 0]) for name, given in values.items()
        }
        if assignment not in assignments:
            assignments.append(assignment)
    return assignments


def _fold_into(node: ast.AST, found: dict[float, str], assignment: Mapping[str, float]) -> None:
    """Add the constant ``node`` and every constant part of it to ``found``."""
    value = constant_value(node, assignment)
    if value is None:
        return
    length = length_of(value)
    if length is not None:
        text = ast.unparse(node)
        if abs(value) < 1:
            text = f"{text} (a scale: 1 / {text})"
        reads = _named_reads(node)
        itself = reads.pop(text, None)
        if itself is not None:  # a parameter alone: "p = 300", "q[h] = 20 with h = 1"
            text = f"{text} = {number_text(assignment[itself])}"
        if reads:  # "p * 1000 with p = 300", "(h + 1) * q[h] with h = 1, q[h] = 20"
            shown = (f"{read} = {number_text(assignment[name])}" for read, name in reads.items())
            text = f"{text} with {', '.join(sorted(shown))}"
        found.setdefault(length, text)
    for child in ast.iter_child_nodes(node):
        _fold_into(child, found, assignment)


def _named_reads(node: ast.AST) -> dict[str, str]:
    """The names a constant subtree reads, by how it reads them: ``{"p": "p", "q[h]":
    "q", "h": "h"}`` for ``p * q[h]`` (h is read too)."""
    reads: dict[str, str] = {}
    for part in ast.walk(node):
        if isinstance(part, ast.Subscript) and isinstance(part.value, ast.Name):
            reads[ast.unparse(part)] = part.value.id
        elif isinstance(part, ast.Name) and not any(
            isinstance(parent, ast.Subscript) and parent.value is part for parent in ast.walk(node)
        ):
            reads[part.id] = part.id
    return reads


def constant_value(node: ast.AST, assignment: Mapping[str, float] | None = None) -> float | None:
    """The float64 value of a subtree of numbers, unary signs and + - * / ** %, and of
    the names (``p``, ``p[h]``, ``h``, ``heads``) that ``assignment`` values, or None (it
    reads i, j or another name, or is not a real number: a division by 0, a negative
    base's fractional power). An overflow is infinite (``10 ** 10 ** 10``); Python
    floats throughout, so no power builds a huge integer."""

    def name_value(node: ast.expr) -> float | None:
        if isinstance(node, ast.Subscript):  # a [heads] parameter read as p[h]
            node = node.value
        if isinstance(node, ast.Name) and assignment is not None:
            return assignment.get(node.id)
        return None

    return fold_numbers(node, float, _binary, name_value)


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
