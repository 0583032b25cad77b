"""Rotary frequency schedules, attention factors, p-RoPE, xPos and M-RoPE against references.

References: Hugging Face transformers' ``ROPE_INIT_FUNCTIONS`` (inverse frequencies and
attention scaling) and ``apply_rotary_pos_emb`` / ``apply_multimodal_rotary_pos_emb``;
x-transformers' ``RotaryEmbedding`` (NTK base rescaling and xPos); float64
implementations of the papers' formulas written here (p-RoPE, bloc97's NTK base).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import pytest
import torch

from generated import _position_axes as position_axes
from posgen.spec.diagnostics import SpecError
from tests.conftest import SPECS as ROOT_SPECS
from tests.conftest import generated_class, head_dim_for, spec_variant

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

F64 = torch.float64


def _schedule(cls: type[torch.nn.Module]) -> Any:
    """The generated module (namespace) of an encoding class: its frequency helpers."""
    return sys.modules[cls.__module__]


def _frequencies(cls: type[torch.nn.Module], rotary_dim: int, length: int | None) -> torch.Tensor:
    module = _schedule(cls)
    given = None if length is None else torch.tensor(length)
    return module._inverse_frequencies(rotary_dim, given, torch.device("cpu"))


def _hf(
    rope_type: str,
    scaling: dict[str, Any] | None,
    head_dim: int = 64,
    base: float = 10000.0,
    max_positions: int = 4096,
    **extra: Any,
) -> LlamaConfig:
    rope_scaling = None if scaling is None else {"rope_type": rope_type, **scaling}
    return LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        rope_theta=base,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        **extra,
    )


def _hf_frequencies(
    rope_type: str, config: LlamaConfig, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
    return inv_freq.to(F64), float(factor)


def _attention_factor(cls: type[torch.nn.Module], head_dim: int) -> float:
    """Measured: rotate a vector of ones at position 0 (cos = a, sin = 0 there)."""
    pe = cls(heads=1, head_dim=head_dim).double()
    ones = torch.ones(1, 1, 1, head_dim, dtype=F64)
    q, _ = pe.rotate(ones, ones, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    return float(q[0, 0, 0, 0])


# --------------------------------------------------------------------------- schedules

YARN = (
    "      frequencies: {kind: yarn, factor: 4, original_max_positions: 4096, "
    "beta_fast: 32, beta_slow: 1}"
)


@pytest.mark.parametrize(
    ("spec", "replacements", "rope_type", "scaling"),
    [
        ("rope_linear", (), "linear", {"factor": 4.0}),
        (
            "rope_yarn",
            (),
            "yarn",
            {"factor": 4.0, "original_max_position_embeddings": 4096},
        ),
        (
            "rope_yarn",
            (
                (
                    YARN,
                    "      frequencies: {kind: yarn, factor: 16, original_max_positions: 2048, "
                    "beta_fast: 16, beta_slow: 2, truncate: false}",
                ),
            ),
            "yarn",
            {
                "factor": 16.0,
                "original_max_position_embeddings": 2048,
                "beta_fast": 16,
                "beta_slow": 2,
                "truncate": False,
            },
        ),
        (
            "rope_yarn",
            (
                (
                    YARN,
                    "      frequencies: {kind: yarn, factor: 40, original_max_positions: 4096, "
                    "mscale: 1.0, mscale_all_dim: 0.707}",
                ),
            ),
            "yarn",
            {
                "factor": 40.0,
                "original_max_position_embeddings": 4096,
                "mscale": 1.0,
                "mscale_all_dim": 0.707,
            },
        ),
        (
            "rope_yarn",
            (
                (
                    YARN,
                    "      frequencies: {kind: yarn, factor: 4, original_max_positions: 64, "
                    "beta_fast: 32, beta_slow: 1}",
                ),
            ),
            "yarn",
            {"factor": 4.0, "original_max_position_embeddings": 64},
        ),
    ],
    # short-context: the ramp's low end, floor(-3.98), is clamped to pair 0
    ids=["linear", "yarn", "yarn-no-truncate", "yarn-deepseek-mscale", "yarn-short-context"],
)
def test_static_schedules_match_hugging_face(
    spec: str, replacements: tuple[tuple[str, str], ...], rope_type: str, scaling: dict[str, Any]
) -> None:
    cls = spec_variant(spec, *replacements) if replacements else generated_class(spec)
    expected, attention = _hf_frequencies(rope_type, _hf(rope_type, scaling))
    got = _frequencies(cls, 64, None)
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=0)
    assert _attention_factor(cls, 64) == pytest.approx(attention, rel=1e-12)


@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_a_stated_attention_factor_below_or_above_one_scales_cos_and_sin(factor: float) -> None:
    """Every logit is multiplied by a^2 (YaRN's attention factor); the schema allows
    0 < a <= 10, and an a below 1 must not be dropped as if it were 1."""
    old = "beta_fast: 32, beta_slow: 1}"
    new = f"beta_fast: 32, beta_slow: 1, attention_factor: {factor}}}"
    cls = spec_variant("rope_yarn", (old, new), name=f"rope_yarn_a{int(factor * 10)}")
    assert _attention_factor(cls, 64) == pytest.approx(factor, rel=1e-12)


def test_llama3_matches_hugging_face_for_llama_3_1() -> None:
    cls = generated_class("rope_llama3")
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = _hf("llama3", scaling, head_dim=128, base=500000.0, max_positions=131072)
    expected, attention = _hf_frequencies("llama3", config)
    torch.testing.assert_close(_frequencies(cls, 128, None), expected, rtol=2e-6, atol=0)
    assert attention == 1.0 and _attention_factor(cls, 128) == 1.0


@pytest.mark.parametrize("length", [1, 100, 2048, 2049, 5000, 65536])
def test_dynamic_ntk_matches_hugging_face_at_each_length(length: int) -> None:
    cls = generated_class("rope_dynamic_ntk")
    config = _hf("dynamic", {"factor": 2.0}, max_positions=2048)
    expected, _ = _hf_frequencies("dynamic", config, seq_len=length)
    torch.testing.assert_close(_frequencies(cls, 64, length), expected, rtol=2e-6, atol=0)


def test_dynamic_ntk_is_stateless_and_never_lowers_the_base() -> None:
    """A long call does not change a later short one (Hugging Face's layer keeps its
    longest length); the base is never below the spec's (frequencies never rise)."""
    pe = generated_class("rope_dynamic_ntk")(heads=2, head_dim=64).double()
    q = torch.randn(1, 2, 8, 64, dtype=F64)
    short = torch.arange(3000, 3008)
    before = pe.rotate(q, q, short, short)
    long = torch.arange(0, 9000)
    keys = torch.randn(1, 2, 9000, 64, dtype=F64)
    pe.rotate(keys, keys, long, long)
    after = pe.rotate(q, q, short, short)
    torch.testing.assert_close(before, after, rtol=0, atol=0)
    standard = _frequencies(generated_class("rope"), 64, None)
    for length in (1, 2048, 4096, 10**6):
        assert bool((_frequencies(type(pe), 64, length) <= standard * (1 + 1e-12)).all())


def test_dynamic_ntk_uses_the_calls_largest_position() -> None:
    """Positions 0..4999 rotate as Hugging Face's dynamic layer does for seq_len 5000."""
    pe = generated_class("rope_dynamic_ntk")(heads=1, head_dim=64).double()
    config = _hf("dynamic", {"factor": 2.0}, max_positions=2048)
    inv_freq, _ = _hf_frequencies("dynamic", config, seq_len=5000)
    positions = torch.tensor([0, 7, 4999])
    x = torch.randn(1, 1, 3, 64, dtype=F64)
    angles = positions.to(F64)[:, None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    want, _ = apply_rotary_pos_emb(x, x, emb.cos(), emb.sin(), unsqueeze_dim=0)
    got, _ = pe.rotate(x, x, positions, positions)
    # HF's float32 inverse frequencies turn ~1e-4 rad away by position 4999
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3)


@pytest.mark.parametrize("name", ["rope_dynamic_ntk", "rope_longrope"])
def test_a_key_the_mask_hides_still_sets_the_schedule(name: str) -> None:
    """The frequencies follow the call's largest position, a masked key's too: explicit
    positions at the defaults but for a hidden key at 100000 had passed for the
    defaults (a mask lets hidden keys sit anywhere), so the schedule read length M, and
    forward disagreed with softmax(scores + mask) v by 0.25 (dynamic NTK) and 0.086
    (LongRoPE), and with the same call compiled."""
    torch.manual_seed(0)
    cls = generated_class(name)
    pe = cls(heads=2, head_dim=head_dim_for(name, 16))
    m, d = 8, pe.head_dim
    q, k, v = torch.randn(1, 2, 1, d), torch.randn(1, 2, m, d), torch.randn(1, 2, m, d)
    k_positions = torch.arange(m)
    k_positions[0] = 100_000
    mask = torch.ones(1, 1, 1, m, dtype=torch.bool)
    mask[..., 0] = False
    positions = {"q_positions": torch.tensor([m - 1]), "k_positions": k_positions}
    scores = pe.scores(q, k, **positions).masked_fill(~mask, float("-inf"))
    want = torch.softmax(scores, dim=-1) @ v
    for backend in ("eager", "sdpa"):
        got = pe(q, k, v, attn_mask=mask, backend=backend, **positions)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length", [100, 4096, 4097, 20000])
def test_longrope_matches_hugging_face_on_both_sides_of_original_max(length: int) -> None:
    """Phi-3's layout: original_max_position_embeddings at the top level of the config and
    factor = max_position_embeddings / original (131072 / 4096 = 32 in the spec)."""
    cls = generated_class("rope_longrope")
    module = _schedule(cls)
    scaling = {
        "short_factor": list(module.LONGROPE_SHORT_FACTOR),
        "long_factor": list(module.LONGROPE_LONG_FACTOR),
    }
    config = _hf("longrope", scaling, max_positions=131072, original_max_position_embeddings=4096)
    expected, attention = _hf_frequencies("longrope", config, seq_len=length)
    torch.testing.assert_close(_frequencies(cls, 64, length), expected, rtol=2e-6, atol=0)
    assert _attention_factor(cls, 64) == pytest.approx(attention, rel=1e-12)


def test_ntk_base_matches_bloc97_and_x_transformers() -> None:
    xt = pytest.importorskip("x_transformers.x_transformers")
    got = _frequencies(generated_class("rope_ntk"), 64, None)
    base = 10000.0 * 4.0 ** (64 / 62)
    formula = torch.tensor([base ** (-2 * k / 64) for k in range(32)], dtype=F64)
    torch.testing.assert_close(got, formula, rtol=1e-13, atol=0)
    reference = xt.RotaryEmbedding(64, base_rescale_factor=4.0).inv_freq.to(F64)
    torch.testing.assert_close(got, reference, rtol=2e-6, atol=0)


@pytest.mark.parametrize("name", ["rope_ntk", "rope_dynamic_ntk"])
def test_ntk_scaling_refuses_two_rotated_features_at_construction(name: str) -> None:
    """base · factor^(d / (d - 2)) has no value at d = 2: the constructor says so,
    naming rotary_dim, instead of every call dividing by zero; d = 4 works."""
    cls = generated_class(name)
    with pytest.raises(ValueError, match="rotary_dim 2"):
        cls(heads=1, head_dim=2)
    q = torch.randn(1, 1, 3, 4)
    assert cls(heads=1, head_dim=4)(q, q, q).shape == (1, 1, 3, 4)


def test_partial_rotary_matches_gpt_neox_layout() -> None:
    """rotary_pct 0.25 of head_dim 64: 16 features rotate with base^(-2k/16) (HF's
    partial_rotary_factor), the other 48 pass through."""
    pe = generated_class("rope_partial")(heads=1, head_dim=64).double()
    config = _hf("default", None, partial_rotary_factor=0.25)
    inv_freq, _ = _hf_frequencies("default", config)
    assert inv_freq.shape == (8,)
    positions = torch.tensor([0, 3, 1000])
    x = torch.randn(1, 1, 3, 64, dtype=F64)
    angles = positions.to(F64)[:, None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    rotated, _ = apply_rotary_pos_emb(
        x[..., :16], x[..., :16], emb.cos(), emb.sin(), unsqueeze_dim=0
    )
    want = torch.cat((rotated, x[..., 16:]), dim=-1)
    got, _ = pe.rotate(x, x, positions, positions)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_p_rope_turns_only_the_highest_frequencies() -> None:
    """Barbero et al. 2024: pairs k of the whole head at base^(-2k/d), k < p·d/2 turn; the
    rest (the lowest frequencies) are the identity."""
    kept = 8  # round(0.25 * 64 / 2)
    theta = [10000.0 ** (-2 * k / 64) if k < kept else 0.0 for k in range(32)]
    _assert_half_pairs_turn_by(generated_class("rope_p")(heads=1, head_dim=64), theta)


def test_p_rope_keeps_the_highest_frequencies_of_a_rising_schedule() -> None:
    """The kept pairs are the highest frequencies by value, not the first pairs: with a
    schedule that rises with k, pairs 24..31 of a 64-dim head turn and 0..23 do not."""
    rising = "base ** (-2 * (d / 2 - 1 - k) / d)"
    proportional = "rotary_dims: {fraction: 0.25, layout: proportional}"
    cls = spec_variant(
        "rope_p",
        (proportional, f'{proportional}\n      frequencies: {{kind: expr, expr: "{rising}"}}'),
        name="rope_p_rising",
    )
    theta = [10000.0 ** (-2 * (31 - k) / 64) if k >= 24 else 0.0 for k in range(32)]
    _assert_half_pairs_turn_by(cls(heads=1, head_dim=64), theta)


def _assert_half_pairs_turn_by(pe: torch.nn.Module, theta: list[float]) -> None:
    """pe rotates feature k with k + 32 of a 64-dim head by position * theta[k], in
    float64, at positions up to 123456."""
    x = torch.randn(1, 1, 4, 64, dtype=F64)
    positions = torch.tensor([0, 1, 77, 123456])
    angles = positions.to(F64)[:, None] * torch.tensor(theta, dtype=F64)  # [4, 32]
    first, second = x[..., :32], x[..., 32:]
    want = torch.cat(
        (
            first * angles.cos() - second * angles.sin(),
            second * angles.cos() + first * angles.sin(),
        ),
        dim=-1,
    )
    got, _ = pe.double().rotate(x, x, positions, positions)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- xPos


def test_xpos_matches_x_transformers() -> None:
    xt = pytest.importorskip("x_transformers.x_transformers")
    torch.manual_seed(0)
    n = 300
    q, k = torch.randn(2, 4, n, 64), torch.randn(2, 4, n, 64)
    reference = xt.RotaryEmbedding(64, use_xpos=True, scale_base=512)
    freqs, scale = reference.forward_from_seq_len(n)
    want_q = xt.apply_rotary_pos_emb(q, freqs, scale)
    want_k = xt.apply_rotary_pos_emb(k, freqs, scale**-1)
    pe = generated_class("rope_xpos")(heads=4, head_dim=64)
    got_q, got_k = pe.rotate(q, k)
    torch.testing.assert_close(got_q, want_q, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_k, want_k, rtol=1e-4, atol=1e-4)


def _xpos_logits64(
    q: torch.Tensor, k: torch.Tensor, i: torch.Tensor, j: torch.Tensor
) -> torch.Tensor:
    """Sun et al. 2023 in float64: Σ_k rotated products · zeta_k^((i - j) / 512)."""
    d = q.shape[-1]
    pairs = torch.arange(d // 2, dtype=F64)
    theta = 10000.0 ** (-2 * pairs / d)
    zeta = (2 * pairs + 0.4 * d) / (1.4 * d)
    qa, qb = q[..., 0::2].to(F64), q[..., 1::2].to(F64)  # interleaved pairs
    ka, kb = k[..., 0::2].to(F64), k[..., 1::2].to(F64)
    r = (i[:, None] - j[None, :]).to(F64)  # [N, M]
    angle = -r[..., None] * theta  # q_i . k_j turns by (j - i) theta: [N, M, d/2]
    dot = qa[:, None] * ka[None] + qb[:, None] * kb[None]
    cross = qb[:, None] * ka[None] - qa[:, None] * kb[None]
    product = dot * angle.cos() + cross * angle.sin()
    return (product * zeta ** (r[..., None] / 512)).sum(-1)


def test_xpos_is_exact_and_finite_in_bf16_near_position_2_pow_20() -> None:
    pe = generated_class("rope_xpos")(heads=1, head_dim=64)
    q = torch.randn(1, 1, 4, 64)
    k = torch.randn(1, 1, 64, 64)
    k_pos = torch.arange(2**20 - 63, 2**20 + 1)
    q_pos = k_pos[-4:]
    rq, rk = pe.rotate(q.bfloat16(), k.bfloat16(), q_pos, k_pos)
    logits = rq.float()[0, 0] @ rk.float()[0, 0].T
    assert bool(torch.isfinite(logits).all())
    want = _xpos_logits64(q[0, 0], k[0, 0], q_pos, k_pos)
    error = (logits.double() - want).abs().max() / want.abs().max()
    assert float(error) < 0.05  # bf16 inputs and outputs: ~2^-8 relative per factor
    out = pe(
        q.bfloat16(), k.bfloat16(), k.bfloat16(), q_positions=q_pos, k_positions=k_pos, causal=True
    )
    assert bool(torch.isfinite(out).all())


def test_xpos_refuses_positions_its_factors_cannot_hold() -> None:
    """Within one call the factors are taken about the middle of the keys; a cache of
    rotated keys shares position 0 with its queries. Past either reach: ValueError."""
    pe = generated_class("rope_xpos")(heads=1, head_dim=64)
    x = torch.randn(1, 1, 2, 64)
    far = torch.tensor([0, 10**6])
    with pytest.raises(ValueError, match="from the middle of the keys"):
        pe.rotate(x, x, far, far)
    near_a_million = torch.tensor([10**6, 10**6 + 1])
    assert bool(torch.isfinite(pe.rotate(x, x, near_a_million, near_a_million)[0]).all())
    with pytest.raises(ValueError, match="a cache of rotated keys"):
        pe.rotate_keys(x, near_a_million)


def test_xpos_without_a_causal_mask_refuses_keys_too_far_ahead() -> None:
    """A key j after query i carries zeta^(-(j - i) / scale_base): with scale_base 1
    (reach 51) and 100 positions the float32 logits overflowed and every backend gave
    NaN rows without a causal mask (window and attn_mask included: sdpa adds them to
    the computed logits). Now a ValueError; with causal=True the output is finite."""
    cls = spec_variant("rope_xpos", ("scale_base: 512}", "scale_base: 1}"), name="rope_xpos_steep")
    pe = cls(heads=2, head_dim=16)
    reach = 51  # int(64 / ln(3.5)) at scale_base 1
    for n in (reach + 1, 100):
        q, k, v = (torch.randn(2, 2, n, 16) for _ in "qkv")
        assert bool(torch.isfinite(pe(q, k, v, causal=True)).all())
        lower = torch.ones(n, n, dtype=torch.bool).tril()
        rows = torch.stack((torch.arange(n), torch.arange(n) + 7))  # [2, n]: shifted rows
        for keywords in (
            {},
            {"window": 8},
            {"attn_mask": lower},
            {"q_positions": rows, "k_positions": rows},
        ):
            if n == reach + 1:  # keys at most 51 after a query: finite
                assert bool(torch.isfinite(pe(q, k, v, **keywords)).all())
            else:
                with pytest.raises(ValueError, match="99 positions after a query.*causal=True"):
                    pe(q, k, v, **keywords)


def _xpos_attention64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor
) -> torch.Tensor:
    """softmax(logits / sqrt(d)) v in float64 from ``_xpos_logits64``, one head, causal
    by the positions: q [N, d], k and v [M, d]."""
    logits = _xpos_logits64(q.double(), k.double(), q_pos, k_pos) / q.shape[-1] ** 0.5
    logits = logits.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return logits.softmax(-1) @ v.double()


def test_xpos_in_float16_keeps_its_factors_within_float16() -> None:
    """float16 holds up to 65504 (~e^11): rotated features carry factors up to e^8,
    6.4 * scale_base = 3269 positions from the reference (the middle of one call's keys,
    or 0 for a cache of rotated keys). Within that the output matches float64 (a cache
    of 3269 keys included); past it, ValueError naming float16 (a cache of 5000 keys
    held inf and decoding from it gave NaN; a call over 12000 keys gave NaN), and
    without a causal mask keys 6499 ahead (whose float16 logits went wrong by 3.4)."""
    pe = generated_class("rope_xpos")(heads=1, head_dim=16)
    generator = torch.Generator().manual_seed(7)
    half = torch.float16
    for m in (3270, 6500):  # a cache up to position 3269; one call 3250 each way
        q, k, v = (torch.randn(1, 1, n, 16, generator=generator) for n in (2, m, m))
        q_pos, k_pos = torch.arange(m - 2, m), torch.arange(m)
        want = _xpos_attention64(q[0, 0], k[0, 0], v[0, 0], q_pos, k_pos)
        got = pe(q.to(half), k.to(half), v.to(half), causal=True)
        torch.testing.assert_close(got[0, 0].double(), want, atol=2e-3, rtol=2e-3)
        if m == 3270:
            cache = pe.rotate_keys(k.to(half))
            assert bool(torch.isfinite(cache).all())
            got = pe(q.to(half), cache, v.to(half), causal=True, keys_rotated=True)
            torch.testing.assert_close(got[0, 0].double(), want, atol=2e-3, rtol=2e-3)
    x = torch.randn(1, 1, 5000, 16, generator=generator)
    with pytest.raises(
        ValueError, match="reaches 3269 positions .*cache of rotated keys in float16"
    ):
        pe.rotate_keys(x.to(half))
    assert bool(torch.isfinite(pe.rotate_keys(x)).all())  # float32 reaches 26158
    x = torch.randn(1, 1, 12000, 16, generator=generator).to(half)
    with pytest.raises(ValueError, match="reaches 3269 positions from the middle.*float16"):
        pe(x[:, :, :1], x, x, causal=True)
    x = x[:, :, :6500]
    with pytest.raises(ValueError, match="6499 positions after a query.*in float16"):
        pe(x, x, x)


# --------------------------------------------------------------------------- M-RoPE


def _qwen2_vl_reference(
    x: torch.Tensor, positions: torch.Tensor, sections: list[int], base: float
) -> torch.Tensor:
    """Hugging Face's apply_multimodal_rotary_pos_emb with float64 cos and sin."""
    qwen = pytest.importorskip("transformers.models.qwen2_vl.modeling_qwen2_vl")
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=F64) / d)
    angles = positions.to(F64)[..., None] * theta  # [3, B, N, d/2]
    emb = torch.cat((angles, angles), dim=-1)
    out, _ = qwen.apply_multimodal_rotary_pos_emb(x, x, emb.cos(), emb.sin(), sections)
    return out


