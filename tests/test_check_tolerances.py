"""The checker's tolerances are float64 rounding, not room for a real change: a break in
one logit of 0.005 far out, or of 0.5 in one head beside a head of large logits, is
refuted, with a counterexample whose change the formula itself gives (plain Python
floats); and decay judges the first queries of a score of absolute positions too. The
true claims beside them still hold."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest

from posgen.check.runner import check_loaded
from posgen.check.search import Budget
from posgen.check.verdicts import Outcome
from posgen.spec.loader import load_spec
from tests.conftest import expr_bias_spec
from tests.reference.formulas import first_rise, window_means

BUDGET = Budget(max_examples=20, seed=0, seconds=60.0, spec_seconds=120.0)
FAR = 3_000_000


def _outcome(path: Path, name: str) -> Outcome:
    return check_loaded(load_spec(path), BUDGET, only=[name]).outcome(name)


def _far_step(i: float, j: float, h: int) -> float:
    return -abs(i - j) + (0.005 if j > FAR else 0.0)


def _past_cap(i: float, j: float, h: int) -> float:
    return -abs(i - j) + (1.0 if i > 17_000_000 else 0.0)


def _head_step(i: float, j: float, h: int) -> float:
    return -1e6 * abs(i - j) if h < 0.5 else (0.5 if j > FAR else 0.0)


@pytest.mark.parametrize(
    ("name", "expr", "bias"),
    [
        # one head; the old tolerance at c = 3 * 10^6 was 1e-11 · 257 · 3e6 ≈ 0.0077
        ("far_step", "-abs(i - j) + 0.005 * where(j > 3 * 1000000, 1, 0)", _far_step),
        # head 0's logits spread 10^6 per position, which set head 1's tolerance
        (
            "head_step",
            "where(h < 0.5, -1000000 * abs(i - j), 0.5 * where(j > 3 * 1000000, 1, 0))",
            _head_step,
        ),
        # 17000000 lies past the 2^24 cap on shifts, but a query at 2^18 shifted by 2^24
        # crosses it: a step of 1 under a tolerance of 1e-11 · 2^18 · 2^24 ≈ 44
        ("past_cap", "-abs(i - j) + where(i > 1000000 * 17, 1, 0)", _past_cap),
    ],
)
def test_a_small_far_break_refutes_relative(
    tmp_path: Path, name: str, expr: str, bias: Callable[[float, float, int], float]
) -> None:
    path = expr_bias_spec(tmp_path, name, expr, "relative: true")
    outcome = _outcome(path, "relative")
    assert outcome.verdict == "REFUTED: fails", outcome.evidence
    found = outcome.counterexample
    assert found is not None
    head, shift = found["head"], found["shift"]
    # the change the counterexample shows is the formula's, at some query and key
    before, after = found["values"]
    changes = {
        bias(i + shift, j + shift, head) - bias(i, j, head)
        for i in found["q_positions"]
        for j in found["k_positions"]
    }
    assert any(abs((after - before) - change) < 1e-9 for change in changes), (found, changes)
    assert abs(after - before) >= 0.005


def test_relative_biases_still_hold_far_out(tmp_path: Path) -> None:
    """The same shifts, without the break: confirmed (their float64 logits are exact)."""
    for name, expr in [
        ("far_plain", "-abs(i - j)"),
        ("head_plain", "where(h < 0.5, -1000000 * abs(i - j), 0.5 * where(j > i, 1, 0))"),
    ]:
        path = expr_bias_spec(tmp_path, name, expr, "relative: true")
        outcome = _outcome(path, "relative")
        assert outcome.verdict == "confirmed: holds", outcome.evidence


# ------------------------------------------------------------ decay: the first queries


def _early_rise(i: int, j: int) -> float:
    return abs(i - j) if i < 400 else -abs(i - j)


def test_decay_judges_the_first_queries_of_absolute_scores(tmp_path: Path) -> None:
    """A score of absolute positions that falls at query 511 (where the curve was read)
    and rises with distance at every query below 400: the claim was confirmed. The
    counterexample's query rises by the formula's own window means."""
    expr = "where(i < 400, abs(i - j), -abs(i - j))"
    full = [_early_rise(511, 511 - r) for r in range(512)]
    assert first_rise(window_means(full, 512)) is None  # query 511: decays
    path = expr_bias_spec(tmp_path, "early_rise", expr, "decay: true")
    outcome = _outcome(path, "decay")
    assert outcome.verdict == "REFUTED: fails", outcome.evidence
    found = outcome.counterexample
    assert found is not None
    query = found["query"]
    assert query < 400
    width = 1 << ((query + 1).bit_length() - 1)
    means = window_means([_early_rise(query, query - r) for r in range(width)], width)
    assert found["means"] == pytest.approx(means, abs=1e-9)
    assert first_rise(means) == found["window"]


@pytest.mark.parametrize(
    "expr",
    [
        "-abs(i - j)",
        "-maximum(abs(i - j) - 8, 0)",  # flat over its first windows, then falls
        "-abs(i - j) + 0.001 * i",  # absolute, but the same curve shape at every query
    ],
)
def test_decay_still_holds_where_every_query_falls(tmp_path: Path, expr: str) -> None:
    path = expr_bias_spec(tmp_path, "falls", expr, "decay: true")
    outcome = _outcome(path, "decay")
    assert outcome.verdict == "confirmed: holds", outcome.evidence


# ------------------------------------------------------------ unique: head by head


def test_unique_compares_each_head_at_its_own_scale(tmp_path: Path) -> None:
    """Head 0, 10^6 cos(j - i), is even in the distance; head 1, 10^-7 (j - i), tells
    every distance apart (±10^-7 at d = ±1: 200 % of its own size). 10^-12 of head 0's
    scores was the tolerance of both heads, so d = -1 and 1 were called the same."""
    expr = "where(h < 0.5, 1000000 * cos(j - i), 0.0000001 * (j - i))"
    low = [1e-7 * d for d in (-1, 1)]
    assert abs(low[0] - low[1]) > 1e4 * 2.0**-52 * max(map(abs, low))  # far past rounding
    assert 1e6 * math.cos(1) * 1e-12 > abs(low[0] - low[1])  # head 0's old tolerance
    path = expr_bias_spec(tmp_path, "head_scales", expr, "unique: true")
    outcome = _outcome(path, "unique")
    assert outcome.verdict == "confirmed: holds", outcome.evidence


def test_a_period_split_over_heads_still_collides(tmp_path: Path) -> None:
    """sin and cos of 2π d / 1000 in two heads: d and d + 1000 collide (sin(π) is
    1.2e-16, not 0: the head's own rounding, not a difference)."""
    turn = 2 * math.pi / 1000
    angle = f"{2 * math.pi!r} * (j - i) / 1000"
    expr = f"where(h < 0.5, sin({angle}), cos({angle}))"
    path = expr_bias_spec(tmp_path, "split_period", expr, "unique: true")
    outcome = _outcome(path, "unique")
    assert outcome.verdict == "REFUTED: fails", outcome.evidence
    found = outcome.counterexample
    assert found is not None
    d1, d2 = found["distances"]
    assert abs(d1 - d2) % 1000 == 0
    for d, values in zip((d1, d2), found["values"], strict=True):
        assert values == pytest.approx([math.sin(turn * d), math.cos(turn * d)], abs=1e-12)
