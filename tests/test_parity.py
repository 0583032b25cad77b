"""Generated modules against the independent float64 references of tests/reference/.

Each reference is written from the paper (literal loops, scalar math), so agreement here
checks two independent derivations. Variants of a spec (other pairing, other bucket
direction, other layout) are built in memory from an edited copy of the catalogue spec.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import generated_class, spec_variant
from tests.reference import formulas as ref

F64 = torch.float64


def random_qkv(heads: int, n: int, m: int, dim: int, value_dim: int = 5, batch: int = 2):
    q = torch.randn(batch, heads, n, dim, dtype=F64)
    k = torch.randn(batch, heads, m, dim, dtype=F64)
    v = torch.randn(batch, heads, m, value_dim, dtype=F64)
    return q, k, v


# ------------------------------------------------------------------------------ sinusoidal


@pytest.mark.parametrize("model_dim", [2, 8, 512])
def test_sinusoidal_embed_matches_vaswani_table(model_dim: int) -> None:
    pe = generated_class("sinusoidal")(model_dim=model_dim)
    last = 65_535 if model_dim <= 8 else 4096  # the reference is a Python loop per entry
    positions = torch.tensor([0, 1, 2, 17, 511, last])
    x = torch.zeros(1, len(positions), model_dim, dtype=F64)
    table = pe.embed(x, positions)[0]
    expected = ref.sinusoidal_table(last + 1, model_dim)[positions]
    torch.testing.assert_close(table, expected, atol=1e-10, rtol=0)


def test_sinusoidal_split_layout_is_the_column_permutation() -> None:
    pe = spec_variant(
        "sinusoidal", ("layout: interleaved", "layout: split"), name="sinusoidal_split"
    )(model_dim=16)
    x = torch.zeros(1, 40, 16, dtype=F64)
    interleaved = ref.sinusoidal_table(40, 16)
    sines_then_cosines = torch.cat((interleaved[:, 0::2], interleaved[:, 1::2]), dim=-1)
    torch.testing.assert_close(pe.embed(x)[0], sines_then_cosines, atol=1e-12, rtol=0)


def test_sinusoidal_embed_adds_to_content_and_keeps_dtype() -> None:
    pe = generated_class("sinusoidal")(model_dim=8)
    x = torch.randn(3, 6, 8)
    out = pe.embed(x)
    assert out.dtype == torch.float32
    expected = x.double() + ref.sinusoidal_table(6, 8)
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------ learned absolute


def test_learned_embed_is_a_table_lookup() -> None:
    pe = generated_class("learned_absolute")(model_dim=12).double()
    x = torch.randn(2, 5, 12, dtype=F64)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    weight = pe.position_embeddings.weight.detach()
    expected = torch.stack([x[b] + weight[positions[b]] for b in range(2)])
    torch.testing.assert_close(pe.embed(x, positions), expected, atol=0, rtol=0)
    with pytest.raises(ValueError, match="out of range"):
        pe.embed(x, positions + pe.max_positions - 5)


# ------------------------------------------------------------------------------ RoPE


@pytest.mark.parametrize(("name", "pairing"), [("rope", "half"), ("rope_gptj", "interleaved")])
def test_rotation_matches_reference(name: str, pairing: str) -> None:
    pe = generated_class(name)(heads=2, head_dim=16)
    q, k, _ = random_qkv(2, 6, 9, 16)
    q_positions = torch.tensor([3, 4, 5, 100, 4097, 1 << 20])
    k_positions = torch.arange(9) * 1000
    rotated_q, rotated_k = pe.rotate(q, k, q_positions, k_positions)
    base = 10000.0
    torch.testing.assert_close(
        rotated_q, ref.rope_apply(q, q_positions, base, pairing), atol=1e-9, rtol=0
    )
    torch.testing.assert_close(
        rotated_k, ref.rope_apply(k, k_positions, base, pairing), atol=1e-9, rtol=0
    )


@pytest.mark.parametrize(("name", "pairing"), [("rope", "half"), ("rope_gptj", "interleaved")])
def test_rotary_attention_matches_reference(name: str, pairing: str) -> None:
    pe = generated_class(name)(heads=3, head_dim=8)
    q, k, v = random_qkv(3, 4, 7, 8)
    out = pe(q, k, v, causal=True, backend="eager")
    q_positions, k_positions = torch.arange(3, 7), torch.arange(7)
    expected = ref.attention(
        ref.rope_apply(q, q_positions, 10000.0, pairing),
        ref.rope_apply(k, k_positions, 10000.0, pairing),
        v,
        causal_q_positions=q_positions,
        causal_k_positions=k_positions,
    )
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
    # the default-position cache path (float32) agrees to float32 precision
    out32 = pe(q.float(), k.float(), v.float(), causal=True, backend="sdpa")
    torch.testing.assert_close(out32.double(), expected, atol=2e-5, rtol=0)


def test_pairings_differ_by_the_fixed_permutation() -> None:
    half = generated_class("rope")(heads=2, head_dim=16)
    interleaved = generated_class("rope_gptj")(heads=2, head_dim=16)
    permutation = ref.half_to_interleaved_permutation(16)
    x, y, _ = random_qkv(2, 5, 5, 16)
    positions = torch.tensor([0, 1, 9, 300, 70_000])
    by_half, _ = half.rotate(x, y, positions, positions)
    by_interleaved, _ = interleaved.rotate(x[..., permutation], y, positions, positions)
    torch.testing.assert_close(by_interleaved, by_half[..., permutation], atol=1e-12, rtol=0)


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_partial_rotation_matches_reference(pairing: str) -> None:
    quarter = f"pairing: {pairing}\n      rotary_dims: {{fraction: 0.25, layout: leading}}"
    cls = spec_variant(
        "rope",
        ("pairing: half              # feature k pairs with k + d/2", quarter),
        name=f"rope_partial_{pairing}",
    )
    pe = cls(heads=2, head_dim=32)
    q, k, _ = random_qkv(2, 5, 5, 32)
    positions = torch.tensor([0, 2, 8, 1000, 123_456])
    rotated, _ = pe.rotate(q, k, positions, positions)
    expected = ref.rope_apply(q, positions, 10000.0, pairing, rotary_dim=8)
    torch.testing.assert_close(rotated, expected, atol=1e-9, rtol=0)


# ------------------------------------------------------------------------------ ALiBi


def test_alibi_slopes_for_every_head_count() -> None:
    cls = generated_class("alibi")
    for heads in range(1, 65):
        slopes = cls(heads=heads, head_dim=4).slopes.double()
        expected = torch.tensor(ref.alibi_slopes(heads), dtype=F64)
        torch.testing.assert_close(slopes, expected, atol=0, rtol=2**-23, msg=f"heads={heads}")


@pytest.mark.parametrize("name", ["alibi", "alibi_learned"])
def test_alibi_built_under_a_float64_default_holds_its_slopes_in_float64(name: str) -> None:
    """A module built under a float64 default dtype (as a float64 reference is) holds
    its slopes in float64, as parameters are made in torch's default dtype: they were
    float32 whatever the default, so with 12 heads (slopes that are not powers of two)
    the bias was off the float64 formula by float32 rounding."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    try:
        pe = generated_class(name)(heads=12, head_dim=8)
    finally:
        torch.set_default_dtype(default)
    assert pe.slopes.dtype == F64
    torch.testing.assert_close(pe.slopes, torch.tensor(ref.alibi_slopes(12), dtype=F64))
    positions = torch.arange(0, 300, 7)
    bias = pe.score_bias(positions, positions)
    torch.testing.assert_close(bias, ref.alibi_bias(12, positions, positions), rtol=1e-15, atol=0)


