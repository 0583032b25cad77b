"""Relative terms of query chunks at default positions as strided views of projections in
diagonal order, not gathered per pair.

At default positions query i and key j (indices) meet on diagonal t = j - i + N - 1, and
a relative term reads its table's row diagonal[t] (Shaw et al. 2018's clip, BERT's
relative_key_query, Huang et al. 2020, DeBERTa's log buckets, He et al. 2021). Project
a query-side term's x on the rows of the diagonals t0 .. t1 that a chunk reaches, in
diagonal order, Q[i, t - t0] = s x_i . R[diagonal[t]]: the term of query i and key j is
then at offset (W - 1) i + j (W = t1 - t0 + 1), so a chunk's terms are one strided view
of Q with row stride W - 1 (``_skewed_relative``'s relative shift). A key-side term
s k_j . R[diagonal[t]] projected in reversed diagonal order, K[j, t1 - t], puts the term
of query i and key j at offset (W - 1) j + i: a view with unit stride along the queries
and stride W - 1 along the keys. A chunk's terms are the sum of the two views, one pass
with no per-pair index; the gathers they replace read the key side a cache line per
pair. The views of two (query, key) pairs never share an entry, so a gradient reaches
the projections by copies through the same views, and x and R through the projections'
matmuls.

The price is width: a chunk of r queries over w keys projects r + w - 1 diagonals (a
band clipped at K: about 2K + 2r, against the table's 2K - 1 rows), so the views serve
up to ``BAND_VIEW_MAX_WIDTH_RATIO`` times the table's rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ._chunked_flash import Span
from ._mask_buffer import ChunkBuffer, largest_span
from ._skewed_relative import projection_buffer, skewed_terms
from ._terms import RelativeFactors, scaled_factors

#: the chunks' diagonals may number up to this many times the rows of a term's table
BAND_VIEW_MAX_WIDTH_RATIO = 2


def band_diagonals(spans: list[Span], n: int) -> tuple[int, int] | None:
    """The first and last diagonal t = j - i + N - 1 that a (query, key) pair of
    ``spans`` (i0, i1, lo, hi) lies on; None where no span has a pair."""
    reached = [(lo - (i1 - 1), hi - 1 - i0) for i0, i1, lo, hi in spans if hi > lo and i1 > i0]
    if not reached:
        return None
    return min(first for first, _ in reached) + n - 1, max(last for _, last in reached) + n - 1


def band_views_serve(factors: list[RelativeFactors], spans: list[Span], n: int) -> bool:
    """Whether ``band_view_terms`` and ``band_view_span_terms`` take these terms (merged,
    ``merged_factors``) over ``spans``: eager mode, at most one query-side and one
    key-side term and no other, and the diagonals the spans reach at most
    ``BAND_VIEW_MAX_WIDTH_RATIO`` times as many as each term's table rows."""
    if torch.compiler.is_compiling() or not factors:
        return False
    sides = [factor.side for factor in factors]
    if any(side not in ("query", "key") for side in sides) or len(set(sides)) < len(sides):
        return False
    bounds = band_diagonals(spans, n)
    if bounds is None:
        return False
    width = bounds[1] - bounds[0] + 1
    return all(width <= BAND_VIEW_MAX_WIDTH_RATIO * factor.rows.shape[0] for factor in factors)


def diagonal_projection(factor: RelativeFactors, t0: int, t1: int) -> Tensor:
    """s x . R[diagonal[t]] over the diagonals t0 .. t1, in that order for a query-side
    term and reversed for a key-side one: [B, H, L, t1 - t0 + 1], contiguous (L: N
    queries or M keys)."""
    assert factor.diagonal is not None  # query- and key-side terms read rows by diagonal
    window = factor.diagonal[t0 : t1 + 1]  # [W]
    if factor.side == "key":
        window = window.flip(0)
    x, rows = scaled_factors(factor.x, factor.rows, factor.scale)
    window_rows = rows.index_select(0, window).permute(1, 2, 0)  # [H, D, W]
    return torch.matmul(x, window_rows)  # [B, H, L, D] @ [H, D, W]


def query_side_view(projection: Tensor, span: Span, n: int, t0: int) -> Tensor:
    """The terms [B, H, r, w] of span (i0, i1, lo, hi) in a query-side
    ``diagonal_projection`` over t0 .. of every query: entry (i, j) at [i, j - i + N - 1
    - t0]."""
    i0, i1, lo, hi = span
    batch, heads, _, width = projection.shape
    strides = (projection.stride(0), projection.stride(1), width - 1, 1)
    start = projection.storage_offset() + i0 * width + (lo - i0 + n - 1 - t0)
    return projection.as_strided((batch, heads, i1 - i0, hi - lo), strides, start)


def key_side_view(projection: Tensor, span: Span, n: int, t1: int) -> Tensor:
    """The terms [B, H, r, w] of span (i0, i1, lo, hi) in a key-side
    ``diagonal_projection`` over .. t1 of every key: entry (i, j) at [j, t1 - (j - i + N
    - 1)]."""
    i0, i1, lo, hi = span
    batch, heads, _, width = projection.shape
    strides = (projection.stride(0), projection.stride(1), 1, width - 1)
    start = projection.storage_offset() + lo * width + (t1 - (lo - i0 + n - 1))
    return projection.as_strided((batch, heads, i1 - i0, hi - lo), strides, start)


def causal_block(span: Span, offset: int, device: torch.device) -> Tensor:
    """Which pairs of span (i0, i1, lo, hi) a causal mask hides, key j after query
    position i + ``offset`` (M - N): bool [r, w]."""
    i0, i1, lo, hi = span
    hidden = torch.ones(i1 - i0, hi - lo, dtype=torch.bool, device=device)
    return hidden.triu(i0 + offset - lo + 1)