def test_mrope_matches_qwen2_vl() -> None:
    pe = generated_class("rope_mrope")(heads=2, head_dim=128).double()
    x = torch.randn(2, 2, 6, 128, dtype=F64)
    positions = torch.stack(
        (
            torch.tensor([[0, 1, 2, 2, 2, 2], [0, 0, 0, 5, 6, 7]]),  # temporal
            torch.tensor([[0, 1, 2, 2, 3, 3], [0, 1, 2, 5, 6, 7]]),  # height
            torch.tensor([[0, 1, 2, 3, 2, 3], [0, 2, 1, 5, 6, 7]]),  # width
        )
    )
    want = _qwen2_vl_reference(x, positions, [16, 24, 24], 1e6)
    got, _ = pe.rotate(x, x, positions, positions)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_mrope_with_token_positions_is_plain_rope() -> None:
    mrope = generated_class("rope_mrope")(heads=2, head_dim=128).double()
    plain = spec_variant("rope", ("base: 10000\n", "base: 1000000\n"), name="rope_1e6")(
        heads=2, head_dim=128
    ).double()
    q, k, v = (torch.randn(1, 2, 5, 128, dtype=F64) for _ in range(3))
    positions = torch.tensor([3, 4, 5, 6, 7])
    for kwargs in ({}, {"q_positions": positions, "k_positions": positions}):
        torch.testing.assert_close(
            mrope(q, k, v, causal=True, **kwargs), plain(q, k, v, causal=True, **kwargs)
        )


