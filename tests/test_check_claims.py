"""``posgen check`` finds what a claim hides: collisions behind a near pair, a shift past
a rope scaling's switch, a long context that xPos refuses, and does not invent limits
or collisions (CoPE's clamp, a rotation beside an input table, a two-row table)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from posgen.check.lengths import expression_numbers
from posgen.check.probe import Probe
from posgen.check.search import Budget
from posgen.check.turns import condition_turns
from posgen.cli import main
from posgen.spec.expr import ParamInfo, parse_expr
from posgen.spec.loader import load_spec
from tests.conftest import SPECS, expr_bias_spec, generated_class

HEADER = """name: {name}
title: a spec of tests/test_check_claims.py
references: ["posgen tests"]
"""


def _write(folder: Path, name: str, body: str) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(HEADER.format(name=name) + body, encoding="utf-8")
    return path


def _verdicts(*args: str) -> dict[str, dict[str, Any]]:
    """Each property's JSON record of one ``posgen check --json`` run of one spec."""
    result = CliRunner().invoke(main, ["check", "--json", "--seed", "1", *args])
    assert result.exit_code in (0, 1), result.output
    (spec,) = json.loads(result.stdout)["specs"]
    return {record["property"]: record for record in spec["properties"]}


LEARNED = """defaults: {heads: 2, head_dim: 4, model_dim: 8}
scale: inv_sqrt_head_dim
input:
  kind: add
  table: {kind: learned, max_positions: MAX, init_std: 0.02}
terms:
  content_content: keep
  content_position: absolute
  position_content: absolute
  position_position: absolute
claims: {unique: true}
"""


def test_a_near_pair_does_not_hide_an_equal_pair_of_table_rows(tmp_path: Path) -> None:
    """Rows 40 and 50 are equal; rows 5 and 6 differ by 1e-6 relative, which the scan
    flags first as near (closer to position 0) but the check passes: the scan must go
    on to the equal pair."""
    spec = _write(tmp_path, "learned_near", LEARNED.replace("MAX", "64"))
    cls = Probe(load_spec(spec), Budget()).cls
    state = cls().state_dict()
    (key,) = [name for name, value in state.items() if value.shape == (64, 8)]
    table = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    table[50] = table[40]
    table[6] = table[5] * (1 + 1e-6)
    torch.save({**state, key: table}, tmp_path / "weights.pt")
    args = [str(spec), "--only", "unique", "--max-examples", "5"]
    unique = _verdicts(*args, "--weights", str(tmp_path / "weights.pt"))["unique"]
    assert unique["verdict"] == "REFUTED: fails", unique
    assert unique["counterexample"]["positions"] == [40, 50]


def test_a_near_distance_does_not_hide_an_equal_one(tmp_path: Path) -> None:
    """A bias of j - i whose scores at d = -5 and d = 300 are equal (-5e-7), beside one
    large score (1e6 at d = 200) that made the scan's tolerance loose enough to flag
    near distances first."""
    expr = "where(j - i == 300, -0.0000005, where(j - i == 200, 1000000.0, (j - i) * 0.0000001))"
    spec = expr_bias_spec(tmp_path, "distance_collision", expr, claims="unique: true")
    unique = _verdicts(str(spec), "--only", "unique", "--max-examples", "20")["unique"]
    assert unique["verdict"] == "REFUTED: fails", unique
    assert sorted(unique["counterexample"]["distances"]) == [-5, 300]


