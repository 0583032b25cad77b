"""Relative terms read by distance with no clip, at explicit positions, on the sdpa
backend without autograd: each chunk of queries projected over only the table rows its
own pairs read (Transformer-XL's sinusoid rows R_{i-j}, Dai et al. 2019).

A term of query position i and key position j reads the row diagonal[j - i - low] of
its factors, which are made once per call over every key-minus-query distance the
call's chunks reach, low .. high (``_relative_factors`` at the default diagonals of
that range, ``ranged_diagonals``). A chunk of r queries against w keys at positions a
step apart reads r + w - 1 of those distances, and at most r * w in any case. Its rows
are found by marking the rows its pairs read (``span_rows``), the factors' side it
reads per pair (its queries, or its keys) is projected over those rows alone into a
buffer every chunk reuses, and each pair's term is gathered from there into another
(``gathered_terms``):

    term_ij = scale * x . rows[used[lut[diagonal[j - i - low]]]]

Before, each chunk built its terms as the dense path does: the distinct distances by
sorting its pairs, then each term as an [B, H, r, w] tensor and their sum, every one
fresh, so glibc mapped and the kernel faulted in each of them per chunk.

A CPU training step of a lone query-side term (Transformer-XL's, with its u . k_j
joined into q) runs the chunks as one node (``ranged_attention_at_positions``, over
``attention_at_positions``): each chunk projects its queries over the rows it reads in
the forward and again in the backward, where dS is laid into that projection at each
pair's row and from there into x and the rows read. No chunk keeps a graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ._chunked_flash import Span
from ._clipped_relative import (
    TermsAtPositions,
    batch_and_heads,
    gather_scratch,
    gathered_terms,
    span_distances,
)
from ._mask_buffer import ChunkBuffer, largest_span
from ._relative_at_positions import SpanMasks, attention_at_positions
from ._terms import (
    RelativeFactors,
    RelativePart,
    joined_query_term,
    project_factors,
    scaled_factors,
)

#: the factors made once per call read at most this many diagonals per query and key of
#: the call (positions a step apart reach N + M - 1, two steps apart about twice that);
#: positions farther apart go to the dense terms per chunk, which project only the
#: distances present
RANGED_DIAGONALS_PER_POSITION = 4


def span_distance_bounds(
    spans: list[Span], q_positions: Tensor, k_positions: Tensor
) -> list[tuple[int, int]]:
    """The least and the greatest key minus query position of each span's pairs (i0,
    i1, lo, hi: queries i0 .. i1 - 1 against keys lo .. hi - 1), over every batch row of
    batched positions. q_positions: [N] or [B, N]; k_positions: [M] or [B, M]. One host
    sync for all spans."""
    queries = q_positions.reshape(-1, q_positions.shape[-1])  # [1 or B, N]
    keys = k_positions.reshape(-1, k_positions.shape[-1])  # [1 or B, M]
    ends = []
    for i0, i1, lo, hi in spans:
        rows, columns = queries[:, i0:i1], keys[:, lo:hi]
        ends.append(torch.stack((columns.amin() - rows.amax(), columns.amax() - rows.amin())))
    return [(least, greatest) for least, greatest in torch.stack(ends).tolist()]


def ranged_diagonals(bounds: list[tuple[int, int]], n: int, m: int) -> tuple[int, int] | None:
    """The diagonals (n', m') of default positions that hold every distance of
    ``bounds`` (``span_distance_bounds``): n' queries against m' keys reach key minus
    query position -(m' - 1) .. n' - 1. None where they would be more than
    ``RANGED_DIAGONALS_PER_POSITION`` per query and key of the call (n, m)."""
    least = min(low for low, _ in bounds)
    greatest = max(high for _, high in bounds)
    before, after = max(-least, 0), max(greatest, 0)  # keys before and after a query
    if before + after + 1 > RANGED_DIAGONALS_PER_POSITION * (n + m):
        return None
    return after + 1, before + 1


def span_rows(diagonal: Tensor, entry: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """The rows that a span's pairs read and where each row lands among them.

    diagonal: int64 [T], the row of each diagonal among ``rows`` rows; entry: int64
    [1 or B, r, w], each pair's diagonal. Returns ``used``, int64 [K'], the rows read
    (ascending), and ``lut``, int64 [rows]: row used[c] goes to c (an unread row to -1
    or to a read neighbour's c, never read)."""
    read = torch.zeros(rows, dtype=torch.bool, device=diagonal.device)
    read[diagonal[entry]] = True
    used = read.nonzero().squeeze(1)  # [K']
    return used, read.cumsum(0) - 1


def span_part(
    factor: RelativeFactors, span: Span, entry: Tensor, buffer: ChunkBuffer | None
) -> RelativePart:
    """One term's part for the span (i0, i1, lo, hi) with pairs at diagonals ``entry``
    [1 or B, r, w]: projected over the rows the span reads (``span_rows``), the query
    side over its queries alone and the key side over its keys alone (into ``buffer``,
    [B, H, r or w, K']), a trained vector's over those rows, the content term over its
    keys; each diagonal leads to its row among those rows."""
    side, x, rows, diagonal, scale = factor
    i0, i1, lo, hi = span
    if diagonal is None:  # "content": one value per key
        return project_factors(factor._replace(x=x[:, :, lo:hi]))  # [B, H, w]
    if side == "global":
        used, lut = span_rows(diagonal, entry, rows.shape[0])
        read = rows.index_select(0, used)  # [K', H, D]
        return project_factors(RelativeFactors(side, x, read, lut[diagonal], scale))
    assert buffer is not None  # a query- or key-side term
    x = x[:, :, i0:i1] if side == "query" else x[:, :, lo:hi]  # [B, H, r or w, D]
    projected, _, span_diagonal = projected_on_rows_read(x, rows, diagonal, entry, scale, buffer)
    return RelativePart(side, projected, span_diagonal)


def projected_on_rows_read(
    x: Tensor, rows: Tensor, diagonal: Tensor, entry: Tensor, scale: float, buffer: ChunkBuffer
) -> tuple[Tensor, Tensor, Tensor]:
    """A span's queries or keys x [B, H, r, D] projected, times ``scale``, on only the
    rows of ``rows`` [T, H, D] that its pairs read (``span_rows``; ``diagonal`` [T'],
    the row of each diagonal; ``entry`` [1 or B, r, w], each pair's diagonal).

    Returns the projection [B, H, r, K'], a view of ``buffer`` laid out head by head
    ([H, B * r, K']: one matrix product per head over the batch's rows, where a
    broadcast matmul would copy the rows per batch row and its result into the buffer),
    the rows read ``used`` [K'], and each diagonal's row among them [T']."""
    used, lut = span_rows(diagonal, entry, rows.shape[0])
    read = rows.transpose(0, 1).index_select(1, used)  # [H, K', D]
    x, read = scaled_factors(x, read, scale)
    batch, heads, count, width = x.shape
    by_head = x.transpose(0, 1).reshape(heads, batch * count, width)  # [H, B * r, D]
    shape = (heads, batch * count, read.shape[1])
    into = buffer.view(shape, torch.promote_types(x.dtype, read.dtype), x.device)
    scores = torch.bmm(by_head, read.transpose(-1, -2), out=into)  # [H, B * r, K']
    return scores.unflatten(1, (batch, count)).transpose(0, 1), used, lut[diagonal]


def ranged_span_terms(
    factors: list[RelativeFactors],
    diagonals: tuple[int, int],
    bounds: list[tuple[int, int]],
    spans: list[Span],
) -> TermsAtPositions:
    """The terms of ``factors`` (merged, made at the default ``diagonals`` (n', m') of
    ``ranged_diagonals``) for each span of ``spans`` at its positions, summed:
    [B or 1, H, r, w] (see the module docstring). ``bounds``: each span's distances
    (``span_distance_bounds``), which size the buffers that the spans reuse: a span's
    terms are valid until the next span's are made. No autograd."""
    low = 1 - diagonals[1]  # the least distance the diagonals hold
    rows = max(factor.rows.shape[0] for factor in factors)
    batch, heads = batch_and_heads(factors)
    widest = max(
        max(i1 - i0, hi - lo) * min(rows, greatest - least + 1)
        for (i0, i1, lo, hi), (least, greatest) in zip(spans, bounds, strict=True)
    )  # a span's queries or keys times the rows it can read
    buffers = [
        ChunkBuffer(batch * heads * widest) if factor.side in ("query", "key") else None
        for factor in factors
    ]
    scratch = gather_scratch(factors, spans)

    def terms(span: Span, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        entry = span_distances(q_positions, k_positions, span) - low  # [1 or B, r, w]
        parts = [
            span_part(factor, span, entry, buffer)
            for factor, buffer in zip(factors, buffers, strict=True)
        ]
        columns = torch.arange(span[3] - span[2], device=entry.device).unsqueeze(0)  # [1, w]
        return gathered_terms(parts, entry, columns, 0, scratch)

    return terms


def ranged_attention_at_positions(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    factors: list[RelativeFactors],
    diagonals: tuple[int, int],
    bounds: list[tuple[int, int]],
    spans: list[Span],
    q_positions: Tensor,
    k_positions: Tensor,
    masked: SpanMasks,
    scale: float,
) -> Tensor:
    """softmax(scale q kᵀ + terms + masks) v at explicit positions as one autograd node
    over the spans (``attention_at_positions``), for a CPU training step: each span
    projects its queries over only the rows its pairs read, in the forward and again in
    the backward, which lays dS into that projection at the row each pair read and from
    there into x's rows and the table's rows (``_RangedRows``). Before, each span built
    its terms through autograd.

    q: [B, H, N, D]; k, v: [B, H, M, D] (heads repeated for GQA); ``factors`` merged,
    made at the default ``diagonals`` (n', m') of ``ranged_diagonals``, as
    ``lone_query_term`` takes them; ``bounds``: each span's distances
    (``span_distance_bounds``) -> [B, H, N, value_dim], differentiable (once) in q, k,
    v and the factors' tensors."""
    q, x, rows, diagonal = joined_query_term(q, factors, scale)
    positions = (q_positions, k_positions)
    layout = _RangedRows(diagonal, 1 - diagonals[1], bounds, positions, masked)
    return attention_at_positions(q, k, v, spans, layout, scale, [x, rows])


class _RangedScratch(NamedTuple):
    """Buffers a pass over the spans reuses: a span's projection (then its gradient,
    the terms being gathered by then), [H, B * r, K'], and its gathered terms."""

    projection: ChunkBuffer
    terms: ChunkBuffer


class _RangedRows:
    """``ranged_attention_at_positions``' terms of a span and their gradient (the
    ``SpanTerms`` of ``attention_at_positions``), from the inputs x [B, H, N, D] (scaled)
    and rows [T, H, D]: term_ij = x_i . rows[used[lut[diagonal[j - i - low]]]]."""

    def __init__(
        self,
        diagonal: Tensor,
        low: int,
        bounds: list[tuple[int, int]],
        positions: tuple[Tensor, Tensor],
        masked: SpanMasks,
    ):
        self.diagonal, self.low, self.bounds = diagonal, low, bounds
        self.q_positions, self.k_positions = positions  # [N] or [B, N]; [M] or [B, M]
        self.masked = masked
        # the last span's rows read (``used`` [K']) and each pair's row among them
        # ([1 or B, r, w]), which its gradient goes back through
        self.read: tuple[Span, Tensor, Tensor] | None = None

    def scratch(self, inputs: tuple[Tensor, ...], spans: list[Span]) -> _RangedScratch:
        """A projection buffer for the span that reads the most rows and a buffer for
        the largest span's terms."""
        x, rows = inputs
        per_row = x.shape[0] * x.shape[1]
        widest = max(
            (i1 - i0) * min(rows.shape[0], greatest - least + 1)
            for (i0, i1, _, _), (least, greatest) in zip(spans, self.bounds, strict=True)
        )  # a span's queries times the rows it can read
        return _RangedScratch(
            ChunkBuffer(per_row * widest), ChunkBuffer(per_row * largest_span(spans))
        )

    def terms(self, span: Span, inputs: tuple[Tensor, ...], scratch: _RangedScratch) -> Tensor:
        """The span's terms with its masks joined: [B, H, r, w] in ``scratch``."""
        x, rows = inputs
        i0, i1, lo, hi = span
        q_at, k_at = self.q_positions[..., i0:i1], self.k_positions[..., lo:hi]
        entry = span_distances(q_at, k_at, span) - self.low  # [1 or B, r, w]
        projected, used, span_diagonal = projected_on_rows_read(
            x[:, :, i0:i1], rows, self.diagonal, entry, 1.0, scratch.projection
        )  # [B, H, r, K']
        pair_rows = span_diagonal[entry]  # [1 or B, r, w]: each pair's row among used
        batch, heads, count, width = *projected.shape[:3], hi - lo
        shape = (batch, heads, count, width)
        into = scratch.terms.view(shape, projected.dtype, projected.device)
        index = pair_rows.unsqueeze(1).expand(shape)
        terms = torch.gather(projected, -1, index, out=into)  # [B, H, r, w]
        self.read = (span, used, pair_rows)
        return self.masked(span, terms)

    def add_gradient(
        self,
        span: Span,
        grad_logits: Tensor,
        inputs: tuple[Tensor, ...],
        grads: list[Tensor | None],
        scratch: _RangedScratch,
    ) -> None:
        """dS [B, H, r, w] into the span's projection at the row each pair read, then
        into x's rows of the span's queries and into the rows it read."""
        assert self.read is not None and self.read[0] == span  # its terms were the last
        _, used, pair_rows = self.read
        x, rows = inputs
        grad_x, grad_rows = grads
        i0, i1, _, _ = span
        batch, heads, count, _ = grad_logits.shape
        shape = (heads, batch * count, used.shape[0])
        by_head = scratch.projection.view(shape, grad_logits.dtype, grad_logits.device).zero_()
        grad_projected = by_head.unflatten(1, (batch, count)).transpose(0, 1)  # [B, H, r, K']
        index = pair_rows.unsqueeze(1).expand(grad_logits.shape)
        grad_projected.scatter_add_(-1, index, grad_logits)
        if grad_x is not None:  # [H, B * r, K'] @ [H, K', D], back to [B, H, r, D]
            read = rows.transpose(0, 1).index_select(1, used)  # [H, K', D]
            grad_span = torch.bmm(by_head, read.to(by_head.dtype))
            grad_x[:, :, i0:i1] += grad_span.unflatten(1, (batch, count)).transpose(0, 1)
        if grad_rows is not None:  # [H, K', B * r] @ [H, B * r, D] -> [H, K', D]
            x_span = x[:, :, i0:i1].transpose(0, 1).reshape(heads, batch * count, -1)
            grad_read = torch.bmm(by_head.transpose(1, 2), x_span.to(by_head.dtype))
            grad_rows.index_add_(0, used, grad_read.transpose(0, 1).to(grad_rows.dtype))
