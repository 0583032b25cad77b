"""Relative terms of query chunks at default positions as strided views of projections in
diagonal order, not gathered per pair.

At default positions query i and key j (indices) meet on diagonal t = j - i + N - 1, and
a relative term reads its table's row diagonal[t] (Shaw et al. 2018's clip, BERT's
relative_key_query, Huang et al. 2020, DeBERTa's log buckets, He et al. 2021). A chunk
of queries i0 .. i1 - 1 projects its x on the rows of the W diagonals it reaches, in
diagonal order, Q[a, t - t0] = s x_(i0 + a) . R[diagonal[t]]: its terms are one strided
view of Q with row stride W - 1 (``_skewed_relative``'s relative shift). A key-side term
s k_j . R[diagonal[t]] projected once for every key on the diagonals t0 .. t1 that any
chunk reaches, in reversed order, K[j, t1 - t], puts the term of query i and key j at
offset (W - 1) j + i: a view with unit stride along the queries and stride W - 1 along
the keys. A chunk's terms are the key-side view added into the query side's projection
through its view (each pair its own entry), one pass with no per-pair index, and
attention reads that view as its mask in place; the gathers they replace read the key
side a cache line per pair. The views of
two (query, key) pairs never share an entry, so dS goes back by copies through the same
views: into K's gradient, and through each chunk's Q (projected again) into x and R.

The price is width: a chunk of r queries over w keys projects r + w - 1 diagonals (a
band clipped at K: about 2K + 2r, against the table's 2K - 1 rows), so the views serve
up to ``BAND_VIEW_MAX_WIDTH_RATIO`` times the table's rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._chunked_flash import Span
from ._diagonal_projection import DiagonalWindow, window_of, window_projection
from ._mask_buffer import ChunkBuffer, largest_span
from ._skewed_relative import projection_buffer, skewed_gradient, skewed_terms
from ._terms import RelativeFactors, scaled_factors

#: the chunks' diagonals may number up to this many times the rows of a term's table
BAND_VIEW_MAX_WIDTH_RATIO = 2
#: devices where the views serve (measured on the CPU only; CUDA keeps the gathers)
BAND_VIEW_DEVICES: set[str] = {"cpu"}


def spans_with_pairs(spans: list[Span]) -> list[Span]:
    """The spans (i0, i1, lo, hi) of ``spans`` with at least one query and one key."""
    return [span for span in spans if span[3] > span[2] and span[1] > span[0]]


def band_diagonals(spans: list[Span], n: int) -> tuple[int, int] | None:
    """The first and last diagonal t = j - i + N - 1 that a (query, key) pair of
    ``spans`` (i0, i1, lo, hi) lies on; None where no span has a pair."""
    reached = [(lo - (i1 - 1), hi - 1 - i0) for i0, i1, lo, hi in spans_with_pairs(spans)]
    if not reached:
        return None
    return min(first for first, _ in reached) + n - 1, max(last for _, last in reached) + n - 1


def band_views_serve(factors: list[RelativeFactors], spans: list[Span], n: int) -> bool:
    """Whether ``band_views`` takes these terms (merged, ``merged_factors``) over
    ``spans``: eager mode on a device in ``BAND_VIEW_DEVICES``, at most one query-side
    and one key-side term and no other, and the diagonals the spans reach at most
    ``BAND_VIEW_MAX_WIDTH_RATIO`` times as many as each term's table rows."""
    if torch.compiler.is_compiling() or not factors:
        return False
    if factors[0].x.device.type not in BAND_VIEW_DEVICES:
        return False
    sides = [factor.side for factor in factors]
    if any(side not in ("query", "key") for side in sides) or len(set(sides)) < len(sides):
        return False
    bounds = band_diagonals(spans, n)
    if bounds is None:
        return False
    width = bounds[1] - bounds[0] + 1
    return all(width <= BAND_VIEW_MAX_WIDTH_RATIO * factor.rows.shape[0] for factor in factors)


def band_keys(spans: list[Span]) -> tuple[int, int]:
    """The first key of ``spans`` (i0, i1, lo, hi) and one past their last (of spans
    with a pair; ``band_diagonals`` is not None)."""
    pairs = spans_with_pairs(spans)
    return min(span[2] for span in pairs), max(span[3] for span in pairs)


def key_side_projection(
    factor: RelativeFactors, t0: int, t1: int, first_key: int, end_key: int
) -> Tensor:
    """A key-side term's s k_j . R[diagonal[t]] over the diagonals t1 down to t0 (reversed
    order), for keys first_key .. end_key - 1 (those the spans read: chunked prefill
    reads few of them): [B, H, end_key - first_key, t1 - t0 + 1], contiguous."""
    assert factor.diagonal is not None  # a key-side term reads rows by diagonal
    rows = factor.diagonal[t0 : t1 + 1].flip(0)  # [W]
    x, table = scaled_factors(factor.x, factor.rows, factor.scale)  # table: [K, H, D]
    keys = x[:, :, first_key:end_key]  # [B, H, keys, D]
    return window_projection(keys, table.permute(1, 0, 2), window_of(rows, rows.shape[0]))