@pytest.mark.parametrize(
    ("name", "expr", "claim", "found"),
    [
        # NaN past position 1000: a shift there changes the logits from finite to NaN
        ("nan_when_shifted", "-abs(i - j) + where(i > 1000, log(0 - i), 0)", "relative", None),
        # every distance past 100 scores NaN
        ("nan_far_distances", "where(abs(i - j) > 100, log(0 - i - 1), j - i)", "unique", 101),
        # every position past 20 scores +inf (10**10**10 overflows float64; a bias not
        # finite at the first positions is refused by the spec)
        ("infinite_far", "i + where(i > 20, 10**10**10, 0)", "unique", None),
    ],
)
def test_non_finite_scores_refute_a_claim(
    tmp_path: Path, name: str, expr: str, claim: str, found: int | None
) -> None:
    """NaN compares unequal to everything (a shift's |Δ| of NaN was not > tol) and +inf
    minus +inf is NaN (no gap was ever <= tol): such scores confirmed false claims."""
    spec = expr_bias_spec(tmp_path, name, expr, claims=f"{claim}: true")
    verdict = _verdicts(str(spec), "--only", claim, "--max-examples", "30")[claim]
    assert verdict["verdict"] == "REFUTED: fails", verdict
    if found is not None:  # the non-finite distance nearest 0, found by the scan
        assert verdict["counterexample"]["distances"] == [found]


@pytest.mark.parametrize("name", ["rope_dynamic_ntk", "fire"])
def test_a_small_budget_still_tries_far_shifts(tmp_path: Path, name: str) -> None:
    """Ten random examples may draw no far shift (seed 0 drew none): the fixed shifts,
    powers of two up to the far reach, refute a false relative claim whatever the budget."""
    text = (SPECS / f"{name}.yaml").read_text(encoding="utf-8")
    head, _, _ = text.partition("\nclaims:")
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(head + "\nclaims: {relative: true}\n", encoding="utf-8")
    args = (str(spec), "--seed", "0", "--only", "relative", "--max-examples", "10")
    relative = _verdicts(*args)["relative"]  # the last --seed given counts
    assert relative["verdict"] == "REFUTED: fails", relative


def test_a_shift_past_longropes_switch_refutes_a_relative_claim(tmp_path: Path) -> None:
    """LongRoPE takes long_factor once a call's largest position passes
    original_max_positions (4096): the logits of a pair shifted past it change."""
    text = (SPECS / "rope_longrope.yaml").read_text(encoding="utf-8")
    claimed = text.replace("name: rope_longrope", "name: longrope_relative")
    claimed = claimed.replace("claims: {relative: false,", "claims: {relative: true,")
    assert claimed.count("relative: true") == 1
    spec = tmp_path / "longrope_relative.yaml"
    spec.write_text(claimed, encoding="utf-8")
    relative = _verdicts(str(spec), "--only", "relative", "--max-examples", "50")["relative"]
    assert relative["verdict"] == "REFUTED: fails", relative
    counterexample = relative["counterexample"]
    assert max(counterexample["q_positions"] + counterexample["k_positions"]) < 4096
    top = max(counterexample["q_positions"] + counterexample["k_positions"])
    assert top + counterexample["shift"] >= 4096


@pytest.mark.parametrize(
    ("name", "expr"),
    [
        # past the default far reach (2^16): only the number 300000 raises it
        ("late_break3", "-abs(i - j) + where(i > 300000, 1, 0)"),
        # a band two positions wide at a named number: no power of two and almost no
        # random shift lands in it; a shift onto the number and one past it do
        ("narrow_band", "-abs(i - j) + where(i > 300000, 1, 0) - where(i > 300002, 1, 0)"),
    ],
)
def test_a_threshold_an_expression_names_refutes_a_relative_claim(
    tmp_path: Path, name: str, expr: str
) -> None:
    """The numbers of an expression bias are lengths: the shifts tried go past them (and
    land on them), so a bias that changes at position 300000 is not relative (shifts
    stopped at 65536, and the claim was confirmed)."""
    spec = expr_bias_spec(tmp_path, name, expr, claims="relative: true")
    relative = _verdicts(str(spec), "--only", "relative", "--max-examples", "30")["relative"]
    assert relative["verdict"] == "REFUTED: fails", relative
    counterexample = relative["counterexample"]
    positions = counterexample["q_positions"] + counterexample["k_positions"]
    assert max(positions) + counterexample["shift"] > 300000, counterexample


