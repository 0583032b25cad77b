"""``posgen check``'s ``unique`` and ``decay``: unique takes the per-distance rule only
for scores that are of j - i over the whole span and far out (not on the first 96
positions alone), decay's curve reaches past the lengths the spec names (or says how far
it got), and a decay curve that is not finite is reported as such."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posgen.check.decay import (
    MAX_DECAY_REACH,
    WINDOW_SAMPLES,
    curve_distances,
    decay_reach,
    distance_lengths,
    distance_windows,
)
from posgen.check.probe import Probe
from posgen.check.runner import check_loaded
from posgen.check.search import Budget
from posgen.check.unique import shift_invariant_scores
from posgen.check.verdicts import Outcome
from posgen.spec.loader import load_spec
from tests.conftest import ROOT, expr_bias_spec

FALSE_CLAIMS = ROOT / "tests" / "specs" / "false_claims"
BUDGET = Budget(max_examples=10, seed=0, seconds=60.0, spec_seconds=120.0)


def _outcome(path: Path, name: str) -> Outcome:
    return check_loaded(load_spec(path), BUDGET, only=[name]).outcome(name)


def _probe(path: Path) -> Probe:
    return Probe(load_spec(path), Budget())


# --------------------------------------------------------------------------- unique


@pytest.mark.parametrize("threshold", [100, 1000])
def test_scores_of_j_minus_i_on_the_first_positions_only_are_judged_by_position(
    tmp_path: Path, threshold: int
) -> None:
    """-|i - j| for queries up to a threshold, 0 past it: of j - i on the first 96
    positions, not beyond (within the span at 100, past it at 1000). Queries 0 .. 100
    tell every key apart, so the claim holds by the rule for absolute scores; it was
    refuted by distances 0 and 1 at query 512, which no rule makes a collision."""
    expr = f"where(i > {threshold}, 0, -abs(i - j))"
    path = expr_bias_spec(tmp_path, f"late_{threshold}", expr, "unique: true")
    outcome = _outcome(path, "unique")
    assert outcome.verdict == "confirmed: holds", outcome.evidence
    assert "rows and columns" in outcome.evidence
    with torch.no_grad():
        assert not shift_invariant_scores(_probe(path))


def test_a_bias_of_j_minus_i_keeps_the_per_distance_rule_and_its_counterexample(
    tmp_path: Path,
) -> None:
    """-|i - j| is of j - i everywhere: distances -1 and 1 collide, and the counterexample
    reproduces by hand at the query and keys it names."""
    path = expr_bias_spec(tmp_path, "symmetric", "-abs(i - j)", "unique: true")
    probe = _probe(path)
    with torch.no_grad():
        assert shift_invariant_scores(probe)
    outcome = _outcome(path, "unique")
    assert outcome.verdict == "REFUTED: fails", outcome.evidence
    example = outcome.counterexample
    assert example is not None and sorted(example["distances"]) == [-1, 1]
    with torch.no_grad():
        scores = probe.position_scores(
            torch.tensor([example["query"]]), torch.tensor(example["keys"])
        )
    torch.testing.assert_close(scores[:, 0, 0], scores[:, 0, 1], rtol=0, atol=0)


def test_a_band_at_a_named_length_far_out_is_seen(tmp_path: Path) -> None:
    """Scores of 0 for queries and keys within 40 of position 3000000, far past the span
    and between two powers of two: the window straddling the named length sees them."""
    expr = "where(abs(i - 1000000 * 3) < 40, 0, -abs(i - j))"
    path = expr_bias_spec(tmp_path, "far_band", expr)
    with torch.no_grad():
        assert not shift_invariant_scores(_probe(path))


# --------------------------------------------------------------------------- decay


def test_decay_looks_past_a_length_the_spec_names(tmp_path: Path) -> None:
    """A rise of 100000 past distance 1000: distances stopped at the span (512), so the
    claim was confirmed; the curve now reaches 2 × 1000 and the rise refutes it."""
    path = expr_bias_spec(
        tmp_path,
        "far_rise",
        "-abs(i - j) + where(abs(i - j) > 1000, 100000, 0)",
        "decay: true",
    )
    probe = _probe(path)
    assert [length.value for length in distance_lengths(probe)] == [1000.0]  # not 100000
    assert decay_reach(probe) == (2000, [])
    outcome = _outcome(path, "decay")
    assert outcome.verdict == "REFUTED: fails", outcome.evidence
    assert "rises from distance window [256, 512) to [512, 1024)" in outcome.evidence
    assert outcome.curve is not None and outcome.curve["windows"][-1] == [1024, 2000]


def test_a_length_past_the_cap_makes_decay_limited(tmp_path: Path) -> None:
    """A rise past distance 17000000: the curve stops at 2^24, so a claim that held is
    limited, neither confirmed nor refuted, and the evidence names the length."""
    path = expr_bias_spec(
        tmp_path,
        "farther_rise",
        "-abs(i - j) + where(abs(i - j) > 1000000 * 17, 100000, 0)",
        "decay: true",
    )
    reach, short = decay_reach(_probe(path))
    assert reach == MAX_DECAY_REACH and [length.value for length in short] == [17e6]
    outcome = _outcome(path, "decay")
    assert outcome.verdict == "limited: holds" and outcome.ok, outcome.evidence
    assert outcome.limited_to == f"r < {MAX_DECAY_REACH}"
    assert "1000000 * 17 = 17000000" in outcome.evidence


def test_the_default_curve_is_every_distance_and_a_far_one_is_sampled() -> None:
    """Windows up to the span are read at every distance (as before); wider windows past
    it at WINDOW_SAMPLES evenly spaced ones."""
    assert torch.equal(curve_distances(distance_windows(512), 512), torch.arange(512))
    far = curve_distances(distance_windows(1 << 16), 512)
    assert len(far) == 1024 + 6 * WINDOW_SAMPLES  # every one below 1024; [1024, 2048) ...
    assert int(far[-1]) == (1 << 16) - 1 and bool((far[1:] > far[:-1]).all())


def test_a_randomized_training_range_is_reached_but_not_doubled() -> None:
    """Training draws positions from [0, 4096): decay's curve covers every distance a
    training sequence has, but not twice the range (past it the module extrapolates,
    and RoPE's RoFormer bound rises by 0.002 from [2048, 4096) to [4096, 8192), a
    property of RoPE, not of the training range); tests/test_check_soundness.py
    judges claims over it."""
    assert decay_reach(_probe(ROOT / "specs" / "rope_randomized.yaml")) == (4096, [])
    assert decay_reach(_probe(ROOT / "specs" / "rope_yarn.yaml"))[0] == 8192


def test_a_curve_that_is_not_finite_is_reported_as_such(tmp_path: Path) -> None:
    """sqrt(400 - |i - j|) falls to distance 400, then is NaN: the evidence said it fell
    "between only 0 of 9" windows (a NaN tolerance); it names the first NaN distance."""
    path = expr_bias_spec(tmp_path, "root", "sqrt(400 - abs(i - j))", "decay: true")
    outcome = _outcome(path, "decay")
    assert outcome.verdict == "REFUTED: fails", outcome.evidence
    assert "not finite at distance 401 (nan)" in outcome.evidence
    assert "falls strictly between" not in outcome.evidence
    assert outcome.counterexample is not None and outcome.counterexample["distance"] == 401


@pytest.mark.parametrize("name", ["false_decay_far_rise", "false_decay_not_finite"])
def test_the_planted_false_decay_claims_are_refuted(name: str) -> None:
    outcome = _outcome(FALSE_CLAIMS / f"{name}.yaml", "decay")
    assert outcome.verdict == "REFUTED: fails", outcome.evidence


def test_a_curve_that_falls_at_every_distance_decays_however_far_it_reaches(
    tmp_path: Path,
) -> None:
    """-(i - j)^4 / 10^6 falls strictly between every pair of windows. Windows near 0
    (means 0, -1e-06, -4.9e-05, ...) were compared within 1e-9 of the whole curve's
    largest value (-6e18 at distance 2e6), so they counted as equal and the claim was
    refuted with 8 strict falls of 21; each pair is now compared at its own size, and
    the evidence joins them by >."""
    path = expr_bias_spec(tmp_path, "quartic", "-(i - j) ** 4 / 1000000", "decay: true")
    outcome = _outcome(path, "decay")
    assert outcome.verdict == "confirmed: holds", outcome.evidence
    assert "0 > -1e-06 > " in outcome.evidence and " = " not in outcome.evidence
