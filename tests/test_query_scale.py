"""Query scales: each query multiplied by a factor of its own position, tau(i).

Llama 4's attention temperature tuning (``nope_llama4``) is compared with Hugging
Face's Llama4TextAttention on a NoPE layer; log-length scaling (``rope_logn``) with a
float64 reference of Qwen's formula (tests/reference/formulas.py). Small variants
(a floor step of 4 positions, a training length of 4) put tau above 1 at the positions
small tests reach. Every backend is compared with the eager oracle, outputs and
gradients, and a decode step over keys rotated once with the full call.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from click.testing import CliRunner

from posgen.cli import main
from tests.conftest import (
    ROOT,
    assert_backends_agree_on_a_grouped_call,
    generated_class,
    llama4_layer_and_module,
    spec_variant,
)
from tests.reference.formulas import (
    attention,
    floor_log_query_scale,
    log_length_query_scale,
    rope_apply,
)

F64 = torch.float64


@functools.cache
def small_floor_class() -> type[torch.nn.Module]:
    """nope_llama4 with tau stepping every 4 positions, by 0.5 ln(1 + steps)."""
    return spec_variant(
        "nope_llama4",
        ("floor_scale: 8192, attn_scale: 0.1", "floor_scale: 4, attn_scale: 0.5"),
        ("defaults: {heads: 40, head_dim: 128}", "defaults: {heads: 4, head_dim: 8}"),
        name="nope_llama4_small",
    )


@functools.cache
def short_log_class() -> type[torch.nn.Module]:
    """rope_logn with a training length of 4: tau = ln(i + 1) / ln(4) from position 4."""
    return spec_variant(
        "rope_logn",
        ("original_max_positions: 8192", "original_max_positions: 4"),
        ("defaults: {heads: 32, head_dim: 128}", "defaults: {heads: 4, head_dim: 8}"),
        name="rope_logn_short",
    )


def _llama4_layer(floor_scale: int, attn_scale: float) -> torch.nn.Module:
    """Hugging Face's Llama 4 attention on a NoPE layer (no rotation, no QK norm), float64:
    4 query heads of 8 over 2 key-value heads."""
    from transformers.models.llama4.configuration_llama4 import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention

    config = Llama4TextConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=1,
        no_rope_layers=[0],  # layer 0 takes no rotation
        floor_scale=floor_scale,
        attn_scale=attn_scale,
        attn_temperature_tuning=True,
    )
    config._attn_implementation = "eager"
    return Llama4TextAttention(config, layer_idx=0).to(F64).eval()


@pytest.mark.parametrize(
    ("small", "start"),
    [(True, 0), (True, 9), (False, 8188), (False, 3 * 8192 - 3)],
    ids=["floor4-from0", "floor4-from9", "floor8192-step1", "floor8192-step3"],
)
def test_floor_log_scale_matches_hugging_face_llama4(small: bool, start: int) -> None:
    """The module between Hugging Face's projections gives Llama4TextAttention's output on
    a causal prompt at positions start .. start + 5 (across a step of the factor), float64,
    grouped-query heads, batch 2, layout bnhd as the projections produce it. Hugging Face
    computes tau in float32 (``cache_position.float()``), the module in float64: they
    agree to float32's rounding of tau."""
    floor_scale, attn_scale = (4, 0.5) if small else (8192, 0.1)
    layer = _llama4_layer(floor_scale, attn_scale)
    cls = small_floor_class() if small else generated_class("nope_llama4")
    pe = cls(heads=4, head_dim=8)
    hidden = torch.randn(2, 6, 32, dtype=F64)
    positions = torch.arange(start, start + 6)
    mask = torch.full((6, 6), float("-inf"), dtype=F64).triu(1)[None, None]  # [1, 1, 6, 6]
    expected, got = llama4_layer_and_module(layer, pe, hidden, positions, mask)
    nope = generated_class("nope")(heads=4, head_dim=8)
    _, unscaled = llama4_layer_and_module(layer, nope, hidden, positions, mask)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-8)
    assert (got - unscaled).abs().max() > 1e-3  # tau > 1 at these positions