@pytest.mark.parametrize("backend", ["eager", "sdpa", "auto"])
@pytest.mark.parametrize("name", ["rope_mrope", "rope_mrope_interleaved"])
def test_mrope_forward_with_axis_positions_agrees_across_backends(name: str, backend: str) -> None:
    """Axis positions rotate q and k; causal masking follows token order (as Qwen2-VL's
    and Qwen3-VL's)."""
    pe = generated_class(name)(heads=4, head_dim=128)
    q = torch.randn(2, 4, 6, 128, requires_grad=True)
    k = torch.randn(2, 2, 6, 128, requires_grad=True)  # GQA
    v = torch.randn(2, 2, 6, 16)
    positions = torch.stack([torch.tensor([[0, 1, 1, 1, 1, 2]] * 2)] * 3)
    positions[1, :, 1:5] = torch.tensor([0, 0, 1, 1])
    positions[2, :, 1:5] = torch.tensor([0, 1, 0, 1])
    out = pe(q, k, v, q_positions=positions, k_positions=positions, causal=True, backend=backend)
    rq, rk = pe.rotate(q, k, positions, positions)
    rk = rk.repeat_interleave(2, dim=1)
    logits = rq @ rk.transpose(-1, -2) / math.sqrt(128)
    logits = logits.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    want = logits.softmax(-1) @ v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(out.sum(), (q, k))
    want_grads = torch.autograd.grad(want.sum(), (q, k))
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_mrope_refuses_malformed_axis_positions() -> None:
    pe = generated_class("rope_mrope")(heads=2, head_dim=128)
    x = torch.randn(1, 2, 4, 128)
    with pytest.raises(ValueError, match=r"q_positions must have shape \[3, batch, 4\]"):
        pe(x, x, x, q_positions=torch.zeros(2, 1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="k_positions must also be"):
        pe(x, x, x, q_positions=torch.zeros(3, 1, 4, dtype=torch.long), k_positions=torch.arange(4))
    with pytest.raises(ValueError, match="must sum to the 32 rotated pairs"):
        type(pe)(heads=2, head_dim=64)


def _qwen3_vl_reference(
    x: torch.Tensor, positions: torch.Tensor, sections: list[int], base: float
) -> torch.Tensor:
    """Hugging Face's Qwen3-VL rotation in float64: its apply_interleaved_mrope over the
    angles of every axis, then apply_rotary_pos_emb."""
    qwen = pytest.importorskip("transformers.models.qwen3_vl.modeling_qwen3_vl")
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=F64) / d)
    angles = positions.to(F64)[..., None] * theta  # [3, B, N, d/2]
    # the method reads nothing of its module: called unbound on the float64 angles
    dealt = qwen.Qwen3VLTextRotaryEmbedding.apply_interleaved_mrope(None, angles, sections)
    emb = torch.cat((dealt, dealt), dim=-1)  # [B, N, d]
    out, _ = qwen.apply_rotary_pos_emb(x, x, emb.cos(), emb.sin())
    return out