@pytest.mark.parametrize("claim", ["true", "false"])
def test_a_threshold_past_the_shift_cap_limits_the_verdict(tmp_path: Path, claim: str) -> None:
    """18000000 (a product: a literal is at most 10^6) lies past the 2^24 cap on shifts
    plus the 2^20 positions drawn: no shifted position crosses it, so the claim is
    neither confirmed nor refuted, the evidence names the number, and the run exits 0
    either way (it said "confirmed: holds", and a
    claim of false was refuted). At 1000000 * 17, below 2^24 + 2^20, a query at 2^18
    shifted by 2^24 crosses it: refuted (its step of 1 hid under the former tolerance,
    1e-11 per unit of spread 2^18 and position 2^24, 44)."""
    expr = "-abs(i - j) + where(i > 1000000 * 18, 1, 0)"
    spec = expr_bias_spec(tmp_path, "past_cap", expr, claims=f"relative: {claim}")
    args = ["check", str(spec), "--only", "relative", "--max-examples", "10"]
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 0, result.output
    (record,) = json.loads(result.stdout)["specs"][0]["properties"]
    assert record["verdict"] == "limited: holds", record
    assert record["ok"] is True and record["limited_to"] == f"c ≤ {1 << 24}", record
    assert "tested only up to c = 16777216" in record["evidence"], record
    assert "1000000 * 18 = 18000000" in record["evidence"], record
    table = CliRunner().invoke(main, args)
    assert table.exit_code == 0, table.output
    assert "confirmed" not in table.output and "tested only in part" in table.output
    strict = CliRunner().invoke(main, [*args, "--strict"])  # every claim settled, or exit 1
    assert strict.exit_code == 1, strict.output
    assert "--strict: 1 stated claim tested only in part (past_cap: relative" in strict.stderr


@pytest.mark.parametrize(
    "expr",
    [
        "-abs(i - j) * 0.5",
        # a clip past the cap, but of j - i: a shift never moves it
        "-abs(i - j) + where(abs(i - j) > 1000000 * 17, -1, 0)",
    ],
)
def test_a_relative_expression_is_still_confirmed(tmp_path: Path, expr: str) -> None:
    """Expressions of j - i name no position: their numbers neither limit the verdict
    nor raise the reach (a guard for the two tests above; it passed before them)."""
    spec = expr_bias_spec(tmp_path, "honest", expr, claims="relative: true")
    relative = _verdicts(str(spec), "--only", "relative", "--max-examples", "10")["relative"]
    assert relative["verdict"] == "confirmed: holds", relative
    assert relative["limited_to"] is None and "up to 65536" in relative["evidence"], relative


def test_expression_numbers_fold_constants_and_skip_what_a_shift_leaves() -> None:
    """Literals and folded constants that meet a position count (a scale below 1 as its
    reciprocal); numbers inside a function of j - i, and non-finite ones, do not."""

    def numbers(expr: str) -> list[float]:
        parsed = parse_expr(expr, {})
        return [value for _, value in expression_numbers(parsed.tree.body, parsed.of_difference)]

    assert numbers("-abs(i - j) + where(i > 2 ** 20 * 3, 1, 0)") == [
        1.0,
        2.0,
        3.0,
        20.0,
        1048576.0,
        3145728.0,
    ]
    assert numbers("where(i * 0.0000001 > 2, 1, 0)") == [1.0, 2.0, 10000000.0]
    assert numbers("-abs(i - j) * 0.5 + 1000000") == []  # of j - i as a whole
    # the clip of j - i is left as it is by a shift; the threshold on i is not
    assert numbers("where(i > 5, 1, 0) + where(abs(i - j) > 1000000 * 17, 1, 0)") == [1.0, 5.0]
    assert numbers("i + where(i > 20, 10 ** 400, 0)") == [10.0, 20.0, 400.0]  # 10 ** 400: inf


