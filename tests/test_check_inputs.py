"""``posgen check``'s inputs and outputs: --weights values and dtypes, trained slopes, the
time budgets, strict JSON, honest kv_cache evidence, chunked decay curves and the bf16
tolerance at large logits. Every input is built here, under tmp_path."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from posgen.check.agreement import (
    _bf16_and_fp32,
    _row_content_size,
    _row_spread,
    _within_bf16_error,
    kv_cache,
)
from posgen.check.decay import decay_curve, distance_chunk, keys_independent
from posgen.check.probe import Probe
from posgen.check.report import render_json
from posgen.check.search import Budget, Violation, generator
from posgen.check.verdicts import Outcome, Report
from posgen.cli import main
from posgen.spec.loader import load_spec
from tests.conftest import SPECS, expr_bias_spec, generated_class, small_spec_text

ALIBI_LEARNED = str(SPECS / "alibi_learned.yaml")
SMALL = Budget(max_examples=5, seed=0, span=64, seconds=5.0)


def _strict_json(text: str) -> object:
    """Parse ``text`` as standard JSON: NaN, Infinity and -Infinity are refused."""

    def refuse(token: str) -> object:
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


# --------------------------------------------------------------------------- 6: --weights


def test_weights_values_and_dtypes_are_a_usage_error(tmp_path: Path) -> None:
    """NaN/inf values, non-floating dtypes (complex, bool, int), sparse and meta tensors
    are refused before any property runs: exit 2, one line naming the key, no traceback."""
    runner = CliRunner()
    slopes = torch.full((8,), 0.25)
    cases = {
        "nan": (slopes.clone().index_fill_(0, torch.tensor([3]), math.nan), "non-finite"),
        "inf": (slopes.clone().index_fill_(0, torch.tensor([0]), math.inf), "non-finite"),
        "complex": (slopes.to(torch.complex64), "has dtype complex64"),
        "bool": (torch.ones(8, dtype=torch.bool), "has dtype bool"),
        "int": (torch.ones(8, dtype=torch.int64), "has dtype int64"),
        "sparse": (slopes.to_sparse(), "a dense (strided) one is needed"),
        "meta": (torch.empty(8, device="meta"), "meta device"),
        # finite in float64, +inf once loaded into the float32 module
        "past_float32": (slopes.double().index_fill_(0, torch.tensor([0]), 1e300), "past what"),
    }
    for name, (value, message) in cases.items():
        path = tmp_path / f"{name}.pt"
        torch.save({"slopes": value}, path)
        result = runner.invoke(
            main, ["check", ALIBI_LEARNED, "--weights", str(path), "--max-examples", "2"]
        )
        assert result.exit_code == 2, (name, result.output)
        assert "slopes" in result.output and message in result.output, (name, result.output)
        assert "Traceback" not in result.output and "REFUTED" not in result.output, name
        assert len(result.output.strip().splitlines()[-1]) > 0
    os.mkfifo(tmp_path / "pipe.pt")  # refused before torch.load would block on it
    result = runner.invoke(main, ["check", ALIBI_LEARNED, "--weights", str(tmp_path / "pipe.pt")])
    assert result.exit_code == 2 and "not a regular file" in result.output, result.output
    fine = tmp_path / "float64.pt"
    torch.save({"slopes": slopes.double()}, fine)  # another real floating dtype is taken
    result = runner.invoke(
        main, ["check", ALIBI_LEARNED, "--weights", str(fine), "--only", "slopes"]
    )
    assert result.exit_code == 0, result.output


# --------------------------------------------------------------------------- 7: slopes


def test_slopes_measure_the_loaded_weights(tmp_path: Path) -> None:
    """``slopes`` reads the module as loaded: trained slopes -0.5 fail positivity and are
    shown; trained 0.3 hold and are shown, the fresh modules labelled as initialisation."""
    runner = CliRunner()
    args = ["check", ALIBI_LEARNED, "--only", "slopes", "--max-examples", "3"]
    negative, positive = tmp_path / "negative.pt", tmp_path / "positive.pt"
    torch.save({"slopes": torch.full((8,), -0.5)}, negative)
    torch.save({"slopes": torch.full((8,), 0.3)}, positive)
    result = runner.invoke(main, [*args, "--weights", str(negative)])
    assert result.exit_code == 1, result.output
    assert "FAILS" in result.output and "-0.5" in result.output, result.output
    result = runner.invoke(main, [*args, "--weights", str(positive), "--json"])
    assert result.exit_code == 0, result.output
    evidence = _strict_json(result.output)["specs"][0]["properties"][0]["evidence"]  # type: ignore[index]
    assert "as loaded" in evidence and "0.3" in evidence, evidence
    assert "initialisation" in evidence and "0.5" not in evidence, evidence
    at_init = runner.invoke(main, [*args, "--json"])
    evidence = _strict_json(at_init.output)["specs"][0]["properties"][0]["evidence"]  # type: ignore[index]
    assert at_init.exit_code == 0 and "as loaded" not in evidence and "0.5" in evidence


# --------------------------------------------------------------------------- 8: budgets


@pytest.mark.parametrize("option", ["--time-budget", "--spec-time-budget"])
@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf"])
def test_time_budgets_must_be_finite(option: str, value: str) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["check", ALIBI_LEARNED, "--only", "slopes", option, value])
    assert result.exit_code == 2, result.output
    assert option in result.output and "Traceback" not in result.output


# --------------------------------------------------------------------------- 9: JSON


def test_json_is_standard_where_the_curve_is_infinite(tmp_path: Path) -> None:
    """-log(|i - j| + a), trained to a = 0, is +inf at distance 0 (a spec whose initial
    bias is not finite is refused): the decay curve's value and window mean are written
    as the string "inf", never as the non-standard Infinity."""
    bias = (
        '{bias: {kind: expr, expr: "-log(abs(i - j) + a)", '
        "params: {a: {shape: [], init: 1.0}}, placement: after_scale}}"
    )
    path = tmp_path / "log_bias.yaml"
    path.write_text(small_spec_text("log_bias", "", bias, "a log bias", "test"), encoding="utf-8")
    torch.save({"expr_a": torch.tensor(0.0)}, tmp_path / "trained.pt")
    result = CliRunner().invoke(
        main,
        ["check", str(path), "--json", "--only", "decay", "--max-examples", "3"]
        + ["--weights", str(tmp_path / "trained.pt")],
    )
    assert result.exit_code == 0, result.output
    document = _strict_json(result.output)
    curve = document["specs"][0]["properties"][0]["curve"]  # type: ignore[index]
    assert curve["values"][0] == "inf" and curve["means"][0] == "inf"
    assert isinstance(curve["values"][1], float)


def test_render_json_never_writes_nan() -> None:
    """Non-finite floats anywhere in an outcome (curve, counterexample) become strings."""
    outcome = Outcome(
        "decay",
        "claim",
        None,
        True,
        "made up",
        counterexample={"error": math.nan, "values": (math.inf, -math.inf, 1.5)},
        curve={"means": [math.nan, 0.0], "values": [-math.inf]},
    )
    report = Report("x", "x.yaml", "x", "scores", [outcome])
    document = _strict_json(render_json([report], Budget(), 1.0))
    entry = document["specs"][0]["properties"][0]  # type: ignore[index]
    assert entry["counterexample"] == {"error": "nan", "values": ["inf", "-inf", 1.5]}
    assert entry["curve"] == {"means": ["nan", 0.0], "values": ["-inf"]}


# --------------------------------------------------------------------------- 10: kv_cache


def test_kv_cache_evidence_says_what_ran() -> None:
    """Through embed only float64 logits at explicit positions are compared; elsewhere
    the float32 forward too, and keys rotated once only where the module rotates."""
    through_embed = kv_cache(Probe(load_spec(SPECS / "sinusoidal.yaml"), SMALL))
    assert through_embed.holds, through_embed.evidence
    assert "explicit positions" in through_embed.evidence
    assert "float32 forward are not compared" in through_embed.evidence
    assert "keys rotated" not in through_embed.evidence
    alibi = kv_cache(Probe(load_spec(SPECS / "alibi.yaml"), SMALL))
    assert "float32 forward with default positions" in alibi.evidence, alibi.evidence
    assert "keys rotated" not in alibi.evidence
    rope = kv_cache(Probe(load_spec(SPECS / "rope.yaml"), SMALL))
    assert "keys rotated once" in rope.evidence, rope.evidence


# --------------------------------------------------------------------------- 11: decay


def _key_counts(monkeypatch: pytest.MonkeyPatch, probe: Probe) -> list[int]:
    """Record how many keys each position_scores call of ``probe`` is given."""
    counts: list[int] = []
    real = probe.position_scores

    def counted(q_pos: torch.Tensor, k_pos: torch.Tensor, example_seed: int | None = None):
        counts.append(int(k_pos.shape[0]))
        return real(q_pos, k_pos, example_seed)

    monkeypatch.setattr(probe, "position_scores", counted)
    return counts


def test_a_long_decay_curve_is_evaluated_in_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A span-wide curve over many heads goes a bounded chunk of keys per call (so the
    hard deadline lands between calls and memory stays bounded), with the values of one
    call; the default span is still a single call."""
    probe = Probe(load_spec(SPECS / "fire.yaml"), Budget(span=512))
    counts = _key_counts(monkeypatch, probe)
    decay_curve(probe)
    assert counts == [512]
    monkeypatch.undo()
    text = (SPECS / "fire.yaml").read_text(encoding="utf-8")
    wide = text.replace("heads: 8, head_dim: 64", "heads: 64, head_dim: 64")
    assert wide != text
    path = tmp_path / "fire_wide.yaml"
    path.write_text(wide.replace("name: fire", "name: fire_wide"), encoding="utf-8")
    probe = Probe(load_spec(path), Budget(span=16384))
    assert probe.heads == 64 and probe.span == 16384
    counts = _key_counts(monkeypatch, probe)
    with torch.no_grad():
        _, curve = decay_curve(probe, head=5, query=20000, example_seed=3)
        monkeypatch.undo()
        whole = probe.position_scores(torch.tensor([20000]), 20000 - torch.arange(16384), 3)
    assert sum(counts) == 16384 and len(counts) > 1
    assert max(counts) <= distance_chunk(probe) <= 4096
    torch.testing.assert_close(curve, whole[5, 0], rtol=1e-12, atol=1e-12)


