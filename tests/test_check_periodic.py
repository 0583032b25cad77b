"""``posgen check`` on rotations that repeat past the checked span: θ_k = 2π(k + 1)/1000
turns every pair back to where it started at position 1000 (R_1000 = I), so positions m
and m + 1000 get the same encoding and the RoFormer bound is back at its maximum at
distance 1000. ``unique`` compared positions within the span only, and ``decay``'s curve
stopped there: both claims were confirmed (and the true ``unique: false`` refuted).
Reference values come from the angles themselves, in plain Python."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from posgen.check.decay import decay_reach, rotation_return
from posgen.check.periods import PERIOD_REACH, linear_reach, turns_back
from posgen.check.probe import Probe
from posgen.check.runner import check_loaded
from posgen.check.search import Budget
from posgen.check.unique import rotation_periods
from posgen.check.verdicts import Outcome
from posgen.spec.loader import load_spec
from tests.conftest import ROOT
from tests.reference.formulas import first_rise, roformer_bound, window_means

BUDGET = Budget(max_examples=10, seed=0, seconds=60.0, spec_seconds=120.0)
PAIRS = 32  # specs/rope.yaml: head_dim 64
PERIOD = "0.006283185307179587 * (k + 1)"  # 2π(k + 1)/1000: R_1000 = I
NEAR = "0.0063 * (k + 1)"  # 2π/0.0063 = 997.3: every pair within 0.07 of a turn at 997


def _rope(folder: Path, name: str, expr: str, claims: str) -> Path:
    """specs/rope.yaml with the frequencies ``expr`` of k and the claims ``claims``."""
    text = (ROOT / "specs" / "rope.yaml").read_text(encoding="utf-8")
    text = text.replace("name: rope\n", f"name: {name}\n").replace(
        "      pairing: half ",
        f'      frequencies: {{kind: expr, expr: "{expr}"}}\n      pairing: half ',
    )
    text = text.replace(
        "claims: {relative: true, decay: true, unique: true, extrapolates: true}",
        f"claims: {{{claims}}}",
    )
    path = folder / f"{name}.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def _outcome(path: Path, name: str) -> Outcome:
    return check_loaded(load_spec(path), BUDGET, only=[name]).outcome(name)


def _thetas(scale: float) -> list[float]:
    return [scale * (k + 1) for k in range(PAIRS)]


def _off_turn(d: int, theta: float) -> float:
    """How far d·θ is from a whole turn, in plain Python."""
    return abs(math.remainder(d * theta, 2 * math.pi))


# --------------------------------------------------------------------------- unique


def test_unique_sees_a_rotation_period_past_the_span(tmp_path: Path) -> None:
    """θ_k = 2π(k + 1)/1000: every pair is a whole number of turns at 1000 and at no
    distance before it; positions 0 and 1000 collide (past the span, 512)."""
    thetas = _thetas(0.006283185307179587)
    assert max(_off_turn(1000, theta) for theta in thetas) < 1e-11
    assert min(max(_off_turn(d, theta) for theta in thetas) for d in range(1, 1000)) > 6e-3

    path = _rope(tmp_path, "rope_period", PERIOD, "unique: true")
    outcome = _outcome(path, "unique")
    assert outcome.verdict == "REFUTED: fails", outcome.evidence
    assert outcome.counterexample is not None
    assert outcome.counterexample["positions"] == [0, 1000]
    assert "a period of the rotation" in outcome.evidence
    with torch.no_grad():  # the module's own rotations agree there, on both sides
        probe = Probe(load_spec(path), Budget())
        for side in (0, 1):
            torch.testing.assert_close(
                probe.rotation_matrix(1000, side), probe.rotation_matrix(0, side)
            )

    denied = _rope(tmp_path, "rope_period_denied", PERIOD, "unique: false")
    assert _outcome(denied, "unique").verdict == "confirmed: fails"


def test_unique_sees_a_period_far_past_the_span(tmp_path: Path) -> None:
    """θ_k = 2π(k + 1)/10^7: the period lies 20000 spans out, below 2^24."""
    thetas = _thetas(0.0000006283185307179586)
    assert max(_off_turn(10**7, theta) for theta in thetas) < 1e-9
    path = _rope(tmp_path, "rope_far_period", "0.0000006283185307179586 * (k + 1)", "unique: true")
    outcome = _outcome(path, "unique")
    assert outcome.verdict == "REFUTED: fails", outcome.evidence
    assert outcome.counterexample is not None
    assert outcome.counterexample["positions"] == [0, 10**7]


def test_a_near_period_is_no_collision(tmp_path: Path) -> None:
    """θ_k = 0.0063(k + 1) comes back near a whole turn at 997 (pair 31 is 0.067 off),
    but R_997 is not R_0: unique holds, and the evidence says which d it compared."""
    thetas = _thetas(0.0063)
    assert 0.06 < max(_off_turn(997, theta) for theta in thetas) < 0.07
    path = _rope(tmp_path, "rope_near", NEAR, "unique: true")
    outcome = _outcome(path, "unique")
    assert outcome.verdict == "confirmed: holds", outcome.evidence
    with torch.no_grad():
        periods, _, _ = rotation_periods(Probe(load_spec(path), Budget()))
    assert 997 not in periods
    for d in periods:  # each candidate is a near-whole turn by the formula, far out
        assert d > 10**6 and max(_off_turn(d, theta) for theta in thetas) < 1e-4


def test_standard_rope_has_no_period_up_to_2_24() -> None:
    """RoPE (base 10^4, d 64): no d up to 2^24 turns every pair back (the closest comes
    within 2.3 rad on some pair); unique is still confirmed, and says how far it looked."""
    thetas = [10000.0 ** (-2 * k / 64) for k in range(PAIRS)]
    wavelength = 2 * math.pi / thetas[-1]
    closest = min(
        max(_off_turn(round(j * wavelength) + shift, theta) for theta in thetas)
        for j in range(1, PERIOD_REACH // math.floor(wavelength) + 1)
        for shift in (-1, 0, 1)
    )
    assert closest > 2.0
    probe = Probe(load_spec(ROOT / "specs" / "rope.yaml"), Budget())
    with torch.no_grad():
        assert rotation_periods(probe)[0] == []
        assert rotation_return(probe) == []
    outcome = _outcome(ROOT / "specs" / "rope.yaml", "unique")
    assert outcome.verdict == "confirmed: holds", outcome.evidence
    assert f"no period: no d up to {PERIOD_REACH}" in outcome.evidence


def test_a_schedule_that_switches_is_searched_only_below_its_switch() -> None:
    """Dynamic NTK raises the base once a call's positions pass 2048: R_2048's angles are
    not 2048·θ_k (θ_k = 10^4^(-2k/64)), so periods are sought below it only, and the
    claim is tested only in part ("limited")."""
    path = ROOT / "specs" / "rope_dynamic_ntk.yaml"
    probe = Probe(load_spec(path), Budget())
    thetas = [10000.0 ** (-2 * k / 64) for k in range(PAIRS)]
    with torch.no_grad():
        assert linear_reach(probe, PERIOD_REACH) == (1024, 2048)
        got = torch.linalg.eigvals(probe.rotation_matrix(2048)).angle().abs().sort().values
    predicted = sorted(_off_turn(2048, theta) for theta in thetas for _ in (0, 1))
    assert float((got - torch.tensor(predicted, dtype=torch.float64)).abs().max()) > 1e-3
    outcome = _outcome(path, "unique")
    # past 1024 a collision would go unseen: the claim held, but only in part
    assert outcome.verdict == "limited: holds", outcome.evidence
    assert outcome.limited_to == "m ≤ 1024"
    assert "R_m is not R_1^m at m = 2048" in outcome.evidence


# --------------------------------------------------------------------------- decay


@pytest.mark.parametrize(
    ("expr", "scale", "back"), [(PERIOD, 0.006283185307179587, 1000), (NEAR, 0.0063, 997)]
)
def test_decay_reaches_past_the_rotation_s_return(
    tmp_path: Path, expr: str, scale: float, back: int
) -> None:
    """The bound falls over the span and comes back at 1000 (997): its first return,
    by the formula. The curve now reaches twice that, and the window means rise."""
    thetas = _thetas(scale)
    curve = roformer_bound(thetas, 2 * back)
    assert curve[back] > 0.995 * curve[0]  # back at its maximum
    assert first_rise(window_means(curve[:512], 512)) is None  # the span alone: decays
    means = window_means(curve, 2 * back)
    rise = first_rise(means)
    assert rise == 9  # [256, 512) -> [512, 1024)
    # the first return (every pair within 0.1 of a whole turn, the fastest past one)
    first = next(
        d
        for d in range(math.ceil((2 * math.pi - 0.1) / thetas[-1]), 2 * back)
        if max(_off_turn(d, theta) for theta in thetas) <= 0.1
    )
    assert first == back

    path = _rope(tmp_path, f"rope_return_{back}", expr, "decay: true")
    probe = Probe(load_spec(path), Budget())
    with torch.no_grad():
        assert [length.value for length in rotation_return(probe)] == [float(back)]
        assert decay_reach(probe) == (2 * back, [])
    outcome = _outcome(path, "decay")
    assert outcome.verdict == "REFUTED: fails", outcome.evidence
    assert outcome.counterexample is not None and outcome.counterexample["window"] == rise
    assert f"return to within 0.1 of a whole turn on every pair at distance {back}" in (
        outcome.evidence
    )
    assert outcome.curve is not None
    torch.testing.assert_close(
        torch.tensor(outcome.curve["means"]), torch.tensor(means), rtol=1e-9, atol=0
    )


def test_rope_decay_is_unchanged() -> None:
    """RoPE's bound never comes back within 2^24 (no return): the curve still stops at
    the span and the claim is confirmed."""
    outcome = _outcome(ROOT / "specs" / "rope.yaml", "decay")
    assert outcome.verdict == "confirmed: holds", outcome.evidence
    assert outcome.curve is not None and outcome.curve["windows"][-1] == [256, 512]


# --------------------------------------------------------------------------- the search


def _brute_force(thetas: list[float], reach: int, tolerance: float, start: int = 1) -> list[int]:
    return [
        d
        for d in range(start, reach + 1)
        if all(_off_turn(d, theta) <= tolerance * (1 + d / 1000) for theta in thetas)
    ]


@pytest.mark.parametrize("seed", range(6))
def test_turns_back_finds_exactly_what_trying_every_distance_finds(seed: int) -> None:
    """Every d ≤ 20000 at which every angle is within tol·(1 + d/1000) of a whole turn,
    against plain Python over every d: angles near multiples of 2π/P (many returns),
    random ones (few), a tiny one and one near π (the generator's extremes)."""
    drawn = random.Random(seed)
    period = drawn.randrange(50, 3000)
    near = [
        2 * math.pi * drawn.randrange(1, 40) / period + drawn.uniform(-1e-8, 1e-8) for _ in range(4)
    ]
    cases = [
        (near, 0.002),
        ([drawn.uniform(0.001, math.pi) for _ in range(2)], 0.05),
        ([drawn.uniform(1e-7, 1e-5), math.pi - drawn.uniform(0, 1e-3)], 0.01),
    ]
    for thetas, tolerance in cases:
        expected = _brute_force(thetas, 20000, tolerance, start=seed + 1)
        found = turns_back(
            torch.tensor(thetas, dtype=torch.float64),
            20000,
            lambda d, tol=tolerance: tol * (1 + d / 1000),
            10**6,
            start=seed + 1,
        )
        assert expected and found == expected, (thetas, tolerance)
        assert (
            turns_back(
                torch.tensor(thetas, dtype=torch.float64),
                20000,
                lambda d, tol=tolerance: tol * (1 + d / 1000),
                3,
                start=seed + 1,
            )
            == expected[:3]
        )