def _grid_positions(batch: int) -> torch.Tensor:
    """[3, batch, 10]: two text tokens, a 2 x 3 image (rows on axis 1, columns on axis 2)
    and two more text tokens, each row of the batch shifted by its index."""
    text = torch.tensor([0, 1, 2, 2, 2, 2, 2, 2, 5, 6])
    rows = torch.tensor([0, 1, 2, 2, 2, 3, 3, 3, 5, 6])
    columns = torch.tensor([0, 1, 2, 3, 4, 2, 3, 4, 5, 6])
    shift = torch.arange(batch)[:, None]
    return torch.stack([axis + shift for axis in (text, rows, columns)])


def test_interleaved_mrope_matches_qwen3_vl() -> None:
    pe = generated_class("rope_mrope_interleaved")(heads=2, head_dim=128).double()
    x = torch.randn(2, 2, 10, 128, dtype=F64)
    positions = _grid_positions(2)
    want = _qwen3_vl_reference(x, positions, [24, 20, 20], 5e6)
    got, _ = pe.rotate(x, x, positions, positions)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # the layout matters: Qwen2-VL's runs of pairs turn the image tokens otherwise
    runs = _qwen2_vl_reference(x, positions, [24, 20, 20], 5e6)
    assert (got - runs).abs().max() > 0.1