def key_side_view(projection: Tensor, span: Span, n: int, t1: int, first_key: int) -> Tensor:
    """The terms [B, H, r, w] of span (i0, i1, lo, hi) in a ``key_side_projection`` over
    .. t1 from key ``first_key``: entry (i, j) at [j - first_key, t1 - (j - i + N - 1)]."""
    i0, i1, lo, hi = span
    batch, heads, _, width = projection.shape
    strides = (projection.stride(0), projection.stride(1), 1, width - 1)
    start = projection.storage_offset() + (lo - first_key) * width + (t1 - (lo - i0 + n - 1))
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


class BandViews:
    """The terms of each span as strided views: callable on a span for its terms [B, H,
    r, w] (valid until the next span's), made when a call needs them (in a backward
    again) in the query side's projection, a buffer the spans reuse (a key-side term
    alone: a buffer of its own), so no [B, H, N, w] tensor of them exists at once. As a
    mask of ``_ChunkedAttention`` that trains, its ``inputs`` get their gradients by
    ``add_gradient``, dS copied back through the same views.

    ``query``: a query-side term's x [B, H, N, D] (scaled), its table [H, K, D] and the
    row of each diagonal: each span projects its own queries on the diagonals it reaches
    (``skewed_terms``, -inf on the diagonals a causal mask hides), in a backward again;
    ``key``: a key-side term's ``key_side_projection`` over the diagonals ``bounds``,
    made once for every key the spans read, from ``first_key``. None where there is no
    such term."""

    def __init__(
        self,
        query: tuple[Tensor, Tensor, Tensor] | None,
        key: Tensor | None,
        n: int,
        m: int,
        bounds: tuple[int, int],
        first_key: int,
        causal: bool,
        spans: list[Span],
    ) -> None:
        self.query, self.key, self.n, self.m = query, key, n, m
        self.bounds, self.first_key, self.causal = bounds, first_key, causal
        self.inputs = [
            *(query[:2] if query is not None else ()),
            *([key] if key is not None else []),
        ]
        some = self.inputs[0]
        self.key_terms = ChunkBuffer(largest_span(spans) * some.shape[0] * some.shape[1])
        self.projections = self.grad_projections = None
        if query is not None:  # each span's projection, and its gradient
            self.projections = projection_buffer(query[0], spans)
            self.grad_projections = projection_buffer(query[0], spans)
        self.last: tuple[Span, Tensor, DiagonalWindow] | None = None  # span, view, diagonals
        self.grads: list[Tensor] | None = None

    def __call__(self, span: Span) -> Tensor:
        """Span (i0, i1, lo, hi)'s terms [B, H, r, w], valid until the next span's."""
        i0, i1, lo, hi = span
        views = []
        if self.query is not None:
            assert self.projections is not None
            x, table, diagonal = self.query
            view, window = skewed_terms(
                x, table, diagonal, span, self.n, self.causal, self.projections
            )
            self.last = (span, view, window)
            views.append(view)
        if self.key is None:  # the query side's view, read in place (-inf where causal)
            return views[0]
        key_view = key_side_view(self.key, span, self.n, self.bounds[1], self.first_key)
        if views:  # the key side added into the query side's projection (its own entries)
            return views[0].add_(key_view)
        some = self.inputs[0]
        shape = (key_view.shape[0], key_view.shape[1], i1 - i0, hi - lo)
        out = self.key_terms.view(shape, some.dtype, some.device).copy_(key_view)
        if self.causal:
            out.masked_fill_(causal_block(span, self.m - self.n, out.device), float("-inf"))
        return out

    def add_gradient(self, span: Span, grad_terms: Tensor) -> None:
        """Adds span's dS [B, H, r, w] into the gradients of ``inputs``; span's terms
        are the last this made."""
        if self.grads is None:
            self.grads = [torch.zeros_like(t) for t in self.inputs]
        if self.key is not None:
            grad_view = key_side_view(self.grads[-1], span, self.n, self.bounds[1], self.first_key)
            grad_view.copy_(grad_terms)
        if self.query is not None:
            assert self.last is not None and self.last[0] == span
            assert self.grad_projections is not None
            _, view, window = self.last
            x, table, _ = self.query
            grad_x, grad_table = self.grads[:2]
            skewed_gradient(
                grad_terms, view, window, x, table, span, self.grad_projections, grad_x, grad_table
            )

    def gradients(self) -> list[Tensor | None]:
        """The gradients of ``inputs`` (None before any ``add_gradient``), handed over:
        a later ``add_gradient`` starts from zeros again."""
        grads, self.grads = self.grads, None
        return [None for _ in self.inputs] if grads is None else list(grads)


def band_views(
    factors: list[RelativeFactors], n: int, m: int, spans: list[Span], causal: bool
) -> BandViews:
    """The terms of ``spans`` as ``BandViews`` of ``factors`` (as ``band_views_serve``
    takes them), differentiable where the factors are."""
    bounds = band_diagonals(spans, n)
    assert bounds is not None  # band_views_serve
    query, key = sides_of(factors)
    first_key, end_key = band_keys(spans)
    key_projection = None
    if key is not None:
        key_projection = key_side_projection(key, *bounds, first_key, end_key)
    query_inputs = None
    if query is not None:
        assert query.diagonal is not None  # a query-side term reads rows by diagonal
        x, rows = scaled_factors(query.x, query.rows, query.scale)
        query_inputs = (x, rows.permute(1, 0, 2).contiguous(), query.diagonal)  # [H, K, D]
    return BandViews(query_inputs, key_projection, n, m, bounds, first_key, causal, spans)
