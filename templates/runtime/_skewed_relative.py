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

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ._chunked_flash import (
    Span,
    cpu_flash_forward,
    cpu_flash_serves,
    explicit_backward_scratch,
    explicit_span_backward,
)
from ._diagonal_projection import (
    DiagonalWindow,
    add_window_gradient,
    project_window,
    window_of,
)
from ._first_order import first_order_only
from ._mask_buffer import ChunkBuffer
from ._terms import RelativeFactors, joined_query_term, lone_query_term

#: devices where the sdpa backend takes ``skewed_relative_attention`` (its chunks of
#: queries are ``SDPA_QUERY_CHUNK``'s; the training step runs the CPU flash kernels)
SKEWED_RELATIVE_DEVICES: set[str] = {"cpu"}

#: the chunks' windows of diagonals may hold up to this many rows per row of the table
#: projected for every query: the view needs no gather, which the table's projection
#: does per pair. 2-core CPU, float32, batch 2, 8 heads, against plain SDPA, with the
#: old bound of 1: Transformer-XL, 256 causal queries against 2048 keys (its windows
#: 1.12x its table of M rows: chunked prefill, or a segment against its memory),
#: forward 5.55x -> 2.72x, training step 5.90x -> 3.70x; BERT relative_key at N = 1024
#: (1.25x) within noise. A table clipped at a few rows stays projected once.
SKEWED_MAX_WINDOW_RATIO = 2


def skewed_relative_serves(
    factors: list[RelativeFactors], q: Tensor, k: Tensor, v: Tensor, spans: list[Span]
) -> bool:
    """Whether ``skewed_relative_attention`` runs these terms: eager mode on a device in
    ``SKEWED_RELATIVE_DEVICES``, the terms one
    query-side term and terms of one value per key (``factors`` as ``merged_factors``
    gives them), in q's
    dtype, a training step only where the CPU flash kernels take q
    (``cpu_flash_serves``), and the chunks' windows of diagonals at most
    ``SKEWED_MAX_WINDOW_RATIO`` times as many rows to project as the query-side term's
    table for every query (Transformer-XL's N + M - 1 rows, or M causal; a table clipped
    at a few rows is cheaper projected once)."""
    if torch.compiler.is_compiling() or not factors:
        return False
    if q.device.type not in SKEWED_RELATIVE_DEVICES:
        return False
    if not lone_query_term(factors):
        return False
    tensors = [q, k, v, *(t for factor in factors for t in (factor.x, factor.rows))]
    if any(t.dtype != q.dtype for t in tensors):
        return False
    trains = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if trains and not cpu_flash_serves(q, v):
        return False
    windows = sum((i1 - i0) * ((i1 - i0) + (hi - lo) - 1) for i0, i1, lo, hi in spans)
    (table_rows,) = [factor.rows.shape[0] for factor in factors if factor.side == "query"]
    return windows <= SKEWED_MAX_WINDOW_RATIO * q.shape[2] * table_rows


def skewed_relative_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    factors: list[RelativeFactors],
    spans: list[Span],
    scale: float,
    causal: bool,
) -> Tensor:
    """softmax(scale q kᵀ + terms) v at default positions, one attention call per span
    with its query-side term as a strided view of its projection (see the module
    docstring) and the terms of one value per key joined into q; ``causal`` masks the
    diagonals whose key comes after the query (key position M - N + i at most).

    q: [B, H, N, D]; k, v: [B, H, M, D] (heads repeated for grouped queries by the
    caller); ``factors`` merged (``merged_factors``) -> [B, H, N, value_dim]. Without
    autograd, SDPA per span; with it, one node (``_SkewedAttention``) whose backward
    makes each span's view again."""
    q, x, table, diagonal = joined_query_term(q, factors, scale)
    table = table.permute(1, 0, 2).contiguous()  # [H, K, D]: each chunk's rows in one read
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, x, table)):
        out: Tensor = _SkewedAttention.apply(q, k, v, x, table, diagonal, spans, scale, causal)
        return out
    outs = []
    projections = projection_buffer(x, spans)
    for i0, i1, lo, hi in spans:
        span = (i0, i1, lo, hi)
        terms, _ = skewed_terms(x, table, diagonal, span, q.shape[2], causal, projections)
        rows, keys, values = q[:, :, i0:i1], k[:, :, lo:hi], v[:, :, lo:hi]
        outs.append(
            F.scaled_dot_product_attention(rows, keys, values, attn_mask=terms, scale=scale)
        )
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def projection_buffer(x: Tensor, spans: list[Span]) -> ChunkBuffer:
    """A buffer for the spans' projections [B, H, r, W] (``skewed_terms``' ``out``),
    W = r + keys - 1, made one at a time. x: [B, H, N, D]."""
    per_row = x.shape[0] * x.shape[1]
    return ChunkBuffer(
        max(per_row * (i1 - i0) * (i1 - i0 + hi - lo - 1) for i0, i1, lo, hi in spans)
    )


def diagonal_window(diagonal: Tensor, span: Span, n: int, causal: bool) -> DiagonalWindow:
    """The ``DiagonalWindow`` of span (i0, i1, lo, hi): its W = r + keys - 1 diagonals
    from t0 = lo - (i1 - 1) + N - 1, those past key position M - N + i hidden where
    ``causal``. diagonal: the table row of each of the N + M - 1 diagonals, int64."""
    i0, i1, lo, hi = span
    m = diagonal.shape[0] - n + 1  # diagonals: N + M - 1
    t0 = lo - (i1 - 1) + n - 1
    rows = diagonal[t0 : t0 + (i1 - i0) + (hi - lo) - 1]  # [W]
    return window_of(rows, min(rows.shape[0], max(0, m - t0)) if causal else rows.shape[0])