def test_interleaved_mrope_matches_qwen3_vl_rotary_module() -> None:
    """Against Hugging Face's own Qwen3VLTextRotaryEmbedding (float32 angles, as it
    computes them) with a published config's rope_scaling: small sections, small base."""
    qwen = pytest.importorskip("transformers.models.qwen3_vl.modeling_qwen3_vl")
    config = qwen.Qwen3VLTextConfig(
        head_dim=16, hidden_size=64, num_attention_heads=4, rope_theta=100.0,
        rope_scaling={"rope_type": "default", "mrope_section": [4, 2, 2],
                      "mrope_interleaved": True},
    )  # fmt: skip
    hf = qwen.Qwen3VLTextRotaryEmbedding(config)
    pe = spec_variant(
        "rope_mrope_interleaved",
        ("base: 5000000\n", "base: 100\n"),
        ("sections: [24, 20, 20]", "sections: [4, 2, 2]"),
        ("head_dim: 128", "head_dim: 16"),
        name="rope_mrope_interleaved_small",
    )(heads=4, head_dim=16)
    x = torch.randn(3, 4, 10, 16)
    positions = _grid_positions(3)
    cos, sin = hf(x, positions)
    want, _ = qwen.apply_rotary_pos_emb(x, x, cos, sin)
    got, _ = pe.rotate(x, x, positions, positions)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_interleaved_sections_deal_the_pairs_in_turn() -> None:
    """Axis a >= 1 of n owns pairs a, a + n, ... while it has pairs left; axis 0 the rest:
    angles equal to their axis's index come out as each pair's owner."""

    def owners(sections: tuple[int, ...]) -> tuple[int, ...]:
        count, pairs = len(sections), sum(sections)
        angles = torch.arange(count, dtype=F64).view(count, 1, 1).expand(count, 2, pairs)
        dealt = position_axes.angles_by_axis(angles, sections, interleaved=True)  # [2, pairs]
        assert bool((dealt[0] == dealt[1]).all())
        return tuple(int(axis) for axis in dealt[0])

    assert owners((4, 2, 2)) == (0, 1, 2, 0, 1, 2, 0, 0)
    assert owners((2, 2, 2)) == (0, 1, 2, 0, 1, 2)
    assert owners((3, 3)) == (0, 1, 0, 1, 0, 1)
    assert owners((24, 20, 20)) == (0, 1, 2) * 20 + (0,) * 4