def test_contextual_positions_are_never_chunked(monkeypatch: pytest.MonkeyPatch) -> None:
    """CoPE counts gates over the other keys: its curve is always one call."""
    probe = Probe(load_spec(SPECS / "cope.yaml"), SMALL)
    assert not keys_independent(probe)
    monkeypatch.setattr("posgen.check.decay.distance_chunk", lambda probe: 4)
    counts = _key_counts(monkeypatch, probe)
    decay_curve(probe, span=16)
    assert counts == [16]


# --------------------------------------------------------------------------- 12: bf16


def test_row_spread_reads_only_finite_attended_logits() -> None:
    logits = torch.tensor([[[[1000.0, 1003.0, -math.inf], [5.0, math.nan, 2.0]]]])
    allowed = torch.tensor([[True, True, True], [True, False, False]])
    spread = _row_spread(logits, None)
    assert spread.shape == (1, 1, 2, 1) and spread.flatten().tolist() == [3.0, 3.0]
    assert _row_spread(logits, allowed).flatten().tolist() == [3.0, 0.0]


def test_row_content_size_reads_the_content_logits_of_attended_keys() -> None:
    """max_j |q_i · k_j| / sqrt(d) over the keys each row attends to (NoPE: no rotation,
    no query scale), and 0 for a module without score_terms."""
    pe = generated_class("nope")(heads=2, head_dim=4).double()
    q, k = torch.randn(2, 1, 2, 3, 4, dtype=torch.float64)
    positions = torch.arange(3)
    allowed = positions[None, :] <= positions[:, None]  # [3, 3], causal
    logits = (q @ k.transpose(-1, -2) / 2).abs().masked_fill(~allowed, 0.0)
    size = _row_content_size(pe, q, k, positions, positions, allowed)
    torch.testing.assert_close(size, logits.amax(dim=-1, keepdim=True), rtol=1e-12, atol=0)
    assert _row_content_size(object(), q, k, positions, positions, None) == 0.0  # type: ignore[arg-type]