def skewed_terms(
    x: Tensor,
    table: Tensor,
    diagonal: Tensor,
    span: Span,
    n: int,
    causal: bool,
    out: ChunkBuffer,
) -> tuple[Tensor, DiagonalWindow]:
    """The terms x_i . table[:, diagonal[j - i + N - 1]] of span (i0, i1, lo, hi) as a
    strided view [B, H, r, keys] of the span's projection [B, H, r, W] (made in ``out``
    by ``project_window``, each run of one row projected once; no autograd), and its
    ``DiagonalWindow``. x: [B, H, N, D] (scaled); table: [H, K, D], x's dtype;
    ``causal``: -inf on the diagonals past key position M - N + i, M = keys of a span
    that ends at the last key."""
    i0, i1 = span[0], span[1]
    rows, keys = i1 - i0, span[3] - span[2]
    window = diagonal_window(diagonal, span, n, causal)
    batch, heads, width = x.shape[0], x.shape[1], window.rows.shape[0]
    projected = out.view((batch, heads, rows, width), x.dtype, x.device)
    project_window(x[:, :, i0:i1], table, window, projected)
    # entry (a, c) of the span's terms is projected[..., a, c - a + r - 1]
    strides = (heads * rows * width, rows * width, width - 1, 1)
    start = projected.storage_offset() + rows - 1
    return projected.as_strided((batch, heads, rows, keys), strides, start), window


def skewed_gradient(
    grad_terms: Tensor,
    terms: Tensor,
    window: DiagonalWindow,
    x: Tensor,
    table: Tensor,
    span: Span,
    buffer: ChunkBuffer,
    grad_x: Tensor,
    grad_table: Tensor,
) -> None:
    """Adds the gradient of span's terms, dS [B, H, r, keys], into x's and the table's:
    laid through the view ``terms`` (``skewed_terms``' first output, ``window`` its
    second) into the span's projection gradient [B, H, r, W] (in ``buffer``, zeroed
    first: each (query, key) its own entry), then into x's rows, dx = dP R, and the
    rows of the span's diagonals, dR = dPᵀ x (``add_window_gradient``). grad_x: [B, H,
    N, D]; grad_table: [H, K, D]."""
    i0, i1 = span[0], span[1]
    shape = terms.shape[:2] + (i1 - i0, window.rows.shape[0])  # [B, H, r, W]
    grad_projected = buffer.view(shape, grad_terms.dtype, grad_terms.device).zero_()
    grad_projected.as_strided(terms.shape, terms.stride(), i1 - i0 - 1).copy_(grad_terms)
    rows_x, rows_grad_x = x[:, :, i0:i1], grad_x[:, :, i0:i1]
    add_window_gradient(grad_projected, window, rows_x, table, rows_grad_x, grad_table)


class _SkewedAttention(torch.autograd.Function):
    """``skewed_relative_attention`` with gradients into q, k, v, x and the table, as
    one node: the CPU flash kernel forward per span, and a backward per span that
    makes its view again and forms dS explicitly (``explicit_flash_backward``), dS
    being also the terms' gradient: laid into the span's
    projection through the same view (each (query, key) its own entry), then into x's
    rows and the table's rows of the span's diagonals."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        x: Tensor,
        table: Tensor,
        diagonal: Tensor,
        spans: list[Span],
        scale: float,
        causal: bool,
    ) -> Tensor:
        n = q.shape[2]
        out = q.new_empty(q.shape[:-1] + v.shape[-1:])  # [B, H, N, value_dim]
        lse = q.new_empty(q.shape[:-1])  # [B, H, N]
        projections = projection_buffer(x, spans)
        for i0, i1, lo, hi in spans:
            span = (i0, i1, lo, hi)
            terms, _ = skewed_terms(x, table, diagonal, span, n, causal, projections)
            rows, keys, values = q[:, :, i0:i1], k[:, :, lo:hi], v[:, :, lo:hi]
            out[:, :, i0:i1], lse[:, :, i0:i1] = cpu_flash_forward(rows, keys, values, terms, scale)
        ctx.save_for_backward(q, k, v, x, table, diagonal, out, lse)
        ctx.spans, ctx.scale, ctx.causal = spans, scale, causal
        return out

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, x, table, diagonal, out, lse = ctx.saved_tensors
        scale, n = ctx.scale, q.shape[2]
        grads = [torch.zeros_like(t) for t in (q, k, v, x, table)]
        grad_q, grad_k, grad_v, grad_x, grad_table = grads
        projections, grad_projections = (projection_buffer(x, ctx.spans) for _ in "pg")
        scratch = explicit_backward_scratch(q, ctx.spans)  # P and dP of a span
        qkv_grads = (grad_q, grad_k, grad_v)
        for i0, i1, lo, hi in ctx.spans:
            span = (i0, i1, lo, hi)
            terms, window = skewed_terms(x, table, diagonal, span, n, ctx.causal, projections)
            grad_logits = explicit_span_backward(
                grad_out, q, k, v, out, lse, span, terms, scale, qkv_grads, scratch
            )  # dS [B, H, r, keys]
            skewed_gradient(
                grad_logits, terms, window, x, table, span, grad_projections, grad_x, grad_table
            )
        return grad_q, grad_k, grad_v, grad_x, grad_table, None, None, None, None
