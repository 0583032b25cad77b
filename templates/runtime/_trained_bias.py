"""CPU training with a bias that needs a gradient, without SDPA's math kernel.

A float mask that requires grad sends CPU SDPA to its unfused math kernel. Two paths
avoid it: ``trained_mask_attention`` (three plain differentiable ops per query chunk),
and, for a bias constant past a clip distance K (T5's buckets), ``clipped_bias_attention``:
CPU flash attention with the bias as a constant strided view, whose table gradient is
the sum of dS = P * (dP - delta) along the band |j - i| < K plus two far entries found
from one causal flash pass over a triangle and from each row of dS summing to zero.
(A bias of j - i whose trained scalars are one per head, KERPLE's or trained ALiBi
slopes, takes ``directional_bias_attention`` instead: ``_directional_bias``.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._chunked_flash import (
    cpu_flash_forward,
    cpu_flash_kernel_takes,
    flash_chunks_backward,
    flash_chunks_forward,
    recomputed_weights,
)
from ._distances import (
    anti_diagonal_sums,
    default_distances,
    distance_chunk_view,
    distance_chunk_views,
)
from ._first_order import first_order_only
from ._masks import distance_allowed, query_chunks
from ._numerics import autocast_off, compute_dtype

#: device types where ``trained_mask_attention`` replaces SDPA for a mask that needs a
#: gradient (the CPU's SDPA then runs its unfused math kernel anyway)
TRAINED_MASK_DEVICES: set[str] = {"cpu"}


def trained_mask_attention_serves(q: Tensor, mask: Tensor | None) -> bool:
    """Whether ``trained_mask_attention`` replaces SDPA for one query chunk: a float
    mask that needs a gradient, float32 or float64 q, on a device of
    TRAINED_MASK_DEVICES."""
    return (
        mask is not None
        and mask.requires_grad
        and mask.is_floating_point()
        and q.device.type in TRAINED_MASK_DEVICES
        and q.dtype in (torch.float32, torch.float64)
    )


def trained_mask_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """softmax(q kᵀ · scale + mask) v as three differentiable ops, for a chunk whose
    every query row has a key it may read (the chunked paths guarantee it: causal and
    window masks keep each query's own position).

    SDPA's math kernel, which CPU SDPA runs for a mask that needs a gradient, adds a
    safe softmax (checks for fully masked rows) and zero fills around it. Attention
    over 256-query chunks with a trained per-distance bias, forward and backward
    (N = 2048, batch 2, 16 heads, float32, 2-core CPU): 2.16 s through SDPA, 1.68 s
    through these ops, 0.52 s for SDPA without a bias; T5's whole training step went
    from 3.2-3.3x to 3.0x the bias-free one (non-causal).

    q: [B, H, n, D]; k, v: [B, KVH, m, D] (KVH divides H: query head h reads key head
    h // (H / KVH)); mask: [1 or B, H, n, m] -> [B, H, n, value_dim], in q's dtype with
    autocast off (as the eager oracle: the caller casts to autocast's dtype).
    """
    batch, heads, n, _ = q.shape
    kv_heads, m = k.shape[1], k.shape[2]
    group = heads // kv_heads
    with autocast_off(q.device.type):  # scores in bfloat16 moved T5's outputs by 3.5e-2
        grouped = (q * scale).view(batch, kv_heads, group, n, q.shape[-1])  # [B, KVH, G, n, D]
        scores = torch.matmul(grouped, k.unsqueeze(2).transpose(-1, -2))  # [B, KVH, G, n, m]
        weights = torch.softmax(scores.view(batch, heads, n, m) + mask, dim=-1)  # [B, H, n, m]
        out = torch.matmul(weights.view(batch, kv_heads, group, n, m), v.unsqueeze(2))
    return out.view(batch, heads, n, v.shape[-1])


#: the clipped-bias path serves at least this many keys per unit of the clip distance:
#: with fewer, the band pass spans (nearly) every key and recomputes more than it saves
#: (T5, clip 128, training step, 2-core CPU, float32, against the chunked path in one
#: run: N = 512 1.91x plain SDPA against 1.41x; N = 1024 1.52x against 2.09x)
CLIPPED_BIAS_MIN_KEYS_PER_CLIP = 8


def band_gradient_pays(m: int, clip: int) -> bool:
    """Whether a bias clipped at ``clip`` trains through the band-and-triangle gradient
    at ``m`` keys (every route that offers it: CPU sdpa, flex, the fused kernel): at
    least ``CLIPPED_BIAS_MIN_KEYS_PER_CLIP`` keys per unit of the clip distance."""
    return m >= CLIPPED_BIAS_MIN_KEYS_PER_CLIP * clip


#: queries per step of the band pass: its scores are [B, H, rows, rows + 2 clip - 2]
CLIPPED_BIAS_BAND_ROWS = 256


def flash_training_serves(q: Tensor, window: int | None) -> bool:
    """The CPU (its flash kernel returns the log-sum-exp the gradient needs), float32 or
    float64, no autocast, more than one query, no window."""
    return cpu_flash_kernel_takes(q) and q.shape[2] > 1 and window is None


def clipped_bias_attention_serves(
    q: Tensor, v: Tensor, m: int, clip: int, window: int | None
) -> bool:
    """Whether ``clipped_bias_attention`` runs a training step with a bias clipped at
    ``clip``: ``flash_training_serves``, values as wide as the queries (the CPU flash
    kernel's rule; also under compile) and at least ``CLIPPED_BIAS_MIN_KEYS_PER_CLIP``
    keys per unit of ``clip``."""
    return (
        flash_training_serves(q, window)
        and v.shape[-1] == q.shape[-1]
        and band_gradient_pays(m, clip)
    )


def clipped_distance_vector(clipped: Tensor, n: int, m: int, causal: bool) -> Tensor:
    """[H, 2 clip + 1] bias at key minus query position -clip .. clip -> the per-distance
    vector of default positions [H, n + m - 1] (``default_distances``), -inf on the
    distances a causal mask excludes."""
    clip = (clipped.shape[1] - 1) // 2
    r = default_distances(n, m, clipped.device)  # key - query
    vec = clipped[:, r.clamp(-clip, clip) + clip]
    allowed = distance_allowed(n, m, clipped.device, causal, None)
    return vec if allowed is None else vec.masked_fill(~allowed, float("-inf"))


def flash_spans(n: int, m: int, causal: bool) -> list[tuple[int, int, int, int]]:
    """The CPU flash calls of ``clipped_bias_attention``: causal queries in chunks that
    skip the keys they may not read (the reversed-query view cannot use is_causal), all
    queries in one call otherwise (chunks there only add work)."""
    return query_chunks(n, m, "cpu", causal, None, views=True) if causal else [(0, n, 0, m)]


class _ClippedBiasAttention(torch.autograd.Function):
    """softmax(q kᵀ · scale + c[clamp(j - i, -K, K)]) v with c [H, 2K + 1] trained: CPU
    FlashAttention forward and backward, and the gradient of c from a band and a
    triangle.

    The bias is constant past distance K on each side (T5's buckets past max_distance).
    With dS = P ⊙ (dP - δ), δ_i = dO_i · O_i, the gradient of c[d] for |d| < K sums dS
    over one diagonal, and the band pass (``clipped_bias_gradient``) recomputes P and dP
    only on the band |j - i| < K. The two far entries sum dS over triangles, and need no
    per-pair work:

    - every row of dS sums to 0 (softmax), so the far side d <= -K is minus the rest;
    - the near side d >= K, for query i, is m_i (dO_i · Ō_i - δ_i), where Ō_i is the
      attention output over those keys alone and m_i = exp(lse_i^far + c[K] - lse_i)
      their share of the softmax mass: one causal flash forward over the triangle.

    The bias enters the flash kernels as a strided view of the per-distance vector
    (queries reversed, ``query_reversed_bias``) that needs no gradient, so SDPA's math
    kernel (every score, probability and gradient as an [B, H, N, M] tensor) never
    runs. q: [B, H, N, D]; k, v: [B, H, M, D] (heads repeated for GQA by the caller).
    """

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, clipped: Tensor, scale: float, causal: bool
    ) -> Tensor:
        n, m = q.shape[2], k.shape[2]
        vec = clipped_distance_vector(clipped, n, m, causal)  # [H, N + M - 1]
        spans = flash_spans(n, m, causal)
        out, lse = flash_chunks_forward(q, k, v, spans, distance_chunk_views(vec, n), scale, True)
        ctx.save_for_backward(q, k, v, clipped, vec, out, lse)
        ctx.scale, ctx.causal = scale, causal
        return out

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, clipped, vec, out, lse = ctx.saved_tensors
        scale, causal = ctx.scale, ctx.causal
        n, m = q.shape[2], k.shape[2]
        spans, view = flash_spans(n, m, causal), distance_chunk_views(vec, n)
        grad_out = grad_out.contiguous()
        dq, dk, dv = flash_chunks_backward(grad_out, q, k, v, out, lse, spans, view, scale, True)
        grad_clipped = None
        if ctx.needs_input_grad[3]:
            grad_clipped = clipped_bias_gradient(
                q, k, v, clipped, vec, out, lse, grad_out, scale, causal, cpu_flash_triangle
            )
        return dq, dk, dv, grad_clipped, None, None


def cpu_flash_triangle(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Top-left causal attention of r queries over r keys (query u reads keys <= u) with
    its log-sum-exp, by the CPU FlashAttention kernel: [B, H, r, value_dim], [B, H, r]."""
    return cpu_flash_forward(q, k, v, None, scale, causal=True)


def clipped_bias_gradient(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    clipped: Tensor,
    vec: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    scale: float,
    causal: bool,
    triangle: Any,
) -> Tensor:
    """The gradient of the clipped bias c [H, 2K + 1] (see ``_ClippedBiasAttention``)
    for attention at default positions whose output was ``out`` [B, H, N, value_dim]
    and row log-sum-exp ``lse`` [B, H, N], given ``grad_out``. q: [B, H, N, D]; k, v:
    [B, H, M, D]; vec: the per-distance vector of ``clipped_distance_vector``;
    ``triangle(q, k, v, scale)``: top-left causal attention and its log-sum-exp.

    Band: ``CLIPPED_BIAS_BAND_ROWS`` queries at a time against the keys within K - 1 of
    them, P = exp(S - lse) and dS = P ⊙ (dO vᵀ - δ) in reversed query order (the view of
    ``vec`` the forward used), summed over the batch and along each diagonal
    (``anti_diagonal_sums``), in float32 (float64 for float64 inputs). Far entries: the
    triangle and the zero row sums.
    """
    n, m = q.shape[2], k.shape[2]
    clip = (clipped.shape[1] - 1) // 2
    dtype = compute_dtype(q)
    grad_out, out, lse = grad_out.to(dtype), out.to(dtype), lse.to(dtype)
    vec = vec.to(dtype)
    delta = (grad_out * out).sum(-1)  # [B, H, N]: δ_i = dO_i . O_i
    per_distance = torch.zeros_like(vec)  # [H, N + M - 1]: dS summed per diagonal
    for i0 in range(0, n, CLIPPED_BIAS_BAND_ROWS):
        i1 = min(n, i0 + CLIPPED_BIAS_BAND_ROWS)
        first, last = m - n + i0, m - n + i1 - 1  # the chunk's query positions
        lo, hi = max(0, first - clip + 1), min(m, (last + 1) if causal else (last + clip))
        rows = q[:, :, i0:i1].flip(2).to(dtype)  # [B, H, rows, D], reversed
        keys, values = k[:, :, lo:hi].to(dtype), v[:, :, lo:hi].to(dtype)
        view = distance_chunk_view(vec, n, i0, i1, lo, hi)  # [1, H, rows, keys]
        weights = recomputed_weights(rows, keys, view, lse[:, :, i0:i1].flip(-1), scale)  # P
        grad_weights = torch.matmul(grad_out[:, :, i0:i1].flip(2), values.transpose(-1, -2))
        grad_weights -= delta[:, :, i0:i1].flip(-1).unsqueeze(-1)  # dP - δ
        grad_scores = weights.mul_(grad_weights).sum(0)  # [H, rows, keys]: dS, batch summed
        start = lo - i1 + n  # the vector entry of the chunk's first anti-diagonal
        per_distance[:, start : start + (i1 - i0) + (hi - lo) - 1] += anti_diagonal_sums(
            grad_scores
        )
    grad = clipped.new_zeros(clipped.shape, dtype=dtype)  # [H, 2K + 1], entry d + K
    # the band |d| < K: entries t = d + M - 1 of the per-distance sums (complete there:
    # every pair within K - 1 of its query is in its chunk's keys)
    t0, t1 = max(0, m - clip), min(n + m - 1, m + clip - 1)
    grad[:, t0 - (m - 1) + clip : t1 - (m - 1) + clip] = per_distance[:, t0:t1]
    band = grad.sum(1)  # [H]
    near = torch.zeros_like(band)  # d >= K: keys at least K after the query
    rows_with_near = n - clip  # queries 0 .. n - clip - 1 have such keys
    if not causal and rows_with_near > 0:
        r = rows_with_near
        # query i (reversed: u = r - 1 - i) reads keys j >= i + (m - n) + K, i.e. the
        # reversed keys u' = m - 1 - j <= u: top-left causal over r queries and r keys
        far_out, far_lse = triangle(
            q[:, :, :r].flip(2), k[:, :, m - r :].flip(2), v[:, :, m - r :].flip(2), scale
        )  # [B, H, r, value_dim], [B, H, r]: reversed query order
        far_lse = far_lse.to(dtype) + clipped[:, 2 * clip, None].to(dtype)
        mass = torch.exp(far_lse - lse[:, :, :r].flip(-1))  # the triangle's softmax share
        far_dot = (grad_out[:, :, :r].flip(2) * far_out.to(dtype)).sum(-1)  # dO_i . Ō_i
        near = (mass * (far_dot - delta[:, :, :r].flip(-1))).sum((0, 2))
        grad[:, 2 * clip] += near
    if m - 1 >= clip:  # some query has keys at d <= -K: the rest of its zero row sum
        grad[:, 0] -= band + near
    return grad.to(clipped.dtype)


class _ClippedBiasGradient(torch.autograd.Function):
    """out, unchanged, whose backward also gives the gradient of the clipped bias c that
    went into it as a constant (``clipped_bias_gradient``): attention computed with a
    detached bias (flex's per-score read, no atomic adds in its backward) still trains
    c. The gradient into out passes through to that attention's own backward."""

    @staticmethod
    def forward(
        ctx: Any,
        out: Tensor,
        clipped: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        lse: Tensor,
        scale: float,
        causal: bool,
        triangle: Any,
    ) -> Tensor:
        ctx.save_for_backward(out, clipped, q, k, v, lse)
        ctx.scale, ctx.causal, ctx.triangle = scale, causal, triangle
        return out.clone()

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        out, clipped, q, k, v, lse = ctx.saved_tensors
        n, m = q.shape[2], k.shape[2]
        vec = clipped_distance_vector(clipped, n, m, ctx.causal)
        grad_clipped = clipped_bias_gradient(
            q, k, v, clipped, vec, out, lse, grad_out, ctx.scale, ctx.causal, ctx.triangle
        )
        return (grad_out, grad_clipped) + (None,) * 7


def attach_clipped_bias_gradient(
    out: Tensor,
    clipped: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    scale: float,
    causal: bool,
    triangle: Any,
) -> Tensor:
    """``out`` [B, H, N, value_dim] of attention at default positions with the bias
    c[clamp(j - i, -K, K)] taken as a constant, row log-sum-exp ``lse`` [B, H, N]; the
    result is out, through which c [H, 2K + 1] also gets its gradient. q: [B, H, N, D];
    k, v: [B, H, M, D] (heads repeated for GQA), as the attention saw them."""
    args = (out, clipped, q.detach(), k.detach(), v.detach(), lse.detach())
    return _ClippedBiasGradient.apply(*args, scale, causal, triangle)


def clipped_bias_attention(
    q: Tensor, k: Tensor, v: Tensor, clipped: Tensor, scale: float, causal: bool
) -> Tensor:
    """Attention with the bias c[clamp(j - i, -K, K)] for default positions (the queries
    are the last N of M keys), c = ``clipped`` [H, 2K + 1] (already scaled where the bias
    sits inside the scale), causal or not: [B, H, N, value_dim]. q: [B, H, N, D]; k, v:
    [B, H, M, D]. See ``_ClippedBiasAttention``."""
    return _ClippedBiasAttention.apply(q, k, v, clipped, scale, causal)
