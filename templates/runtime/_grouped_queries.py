"""A few queries under grouped-query heads (a decode step) as two batched matmuls.

With grouped-query attention (Ainslie et al. 2023) G = H / H_kv query heads share each
key-value head. A decode step's N queries per head are few, so the G heads' queries of
one key-value head fit in one small matrix of G * N rows, and the step is

    logits = scale * Q_g K^T + mask      [G N, D] x [D, M] per (batch, key-value head)
    out = softmax(logits) V              [G N, M] x [M, Dv]

two batched matmuls that read each cached key and value once. Logits and softmax are
float32 (float64 for float64 inputs; half-precision inputs through bmm's float32
output), and the weights are rounded to v's dtype for the second product, as
FlashAttention rounds its probabilities. Under autocast they run with it off (it
would take baddbmm to bfloat16), and the output is cast to autocast's dtype, the dtype
SDPA gives the other paths there (float64 stays float64, as autocast leaves it).

On a 2-core x86 CPU (float32, one query, head_dim 64 or 128, 1024 to 8192 cached keys)
these matmuls with an ALiBi-like mask took 0.27-0.31x the time of
F.scaled_dot_product_attention with ``enable_gqa`` and no mask at G = 8, 0.62x at G = 2
and 0.65-0.68x at G = 4 and batch 4, where SDPA with the mask took 1.0x; without
grouped heads (G = 1) they took 1.07-1.25x, so there SDPA serves, as it does below
about 2^17 key elements, where the extra calls cost more than they save. In the
modules, a decode step (batch 4, 32 heads, 8 key-value heads, head_dim 128) went from
1.10-1.17x plain SDPA to 0.84-0.96x with 1024 cached keys and from 1.01-1.05x to
0.63-0.77x with 8192 (benchmarks/results/decode_cpu_float32_cache*_grouped.md).

The matmuls flush denormal weights before the second product, so a bias that SDPA on
the CPU would take with a floor (``floored_bias``: a pass over every cached key for
its bound, about 30 small operations, and a read back to tell whether any entry moves)
needs none here. A decode step with a position bias therefore takes the matmuls
wherever they can run (``few_query_matmuls_serve``), grouped heads or not (a few
queries of a bias of j - i alone where the floor would move an entry): one query
against 449-512 cached keys (batch 1, 8 heads, 2-core AMD EPYC, float32) went from
5.3x plain SDPA to 3.0x for ALiBi, 5.9x to 3.7x for KERPLE's power kernel and 2.9x to
2.8x for T5; against 4033-4096 keys ALiBi from 2.9x to 1.5x (benchmarks/results/
revisions_cpu_float32_decode_flushed_matmuls*.md). A mask with one row per logit row
rides in the first product (``torch.baddbmm``), one pass fewer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ._inputs import repeat_kv
from ._masks import masked_softmax
from ._numerics import autocast_off, in_autocast_dtype

# Devices where a few grouped queries take the two batched matmuls
# (``grouped_queries_serve``): the CPU, measured (see the module docstring). On CUDA
# they were slower than SDPA's fused kernels (an H200, bf16, 8192 cached keys: RoPE's
# step 3.60x plain SDPA against 2.59x, ALiBi's 6.11x against 3.56x), so there SDPA
# serves.
GROUPED_QUERY_DEVICES: set[str] = {"cpu"}

# The most query rows per key-value head (G * N): at G * N = 16 the matmuls took 0.79 to
# 0.81x SDPA's time on the CPU, at 32 1.0x, at 64 1.1-1.2x.
GROUPED_QUERY_MAX_ROWS = 16

# The fewest key elements (B * H_kv * M * D) for the matmuls: at 2^17 (batch 1, 2
# key-value heads, 1024 keys of 64) they took 0.93x SDPA's time, at half that 1.2x.
GROUPED_QUERY_MIN_KEY_ELEMENTS = 1 << 17

# The fewest key elements per batch row (H_kv * M * D) for the matmuls where the batch
# and head axes of the keys or values do not merge (a [B, M, H_kv, D] cache seen as
# [B, H_kv, M, D], ``layout="bnhd"``): then they run one batch row at a time. 2-core
# x86 CPU, float32, 32 heads, 8 key-value heads, head_dim 128, one query, against SDPA
# with ``enable_gqa``: batch 4 and 1024 keys 2.08 ms against 3.18 ms, 4096 keys 10.9
# against 18.1, batch 2 and 512 keys (2^19 per row) 0.40 against 0.55, batch 16 and
# 256 keys (2^18) 2.97 against 3.13; batch 2 and 8 with 128 keys (2^17) 1.2x SDPA's.
GROUPED_QUERY_MIN_ROW_KEY_ELEMENTS = 1 << 18

# Input dtypes the matmuls compute in as they are (the CPU has no float32 output for
# half-precision matmuls, so there half precision stays with SDPA).
_FULL_PRECISION = (torch.float32, torch.float64)


# The weights below which a decode step's softmax weights become 0 on the CPU, per dtype
# (read once): the smallest normal value over the dtype's eps (float32: 9.9e-32), so that
# a weight's product with any entry of v above eps in size is no denormal. Flushing at
# the smallest normal value alone left ALiBi's weights down to 1.2e-38 at 512 keys,
# whose products with v are denormal: the second product took 46 us against 25 us with
# them flushed here (batch 1, 32 heads on 8, head_dim 128, 2-core x86 CPU), and its
# output was the same to the bit. A weight dropped here moves the output by at most
# 1e-31 times v's largest entry.
_FLUSHED_BELOW = {
    dtype: torch.finfo(dtype).tiny / torch.finfo(dtype).eps for dtype in _FULL_PRECISION
}


def grouped_queries_serve(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> bool:
    """Whether ``grouped_query_attention`` runs q [B, H, N, D] against k [B, H_kv, M, D]
    and v (with ``mask``) in place of SDPA: with grouped heads (H > H_kv), at least
    ``GROUPED_QUERY_MIN_KEY_ELEMENTS`` key elements, and where the matmuls can run
    (``few_query_matmuls_serve``; on CUDA also half precision where no gradient is
    needed: bmm's float32-output overload is a forward)."""
    groups = q.shape[1] // k.shape[1]
    if groups < 2 or k.numel() < GROUPED_QUERY_MIN_KEY_ELEMENTS:
        return False
    if q.dtype in _FULL_PRECISION or q.device.type != "cuda":
        return few_query_matmuls_serve(q, k, v)
    inputs = (q, k, v) if mask is None else (q, k, v, mask)
    trains = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    return not trains and _matmuls_fit(q, k, v)


def few_query_matmuls_serve(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether ``grouped_query_attention`` can run q [B, H, N, D] against k and v at all:
    float32/float64 inputs where the matmuls fit (``_matmuls_fit``). Where a bias would
    need a floor for SDPA, its callers take the matmuls whenever they can, grouped heads
    or not (see the module docstring)."""
    return q.dtype in _FULL_PRECISION and _matmuls_fit(q, k, v)


def _matmuls_fit(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """On ``GROUPED_QUERY_DEVICES``, at most ``GROUPED_QUERY_MAX_ROWS`` query rows per
    key-value head, and keys and values whose batch and head axes merge without a
    copy, or else (one batch row at a time) at least
    ``GROUPED_QUERY_MIN_ROW_KEY_ELEMENTS`` key elements per batch row."""
    if q.device.type not in GROUPED_QUERY_DEVICES:
        return False
    if q.shape[1] // k.shape[1] * q.shape[2] > GROUPED_QUERY_MAX_ROWS:
        return False
    if _heads_merge(k) and _heads_merge(v):
        return True
    return k.numel() >= GROUPED_QUERY_MIN_ROW_KEY_ELEMENTS * k.shape[0]


def _heads_merge(t: Tensor) -> bool:
    """Whether t [B, H_kv, M, d] views as [B * H_kv, M, d] (no copy)."""
    return t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1)


def grouped_query_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    every_row_reads: bool = False,
) -> Tensor:
    """softmax(scale * q . k^T + mask) @ v with each key-value head's G query heads as
    the rows of one matmul (see the module docstring); a row whose every key is masked
    gives zeros, as SDPA does (``every_row_reads``: the caller knows that each row reads
    a key, so no row needs that care). On the CPU weights below the smallest normal
    float over eps become 0 (``_FLUSHED_BELOW``).

    q: [B, H, N, D]; k: [B, H_kv, M, D]; v: [B, H_kv, M, Dv], H_kv dividing H and each
    merging its batch and head axes (``few_query_matmuls_serve``); mask: None, bool
    (True = attend) or additive float, broadcastable to [B, H, N, M]
    -> [B, H, N, Dv] in v's dtype; under autocast computed with it off and returned in
    autocast's dtype, as SDPA returns it there (float64 as it is).
    """
    device = q.device.type
    with autocast_off(device):
        out = _grouped_query_attention(q, k, v, mask, scale, every_row_reads)
    return in_autocast_dtype(out)


def _grouped_query_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    every_row_reads: bool,
) -> Tensor:
    """``grouped_query_attention`` with autocast off -> [B, H, N, Dv] in v's dtype."""
    b, h, n, d = q.shape
    if b > 1 and not (_heads_merge(k) and _heads_merge(v)):  # one batch row at a time
        outs = [  # autocast is off here: each row in v's dtype
            grouped_query_attention(
                q[i : i + 1],
                k[i : i + 1],
                v[i : i + 1],
                _batch_row(mask, i, b),
                scale,
                every_row_reads,
            )
            for i in range(b)
        ]
        return torch.cat(outs, dim=0)  # [B, H, N, Dv]
    heads_kv, m = k.shape[1], k.shape[2]
    rows = q.reshape(b * heads_kv, h // heads_kv * n, d)  # [B H_kv, G N, D]
    keys = k.view(b * heads_kv, m, d).transpose(1, 2)  # [B H_kv, D, M]
    added = _mask_as_rows(mask, q, heads_kv, m)  # [B H_kv, G N, M] or None
    if added is not None:  # the mask rides in the product: one pass fewer
        logits = torch.baddbmm(added, rows, keys, alpha=scale)  # [B H_kv, G N, M]
    else:
        if q.dtype in _FULL_PRECISION:  # scaled in the product (beta 0 reads no input)
            unread = rows.new_empty((b * heads_kv, rows.shape[1], m))
            logits = torch.baddbmm(unread, rows, keys, beta=0, alpha=scale)  # [B H_kv, G N, M]
        else:  # half-precision inputs, float32 out
            logits = torch.bmm(rows, keys, torch.float32).mul_(scale)  # [B H_kv, G N, M]
        logits = logits.view(b, h, n, m)  # [B, H, N, M], where masks broadcast
        if mask is not None and mask.dtype == torch.bool:
            logits = logits.masked_fill_(~mask, float("-inf"))
        elif mask is not None:
            logits = logits.add_(mask)
    if mask is None or every_row_reads:
        weights = torch.softmax(logits, dim=-1)
    else:
        weights = masked_softmax(logits)
    if weights.device.type == "cpu":
        # weights near the smallest normal float (a steep bias far from the query:
        # ALiBi at 512 keys) are denormal, or give denormal products with v, and the CPU
        # multiplies those slowly: the second product took 2x as long
        # (``_FLUSHED_BELOW``; ``flush_denormals`` does this process-wide). Softmax
        # keeps its output for the backward, so only without one in place.
        floor = _FLUSHED_BELOW[weights.dtype]  # logits are float32 or float64 here
        if torch.is_grad_enabled() and weights.requires_grad:
            weights = torch.threshold(weights, floor, 0.0)
        else:
            weights = torch.threshold_(weights, floor, 0.0)
    if weights.dtype != v.dtype:
        weights = weights.to(v.dtype)
    out = grouped_values(weights.view(b, h, n, m), v)  # [B, H, N, Dv]
    assert out is not None  # v's batch and head axes merge (one batch row, or checked)
    return out


def grouped_scores(q: Tensor, k: Tensor) -> Tensor | None:
    """q . k^T [B, H, N, M] for q [B, H, N, D] and k [B, H_kv, M, D] (H_kv dividing
    H), each key-value head's G query heads the rows of one matmul, so no key is copied
    out per query head; None where k's batch and head axes do not merge
    (``_heads_merge``)."""
    b, h, n, d = q.shape
    heads_kv, m = k.shape[1], k.shape[2]
    if not _heads_merge(k):
        return None
    rows = q.reshape(b * heads_kv, h // heads_kv * n, d)  # [B H_kv, G N, D]
    scores = torch.bmm(rows, k.view(b * heads_kv, m, d).transpose(1, 2))  # [B H_kv, G N, M]
    return scores.view(b, h, n, m)


def grouped_values(weights: Tensor, v: Tensor) -> Tensor | None:
    """weights @ v [B, H, N, Dv] for weights [B, H, N, M] and v [B, H_kv, M, Dv], each
    key-value head's G query heads the rows of one matmul (``grouped_scores``'
    counterpart); None where v's batch and head axes do not merge."""
    b, h, n, m = weights.shape
    heads_kv, dv = v.shape[1], v.shape[-1]
    if not _heads_merge(v):
        return None
    rows = weights.reshape(b * heads_kv, h // heads_kv * n, m)  # [B H_kv, G N, M]
    return torch.bmm(rows, v.view(b * heads_kv, m, dv)).view(b, h, n, dv)


def scores_per_query_head(q: Tensor, k: Tensor) -> Tensor:
    """q . k^T [B, H, N, M], k with q's heads or grouped-query heads: grouped, its keys
    are copied out per query head only where its batch and head axes do not merge
    (``grouped_scores``)."""
    groups = q.shape[1] // k.shape[1]
    scores = grouped_scores(q, k) if groups > 1 else None
    return torch.matmul(q, repeat_kv(k, groups).transpose(-2, -1)) if scores is None else scores


def values_per_query_head(weights: Tensor, v: Tensor) -> Tensor:
    """weights @ v [B, H, N, Dv], v with the weights' heads or grouped-query heads
    (``scores_per_query_head``'s counterpart, ``grouped_values``)."""
    groups = weights.shape[1] // v.shape[1]
    out = grouped_values(weights, v) if groups > 1 else None
    return torch.matmul(weights, repeat_kv(v, groups)) if out is None else out


def _batch_row(mask: Tensor | None, row: int, batch: int) -> Tensor | None:
    """Batch row ``row`` of a mask broadcastable to [batch, H, N, M] (as it is where it
    broadcasts over the batch)."""
    if mask is None or mask.dim() < 4 or mask.shape[0] != batch:
        return mask
    return mask[row : row + 1]


def _mask_as_rows(mask: Tensor | None, q: Tensor, heads_kv: int, m: int) -> Tensor | None:
    """An additive float mask in q's dtype as the logits' rows [B H_kv, G N, M] (query
    head h reads key-value head h // G, so [B, H, N, M] is [B, H_kv, G, N, M]; a copy
    where its strides do not merge, as a slice of a longer vector's does not), where it
    holds one row per batch, head and query and q is float32 or float64 (half-precision
    logits come from bmm's float32 output instead); else None."""
    b, h, n = q.shape[:3]
    if mask is None or mask.dtype != q.dtype or q.dtype not in _FULL_PRECISION:
        return None
    if mask.shape != (b, h, n, m):
        return None
    return mask.reshape(b * heads_kv, h // heads_kv * n, m)


def scaled_dot_product(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    every_row_reads: bool = False,
) -> Tensor:
    """F.scaled_dot_product_attention(q, k, v, mask, scale), grouped-query heads
    included, or ``grouped_query_attention`` where it serves (a decode step), told
    ``every_row_reads`` (the caller knows that each query reads a key: its softmax then
    needs no care for rows with every key masked). One query against 4033-4096 keys, 8
    heads on 2, 2-core CPU, against plain SDPA with ``enable_gqa``: T5 1.17x -> 0.94x,
    KERPLE-log 1.13x -> 0.90x, Transformer-XL 2.34x -> 2.07x
    (``revisions_cpu_float32_decode_rows_read_grouped.md``)."""
    if grouped_queries_serve(q, k, v, mask):
        return grouped_query_attention(q, k, v, mask, scale, every_row_reads)
    gqa: dict[str, Any] = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, **gqa)
