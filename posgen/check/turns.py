"""Where a bias expression's conditions turn when every position shifts by c.

A threshold need not be written as a number: ``sqrt(i) > 1000`` turns at i = 1000001
and ``i / 1000000 > 10`` past 10^7, though no number of theirs is that large
(``posgen.check.lengths`` folds only constant sub-expressions). So each discrete part of
the expression that a shift moves (``expr_shift.drift`` not 0): a comparison, and the
choices inside ``abs`` (x < 0), ``sign`` (its value), ``minimum``/``maximum`` (a < b)
and ``clamp`` (x < low, x > high), is evaluated at positions (i0 + c, j0 + c) for bases
(i0, j0) = (0, 0), (0, 256), (256, 0), over every c up to 64, then ``STEPS_PER_OCTAVE``
points per octave up to 2^53 (the largest position a module takes). Where the outcome
differs from the one at c = 0, the first such c is found exactly by bisection between
the last grid point that agreed and the first that did not: a length
(``condition_turns``).

Values are Python floats, as ``posgen.spec.expr_values`` evaluates them (torch's IEEE
conventions), with the parameters, h and heads at the values the module reads. A
condition that is true over a narrow band of positions that falls between two grid
points (``abs(sqrt(i) - 1000) < 0.0001``) is not found: the search is a sampling,
finer near 0.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping

from posgen.spec.expr_shift import drift
from posgen.spec.expr_values import expression_value

STEPS_PER_OCTAVE = 8
LAST_POSITION = 2**53 - 1  # the largest position a generated module accepts
BASES = ((0, 0), (0, 256), (256, 0))  # (i0, j0): where position 0 of a shift starts

Outcome = tuple[float, ...]
Probe = Callable[[int, int], Outcome]  # (i, j) -> the part's outcome there


def shift_grid() -> list[int]:
    """The shifts tried: 0 .. 64, then ``STEPS_PER_OCTAVE`` per octave up to 2^53 - 1."""
    grid = set(range(65))
    point = 64.0
    ratio = 2 ** (1 / STEPS_PER_OCTAVE)
    while point < LAST_POSITION:
        point *= ratio
        grid.add(min(int(point), LAST_POSITION))
    return sorted(grid)


def condition_turns(body: ast.expr, values: Mapping[str, float]) -> list[tuple[str, int]]:
    """(text, c) for each discrete part of ``body`` that a shift moves and, from each
    base, the first shift c ≥ 1 at which its outcome differs from c = 0's; ``values``
    binds the parameters, h and heads (one head's assignment)."""
    grid = shift_grid()
    found: set[tuple[str, int]] = set()
    for node in ast.walk(body):
        probe = _probe(node, values)
        if probe is None:
            continue
        for i0, j0 in BASES:
            turn = _first_turn(_shifted(probe, i0, j0), grid)
            if turn is not None:
                found.add((ast.unparse(node), turn))
    return sorted(found, key=lambda item: (item[1], item[0]))


def _probe(node: ast.AST, values: Mapping[str, float]) -> Probe | None:
    """The outcome of ``node`` at (i, j) where it is a discrete part a shift moves."""
    parts: list[ast.expr]
    if isinstance(node, ast.Compare):
        parts = [node]  # its value is 0 or 1
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        parts = _choices(node.func.id, node.args)
    else:
        return None
    if not parts or drift(node) == 0:
        return None

    trees = [ast.Expression(body=part) for part in parts]  # made once, read per point

    def outcome(i: int, j: int) -> Outcome:
        names = {"i": float(i), "j": float(j), **values}
        return tuple(expression_value(tree, names, values) for tree in trees)

    return outcome


def _choices(function: str, args: list[ast.expr]) -> list[ast.expr]:
    """The comparisons that decide which way ``function(*args)`` goes (none for a
    smooth function): x < 0 for abs, its value for sign, a < b for minimum and
    maximum, x < low and x > high for clamp."""

    def less(a: ast.expr, b: ast.expr) -> ast.expr:
        return ast.Compare(left=a, ops=[ast.Lt()], comparators=[b])

    zero = ast.Constant(value=0)
    if function == "abs":
        return [less(args[0], zero)]
    if function == "sign":
        return [less(args[0], zero), less(zero, args[0])]
    if function in ("minimum", "maximum"):
        return [less(args[0], args[1])]
    if function == "clamp":
        return [less(args[0], args[1]), less(args[2], args[0])]
    return []


def _shifted(probe: Probe, i0: int, j0: int) -> Callable[[int], Outcome]:
    """The outcome at (i0 + c, j0 + c), as a function of the shift c."""
    return lambda c: probe(i0 + c, j0 + c)


def _first_turn(outcome_at: Callable[[int], Outcome], grid: list[int]) -> int | None:
    """The least c in ``grid``'s range whose outcome differs from c = 0's, exact between
    grid points (bisection), or None where every grid point agrees."""
    start = outcome_at(0)
    agreed = 0
    for c in grid[1:]:
        if _differs(outcome_at(c), start):
            low, high = agreed, c  # low agrees, high differs
            while high - low > 1:
                middle = (low + high) // 2
                if _differs(outcome_at(middle), start):
                    high = middle
                else:
                    low = middle
            return high
        agreed = c
    return None


def _differs(a: Outcome, b: Outcome) -> bool:
    """Whether two outcomes differ (NaN equals NaN: an undefined part that stays so)."""
    return any(x != y and not (x != x and y != y) for x, y in zip(a, b, strict=True))