def test_default_positions_scale_a_decode_query_past_the_first_step() -> None:
    """A decode step at the default positions (one query at position M - 1) is scaled by
    tau(M - 1): with 8193 keys Llama 4's factor is 1 + 0.1 ln 2 for the last query, read
    from the kept factors after a call of 5 keys kept fewer."""
    pe = generated_class("nope_llama4")(heads=2, head_dim=8)
    q = torch.randn(1, 2, 1, 8, dtype=F64)
    short = torch.randn(1, 2, 5, 8, dtype=F64)
    torch.testing.assert_close(pe(q, short, short), attention(q, short, short))
    k, v = torch.randn(1, 2, 8193, 8, dtype=F64), torch.randn(1, 2, 8193, 8, dtype=F64)
    tau = floor_log_query_scale(8192, 8192, 0.1)
    assert tau == pytest.approx(1 + 0.1 * math.log(2))
    expected = attention(q * tau, k, v)
    for backend in ("eager", "sdpa", "auto"):
        got = pe(q, k, v, causal=True, backend=backend)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def _log_length_logits(q: torch.Tensor, k: torch.Tensor, qp: torch.Tensor, kp: torch.Tensor):
    """float64 logits of rope_logn_short: tau(i) (R_i q_i) . (R_j k_j) / sqrt(8)."""
    tau = torch.tensor([log_length_query_scale(int(p), 4) for p in qp], dtype=F64)
    rq = rope_apply(q.to(F64), qp, 10000.0, "half")
    rk = rope_apply(k.to(F64), kp, 10000.0, "half")
    return (rq * tau[:, None]) @ rk.transpose(-1, -2) / math.sqrt(8)


def test_log_length_scale_matches_the_float64_formula() -> None:
    """scores of rope_logn (training length 4) against an independent float64 RoPE and
    Qwen's log_L(i + 1) past L, at positions from 0 to 40 (tau from 1 to 2.68)."""
    pe = short_log_class()(heads=4, head_dim=8)
    q, k = torch.randn(1, 4, 5, 8, dtype=F64), torch.randn(1, 4, 6, 8, dtype=F64)
    qp, kp = torch.tensor([0, 3, 4, 17, 40]), torch.tensor([0, 1, 5, 9, 30, 39])
    got = pe.scores(q, k, q_positions=qp, k_positions=kp)
    torch.testing.assert_close(got, _log_length_logits(q, k, qp, kp), rtol=1e-10, atol=1e-12)
    assert log_length_query_scale(40, 4) == pytest.approx(math.log(41) / math.log(4))


