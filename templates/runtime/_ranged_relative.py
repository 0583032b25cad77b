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
"""

from __future__ import annotations

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
from ._mask_buffer import ChunkBuffer
from ._terms import RelativeFactors, RelativePart, project_factors, scaled_factors

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
    used, lut = span_rows(diagonal, entry, rows.shape[0])
    span_diagonal = lut[diagonal]  # [T]: each diagonal's row among the rows read
    if side == "global":
        read = rows.index_select(0, used)  # [K', H, D]
        return project_factors(RelativeFactors(side, x, read, span_diagonal, scale))
    assert buffer is not None  # a query- or key-side term
    read = rows.transpose(0, 1).index_select(1, used)  # [H, K', D]
    x = x[:, :, i0:i1] if side == "query" else x[:, :, lo:hi]  # [B, H, r or w, D]
    x, read = scaled_factors(x, read, scale)
    batch, heads, count, width = x.shape
    # one matrix product per head over the batch's rows: [H, B * r, D] @ [H, D, K']
    # (a broadcast matmul copies the table per batch row and its result into ``out``)
    by_head = x.transpose(0, 1).reshape(heads, batch * count, width)
    shape = (heads, batch * count, used.shape[0])
    into = buffer.view(shape, torch.promote_types(x.dtype, read.dtype), x.device)
    scores = torch.bmm(by_head, read.transpose(-1, -2), out=into)  # [H, B * r, K']
    return RelativePart(side, scores.unflatten(1, (batch, count)).transpose(0, 1), span_diagonal)


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