def test_a_query_scaled_bf16_path_is_held_to_its_content_logits() -> None:
    """rope_ssmax past 2^18 scales its queries by about 5.4: some rows' logits are large
    but close together, and rounding q to bf16 moves their weights by more than the
    spread alone allows (0.049 over a bound of 0.029 in posgen check before the content
    term). The honest bf16 path passes; one that drops the query scale is caught."""
    probe = Probe(load_spec(SPECS / "rope_ssmax.yaml"), SMALL)
    k_pos = torch.arange(262_145, 262_149)
    plain = generated_class("rope")()
    for seed in (15, 104, 170):  # seeds whose causal rows the spread alone failed
        content = probe.content(generator(seed), 4, 4, dtype=torch.bfloat16)
        for causal in (False, True):
            honest = _bf16_and_fp32(probe, None, content, k_pos, k_pos, causal)
            assert _within_bf16_error(k_pos, *honest) > 0
    bf16 = content[0], content[1], content[2]
    _, want, tol, what = honest
    unscaled = plain(*bf16, q_positions=k_pos, k_positions=k_pos, causal=True).float()
    with pytest.raises(Violation, match="bf16 attention output differs"):
        _within_bf16_error(k_pos, unscaled, want, tol, what)


def test_a_wrong_bf16_path_is_caught_at_large_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bias 0.001·i − |i − j| is ~1000 at far queries but the same across a row, so
    softmax ignores it: a bf16 path that attends uniformly there must still fail (a bound
    scaled by max|logit| let any output through), and the honest path must pass."""
    probe = Probe(
        load_spec(expr_bias_spec(tmp_path, "row_constant", "0.001 * i - abs(i - j)")), SMALL
    )
    k_pos = torch.arange(1_000_000, 1_000_006)
    content = probe.content(generator(7), 3, 6, dtype=torch.bfloat16)
    honest = _bf16_and_fp32(probe, None, content, k_pos[3:], k_pos, False)
    assert _within_bf16_error(k_pos, *honest) > 0
    real = type(probe.pe32).forward

    def uniform(self, q, k, v, **options):  # type: ignore[no-untyped-def]
        if q.dtype == torch.bfloat16:
            return (
                v.float().mean(dim=-2, keepdim=True).expand(*q.shape[:-1], v.shape[-1]).to(v.dtype)
            )
        return real(self, q, k, v, **options)

    monkeypatch.setattr(type(probe.pe32), "forward", uniform)
    wrong = _bf16_and_fp32(probe, None, content, k_pos[3:], k_pos, False)
    with pytest.raises(Violation, match="bf16 attention output differs"):
        _within_bf16_error(k_pos, *wrong)