def test_parameters_and_heads_fold_at_the_values_the_module_reads() -> None:
    """A threshold written through a parameter (p * 1000), or through the head index
    and a per-head parameter ((h + 1) * q[h]), is a length at the values taken, head by
    head; without values the parameters name none."""
    infos = {"p": ParamInfo(per_head=False), "q": ParamInfo(per_head=True)}
    parsed = parse_expr("where(i > p * 1000, 1, 0) + where(i > (h + 1) * q[h], 1, 0)", infos)
    values = {"p": (300.0,), "q": (10.0, 20.0), "h": (0.0, 1.0)}
    found = dict(expression_numbers(parsed.tree.body, parsed.of_difference, values))
    assert found["p * 1000 with p = 300"] == 300000.0
    assert found["(h + 1) * q[h] with h = 0, q[h] = 10"] == 10.0
    assert found["(h + 1) * q[h] with h = 1, q[h] = 20"] == 40.0
    assert found["p = 300"] == 300.0
    bare = expression_numbers(parsed.tree.body, parsed.of_difference)
    assert [value for _, value in bare] == [1.0]  # the where's 1: p and q unknown


def test_conditions_turn_where_the_formula_says() -> None:
    """The first shift of position (0, 0) at which each discrete part turns, exactly:
    sqrt(i) > 1000 past i = 10^6, i / 10^6 > 10 past 10^7, a * i > 30 past 60 at a =
    0.5, the minimum at 300; none for a part a shift leaves alone."""
    infos = {"a": ParamInfo(per_head=False)}
    cases = {
        "where(sqrt(i) > 1000, 5, 0)": ("sqrt(i) > 1000", 1000001),
        "where(i / 1000000 > 10, 5, 0)": ("i / 1000000 > 10", 10000001),
        "where(a * i > 30, 1, 0)": ("a * i > 30", 61),
        "minimum(i, 300) - abs(i - j)": ("minimum(i, 300)", 300),
    }
    for expr, turn in cases.items():
        body = parse_expr(expr, infos).tree.body
        assert turn in condition_turns(body, {"a": 0.5}), (expr, condition_turns(body, {"a": 0.5}))
    body = parse_expr("-abs(i - j) * where(abs(i - j) > 1000, 2, 1)", infos).tree.body
    assert condition_turns(body, {}) == []


@pytest.mark.parametrize(
    ("expr", "verdict", "shown", "turn"),
    [
        ("-abs(i - j) + where(sqrt(i) > 1000, 5, 0)", "REFUTED: fails", "|Δ| 5 >", 10**6),
        ("-abs(i - j) + where(i / 1000000 > 10, 5, 0)", "REFUTED: fails", "|Δ| 5 >", 10**7),
        # a constant all logits share widened the tolerance to about 10 and hid the 5
        ("1000000 - abs(i - j) + where(j > 1000000, 5, 0)", "REFUTED: fails", "|Δ| 5 >", 10**6),
        (
            "-abs(i - j) + where(sqrt(i) > 100000, 5, 0)",
            "limited: holds",
            "turns at shift 10000000001",
            None,
        ),
    ],
)
def test_a_threshold_no_number_names_is_found(
    tmp_path: Path, expr: str, verdict: str, shown: str, turn: int | None
) -> None:
    """Thresholds reached through a function or a quotient of the expression's numbers
    (no number of theirs is that large), and a change hidden under a large constant:
    each was confirmed relative. The counterexample's shift carries a position from at
    or below the condition's turn (position ``turn``, by hand) to past it."""
    spec = expr_bias_spec(tmp_path, "threshold", expr, claims="relative: true")
    relative = _verdicts(str(spec), "--only", "relative", "--max-examples", "10")["relative"]
    assert relative["verdict"] == verdict, relative
    assert shown in relative["evidence"], relative
    if turn is not None:
        example = relative["counterexample"]
        positions = example["q_positions"] + example["k_positions"]
        assert any(p <= turn < p + example["shift"] for p in positions), example


BAND_AT_PARAMETER = "-abs(i - j) + where(abs(i - p * 1000) < 0.5, 1, 0)"


