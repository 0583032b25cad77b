"""Independent float64 reference formulas for positional encodings.

Every function here is written from the paper that introduced the method (and, where the paper
leaves a detail open, from the behaviour of the authors' or Hugging Face's public code, read for
facts only). They are deliberately literal: Python loops, scalar ``math``/``cmath`` and explicit
complex arithmetic rather than the fused, vectorised routes a production module would take, so
that a parity test comparing a generated module against them checks two independent derivations.

Nothing in this module imports from ``posgen``, ``generated`` or ``templates``.

All tensors returned are ``torch.float64`` (or Python ``float``/``int`` for scalar functions).
"""

from __future__ import annotations

import cmath
import math

import torch
from torch import Tensor

F64 = torch.float64

__all__ = [
    "alibi_bias",
    "alibi_slopes",
    "attention",
    "complex_order_embedding",
    "deberta_log_bucket_position",
    "half_to_interleaved_permutation",
    "hierarchical_basis_from_absolute",
    "hierarchical_position",
    "rope_apply",
    "rope_frequencies",
    "shaw_relative_attention",
    "sinusoidal_table",
    "t5_bias",
    "t5_relative_bucket",
    "transformer_xl_relative_sinusoid",
    "transformer_xl_scores",
]


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def _as_int_list(positions: Tensor | list[int]) -> list[int]:
    """Positions as a plain list of Python ints (accepts a 1-D tensor or a list)."""
    if isinstance(positions, Tensor):
        if positions.dim() != 1:
            raise ValueError(f"positions must be 1-D, got shape {tuple(positions.shape)}")
        return [int(p) for p in positions.tolist()]
    return [int(p) for p in positions]


def _softmax_last(logits: Tensor) -> Tensor:
    """Softmax over the last axis written out as exp(l - max) / sum(exp(l - max)).

    Rows whose entries are all ``-inf`` (every key masked) raise ``ValueError``.
    """
    row_max = logits.amax(dim=-1, keepdim=True)
    if torch.isinf(row_max).any():
        raise ValueError("a query row has every key masked; softmax is undefined")
    weights = torch.exp(logits - row_max)
    return weights / weights.sum(dim=-1, keepdim=True)


# --------------------------------------------------------------------------------------------
# Sinusoidal absolute positions
# --------------------------------------------------------------------------------------------


