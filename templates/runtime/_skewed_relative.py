"""A query-side relative term at default positions as a strided view per query chunk.

A query-side term depends on the query and on j - i alone: term(i, j) = s x_i .
R[diagonal[j - i + N - 1]] (Transformer-XL's (q_i + v) . W_R R_(i-j), Dai et al.
2019, eq. 2, with its content-position and position-position terms merged). A chunk of
r queries i0 .. i1 - 1 against keys lo .. hi - 1 reads the W = r + (hi - lo) - 1
consecutive diagonals t = j - i + N - 1 from t0 = lo - (i1 - 1) + N - 1. Projecting
the chunk's x on those W rows gives P [B, H, r, W], and the term of query i0 + a and
key lo + c is P[a, c - a + r - 1]: one strided view of P (row stride W - 1), which
CPU SDPA reads as its mask in place. That is Transformer-XL's relative shift without
its pad and reshape, and without projecting every query on all N + M - 1 rows: a
chunk of 256 queries over 2048 keys projects 2303 rows, not 4095. A term with one
value per key (Transformer-XL's u . k_j) joins the queries: s q . k + s' u . k =
s (q + u s' / s) . k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._chunked_flash import Span
from ._terms import RelativeFactors, merged_factors, scaled_factors


def skewed_relative_serves(
    factors: list[RelativeFactors], q: Tensor, k: Tensor, v: Tensor, spans: list[Span]
) -> bool:
    """Whether ``skewed_relative_attention`` runs these terms: eager mode with no
    gradient anywhere, the terms one query-side term (after ``merged_factors``) and
    terms of one value per key, in q's dtype, and the chunks' windows of diagonals
    fewer rows to project than the query-side term's table (Transformer-XL's
    N + M - 1; a clipped table's 2K + 1 rows are cheaper projected once)."""
    if torch.compiler.is_compiling() or not factors:
        return False
    merged = merged_factors(factors)
    queries = [factor for factor in merged if factor.side == "query"]
    if len(queries) != 1 or any(factor.side not in ("query", "content") for factor in merged):
        return False
    tensors = [q, k, v, *(t for factor in merged for t in (factor.x, factor.rows))]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if any(t.dtype != q.dtype for t in tensors):
        return False
    windows = sum((i1 - i0) * ((i1 - i0) + (hi - lo) - 1) for i0, i1, lo, hi in spans)
    return windows < q.shape[2] * queries[0].rows.shape[0]


def skewed_relative_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    factors: list[RelativeFactors],
    spans: list[Span],
    scale: float,
    causal: bool,
) -> Tensor:
    """softmax(scale q kᵀ + terms) v at default positions, one SDPA call per span with
    its query-side term as a strided view of its projection (see the module docstring)
    and the terms of one value per key joined into q; ``causal`` masks the diagonals
    whose key comes after the query (key position M - N + i at most).

    q: [B, H, N, D]; k, v: [B, H, M, D] (heads repeated for grouped queries by the
    caller) -> [B, H, N, value_dim]; no autograd (``skewed_relative_serves``)."""
    n, m = q.shape[2], k.shape[2]
    merged = merged_factors(factors)
    (query_term,) = [factor for factor in merged if factor.side == "query"]
    assert query_term.diagonal is not None  # a query-side term reads rows by diagonal
    for content in (factor for factor in merged if factor.side == "content"):
        q = q + (content.scale / scale) * content.rows[0][:, None, :]  # [H, 1, D] per head
    x, table = scaled_factors(query_term.x, query_term.rows, query_term.scale)
    table = table.permute(1, 0, 2).contiguous()  # [H, K, D]: each chunk's rows in one read
    outs = []
    for i0, i1, lo, hi in spans:
        rows, keys = i1 - i0, hi - lo
        t0 = lo - (i1 - 1) + n - 1  # the chunk's first diagonal
        window = table.index_select(1, query_term.diagonal[t0 : t0 + rows + keys - 1])
        # [H, W, D] -> [B, H, rows, W], contiguous (the rows' transpose read in place)
        projected = torch.matmul(x[:, :, i0:i1], window.transpose(-1, -2))
        # entry (a, c) of the chunk's terms is projected[..., a, c - a + rows - 1]
        if causal:  # diagonal t reads a key after the query past t = m - 1
            projected[..., max(0, m - t0) :] = float("-inf")
        b, h, width = projected.shape[0], projected.shape[1], projected.shape[-1]
        strides = (h * rows * width, rows * width, width - 1, 1)
        start = projected.storage_offset() + rows - 1
        terms = projected.as_strided((b, h, rows, keys), strides, start)  # [B, H, rows, keys]
        out = F.scaled_dot_product_attention(
            q[:, :, i0:i1], k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=terms, scale=scale
        )
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