# --------------------------------------------------------------------------- every new spec


@pytest.mark.parametrize(
    "name",
    [
        "rope_linear",
        "rope_ntk",
        "rope_dynamic_ntk",
        "rope_yarn",
        "rope_llama3",
        "rope_longrope",
        "rope_partial",
        "rope_p",
        "rope_xpos",
    ],
)
def test_sdpa_agrees_with_eager_including_gradients(name: str) -> None:
    pe = generated_class(name)(heads=4)
    d = pe.head_dim
    q = torch.randn(2, 4, 5, d, requires_grad=True)
    k = torch.randn(2, 2, 7, d, requires_grad=True)
    v = torch.randn(2, 2, 7, 8)
    for kwargs in ({}, {"q_positions": torch.arange(10, 15), "k_positions": torch.arange(8, 15)}):
        for causal in (False, True):
            eager = pe(q, k, v, causal=causal, backend="eager", **kwargs)
            sdpa = pe(q, k, v, causal=causal, backend="sdpa", **kwargs)
            torch.testing.assert_close(sdpa, eager, rtol=1e-5, atol=1e-5)
            for a, b in zip(
                torch.autograd.grad(eager.sum(), (q, k)),
                torch.autograd.grad(sdpa.sum(), (q, k)),
                strict=True,
            ):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- expressions