@pytest.mark.parametrize("which", ["floor", "log"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("explicit", [False, True])
def test_every_backend_agrees_with_eager_outputs_and_gradients(
    which: str, causal: bool, explicit: bool
) -> None:
    """sdpa, flex (its unfused reference on the CPU) and auto against the eager oracle,
    float32, grouped-query heads, 12 queries against 12 keys (default positions 0 .. 11,
    or explicit ones reaching 45): outputs and the gradients into q, k and v."""
    cls = small_floor_class() if which == "floor" else short_log_class()
    assert_backends_agree_on_a_grouped_call(cls(heads=4, head_dim=8), causal, explicit)


def test_bfloat16_stays_within_bfloat16_error_of_float64() -> None:
    """bfloat16 q, k, v past the first steps: the scaled queries are rounded once, as
    Hugging Face rounds them, so the output is within bf16 error of float64."""
    pe = small_floor_class()(heads=4, head_dim=8)
    q, k, v = torch.randn(1, 4, 16, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    exact = pe(q.to(F64), k.to(F64), v.to(F64), causal=True)
    for backend in ("eager", "sdpa"):
        half = pe(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, backend=backend)
        assert half.dtype == torch.bfloat16
        torch.testing.assert_close(half.to(F64), exact, rtol=0.0, atol=0.05)


def test_decode_over_keys_rotated_once_matches_the_full_call() -> None:
    """rope_logn: keys rotated once (``rotate_keys``), then one query at a time at the
    default position with ``keys_rotated=True``, equals the rows of one causal call."""
    pe = short_log_class()(heads=4, head_dim=8)
    q, k, v = torch.randn(1, 4, 20, 8), torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    full = pe(q, k, v, causal=True)
    rotated = pe.rotate_keys(k)
    for t in (0, 3, 4, 11, 19):
        step = pe(q[:, :, t : t + 1], rotated[:, :, : t + 1], v[:, :, : t + 1], keys_rotated=True)
        torch.testing.assert_close(step, full[:, :, t : t + 1], rtol=1e-5, atol=1e-6)


def test_scale_queries_multiplies_by_the_factor_of_each_position() -> None:
    """``scale_queries``: positions default to 0 .. N - 1, may be batched, and the layout
    bnhd is kept; an encoding without a query scale returns q itself."""
    pe = small_floor_class()(heads=4, head_dim=8)
    q = torch.randn(2, 4, 9, 8, dtype=F64)
    tau = torch.tensor([floor_log_query_scale(p, 4, 0.5) for p in range(9)], dtype=F64)
    torch.testing.assert_close(pe.scale_queries(q), q * tau[:, None], rtol=1e-15, atol=0)
    batched = torch.tensor([list(range(9)), list(range(20, 29))])
    tau2 = torch.tensor([floor_log_query_scale(p, 4, 0.5) for p in range(20, 29)], dtype=F64)
    got = pe.scale_queries(q, batched)
    torch.testing.assert_close(got[1], q[1] * tau2[:, None], rtol=1e-15, atol=0)
    bnhd = pe.scale_queries(q.transpose(1, 2), layout="bnhd")
    torch.testing.assert_close(bnhd, (q * tau[:, None]).transpose(1, 2), rtol=1e-15, atol=0)
    plain = generated_class("rope")(heads=4, head_dim=8)
    assert plain.scale_queries(q) is q
    # half precision: the float32 product rounded once, as Hugging Face's Llama 4 rounds
    half = q.bfloat16()
    once = (half.float() * tau.float()[:, None]).bfloat16()
    assert torch.equal(pe.scale_queries(half), once)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda pe, q: pe.scale_queries(q, torch.arange(8)), r"positions must have shape \[9\]"),
        (lambda pe, q: pe.scale_queries(q, torch.arange(9.0)), "positions must hold integer"),
        (lambda pe, q: pe.scale_queries(q, -torch.ones(9, dtype=torch.long)), "positions"),
        (lambda pe, q: pe.scale_queries(q[..., :4]), "q must have head_dim 8"),
        (lambda pe, q: pe.scale_queries(q[0]), "q must"),
    ],
    ids=["shape", "float", "negative", "head-dim", "rank"],
)
def test_scale_queries_refuses_bad_arguments_by_name(call, message: str) -> None:
    pe = small_floor_class()(heads=4, head_dim=8)
    with pytest.raises(ValueError, match=message):
        call(pe, torch.randn(2, 4, 9, 8))


def test_a_query_scale_makes_shifted_positions_take_their_own_path() -> None:
    """Positions equal to the defaults plus a constant are not the defaults here (the
    factor reads the query's own position): a prompt at positions 8 .. 15 differs from
    one at 0 .. 7, and equals the float64 formula at its positions."""
    pe = small_floor_class()(heads=4, head_dim=8)
    assert not pe.shift_invariant
    q, k, v = (torch.randn(1, 4, 8, 8, dtype=F64) for _ in range(3))
    shifted = torch.arange(8, 16)
    got = pe(q, k, v, causal=True, q_positions=shifted, k_positions=shifted)
    tau = torch.tensor([floor_log_query_scale(p, 4, 0.5) for p in range(8, 16)], dtype=F64)
    expected = attention(q * tau[:, None], k, v, None, None, shifted, shifted)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(got, pe(q, k, v, causal=True))


@pytest.mark.parametrize(
    ("base", "old", "new"),
    [
        ("rope_logn", "original_max_positions: 8192", "original_max_positions: 4194304"),
        ("nope_llama4", "floor_scale: 8192", "floor_scale: 4194304"),
    ],
    ids=["log-length", "floor-log"],
)
def test_check_refutes_relative_at_the_longest_allowed_length(
    base: str, old: str, new: str, tmp_path
) -> None:
    """At the largest length a query scale allows (2^22), ``posgen check`` still shifts
    past four times it and refutes a claim of ``relative: true`` (exit 1)."""
    text = (ROOT / "specs" / f"{base}.yaml").read_text(encoding="utf-8")
    assert old in text and "relative: false" in text
    spec = tmp_path / f"{base}.yaml"
    spec.write_text(text.replace(old, new).replace("relative: false", "relative: true"))
    result = CliRunner().invoke(
        main, ["check", str(spec), "--only", "relative", "--max-examples", "10"]
    )
    assert result.exit_code == 1, result.output
    assert "relative (REFUTED: fails)" in result.output