@pytest.mark.parametrize("heads", [1, 3, 8, 12])
def test_alibi_bias_and_attention_match_reference(heads: int) -> None:
    pe = generated_class("alibi")(heads=heads, head_dim=8)
    q_positions, k_positions = torch.tensor([0, 5, 9, 300]), torch.arange(0, 320, 20)
    bias = pe.score_bias(q_positions, k_positions)
    expected_bias = ref.alibi_bias(heads, q_positions, k_positions)
    torch.testing.assert_close(bias.double(), expected_bias, atol=0, rtol=2**-22)
    q, k, v = random_qkv(heads, 6, 11, 8)
    out = pe(q, k, v, causal=True, backend="eager")
    qp, kp = torch.arange(5, 11), torch.arange(11)
    expected = ref.attention(
        q, k, v, bias=ref.alibi_bias(heads, qp, kp), causal_q_positions=qp, causal_k_positions=kp
    )
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_alibi_bias_before_scale() -> None:
    before = ("placement: after_scale", "placement: before_scale")
    pe = spec_variant("alibi", before, name="alibi_inside")(heads=4, head_dim=16)
    q, k, v = random_qkv(4, 5, 5, 16)
    positions = torch.arange(5)
    out = pe(q, k, v, backend="eager")
    bias = ref.alibi_bias(4, positions, positions) / math.sqrt(16)
    torch.testing.assert_close(out, ref.attention(q, k, v, bias=bias), atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------ T5


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_bias_matches_reference_in_both_modes(bidirectional: bool) -> None:
    direction = ("bidirectional: true", f"bidirectional: {str(bidirectional).lower()}")
    name = "t5_both" if bidirectional else "t5_one_way"
    pe = spec_variant("t5", direction, name=name)(heads=3, head_dim=8).double()
    table = pe.relative_attention_bias.weight.detach()
    # distances up to 400 reach past max_distance 128 in both directions
    q_positions = torch.tensor([0, 1, 7, 15, 16, 40, 200, 400])
    k_positions = torch.arange(0, 401, 3)
    expected = ref.t5_bias(table, q_positions, k_positions, bidirectional, 32, 128)
    bias = pe.score_bias(q_positions, k_positions)
    torch.testing.assert_close(bias, expected, atol=0, rtol=0)
    q, k, v = random_qkv(3, 4, 9, 8)
    qp, kp = torch.arange(5, 9), torch.arange(9)
    out = pe(q, k, v, causal=not bidirectional, backend="eager")
    causal = {} if bidirectional else {"causal_q_positions": qp, "causal_k_positions": kp}
    reference_out = ref.attention(
        q, k, v, bias=ref.t5_bias(table, qp, kp, bidirectional, 32, 128), scale=1.0, **causal
    )
    torch.testing.assert_close(out, reference_out, atol=1e-10, rtol=0)


def test_t5_query_minus_key_sign_mirrors_the_buckets() -> None:
    flip = ("sign: key_minus_query", "sign: query_minus_key")
    pe = spec_variant("t5", flip, name="t5_flipped")(heads=2, head_dim=8).double()
    table = pe.relative_attention_bias.weight.detach()
    q_positions, k_positions = torch.tensor([3, 50]), torch.tensor([0, 3, 9, 100])
    # query_minus_key: bucket(i - j), the T5 recipe applied to the mirrored offset
    ks = k_positions.tolist()
    key_minus_query = ref.t5_bias(table, q_positions, k_positions, True, 32, 128)
    mirrored = torch.stack(
        [
            torch.stack([table[ref.t5_relative_bucket(qi - kj, True, 32, 128)] for kj in ks])
            for qi in q_positions.tolist()
        ]
    ).permute(2, 0, 1)
    torch.testing.assert_close(pe.score_bias(q_positions, k_positions), mirrored, atol=0, rtol=0)
    assert not torch.equal(mirrored, key_minus_query)