STANDARD = "      pairing: half              # feature k pairs with k + d/2\n"


def _expr_rope(expr: str, name: str) -> type[torch.nn.Module]:
    frequencies = f'      frequencies: {{kind: expr, expr: "{expr}"}}\n'
    return spec_variant("rope", (STANDARD, STANDARD + frequencies), name=name)


def test_an_expression_schedule_equals_the_built_in_kinds() -> None:
    x = torch.randn(2, 8, 5, 64, dtype=F64)
    positions = torch.tensor([0, 1, 9, 1000, 77777])
    for expr, kind in (
        ("base ** (-2 * k / d)", "rope"),
        ("base ** (-2 * k / d) / 4", "rope_linear"),
    ):
        cls = _expr_rope(expr, f"rope_expr_{kind}")
        got = cls().double().rotate(x, x, positions, positions)
        want = generated_class(kind)().double().rotate(x, x, positions, positions)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_schedule_that_is_not_finite_is_refused_at_construction() -> None:
    """The spec is checked at its own head_dim (64); the module checks its own."""
    cls = _expr_rope("base ** (-2 * k / d) / (d - 32)", "rope_expr_pole")  # infinite at d = 32
    x = torch.randn(1, 2, 3, 64, dtype=F64)
    rotated, _ = cls().double().rotate(x, x)  # finite at head_dim 64
    assert torch.isfinite(rotated).all()
    with pytest.raises(ValueError, match="not finite for rotary_dim 32"):
        cls(head_dim=32)


def test_a_schedule_that_is_not_finite_at_the_specs_head_dim_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match=r"the frequency is nan at pair k = 0 \(d = 64"):
        _expr_rope("log(k - 1)", "rope_expr_nan")  # log(-1) at k = 0


@pytest.mark.parametrize(
    ("expr", "column", "message"),
    [
        ("base ** (-2 * i / d)", 15, "unknown name 'i'; allowed names: k, d, base"),
        ("k.exp()", 1, "attribute access is not allowed"),
        ("base ** (-2 / d)", 1, "must depend on the pair index k"),
        ("__import__('os')", 1, "unknown function '__import__'"),
    ],
)
def test_refused_frequency_expressions_name_file_line_and_column(
    expr: str, column: int, message: str, tmp_path: Any
) -> None:
    from click.testing import CliRunner

    from posgen.cli import main

    text = (ROOT_SPECS / "rope.yaml").read_text(encoding="utf-8")
    line = f'      frequencies: {{kind: expr, expr: "{expr}"}}\n'
    text = text.replace(STANDARD, STANDARD + line).replace("name: rope\n", "name: bad\n")
    (tmp_path / "bad.yaml").write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["generate", str(tmp_path / "bad.yaml"), "--out", str(out)])
    assert result.exit_code == 2, result.output
    row = text.splitlines().index(line.rstrip("\n")) + 1
    col = line.index('"') + 1 + column
    assert f"bad.yaml:{row}:{col}: " in result.output and message in result.output
    assert "Traceback" not in result.output and not out.exists()