@pytest.mark.parametrize(("trained", "step"), [(None, 300000), (500.0, 400000)])
def test_a_band_at_a_parameter_is_found_where_the_module_puts_it(
    tmp_path: Path, trained: float | None, step: int
) -> None:
    """A one-position band at i = p * 1000 breaks ``relative`` there: at p's init (300),
    and with --weights at the trained p (500) as the module reads it, clamped to its
    bounds (400). Shifts stopped at 2^16, past no parameter, and confirmed the claim."""
    params = "{p: {shape: [], init: 300, bounds: [1, 400]}}"
    spec = expr_bias_spec(tmp_path, "band", BAND_AT_PARAMETER, "relative: true", params=params)
    args = [str(spec), "--only", "relative", "--max-examples", "10"]
    if trained is not None:
        state = Probe(load_spec(spec), Budget()).cls().state_dict()
        torch.save({**state, "expr_p": torch.tensor(trained)}, tmp_path / "trained.pt")
        args += ["--weights", str(tmp_path / "trained.pt")]
    relative = _verdicts(*args)["relative"]
    assert relative["verdict"] == "REFUTED: fails", relative
    found = relative["counterexample"]
    assert step in [at + found["shift"] for at in found["q_positions"]], relative


def test_xpos_that_refuses_a_long_context_does_not_extrapolate(tmp_path: Path) -> None:
    """xPos with scale_base 4 raises once the keys span more than about 400 positions:
    keys spread from position 0 to a far block find it; short far blocks alone did not."""
    body = """defaults: {heads: 2, head_dim: 16}
scale: inv_sqrt_head_dim
terms:
  content_content:
    rotate:
      base: 10000
      pairing: interleaved
      position_scale: {kind: xpos, scale_base: 4}
  content_position: drop
  position_content: drop
  position_position: drop
claims: {extrapolates: true}
"""
    spec = _write(tmp_path, "xpos_short_reach", body)
    verdict = _verdicts(str(spec), "--only", "extrapolates", "--max-examples", "50")
    extrapolates = verdict["extrapolates"]
    assert extrapolates["verdict"] == "REFUTED: fails", extrapolates
    assert "raises ValueError" in extrapolates["evidence"]


def test_copes_clamp_is_not_a_table_end() -> None:
    """CoPE's max_positions clamps counted positions; positions themselves are free."""
    probe = Probe(load_spec(SPECS / "cope.yaml"), Budget(max_examples=5))
    assert probe.limit is None and probe.length is None
    assert probe.span == Budget().span
    pe = generated_class("cope")()
    q = torch.randn(1, pe.heads, 2, pe.head_dim)
    far = torch.tensor([10**6, 10**6 + 1])
    assert bool(pe(q, q, q, q_positions=far, k_positions=far).isfinite().all())


def test_a_rotation_tells_apart_positions_an_input_table_does_not(tmp_path: Path) -> None:
    """A depthwise-convolution input encodes position only at the edges; RoPE on the
    logits tells every position apart, so the encoding is unique."""
    body = """defaults: {heads: 2, head_dim: 8, model_dim: 16}
scale: inv_sqrt_head_dim
input:
  kind: add
  table: {kind: depthwise_conv, kernel_size: 3, padding: same, bias: true}
terms:
  content_content:
    rotate: {base: 10000, pairing: half}
  content_position: absolute
  position_content: absolute
  position_position: absolute
claims: {unique: true}
"""
    spec = _write(tmp_path, "conv_rope", body)
    unique = _verdicts(str(spec), "--only", "unique", "--max-examples", "10")["unique"]
    assert unique["verdict"] == "confirmed: holds", unique
    assert "p_m and R_m" in unique["evidence"]


def test_a_table_of_two_rows_is_checked(tmp_path: Path) -> None:
    """The input route is found with as many positions as the table has (it probed 4)."""
    spec = _write(tmp_path, "two_rows", LEARNED.replace("MAX", "2"))
    unique = _verdicts(str(spec), "--only", "unique", "--max-examples", "5")["unique"]
    assert unique["verdict"] == "confirmed: holds", unique
