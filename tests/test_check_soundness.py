"""``posgen check`` judges a claim over the distances the spec is about, not only the
span: decay over a randomized-positions training range, relative between a query and a
far key, unique past a period an expression bias names. Each false claim below held
within the first 512 positions and was confirmed (and its true negation refuted); the
reference values come from the formulas themselves, in plain Python."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from posgen.check.decay import decay_reach
from posgen.check.probe import Probe
from posgen.check.runner import check_loaded
from posgen.check.search import Budget
from posgen.check.verdicts import Outcome
from posgen.spec.loader import load_spec
from tests.conftest import ROOT, expr_bias_spec
from tests.reference.formulas import first_rise, roformer_bound, window_means

BUDGET = Budget(max_examples=10, seed=0, seconds=60.0, spec_seconds=120.0)
RANDOMIZED = "positions: {kind: randomized, max_positions: 4096}\n"


def _outcome(path: Path, name: str) -> Outcome:
    return check_loaded(load_spec(path), BUDGET, only=[name]).outcome(name)


# ------------------------------------------------------------------ decay: training range


def test_decay_is_judged_over_a_randomized_training_range(tmp_path: Path) -> None:
    """cos(sqrt(r) / 8) falls until r = (8π)² ≈ 632, then rises: over the span (512) it
    decays, over the training range [0, 4096) it does not. The range was ignored, so
    the claim was confirmed; it is refuted at the first window that rises."""
    expr = "cos(sqrt(abs(i - j)) / 8)"
    curve = [math.cos(math.sqrt(r) / 8) for r in range(4096)]
    assert first_rise(window_means(curve[:512], 512)) is None  # the span alone: decays
    rise = first_rise(window_means(curve, 4096))
    assert rise == 10  # [512, 1024) -> [1024, 2048)

    plain = expr_bias_spec(tmp_path, "cos_root", expr, "decay: true")
    assert _outcome(plain, "decay").verdict == "confirmed: holds"
    path = expr_bias_spec(tmp_path, "cos_root_randomized", expr, "decay: true")
    path.write_text(path.read_text(encoding="utf-8") + RANDOMIZED, encoding="utf-8")
    outcome = _outcome(path, "decay")
    assert outcome.verdict == "REFUTED: fails", outcome.evidence
    assert outcome.counterexample is not None
    assert outcome.counterexample["window"] == rise
    assert "[512, 1024) to [1024, 2048)" in outcome.evidence


def _rope_bound(base: float, dim: int, reach: int) -> list[float]:
    """RoFormer's bound for θ_k = base^(-2k/d), k < d/2."""
    return roformer_bound([base ** (-2 * k / dim) for k in range(dim // 2)], reach)


def test_rotary_decay_reaches_the_training_range_but_not_past_it(tmp_path: Path) -> None:
    """RoPE (base 10^4, d 64) trained on positions from [0, 4096): its RoFormer bound
    falls on every window up to 4096 (confirmed, the curve reaching 4095); at base 500
    it rises from [256, 512) on, inside the range (refuted; it was confirmed)."""
    text = (ROOT / "specs" / "rope_randomized.yaml").read_text(encoding="utf-8")
    probe = Probe(load_spec(ROOT / "specs" / "rope_randomized.yaml"), Budget())
    assert decay_reach(probe) == (4096, [])  # the range itself, not twice it

    outcome = _outcome(ROOT / "specs" / "rope_randomized.yaml", "decay")
    assert outcome.verdict == "confirmed: holds", outcome.evidence
    assert outcome.curve is not None
    expected = window_means(_rope_bound(10000.0, 64, 4096), 4096)
    assert first_rise(expected) is None
    torch.testing.assert_close(
        torch.tensor(outcome.curve["means"]), torch.tensor(expected), rtol=1e-9, atol=0
    )

    low = tmp_path / "rope_randomized_low.yaml"
    low.write_text(
        text.replace("name: rope_randomized", "name: rope_randomized_low").replace(
            "base: 10000", "base: 500"
        ),
        encoding="utf-8",
    )
    means = window_means(_rope_bound(500.0, 64, 4096), 4096)
    assert first_rise(means[:10]) is None and first_rise(means) == 9
    outcome = _outcome(low, "decay")
    assert outcome.verdict == "REFUTED: fails", outcome.evidence
    assert outcome.counterexample is not None and outcome.counterexample["window"] == 9


# ------------------------------------------------------------------ relative: far keys


def test_relative_sees_a_break_between_far_apart_positions(tmp_path: Path) -> None:
    """where(|i - j| > 300, i, 0) is of j - i for keys within 300 of the query and
    reads i past that: positions were drawn from the first half of the span (< 256),
    so no pair was ever 300 apart; "relative: true" was confirmed and the true
    "relative: false" refuted."""
    expr = "where(abs(i - j) > 300, i, 0)"
    path = expr_bias_spec(tmp_path, "far_break", expr, "relative: true")
    outcome = _outcome(path, "relative")
    assert outcome.verdict == "REFUTED: fails", outcome.evidence
    example = outcome.counterexample
    assert example is not None
    # by the formula: the logit of head h, query q, key k moves by c where |q - k| > 300
    far = [k for k in example["k_positions"] for q in example["q_positions"] if abs(q - k) > 300]
    assert far, example
    before, after = example["values"]
    assert math.isclose(after - before, example["shift"], rel_tol=1e-9), example

    denied = expr_bias_spec(tmp_path, "far_break_denied", expr, "relative: false")
    assert _outcome(denied, "relative").verdict == "confirmed: fails"


def test_relative_with_a_distance_threshold_still_holds(tmp_path: Path) -> None:
    """where(|i - j| > 300, 1, 0) is of j - i everywhere: the far positions (up to 2 ×
    300) change nothing, and the evidence says how far they went."""
    path = expr_bias_spec(tmp_path, "far_clip", "where(abs(i - j) > 300, 1, 0)", "relative: true")
    outcome = _outcome(path, "relative")
    assert outcome.verdict == "confirmed: holds", outcome.evidence
    assert "positions up to 599" in outcome.evidence


# ------------------------------------------------------------------ unique: a far period


def test_unique_sees_a_period_past_the_span(tmp_path: Path) -> None:
    """(j - i + 100000) % 1500 repeats every 1500 distances: distinct within (-512, 512),
    so "unique: true" was confirmed and the true "unique: false" refuted."""
    expr = "(j - i + 100000) % 1500"
    path = expr_bias_spec(tmp_path, "far_period", expr, "unique: true")
    outcome = _outcome(path, "unique")
    assert outcome.verdict == "REFUTED: fails", outcome.evidence
    assert outcome.counterexample is not None
    d1, d2 = outcome.counterexample["distances"]
    assert d1 != d2 and (d1 + 100000) % 1500 == (d2 + 100000) % 1500

    denied = expr_bias_spec(tmp_path, "far_period_denied", expr, "unique: false")
    assert _outcome(denied, "unique").verdict == "confirmed: fails"


def test_backends_fails_a_bias_that_overflows_within_the_span(tmp_path: Path) -> None:
    """0.01·exp(|i − j|) in float32: exp(d) itself passes float32's largest value
    (3.4e38) at d = 89, so a causal call's first infinite logit, and NaN row, is query 89's
    (its key 0). backends drew calls of at most 9 positions and said "holds" while a call
    of 200 tokens gave NaN rows; it now makes one call over the whole span first."""
    path = expr_bias_spec(tmp_path, "blows_up", "0.01 * exp(abs(i - j))")
    report = check_loaded(load_spec(path), Budget(max_examples=5, span=256), only=["backends"])
    outcome = report.outcome("backends")
    assert outcome.holds is False, outcome.evidence
    # the first causal query whose bias overflows: where exp(d) passes float32's largest
    largest = float(torch.finfo(torch.float32).max)
    first = next(d for d in range(256) if math.exp(d) > largest)
    assert f"first at query {first}," in outcome.evidence, outcome.evidence
    finite = expr_bias_spec(tmp_path, "stays_finite", "0.01 * exp(abs(i - j) / 100)")
    report = check_loaded(load_spec(finite), Budget(max_examples=5, span=256), only=["backends"])
    assert report.outcome("backends").holds is True