def sides_of(factors: list[RelativeFactors]) -> tuple[RelativeFactors | None, ...]:
    """The query-side and the key-side term of ``factors`` (``band_views_serve``), None
    where there is none."""
    by_side = {factor.side: factor for factor in factors}
    return by_side.get("query"), by_side.get("key")


def band_view_terms(
    factors: list[RelativeFactors], n: int, m: int, spans: list[Span], causal: bool
) -> Tensor:
    """The terms of every span side by side, differentiable in the factors: [B, H, N,
    widest], row i holding query i's terms against its span's keys lo .. hi - 1 in
    columns 0 .. hi - lo - 1 (zeros past them; ``band_terms``' layout), -inf where
    ``causal`` hides the key. ``factors``: as ``band_views_serve`` takes them."""
    bounds = band_diagonals(spans, n)
    assert bounds is not None  # band_views_serve
    projections = [
        None if factor is None else diagonal_projection(factor, *bounds)
        for factor in sides_of(factors)
    ]
    terms: Tensor = _BandTerms.apply(spans, n, m - n if causal else None, bounds, *projections)
    return terms


def span_views(
    projections: tuple[Tensor | None, Tensor | None], span: Span, n: int, bounds: tuple[int, int]
) -> list[Tensor]:
    """Span's views [B, H, r, w] of the query- and key-side ``diagonal_projection`` over
    the diagonals ``bounds`` (None: no such term)."""
    query, key = projections
    views = []
    if query is not None:
        views.append(query_side_view(query, span, n, bounds[0]))
    if key is not None:
        views.append(key_side_view(key, span, n, bounds[1]))
    return views


def sum_into(views: list[Tensor], out: Tensor) -> None:
    """Writes the sum of one or two views into out, in one pass."""
    if len(views) == 2:
        torch.add(views[0], views[1], out=out)
    else:
        out.copy_(views[0])


class _BandTerms(torch.autograd.Function):
    """``band_view_terms``' views summed per span into one tensor; the backward copies
    each span's gradient into the projections' gradients through the same views (no
    entry is read twice)."""

    @staticmethod
    def forward(
        ctx: Any,
        spans: list[Span],
        n: int,
        causal_offset: int | None,
        bounds: tuple[int, int],
        query: Tensor | None,
        key: Tensor | None,
    ) -> Tensor:
        some = query if query is not None else key
        assert some is not None  # band_views_serve: one term at least
        batch, heads = some.shape[:2]
        widest = max(hi - lo for _, _, lo, hi in spans)
        total = some.new_empty(batch, heads, n, widest)  # [B, H, N, widest]
        for i0, i1, lo, hi in spans:
            span = (i0, i1, lo, hi)
            into = total[:, :, i0:i1, : hi - lo]
            if hi > lo:
                sum_into(span_views((query, key), span, n, bounds), into)
            total[:, :, i0:i1, hi - lo :] = 0
            if causal_offset is not None:
                into.masked_fill_(causal_block(span, causal_offset, total.device), float("-inf"))
        ctx.spans, ctx.n, ctx.bounds = spans, n, bounds
        ctx.shapes = [None if t is None else t.shape for t in (query, key)]
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        n, (t0, t1) = ctx.n, ctx.bounds
        grad_query, grad_key = (
            None if shape is None else grad.new_zeros(shape) for shape in ctx.shapes
        )
        for i0, i1, lo, hi in ctx.spans:
            span = (i0, i1, lo, hi)
            grad_span = grad[:, :, i0:i1, : hi - lo]  # [B, H, r, w]
            if grad_query is not None:
                query_side_view(grad_query, span, n, t0).copy_(grad_span)
            if grad_key is not None:
                key_side_view(grad_key, span, n, t1).copy_(grad_span)
        return None, None, None, None, grad_query, grad_key


def band_view_span_terms(
    factors: list[RelativeFactors], n: int, m: int, causal: bool, spans: list[Span]
) -> Callable[[Span], Tensor]:
    """Each span's terms [B, H, r, w] without autograd (``span_terms``' contract: valid
    until the next span's): the key side projected once for every key, the query side
    per span over only the diagonals it reaches (``skewed_terms``, -inf on the diagonals
    ``causal`` hides), summed into a buffer the spans reuse. ``factors``: as
    ``band_views_serve`` takes them."""
    query, key = sides_of(factors)
    bounds = band_diagonals(spans, n)
    assert bounds is not None  # band_views_serve
    key_projection = None if key is None else diagonal_projection(key, *bounds)
    sums = ChunkBuffer(largest_span(spans) * max(f.x.shape[0] * f.x.shape[1] for f in factors))
    x = table = projections = None
    if query is not None:
        x, rows = scaled_factors(query.x, query.rows, query.scale)
        table = rows.permute(1, 0, 2).contiguous()  # [H, K, D]
        projections = projection_buffer(x, spans)

    def terms(span: Span) -> Tensor:
        i0, i1, lo, hi = span
        some = key_projection if query is None else x
        assert some is not None
        shape = (some.shape[0], some.shape[1], i1 - i0, hi - lo)
        out = sums.view(shape, some.dtype, some.device)  # [B, H, r, w]
        views = span_views((None, key_projection), span, n, bounds)
        if query is not None:  # the span's own projection; -inf past the causal limit
            assert x is not None and table is not None and query.diagonal is not None
            view, _ = skewed_terms(x, table, query.diagonal, span, n, causal, projections)
            views.insert(0, view)
        sum_into(views, out)
        if causal and query is None:
            out.masked_fill_(causal_block(span, m - n, out.device), float("-inf"))
        return out

    return terms
