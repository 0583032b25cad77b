"""Pin the independent reference formulas to values taken from outside the code.

Literal numbers come from the papers (ALiBi slopes), from the published recipes worked by hand
(T5 / DeBERTa buckets, ALiBi non-power-of-two heads) or from closed forms (sin/cos of simple
angles). Structural checks cover the properties each paper proves (RoPE's relative property,
rotation invariance of norms, the sinusoid's shift-as-rotation, ...).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.reference import formulas as ref

F64 = torch.float64


def _close(actual: torch.Tensor, expected: torch.Tensor | list, atol: float = 1e-12) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=F64), atol=atol, rtol=1e-12)


# ------------------------------------------------------------------------------ sinusoidal


def test_sinusoidal_position_zero_is_zero_one_alternating() -> None:
    table = ref.sinusoidal_table(3, 8)
    _close(table[0], [0.0, 1.0] * 4)


def test_sinusoidal_literal_values() -> None:
    # dim = 4, base = 10000: column pair 0 has frequency 1, pair 1 has 1/10000^(2/4) = 1/100.
    table = ref.sinusoidal_table(2, 4)
    # sin(1), cos(1), sin(0.01), cos(0.01)
    _close(
        table[1], [0.8414709848078965, 0.5403023058681398, 0.009999833334166664, 0.9999500004166653]
    )
    assert table.dtype == F64 and table.shape == (2, 4)


def test_sinusoidal_custom_base() -> None:
    # base = 4, dim = 4: frequencies 1 and 1/4^(1/2) = 1/2; position 2 -> angles 2 and 1.
    table = ref.sinusoidal_table(3, 4, base=4.0)
    _close(table[2], [math.sin(2.0), math.cos(2.0), math.sin(1.0), math.cos(1.0)])


def test_sinusoidal_shift_is_a_rotation() -> None:
    # Vaswani et al.: PE(pos + k) is a linear function of PE(pos): each (sin, cos) pair rotates.
    dim, k = 8, 5
    table = ref.sinusoidal_table(20, dim)
    for i in range(dim // 2):
        w = 1.0 / 10000.0 ** (2 * i / dim)
        c, s = math.cos(k * w), math.sin(k * w)
        for pos in range(10):
            sin_p, cos_p = table[pos, 2 * i].item(), table[pos, 2 * i + 1].item()
            assert table[pos + k, 2 * i].item() == pytest.approx(sin_p * c + cos_p * s, abs=1e-12)
            assert table[pos + k, 2 * i + 1].item() == pytest.approx(
                cos_p * c - sin_p * s, abs=1e-12
            )


def test_sinusoidal_odd_dim_rejected() -> None:
    with pytest.raises(ValueError):
        ref.sinusoidal_table(4, 7)


# ------------------------------------------------------------------------------ RoPE


def test_rope_frequencies_literal() -> None:
    # 10000^(-2k/8) for k = 0..3 = 1, 10^-1, 10^-2, 10^-3
    _close(ref.rope_frequencies(8, 10000.0), [1.0, 0.1, 0.01, 0.001], atol=1e-15)
    # base 2, rotary_dim 4: 2^0, 2^-1/2
    _close(ref.rope_frequencies(4, 2.0), [1.0, 2.0**-0.5], atol=1e-15)


def test_rope_two_dim_literal_rotation() -> None:
    # dim 2: theta_0 = 1, so position m rotates (a, b) by m radians.
    x = torch.tensor([[3.0, -2.0]], dtype=F64)  # [seq=1, dim=2]
    for pairing in ("interleaved", "half"):
        out = ref.rope_apply(x, torch.tensor([2]), 10000.0, pairing)
        expected = [
            3.0 * math.cos(2.0) + 2.0 * math.sin(2.0),
            3.0 * math.sin(2.0) - 2.0 * math.cos(2.0),
        ]
        _close(out[0], expected)


def test_rope_pairings_literal_dim4() -> None:
    # dim 4, base 100: theta = [1, 1/10]. Position 1.
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=F64)
    c0, s0, c1, s1 = math.cos(1.0), math.sin(1.0), math.cos(0.1), math.sin(0.1)
    inter = ref.rope_apply(x, torch.tensor([1]), 100.0, "interleaved")
    # pairs (x0, x1) @ theta0 and (x2, x3) @ theta1
    _close(inter[0], [1 * c0 - 2 * s0, 1 * s0 + 2 * c0, 3 * c1 - 4 * s1, 3 * s1 + 4 * c1])
    half = ref.rope_apply(x, torch.tensor([1]), 100.0, "half")
    # pairs (x0, x2) @ theta0 and (x1, x3) @ theta1
    _close(half[0], [1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 1 * s0 + 3 * c0, 2 * s1 + 4 * c1])


@pytest.mark.parametrize("pairing", ["interleaved", "half"])
def test_rope_identity_at_zero_and_norm_preserved(pairing: str) -> None:
    x = torch.randn(2, 3, 5, 8, dtype=F64)
    positions = torch.tensor([0, 1, 7, 100, 4096])
    out = ref.rope_apply(x, positions, 10000.0, pairing)
    _close(out[..., 0, :], x[..., 0, :])
    _close(out.norm(dim=-1), x.norm(dim=-1), atol=1e-10)
    # each rotated pair keeps its own norm too
    if pairing == "interleaved":
        pair_norm = lambda t: t[..., 0::2] ** 2 + t[..., 1::2] ** 2  # noqa: E731
    else:
        pair_norm = lambda t: t[..., :4] ** 2 + t[..., 4:] ** 2  # noqa: E731
    _close(pair_norm(out), pair_norm(x), atol=1e-10)


@pytest.mark.parametrize("pairing", ["interleaved", "half"])
def test_rope_relative_property(pairing: str) -> None:
    # RoFormer eq. (16): <R_m q, R_n k> depends only on m - n.
    q = torch.randn(1, 6, dtype=F64)
    k = torch.randn(1, 6, dtype=F64)

    def score(m: int, n: int) -> float:
        qm = ref.rope_apply(q, torch.tensor([m]), 500.0, pairing)
        kn = ref.rope_apply(k, torch.tensor([n]), 500.0, pairing)
        return float((qm * kn).sum())

    for delta in (0, 1, 5, -3):
        values = [score(n + delta, n) for n in (0, 4, 37, 1000)]
        for value in values[1:]:
            assert value == pytest.approx(values[0], abs=1e-10)
    assert score(3, 0) != pytest.approx(score(5, 0), abs=1e-6)


def test_rope_half_matches_rotate_half_closed_form() -> None:
    # Cross-check the complex-pair route against the usual NeoX formula
    # x * cos(m theta) + rotate_half(x) * sin(m theta), cos/sin tiled as [theta, theta].
    x = torch.randn(2, 4, 10, dtype=F64)
    positions = torch.tensor([0, 3, 9, 250])
    theta = ref.rope_frequencies(10, 10000.0)
    angles = positions.to(F64)[:, None] * torch.cat([theta, theta])[None, :]
    rotate_half = torch.cat([-x[..., 5:], x[..., :5]], dim=-1)
    expected = x * torch.cos(angles) + rotate_half * torch.sin(angles)
    _close(ref.rope_apply(x, positions, 10000.0, "half"), expected, atol=1e-12)


def test_rope_partial_rotary_passes_tail_through() -> None:
    x = torch.randn(3, 4, 10, dtype=F64)
    positions = torch.arange(4) * 11
    for pairing in ("interleaved", "half"):
        out = ref.rope_apply(x, positions, 10000.0, pairing, rotary_dim=4)
        _close(out[..., 4:], x[..., 4:], atol=0.0)
        _close(out[..., :4], ref.rope_apply(x[..., :4], positions, 10000.0, pairing))
        # rotary_dim 4 uses frequencies 10000^(-2k/4), not 10000^(-2k/10)
        _close(ref.rope_frequencies(4, 10000.0), [1.0, 0.01], atol=1e-15)


def test_half_to_interleaved_permutation_literal_and_identity() -> None:
    assert ref.half_to_interleaved_permutation(8) == [0, 4, 1, 5, 2, 6, 3, 7]
    assert ref.half_to_interleaved_permutation(2) == [0, 1]
    for dim in (2, 4, 8, 12):
        perm = ref.half_to_interleaved_permutation(dim)
        assert sorted(perm) == list(range(dim))
        x = torch.randn(2, 6, dim, dtype=F64)
        positions = torch.tensor([0, 1, 2, 17, 63, 999])
        lhs = ref.rope_apply(x[..., perm], positions, 10000.0, "interleaved")
        rhs = ref.rope_apply(x, positions, 10000.0, "half")[..., perm]
        _close(lhs, rhs)
    with pytest.raises(ValueError):
        ref.half_to_interleaved_permutation(5)


def test_rope_rejects_bad_arguments() -> None:
    x = torch.randn(3, 8, dtype=F64)
    with pytest.raises(ValueError):
        ref.rope_apply(x, torch.arange(3), 10000.0, "spiral")
    with pytest.raises(ValueError):
        ref.rope_apply(x, torch.arange(3), 10000.0, "half", rotary_dim=3)
    with pytest.raises(ValueError):
        ref.rope_apply(x, torch.arange(4), 10000.0, "half")


# ------------------------------------------------------------------------------ ALiBi


def test_alibi_slopes_8_heads_from_paper() -> None:
    # Press et al. 2022, Sec. 3: "For a model with 8 heads, the slopes that we used are the
    # geometric sequence: 1/2^1, 1/2^2, ..., 1/2^8."
    assert ref.alibi_slopes(8) == [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256]


def test_alibi_slopes_16_heads_from_paper() -> None:
    # "For models that require 16 heads, we interpolate those 8 slopes by geometrically
    # averaging every consecutive pair, resulting in the geometric sequence that starts at
    # 1/sqrt(2) and has the ratio of 1/sqrt(2)."
    expected = [2.0 ** (-0.5 * (h + 1)) for h in range(16)]
    assert ref.alibi_slopes(16) == pytest.approx(expected, rel=1e-14)
    assert ref.alibi_slopes(16)[1::2] == pytest.approx(ref.alibi_slopes(8), rel=1e-14)


def test_alibi_slopes_12_heads_by_recipe() -> None:
    # Official recipe: closest lower power of two c = 8 -> 2^-1 .. 2^-8; then the 16-head
    # sequence 2^-0.5, 2^-1, 2^-1.5, ..., take indices 0, 2, 4, 6 -> 2^-0.5, 2^-1.5, 2^-2.5,
    # 2^-3.5 (12 - 8 = 4 of them).
    expected = [2.0**-e for e in (1, 2, 3, 4, 5, 6, 7, 8, 0.5, 1.5, 2.5, 3.5)]
    assert ref.alibi_slopes(12) == pytest.approx(expected, rel=1e-14)


def test_alibi_slopes_small_and_odd_counts_by_recipe() -> None:
    # n = 1: start = 2^(-8/1).
    assert ref.alibi_slopes(1) == [2.0**-8]
    # n = 2: 2^-4, 2^-8.  n = 4: 2^-2, 2^-4, 2^-6, 2^-8.
    assert ref.alibi_slopes(2) == [2.0**-4, 2.0**-8]
    # n = 6: c = 4 -> 1/4, 1/16, 1/64, 1/256; 8-head sequence at indices 0, 2 -> 1/2, 1/8.
    assert ref.alibi_slopes(6) == [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8]
    # n = 3: c = 2 -> 2^-4, 2^-8; 4-head sequence index 0 -> 2^-2.
    assert ref.alibi_slopes(3) == [2.0**-4, 2.0**-8, 2.0**-2]
    with pytest.raises(ValueError):
        ref.alibi_slopes(0)


def test_alibi_bias_literal() -> None:
    bias = ref.alibi_bias(2, torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2, 3]))
    # slopes for 2 heads: 1/16, 1/256
    assert bias.shape == (2, 3, 4) and bias.dtype == F64
    _close(bias[0, 2], [-2 / 16, -1 / 16, 0.0, -1 / 16])
    _close(bias[1, 0], [0.0, -1 / 256, -2 / 256, -3 / 256])
    # causal rows equal the paper's m * [-(i-1), ..., -1, 0] after masking
    _close(bias[0, 2, :3], [-(2 / 16), -(1 / 16), 0.0])


# ------------------------------------------------------------------------------ T5


@pytest.mark.parametrize(
    ("rel", "bucket"),
    [
        # bidirectional, 32 buckets, max_distance 128: half = 16, max_exact = 8
        (0, 0),
        (-1, 1),
        (-7, 7),  # still exact
        (-8, 8),  # 8 + floor(log(1) ...) = 8
        (-15, 9),  # 8 + floor(ln(15/8)/ln(16)*8) = 8 + floor(0.6286/2.7726*8 = 1.81) = 9
        (-16, 10),  # 8 + ln(2)/ln(16)*8 = 8 + 2
        (-127, 15),  # 8 + floor(ln(15.875)/ln(16)*8 = 7.98) = 15
        (-128, 15),  # 8 + 8 = 16 -> capped at 15
        (-1000, 15),
        (1, 17),  # positive (key after query) -> offset 16
        (7, 23),
        (16, 26),
        (20, 26),  # 16 + 8 + floor(ln(2.5)/ln(16)*8 = 2.64) = 26
        (1000, 31),
    ],
)
def test_t5_bucket_bidirectional_hand_values(rel: int, bucket: int) -> None:
    assert ref.t5_relative_bucket(rel, True, 32, 128) == bucket


@pytest.mark.parametrize(
    ("rel", "bucket"),
    [
        # unidirectional, 32 buckets, max_distance 128: half = 32, max_exact = 16
        (5, 0),  # future keys all map to bucket 0
        (1000, 0),
        (0, 0),
        (-5, 5),
        (-15, 15),
        (-16, 16),
        (-32, 21),  # 16 + floor(ln(2)/ln(8)*16 = 5.33) = 21
        (-100, 30),  # 16 + floor(ln(6.25)/ln(8)*16 = 14.10) = 30
        (-128, 31),  # 16 + 16 = 32 -> capped at 31
    ],
)
def test_t5_bucket_unidirectional_hand_values(rel: int, bucket: int) -> None:
    assert ref.t5_relative_bucket(rel, False, 32, 128) == bucket


def test_t5_bucket_is_monotone_and_in_range() -> None:
    for bidirectional in (True, False):
        previous = 0
        for n in range(0, 400):
            bucket = ref.t5_relative_bucket(-n, bidirectional, 32, 128)
            assert 0 <= bucket < (16 if bidirectional else 32)
            assert bucket >= previous
            previous = bucket


def test_t5_bias_is_table_lookup() -> None:
    table = torch.arange(32 * 3, dtype=F64).reshape(32, 3)
    bias = ref.t5_bias(table, torch.tensor([0, 20]), torch.tensor([0, 4, 40]), True, 32, 128)
    assert bias.shape == (3, 2, 3)
    # (q=20, k=0): rel -20 -> 8 + floor(ln(2.5)/ln(16)*8) = 10; (q=0, k=40): rel 40 ->
    # 16 + 8 + floor(ln(5)/ln(16)*8 = 4.64) = 28; (q=0, k=4): 16 + 4 = 20.
    _close(bias[:, 1, 0], table[10])
    _close(bias[:, 0, 2], table[28])
    _close(bias[:, 0, 1], table[20])
    _close(bias[:, 0, 0], table[0])


# ------------------------------------------------------------------------------ attention


def test_attention_matches_torch_sdpa() -> None:
    q = torch.randn(2, 3, 5, 4, dtype=F64)
    k = torch.randn(2, 3, 6, 4, dtype=F64)
    v = torch.randn(2, 3, 6, 7, dtype=F64)
    bias = torch.randn(3, 5, 6, dtype=F64)
    out = ref.attention(q, k, v, bias=bias, scale=0.3)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.3)
    _close(out, expected, atol=1e-12)


def test_attention_causal_mask_uses_positions() -> None:
    q = torch.randn(1, 2, 4, 3, dtype=F64)
    k = torch.randn(1, 2, 4, 3, dtype=F64)
    v = torch.randn(1, 2, 4, 3, dtype=F64)
    pos = torch.arange(4)
    out = ref.attention(q, k, v, causal_q_positions=pos, causal_k_positions=pos)
    _close(out[..., 0, :], v[..., 0, :])  # first query sees only key 0
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    _close(out, expected, atol=1e-12)
    # decoding with a cache: one query at position 3 sees every key
    last = ref.attention(
        q[..., 3:, :], k, v, causal_q_positions=torch.tensor([3]), causal_k_positions=pos
    )
    _close(last, out[..., 3:, :], atol=1e-12)


def test_attention_zero_query_averages_values() -> None:
    v = torch.randn(1, 1, 5, 2, dtype=F64)
    out = ref.attention(torch.zeros(1, 1, 2, 3, dtype=F64), torch.randn(1, 1, 5, 3, dtype=F64), v)
    _close(out[0, 0, 0], v[0, 0].mean(dim=0))


# ------------------------------------------------------------------------------ Shaw


def test_shaw_zero_relations_is_plain_attention() -> None:
    q, k, v = (torch.randn(2, 3, 5, 4, dtype=F64) for _ in range(3))
    zeros = torch.zeros(5, 4, dtype=F64)
    out = ref.shaw_relative_attention(q, k, v, zeros, zeros, clip=2)
    _close(out, ref.attention(q, k, v), atol=1e-12)
    out_c = ref.shaw_relative_attention(q, k, v, zeros, zeros, clip=2, causal=True)
    pos = torch.arange(5)
    _close(out_c, ref.attention(q, k, v, causal_q_positions=pos, causal_k_positions=pos))


def test_shaw_clip_indexing_by_hand() -> None:
    # k = 0 and rel_k = 0 make attention uniform (1/4 per key); rel_v rows are one-hot, so z_i
    # counts which clipped relative index each key used. clip = 1, N = M = 4.
    n, c = 4, 1
    q = torch.randn(n, 3, dtype=F64)
    k = torch.zeros(n, 3, dtype=F64)
    v = torch.zeros(n, 3, dtype=F64)
    rel_k = torch.zeros(3, 3, dtype=F64)
    rel_v = torch.eye(3, dtype=F64)
    z = ref.shaw_relative_attention(q, k, v, rel_k, rel_v, clip=c)
    # i = 0: j - i = 0, 1, 2, 3 -> idx 1, 2, 2, 2
    _close(z[0], [0.0, 0.25, 0.75])
    # i = 1: j - i = -1, 0, 1, 2 -> idx 0, 1, 2, 2
    _close(z[1], [0.25, 0.25, 0.5])
    # i = 3: j - i = -3, -2, -1, 0 -> idx 0, 0, 0, 1
    _close(z[3], [0.75, 0.25, 0.0])


def test_shaw_constant_relation_shifts_values_only() -> None:
    # clip = 0: a single relation vector for every pair. Adding w to every key adds q_i.w to a
    # whole row of logits (softmax-invariant); adding w_v to every value shifts z_i by w_v.
    q, k, v = (torch.randn(1, 2, 4, 3, dtype=F64) for _ in range(3))
    w_k = torch.randn(1, 3, dtype=F64)
    w_v = torch.randn(1, 3, dtype=F64)
    out = ref.shaw_relative_attention(q, k, v, w_k, w_v, clip=0)
    _close(out, ref.attention(q, k, v) + w_v[0], atol=1e-12)


# ------------------------------------------------------------------------------ DeBERTa


@pytest.mark.parametrize(
    ("rel", "bucket"),
    [
        # bucket_size 256, max_position 512 (DeBERTa-v3 defaults): mid = 128,
        # log((512 - 1)/128) = ln(3.9921875) = 1.38434
        (0, 0),
        (5, 5),
        (-128, -128),  # |r| <= mid: unchanged
        (128, 128),
        (129, 129),  # 128 + ceil(ln(129/128)/1.38434*127 = 0.714) = 129
        (-130, -130),  # 128 + ceil(ln(130/128)/1.38434*127 = 1.42) = 130
        (256, 192),  # 128 + ceil(ln(2)/1.38434*127 = 63.59) = 192
        (511, 255),  # 128 + ceil(127) = 255
        (-511, -255),
        (1000, 317),  # 128 + ceil(ln(7.8125)/1.38434*127 = 188.59) = 317 (not clipped here)
    ],
)
def test_deberta_log_bucket_hand_values(rel: int, bucket: int) -> None:
    assert ref.deberta_log_bucket_position(rel, 256, 512) == bucket


def test_deberta_without_buckets_is_identity_and_odd() -> None:
    assert ref.deberta_log_bucket_position(-700, -1, 512) == -700
    for r in range(1, 600, 7):
        assert ref.deberta_log_bucket_position(-r, 64, 256) == -ref.deberta_log_bucket_position(
            r, 64, 256
        )


# ------------------------------------------------------------------------------ Transformer-XL


def test_transformer_xl_relative_sinusoid_layout() -> None:
    # dim 4: frequencies 1 and 1/100; [sin | cos] concatenated.
    r = ref.transformer_xl_relative_sinusoid(torch.tensor([0.0, 2.0]), 4)
    _close(r[0], [0.0, 0.0, 1.0, 1.0])
    _close(r[1], [math.sin(2.0), math.sin(0.02), math.cos(2.0), math.cos(0.02)])


def test_transformer_xl_scores_scalar_by_hand() -> None:
    # d = 1, mlen = 1, N = 1 (query at absolute position 1), M = 2 keys at positions 0, 1.
    q = torch.tensor([[2.0]], dtype=F64)
    k = torch.tensor([[3.0], [5.0]], dtype=F64)
    r = torch.tensor([[7.0], [11.0]], dtype=F64)  # distances 0 and 1
    u = torch.tensor([0.5], dtype=F64)
    v = torch.tensor([-1.0], dtype=F64)
    scores = ref.transformer_xl_scores(q, k, r, u, v, mlen=1)
    # j = 0: distance 1 -> a = 2*3, b = 2*11, c = 0.5*3, d = -11  -> 6 + 22 + 1.5 - 11 = 18.5
    # j = 1: distance 0 -> a = 2*5, b = 2*7,  c = 0.5*5, d = -7   -> 10 + 14 + 2.5 - 7 = 19.5
    _close(scores, [[18.5, 19.5]])


def test_transformer_xl_scores_factorised_form_and_mask() -> None:
    # (a)+(b)+(c)+(d) = (q_i + u).k_j + (q_i + v).r_{i-j}  (the authors' AC + BD route).
    heads, n, mlen, d = 2, 3, 2, 4
    m = mlen + n
    q = torch.randn(1, heads, n, d, dtype=F64)
    k = torch.randn(1, heads, m, d, dtype=F64)
    r = torch.randn(heads, m, d, dtype=F64)
    u = torch.randn(heads, d, dtype=F64)
    v = torch.randn(heads, d, dtype=F64)
    scores = ref.transformer_xl_scores(q, k, r, u, v, mlen=mlen, scale=0.5)
    for i in range(n):
        for j in range(m):
            t = mlen + i - j
            if t < 0:
                assert torch.isinf(scores[..., i, j]).all()
                continue
            expected = ((q[..., i, :] + u) * k[..., j, :]).sum(-1) + (
                (q[..., i, :] + v) * r[:, t, :]
            ).sum(-1)
            _close(scores[..., i, j], 0.5 * expected)


# ------------------------------------------------------------------------------ hierarchical


def test_hierarchical_position_by_hand() -> None:
    u = torch.eye(2, dtype=F64)  # n = 2
    alpha = 0.4
    _close(ref.hierarchical_position(u, 0, alpha), [1.0, 0.0])  # i=0, j=0
    _close(ref.hierarchical_position(u, 1, alpha), [0.4, 0.6])  # i=0, j=1
    _close(ref.hierarchical_position(u, 2, alpha), [0.6, 0.4])  # i=1, j=0
    _close(ref.hierarchical_position(u, 3, alpha), [0.0, 1.0])  # i=1, j=1
    with pytest.raises(ValueError):
        ref.hierarchical_position(u, 4, alpha)


def test_hierarchical_basis_reproduces_trained_positions() -> None:
    p = torch.randn(6, 5, dtype=F64)
    u = ref.hierarchical_basis_from_absolute(p, 0.4)
    for j in range(6):
        _close(ref.hierarchical_position(u, j, 0.4), p[j])
    # positions beyond n are new, distinct vectors
    q7, q11 = ref.hierarchical_position(u, 7, 0.4), ref.hierarchical_position(u, 11, 0.4)
    assert not torch.allclose(q7, q11)


# ------------------------------------------------------------------------------ complex order


def test_complex_order_embedding_by_hand() -> None:
    r = torch.tensor([2.0, 1.0], dtype=F64)
    omega = torch.tensor([math.pi / 2, 0.0], dtype=F64)
    theta = torch.tensor([0.0, math.pi], dtype=F64)
    real, imag = ref.complex_order_embedding(r, omega, theta, torch.tensor([0, 1]))
    # pos 0: 2 e^{0} = 2, 1 e^{i pi} = -1;  pos 1: 2 e^{i pi/2} = 2i, -1
    _close(real, [[2.0, -1.0], [0.0, -1.0]], atol=1e-15)
    _close(imag, [[0.0, 0.0], [2.0, 0.0]], atol=1e-15)


def test_complex_order_embedding_shift_is_phase_rotation() -> None:
    # Wang et al. 2020: f(j, pos + n) = f(j, pos) * e^{i omega n}, a linear transform in pos.
    seq, d, shift = 4, 3, 5
    r, omega, theta = (torch.randn(seq, d, dtype=F64) for _ in range(3))
    positions = torch.tensor([0, 2, 3, 9])
    re0, im0 = ref.complex_order_embedding(r, omega, theta, positions)
    re1, im1 = ref.complex_order_embedding(r, omega, theta, positions + shift)
    z0, z1 = torch.complex(re0, im0), torch.complex(re1, im1)
    _close(
        torch.view_as_real(z1),
        torch.view_as_real(z0 * torch.polar(torch.ones_like(omega), omega * shift)),
    )
    _close(z1.abs(), r.abs())