def sinusoidal_table(num_positions: int, dim: int, base: float = 10000.0) -> Tensor:
    """Sinusoidal absolute position table, Vaswani et al. 2017 (arXiv:1706.03762), Sec. 3.5.

    Formula (interleaved layout, exactly as printed in the paper)::

        PE(pos, 2i)     = sin(pos / base^(2i / dim))
        PE(pos, 2i + 1) = cos(pos / base^(2i / dim))

    for ``pos`` in ``[0, num_positions)`` and ``i`` in ``[0, dim / 2)``; ``base`` is 10000 in
    the paper. Note that tensor2tensor / fairseq / Transformer-XL concatenate ``[sin | cos]``
    instead of interleaving; that is a different (permuted) table.

    Returns a ``[num_positions, dim]`` float64 tensor. ``dim`` must be even.
    """
    if dim <= 0 or dim % 2 != 0:
        raise ValueError(f"dim must be a positive even number, got {dim}")
    if num_positions < 0:
        raise ValueError(f"num_positions must be >= 0, got {num_positions}")
    rows: list[list[float]] = []
    for pos in range(num_positions):
        row: list[float] = []
        for i in range(dim // 2):
            angle = pos / (base ** (2 * i / dim))
            row.append(math.sin(angle))
            row.append(math.cos(angle))
        rows.append(row)
    return torch.tensor(rows, dtype=F64).reshape(num_positions, dim)


# --------------------------------------------------------------------------------------------
# Rotary position embedding (RoPE)
# --------------------------------------------------------------------------------------------


def rope_frequencies(rotary_dim: int, base: float) -> Tensor:
    """RoPE angular frequencies, Su et al. 2021, RoFormer (arXiv:2104.09864), eq. (15).

    Formula::

        theta_k = base^(-2k / rotary_dim),   k = 0, 1, ..., rotary_dim/2 - 1

    (the paper writes theta_i = 10000^(-2(i-1)/d) with 1-based i). Returns a
    ``[rotary_dim // 2]`` float64 tensor. ``rotary_dim`` must be even.
    """
    if rotary_dim <= 0 or rotary_dim % 2 != 0:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    return torch.tensor(
        [base ** (-2.0 * k / rotary_dim) for k in range(rotary_dim // 2)], dtype=F64
    )


def _rope_pair_indices(pairing: str, rotary_dim: int, k: int) -> tuple[int, int]:
    """Feature indices (real, imaginary) of rotary pair ``k`` under a pairing convention."""
    if pairing == "interleaved":
        return 2 * k, 2 * k + 1
    if pairing == "half":
        return k, k + rotary_dim // 2
    raise ValueError(f"pairing must be 'interleaved' or 'half', got {pairing!r}")


def rope_apply(
    x: Tensor,
    positions: Tensor,
    base: float,
    pairing: str,
    rotary_dim: int | None = None,
) -> Tensor:
    """Apply rotary position embedding, Su et al. 2021, RoFormer (arXiv:2104.09864), eq. (34).

    Each feature pair ``(a, b)`` of token ``m`` is read as the complex number ``a + i*b`` and
    multiplied by ``exp(i * m * theta_k)`` (theta_k from :func:`rope_frequencies`), i.e. the pair
    is rotated by the angle ``m * theta_k``::

        a' = a cos(m theta_k) - b sin(m theta_k)
        b' = a sin(m theta_k) + b cos(m theta_k)

    Pairing conventions (``D = rotary_dim``):

    * ``"interleaved"`` (paper, GPT-J, original Meta LLaMA): pair k is ``(x[2k], x[2k+1])``.
    * ``"half"`` (GPT-NeoX, Hugging Face Llama): pair k is ``(x[k], x[k + D/2])``.

    Only the first ``rotary_dim`` features rotate (default: all of them, which must be even);
    features ``rotary_dim:`` pass through unchanged (GPT-J / NeoX "partial rotary").

    ``x`` is ``[..., seq, dim]``; ``positions`` is a ``[seq]`` tensor of (integer) positions.
    This reference goes through ``torch.complex`` / ``torch.polar`` one pair at a time rather
    than the usual ``x * cos + rotate_half(x) * sin`` route. Returns float64.
    """
    dim = x.shape[-1]
    rd = dim if rotary_dim is None else rotary_dim
    if rd <= 0 or rd % 2 != 0 or rd > dim:
        raise ValueError(f"rotary_dim must be even and in (0, {dim}], got {rd}")
    if positions.dim() != 1 or positions.shape[0] != x.shape[-2]:
        raise ValueError(
            f"positions must be [seq={x.shape[-2]}], got shape {tuple(positions.shape)}"
        )
    x64 = x.to(F64)
    out = x64.clone()
    theta = rope_frequencies(rd, base)
    pos = positions.to(F64)
    for k in range(rd // 2):
        re_idx, im_idx = _rope_pair_indices(pairing, rd, k)
        z = torch.complex(x64[..., re_idx], x64[..., im_idx])  # [..., seq]
        angle = pos * theta[k]  # [seq]
        rotor = torch.polar(torch.ones_like(angle), angle)  # exp(i * m * theta_k)
        rotated = z * rotor
        out[..., re_idx] = rotated.real
        out[..., im_idx] = rotated.imag
    return out


def half_to_interleaved_permutation(dim: int) -> list[int]:
    """Feature permutation relating the two RoPE pairings (Su et al. 2021, arXiv:2104.09864).

    Returns ``P = [0, D/2, 1, D/2 + 1, ..., D/2 - 1, D - 1]`` (``D = dim``), i.e. ``P[2k] = k``
    and ``P[2k + 1] = k + D/2``. Gathering features with ``P`` moves the "half" pair
    ``(x[k], x[k + D/2])`` into interleaved slots ``(2k, 2k + 1)``, so::

        rope_apply(x[..., P], pairing="interleaved") == rope_apply(x, pairing="half")[..., P]

    This is how checkpoints are converted between Meta-LLaMA and HF-Llama layouts (the
    permutation is applied to the rows of W_q / W_k). ``dim`` must be even.
    """
    if dim <= 0 or dim % 2 != 0:
        raise ValueError(f"dim must be a positive even number, got {dim}")
    half = dim // 2
    perm: list[int] = []
    for k in range(half):
        perm.append(k)
        perm.append(k + half)
    return perm


# --------------------------------------------------------------------------------------------
# ALiBi
# --------------------------------------------------------------------------------------------


def _alibi_power_of_two_slopes(n: int) -> list[float]:
    """Geometric sequence 2^(-8/n), 2^(-16/n), ..., 2^(-8) (``n`` a power of two)."""
    return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi head slopes, Press, Smith & Lewis 2022, "Train Short, Test Long" (arXiv:2108.12409).

    For ``heads = n`` a power of two the slopes are the geometric sequence whose first term and
    ratio are both ``2^(-8/n)``: ``m_h = 2^(-8 (h + 1) / n)``, ``h = 0..n-1`` (8 heads: 1/2, 1/4,
    ..., 1/256).

    Otherwise (official ``get_slopes`` recipe): with ``c`` the largest power of two ``< heads``,
    take the ``c`` slopes for ``c`` heads, then append the even-indexed slopes (indices 0, 2,
    4, ...) of the ``2c``-head sequence, keeping the first ``heads - c`` of them.

    Computed as direct powers of two with Python floats (the official code multiplies
    ``start * ratio**i``, which agrees to within a few ulp).
    """
    if heads < 1:
        raise ValueError(f"heads must be >= 1, got {heads}")
    closest = 1 << (heads.bit_length() - 1)  # largest power of two <= heads
    slopes = _alibi_power_of_two_slopes(closest)
    if closest == heads:
        return slopes
    extra = _alibi_power_of_two_slopes(2 * closest)[0::2][: heads - closest]
    return slopes + extra


def alibi_bias(heads: int, q_positions: Tensor, k_positions: Tensor) -> Tensor:
    """ALiBi additive attention bias, Press et al. 2022 (arXiv:2108.12409), Sec. 3.

    Formula (symmetric distance form)::

        bias[h, i, j] = -m_h * |q_i - k_j|

    with ``m_h`` from :func:`alibi_slopes`. Under a causal mask (``k_j <= q_i``) this equals the
    paper's ``m_h * [-(i-1), ..., -2, -1, 0]`` row. Returns ``[heads, N, M]`` float64.
    """
    slopes = alibi_slopes(heads)
    qs = _as_int_list(q_positions)
    ks = _as_int_list(k_positions)
    values = [[[-slope * abs(qi - kj) for kj in ks] for qi in qs] for slope in slopes]
    return torch.tensor(values, dtype=F64).reshape(heads, len(qs), len(ks))


# --------------------------------------------------------------------------------------------
# T5 bucketed relative bias
# --------------------------------------------------------------------------------------------


def t5_relative_bucket(
    relative_position: int, bidirectional: bool, num_buckets: int, max_distance: int
) -> int:
    """T5 relative-position bucket, Raffel et al. 2020 (arXiv:1910.10683), Sec. 2.1.

    ``relative_position = key_position - query_position`` (memory minus query, as in
    Mesh-TensorFlow ``_relative_position_bucket`` and HF ``T5Attention``).

    * Bidirectional: ``nb = num_buckets // 2``; keys *after* the query (``rel > 0``) use buckets
      offset by ``nb``, the rest (``rel <= 0``) use ``[0, nb)``; ``n = |rel|``.
    * Unidirectional: ``nb = num_buckets``; ``n = max(-rel, 0)`` (every future key -> bucket 0).

    Within a half of ``nb`` buckets, with ``max_exact = nb // 2``::

        bucket = n                                                       if n < max_exact
        bucket = min(nb - 1, max_exact + floor(log(n / max_exact)
                                               / log(max_distance / max_exact)
                                               * (nb - max_exact)))     otherwise

    Scalar Python float64 (HF evaluates the log in float32; for the usual settings the two agree).
    """
    if num_buckets < (4 if bidirectional else 2):
        raise ValueError(f"num_buckets too small for a log bucket range: {num_buckets}")
    offset = 0
    if bidirectional:
        half = num_buckets // 2
        if relative_position > 0:
            offset = half
        n = abs(relative_position)
    else:
        half = num_buckets
        n = max(-relative_position, 0)
    max_exact = half // 2
    if max_distance <= max_exact:
        raise ValueError(f"max_distance ({max_distance}) must exceed max_exact ({max_exact})")
    if n < max_exact:
        return offset + n
    scaled = math.log(n / max_exact) / math.log(max_distance / max_exact) * (half - max_exact)
    return offset + min(max_exact + math.floor(scaled), half - 1)


def t5_bias(
    table: Tensor,
    q_positions: Tensor,
    k_positions: Tensor,
    bidirectional: bool,
    num_buckets: int,
    max_distance: int,
) -> Tensor:
    """T5 relative attention bias, Raffel et al. 2020 (arXiv:1910.10683).

    Formula::

        bias[h, i, j] = table[bucket(k_j - q_i), h]

    with ``bucket`` = :func:`t5_relative_bucket`. ``table`` is the learned
    ``[num_buckets, heads]`` embedding (HF ``relative_attention_bias.weight``).
    Returns ``[heads, N, M]`` float64.
    """
    if table.dim() != 2 or table.shape[0] != num_buckets:
        raise ValueError(
            f"table must be [num_buckets={num_buckets}, heads], got {tuple(table.shape)}"
        )
    heads = table.shape[1]
    qs = _as_int_list(q_positions)
    ks = _as_int_list(k_positions)
    t64 = table.to(F64)
    out = torch.zeros(heads, len(qs), len(ks), dtype=F64)
    for i, qi in enumerate(qs):
        for j, kj in enumerate(ks):
            bucket = t5_relative_bucket(kj - qi, bidirectional, num_buckets, max_distance)
            out[:, i, j] = t64[bucket, :]
    return out


# --------------------------------------------------------------------------------------------
# Plain softmax attention
# --------------------------------------------------------------------------------------------


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None = None,
    scale: float | None = None,
    causal_q_positions: Tensor | None = None,
    causal_k_positions: Tensor | None = None,
) -> Tensor:
    """Scaled dot-product attention in float64, Vaswani et al. 2017 (arXiv:1706.03762), eq. (1).

    Formula::

        logits[b, h, i, j] = scale * sum_d q[b, h, i, d] k[b, h, j, d] + bias[h, i, j]
        logits[b, h, i, j] = -inf                 where k_pos[j] > q_pos[i]  (if causal given)
        out[b, h, i]       = sum_j softmax_j(logits[b, h, i, :]) v[b, h, j]

    ``q`` is ``[batch, heads, N, d]``, ``k``/``v`` are ``[batch, heads, M, d]`` / ``[..., M, dv]``.
    ``scale`` defaults to ``1 / sqrt(d)``. ``bias`` may be ``[heads, N, M]`` (broadcast over the
    batch), ``[N, M]`` or ``[batch, heads, N, M]``. The causal mask is applied only when both
    position tensors are given. Dot products are explicit products + sums (no matmul kernel).
    """
    if (causal_q_positions is None) != (causal_k_positions is None):
        raise ValueError("give both causal_q_positions and causal_k_positions, or neither")
    q64, k64, v64 = q.to(F64), k.to(F64), v.to(F64)
    d = q64.shape[-1]
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)
    logits = (q64.unsqueeze(-2) * k64.unsqueeze(-3)).sum(dim=-1) * s  # [B, H, N, M]
    if bias is not None:
        logits = logits + bias.to(F64)
    if causal_q_positions is not None and causal_k_positions is not None:
        qs = _as_int_list(causal_q_positions)
        ks = _as_int_list(causal_k_positions)
        mask = torch.tensor([[kj > qi for kj in ks] for qi in qs], dtype=torch.bool)
        logits = logits.masked_fill(mask, float("-inf"))
    weights = _softmax_last(logits)
    return (weights.unsqueeze(-1) * v64.unsqueeze(-3)).sum(dim=-2)


# --------------------------------------------------------------------------------------------
# Shaw et al. relative attention
# --------------------------------------------------------------------------------------------


def shaw_relative_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rel_k: Tensor,
    rel_v: Tensor,
    clip: int,
    scale: float | None = None,
    causal: bool = False,
    q_positions: Tensor | list[int] | None = None,
    k_positions: Tensor | list[int] | None = None,
) -> Tensor:
    """Relation-aware self-attention, Shaw, Uszkoreit & Vaswani 2018 (arXiv:1803.02155), Sec. 3.

    Formulas (``c = clip``; query index i, key index j, both 0-based sequence indices)::

        a^K_ij = rel_k[clip(j - i, -c, c) + c]        a^V_ij = rel_v[clip(j - i, -c, c) + c]
        e_ij   = scale * q_i . (k_j + a^K_ij)
        alpha_ij = exp(e_ij) / sum_l exp(e_il)
        z_i    = sum_j alpha_ij (v_j + a^V_ij)

    ``q`` is ``[..., N, d]``, ``k``/``v`` ``[..., M, d]``; ``rel_k``/``rel_v`` are ``[2c+1, d]``
    (shared across heads, as in the paper). ``scale`` defaults to ``1/sqrt(d)`` (the paper's
    ``1/sqrt(d_z)``). ``causal=True`` masks keys with ``j > i``. Literal double loop over i, j.
    ``q_positions`` / ``k_positions`` (1-D, length N / M): the positions that stand for i
    and j in every formula above (default: the indices themselves).
    """
    if clip < 0:
        raise ValueError(f"clip must be >= 0, got {clip}")
    if rel_k.shape[0] != 2 * clip + 1 or rel_v.shape[0] != 2 * clip + 1:
        raise ValueError(f"rel_k / rel_v must have 2*clip+1 = {2 * clip + 1} rows")
    q64, k64, v64 = q.to(F64), k.to(F64), v.to(F64)
    rk, rv = rel_k.to(F64), rel_v.to(F64)
    n, m = q64.shape[-2], k64.shape[-2]
    s = 1.0 / math.sqrt(q64.shape[-1]) if scale is None else float(scale)

    q_at = list(range(n)) if q_positions is None else _as_int_list(q_positions)
    k_at = list(range(m)) if k_positions is None else _as_int_list(k_positions)

    def rel_index(i: int, j: int) -> int:
        return min(max(k_at[j] - q_at[i], -clip), clip) + clip

    lead = torch.broadcast_shapes(q64.shape[:-2], k64.shape[:-2])
    outputs = []
    for i in range(n):
        row_logits = []
        for j in range(m):
            if causal and k_at[j] > q_at[i]:
                row_logits.append(torch.full(lead, float("-inf"), dtype=F64))
                continue
            key = k64[..., j, :] + rk[rel_index(i, j)]
            row_logits.append((q64[..., i, :] * key).sum(dim=-1) * s)
        alpha = _softmax_last(torch.stack(torch.broadcast_tensors(*row_logits), dim=-1))
        z_i = torch.zeros_like(v64[..., 0, :])
        for j in range(m):
            value = v64[..., j, :] + rv[rel_index(i, j)]
            z_i = z_i + alpha[..., j : j + 1] * value
        outputs.append(z_i)
    return torch.stack(outputs, dim=-2)


# --------------------------------------------------------------------------------------------
# DeBERTa-v2 log buckets
# --------------------------------------------------------------------------------------------


def deberta_log_bucket_position(relative_position: int, bucket_size: int, max_position: int) -> int:
    """DeBERTa(-v2/v3) log-bucketed relative position, He et al. 2021 (arXiv:2006.03654).

    ``relative_position = query_position - key_position`` (note: the opposite sign of T5).
    With ``mid = bucket_size // 2`` (HF ``make_log_bucket_position``)::

        bucket(r) = r                                                       if |r| <= mid
        bucket(r) = sign(r) * (mid + ceil(log(|r| / mid) / log((max_position - 1) / mid)
                                          * (mid - 1)))                     otherwise

    The result is *not* clipped: for ``|r| > max_position - 1`` it exceeds ``bucket_size - 1``;
    DeBERTa clamps later, when indexing the relative embedding
    (``clamp(bucket + span, 0, 2*span - 1)``). When ``bucket_size <= 0`` or
    ``max_position <= 0`` (DeBERTa-v1 style, no buckets) ``r`` is returned unchanged, as in HF
    ``build_relative_position``. Scalar Python float64, matching Microsoft's numpy original.
    """
    if bucket_size <= 0 or max_position <= 0:
        return relative_position
    mid = bucket_size // 2
    magnitude = abs(relative_position)
    if magnitude <= mid:
        return relative_position
    log_part = math.log(magnitude / mid) / math.log((max_position - 1) / mid) * (mid - 1)
    bucket = mid + math.ceil(log_part)
    return bucket if relative_position > 0 else -bucket


# --------------------------------------------------------------------------------------------
# Transformer-XL
# --------------------------------------------------------------------------------------------


def transformer_xl_relative_sinusoid(distances: Tensor, dim: int, base: float = 10000.0) -> Tensor:
    """Transformer-XL's sinusoid R_t, Dai et al. 2019 (arXiv:1901.02860), Sec. 3.3.

    The paper says only "R is a sinusoid encoding matrix [Vaswani et al.]"; the authors' code
    (``PositionalEmbedding``) uses the *concatenated* layout::

        R_t = [sin(t * w_0), ..., sin(t * w_{D/2-1}), cos(t * w_0), ..., cos(t * w_{D/2-1})]
        w_k = base^(-2k / D)

    (and feeds distances in descending order ``klen-1, ..., 0``). ``distances`` is ``[L]``;
    returns ``[L, dim]`` float64 with row ``l`` = ``R_{distances[l]}``.
    """
    if dim <= 0 or dim % 2 != 0:
        raise ValueError(f"dim must be a positive even number, got {dim}")
    rows = []
    for t in distances.to(F64).tolist():
        angles = [t * base ** (-2.0 * k / dim) for k in range(dim // 2)]
        rows.append([math.sin(a) for a in angles] + [math.cos(a) for a in angles])
    return torch.tensor(rows, dtype=F64).reshape(len(rows), dim)


def transformer_xl_scores(
    q: Tensor,
    k: Tensor,
    r: Tensor,
    u: Tensor,
    v: Tensor,
    mlen: int = 0,
    scale: float = 1.0,
) -> Tensor:
    """Transformer-XL relative attention logits, Dai et al. 2019 (arXiv:1901.02860), eq. in 3.3.

    The paper decomposes the score between query i and key j as::

        A_ij = (a) q_i . k_j  +  (b) q_i . r_{i-j}  +  (c) u . k_j  +  (d) v . r_{i-j}

    where, in the paper's notation, ``q_i = W_q E_{x_i}``, ``k_j = W_{k,E} E_{x_j}``,
    ``r_t = W_{k,R} R_t`` (projected sinusoid, see :func:`transformer_xl_relative_sinusoid`) and
    ``u``, ``v`` are learned global biases (not projected by W_q).

    Conventions of this reference:

    * ``q``: ``[..., N, d]``, the current segment; query ``i`` sits at absolute position
      ``mlen + i``.
    * ``k``: ``[..., M, d]`` over memory + segment (usually ``M = mlen + N``); key ``j`` sits at
      absolute position ``j``.
    * ``r``: ``[..., L, d]`` indexed by *distance*: ``r[..., t, :] = W_{k,R} R_t``, ``t >= 0``
      (the authors' code stores it in descending order; reverse it before passing).
    * ``u``, ``v``: ``[..., d]``, broadcastable against ``q[..., i, :]`` (e.g. ``[heads, d]``).
    * The distance is ``t = (mlen + i) - j``. Keys with ``t < 0`` (future) get ``-inf``
      (Transformer-XL is causal); ``t >= L`` raises ``ValueError``.
    * Output ``[..., N, M]`` = ``scale * A`` (the authors' code uses ``scale = 1/sqrt(d)``).

    Literal double loop over i, j with the four terms computed separately.
    """
    q64, k64, r64 = q.to(F64), k.to(F64), r.to(F64)
    u64, v64 = u.to(F64), v.to(F64)
    n, m, length = q64.shape[-2], k64.shape[-2], r64.shape[-2]
    rows = []
    for i in range(n):
        row = []
        for j in range(m):
            t = mlen + i - j
            if t < 0:
                shape = torch.broadcast_shapes(q64.shape[:-2], k64.shape[:-2])
                row.append(torch.full(shape, float("-inf"), dtype=F64))
                continue
            if t >= length:
                raise ValueError(f"distance {t} has no row in r (L={length})")
            qi, kj, rt = q64[..., i, :], k64[..., j, :], r64[..., t, :]
            term_a = (qi * kj).sum(dim=-1)
            term_b = (qi * rt).sum(dim=-1)
            term_c = (u64 * kj).sum(dim=-1)
            term_d = (v64 * rt).sum(dim=-1)
            row.append(scale * (term_a + term_b + term_c + term_d))
        rows.append(torch.stack(torch.broadcast_tensors(*row), dim=-1))
    return torch.stack(rows, dim=-2)


# --------------------------------------------------------------------------------------------
# Hierarchically decomposed positions
# --------------------------------------------------------------------------------------------


def hierarchical_position(u: Tensor, position: int, alpha: float) -> Tensor:
    """Hierarchically decomposed position embedding, Su Jianlin 2020 ("层次分解位置编码，让BERT可以
    处理超长文本", kexue.fm/archives/7947; used to extend BERT's 512 learned positions).

    With a base table ``u`` of ``n`` vectors, position ``p = i*n + j`` (0-based,
    ``0 <= i, j < n``) is encoded as::

        q_{i*n + j} = alpha * u_i + (1 - alpha) * u_j

    (the blog's 1-based ``q_{(i-1)n + j}``). Covers ``n*n`` positions; ``alpha != 0.5`` keeps
    ``q_{i*n+j}`` and ``q_{j*n+i}`` distinct (the blog uses ``alpha = 0.4``). Returns ``[d]``.
    """
    n = u.shape[0]
    if not 0 <= position < n * n:
        raise ValueError(f"position must be in [0, {n * n}), got {position}")
    i, j = divmod(position, n)
    u64 = u.to(F64)
    return alpha * u64[i] + (1.0 - alpha) * u64[j]


def hierarchical_basis_from_absolute(p: Tensor, alpha: float) -> Tensor:
    """Base vectors u from a trained absolute table p (Su 2020, kexue.fm/archives/7947).

    Formula (0-based)::

        u_i = (p_i - alpha * p_0) / (1 - alpha)

    chosen so that :func:`hierarchical_position` reproduces ``p_j`` exactly for ``j < n``.
    ``p`` is ``[n, d]``; returns ``[n, d]`` float64.
    """
    if alpha == 1.0:
        raise ValueError("alpha must differ from 1")
    p64 = p.to(F64)
    return (p64 - alpha * p64[0]) / (1.0 - alpha)


# --------------------------------------------------------------------------------------------
# Complex order embeddings
# --------------------------------------------------------------------------------------------


def complex_order_embedding(
    r: Tensor, omega: Tensor, theta: Tensor, positions: Tensor
) -> tuple[Tensor, Tensor]:
    """Complex-valued word-order embedding, Wang et al. 2020, "Encoding word order in complex
    embeddings" (ICLR 2020, arXiv:1912.12333), eq. (3).

    For word ``w`` at position ``pos``, each dimension ``d`` is::

        f(w, pos)_d = r_{w,d} * exp(i * (omega_{w,d} * pos + theta_{w,d}))

    (amplitude r, frequency omega, initial phase theta, all word-dependent).

    ``r``, ``omega``, ``theta`` are either ``[seq, d]`` (parameters already looked up for the word
    at each position) or ``[d]`` (one word, broadcast over positions); ``positions`` is ``[seq]``.
    Returns ``(real, imag)``, each ``[seq, d]`` float64, computed element by element with
    ``cmath``.
    """
    pos_list = positions.to(F64).tolist()
    seq = len(pos_list)

    def rows(t: Tensor) -> list[list[float]]:
        t64 = t.to(F64)
        if t64.dim() == 1:
            return [t64.tolist()] * seq
        if t64.dim() == 2 and t64.shape[0] == seq:
            return t64.tolist()
        raise ValueError(f"expected [d] or [seq={seq}, d], got {tuple(t.shape)}")

    r_rows, w_rows, p_rows = rows(r), rows(omega), rows(theta)
    real: list[list[float]] = []
    imag: list[list[float]] = []
    for s, pos in enumerate(pos_list):
        zs = [
            cmath.rect(amp, freq * pos + phase)
            for amp, freq, phase in zip(r_rows[s], w_rows[s], p_rows[s], strict=True)
        ]
        real.append([z.real for z in zs])
        imag.append([z.imag for z in zs])
    d = len(r_rows[0]) if seq else r.shape[-1]
    return (
        torch.tensor(real, dtype=F64).reshape(seq, d),
        torch.tensor(imag, dtype=F64).reshape(seq, d),
    )


# --------------------------------------------------------------------------------------------
# Query scales (a factor of the query's own position)
# --------------------------------------------------------------------------------------------


def floor_log_query_scale(position: int, floor_scale: int, attn_scale: float) -> float:
    """Llama 4's attention temperature tuning (Hugging Face Llama4TextAttention, NoPE
    layers): the query at 0-based ``position`` is multiplied by
    1 + attn_scale * ln(floor((position + 1) / floor_scale) + 1). Python integers and
    ``math.log``, one position at a time."""
    return 1.0 + attn_scale * math.log((position + 1) // floor_scale + 1)


def log_length_query_scale(position: int, original_max_positions: int) -> float:
    """Qwen's LogN-Scaling (``use_logn_attn``): the query at 0-based ``position`` reads
    entry ``position`` of [log_L(t) if t > L else 1 for t = 1, 2, ...], L the training
    length, i.e. log base L of position + 1 past L and 1 within it."""
    t = position + 1
    return math.log(t, original_max_positions) if t > original_max_positions else 1.0


def scalable_softmax_attention(
    logits: Tensor, v: Tensor, s: Tensor, allowed: Tensor | None = None
) -> Tensor:
    """Scalable-Softmax attention, Nakanishi 2025 (arXiv:2501.19399), eq. (3): each row's
    softmax takes its logits z_j times s ln n, n the number of keys the row attends to::

        SSMax(z)_j = n^(s z_j) / sum_t n^(s z_t) = exp(s ln(n) z_j) / sum_t exp(s ln(n) z_t)

    logits: [B, H, N, M] (already scaled, float64); v: [B, H, M, D]; s: [H], one per head;
    allowed: [N, M] bool (a causal mask), every key where None. The row's n is counted
    from the mask, not from the query's position.
    """
    allowed = torch.ones(logits.shape[-2:], dtype=torch.bool) if allowed is None else allowed
    n = allowed.sum(-1).to(logits.dtype)  # [N]
    sharpened = logits * (s[:, None, None] * torch.log(n)[:, None])  # [B, H, N, M]
    weights = torch.softmax(sharpened.masked_fill(~allowed, -math.inf), dim=-1)
    return weights @ v


# ----------------------------------------------------------- decay curves (posgen check)


def roformer_bound(thetas: list[float], reach: int) -> list[float]:
    """RoFormer's decay bound (Su et al. 2021, section 3.4.3) at r = 0 .. reach - 1:
    (1/(d/2)) Σ_j |Σ_{k<j} e^{i r θ_k}|, over the pairs' angles θ_k, in Python complex."""
    values = []
    for r in range(reach):
        total, partial = 0j, 0.0
        for theta in thetas:
            total += complex(math.cos(r * theta), math.sin(r * theta))
            partial += abs(total)
        values.append(partial / len(thetas))
    return values


def window_means(values: list[float], reach: int) -> list[float]:
    """Means of ``values`` over the log windows [0, 1), [1, 2), [2, 4), …, [2^k, reach)."""
    edges = [0, 1]
    while edges[-1] * 2 < reach:
        edges.append(edges[-1] * 2)
    edges.append(reach)
    return [sum(values[a:b]) / (b - a) for a, b in zip(edges, edges[1:], strict=False)]


def first_rise(means: list[float]) -> int | None:
    """The first window whose successor's mean is higher, or None (the means fall)."""
    return next((k for k in range(len(means) - 1) if means[k + 1] > means[k]), None)