# --------------------------------------------------------------------------- 2-D axial


def _axial64(x: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor, base: float) -> torch.Tensor:
    """Heo et al. 2024's axial RoPE in complex form, float64: pairs (2p, 2p + 1); the first
    d/4 pairs turn by column·f_t, the last d/4 by row·f_t, f_t = base^(-4t/d)."""
    d = x.shape[-1]
    f = base ** (-4 * torch.arange(d // 4, dtype=F64) / d)
    phases = torch.cat((cols.to(F64)[:, None] * f, rows.to(F64)[:, None] * f), dim=-1)
    z = torch.view_as_complex(x.to(F64).reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(phases), phases)).flatten(-2)


def test_only_two_axes_offer_grid_positions() -> None:
    """grid_positions gives (column, row) pairs, [2, 1, H * W]: an axial rotation over
    4 axes takes [4, batch, N] and would refuse them, so it has no such helper."""
    four_axes = spec_variant(
        "rope_axial_2d",
        ("axes: {kind: axial, count: 2}", "axes: {kind: axial, count: 4}"),
        ("head_dim: 64}", "head_dim: 48}"),
        name="rope_axial_4d",
    )
    assert not hasattr(four_axes, "grid_positions")
    assert hasattr(generated_class("rope_axial_2d"), "grid_positions")


def test_axial_rope_matches_the_papers_formula_on_a_patch_grid() -> None:
    cls = generated_class("rope_axial_2d")
    pe = cls(heads=2, head_dim=64).double()
    grid = cls.grid_positions(3, 5)  # [2, 1, 15]: (column, row)
    assert grid.shape == (2, 1, 15) and grid[:, 0, 7].tolist() == [2, 1]
    x = torch.randn(1, 2, 15, 64, dtype=F64)
    got, _ = pe.rotate(x, x, grid, grid)
    want = _axial64(x, grid[0, 0], grid[1, 0], 100.0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_axial_rope_is_relative_in_each_axis() -> None:
    """Shifting every row (or column) by the same amount leaves the logits unchanged."""
    cls = generated_class("rope_axial_2d")
    pe = cls(heads=1, head_dim=32).double()
    q, k = torch.randn(1, 1, 6, 32, dtype=F64), torch.randn(1, 1, 6, 32, dtype=F64)
    grid = cls.grid_positions(2, 3)
    base_logits = pe.scores(q, k, q_positions=grid, k_positions=grid)
    for shift in (torch.tensor([[[7]], [[0]]]), torch.tensor([[[0]], [[11]]])):
        moved = grid + shift
        shifted = pe.scores(q, k, q_positions=moved, k_positions=moved)
        torch.testing.assert_close(shifted, base_logits, rtol=1e-10, atol=1e-10)
    swapped = grid.flip(0)  # rows and columns exchanged: different logits
    assert not torch.allclose(
        pe.scores(q, k, q_positions=swapped, k_positions=swapped), base_logits
    )


def test_axial_positions_may_be_given_as_coordinates() -> None:
    """[batch, N, 2] (x, y) coordinates equal the same positions as [2, batch, N]."""
    cls = generated_class("rope_axial_2d")
    pe = cls(heads=2, head_dim=32).double()
    q, k, v = (torch.randn(1, 2, 6, 32, dtype=F64) for _ in range(3))
    grid = cls.grid_positions(2, 3)  # [2, 1, 6]
    coordinates = grid.permute(1, 2, 0)  # [1, 6, 2]
    for backend in ("eager", "sdpa", "flex"):
        want = pe(q, k, v, q_positions=grid, k_positions=grid, backend=backend)
        got = pe(q, k, v, q_positions=coordinates, k_positions=coordinates, backend=backend)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"\[2, batch, 6\] .* or \[batch, 6, 2\]"):
        pe(q, k, v, q_positions=torch.zeros(1, 6, 3, dtype=torch.long))


@pytest.mark.parametrize(
    "name", ["rope", "rope_gptj", "rope_partial", "rope_xpos", "rope_mrope", "rope_yarn"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_in_place_inference_rotation_equals_the_autograd_one(
    name: str, dtype: torch.dtype
) -> None:
    """Without autograd the pairs are written into one output; with it, the composed
    ops run. Both give the same rotation (both pairings, partial, scaled, batched)."""
    pe = generated_class(name)(heads=2, head_dim=head_dim_for(name, 64))
    d = pe.head_dim
    q = torch.randn(2, 2, 6, d, dtype=dtype)
    positions = torch.tensor([[3, 4, 5, 6, 7, 8], [0, 2, 4, 6, 8, 10]])
    for kwargs in ({}, {"q_positions": positions, "k_positions": positions}):
        with torch.no_grad():
            fast_q, fast_k = pe.rotate(q, q, **kwargs)
        graph_q, graph_k = pe.rotate(q.clone().requires_grad_(), q, **kwargs)
        assert graph_q.requires_grad and fast_q.dtype == dtype
        tolerance = {"rtol": 1.6e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {}
        torch.testing.assert_close(fast_q, graph_q.detach(), **tolerance)
        torch.testing.assert_close(fast_k, graph_k.detach(), **tolerance)
