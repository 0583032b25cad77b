"""The clipped path's band at explicit positions (``clipped_relative_attention``, CPU).

Where the relative terms are clipped at K (``relative_clip``: Shaw et al. 2018, BERT's
relative_key and relative_key_query, Huang et al. 2020, DeBERTa's log buckets, He et
al. 2021), query position p_i and key position s_j read row
diagonal[clip(s_j - p_i, -K, K) + K] of the 2K + 1 rows of
``_clipped_relative_factors``. With both positions sorted (non-decreasing along the
sequence), the keys at s_j <= min p - K of a chunk of queries are a prefix of the keys
and those at s_j >= max p + K a suffix, and every pair with one of them reads the row
at -K or at K: they are the far keys of ``clipped_relative_attention``, plain flash
attention with one more feature per key, as at default positions. Only the band between
them has its terms gathered per pair, at its positions (``terms_at_positions``), where
before every key a chunk may read was. A position bias clipped at K (T5's buckets,
Raffel et al. 2020) enters as one term with no content (``clipped_bias_factors``).

In a training step the band's terms are gathered for every query at once through
autograd where the terms have a query- and a key-side projection (the gathers let the
projections go after the forward); with one projection, or a bias alone, span by span
in the forward and again in the backward (``TrainedBand``), so that no [B, H, N, w]
tensor of the band or of its gradient exists.

Batched positions ([B, N] and [B, M]) take the prefix that is far for every batch row
and the suffix likewise; the band's terms and its causal mask are per batch row. Causal
means key position <= query position, as for every other path. Deciding the layout reads
the positions on the host (sortedness, the spans, and under a causal mask that every
query has a key at or before it in its band): eager mode only, as the clipped path is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._chunked_flash import Span
from ._clipped_relative import (
    ClippedLayout,
    band_key_grid,
    clipped_query_chunks,
    clipped_relative_attention,
    clipped_span_terms,
    gathered_terms,
    projected_for_gathers,
    terms_train,
)
from ._inputs import positions_or_default
from ._relative_at_positions import PositionedParts, SpanMasks
from ._terms import RelativeFactors, RelativePart


def position_layout(
    factors: list[RelativeFactors],
    q_positions: Tensor,
    k_positions: Tensor,
    clip: int,
    causal: bool,
) -> ClippedLayout | None:
    """The ``ClippedLayout`` of queries at ``q_positions`` ([N] or [B, N], int64) and keys
    at ``k_positions`` ([M] or [B, M]) for terms clipped at ``clip`` (``factors``: the
    merged ``_clipped_relative_factors``); None where it does not serve: positions not
    sorted, or under ``causal`` a query with no key at or before it in its band (its
    band's row would be all -inf)."""
    q_pos, k_pos = _batched(q_positions, k_positions)  # [P, N], [P, M]
    if not bool(_sorted(q_pos) and _sorted(k_pos)):
        return None
    spans = _position_spans(q_pos, k_pos, clip, causal)
    if spans is None:
        return None
    far_left, band, far_right = spans
    mask: Any
    if terms_train(factors):
        parts = [projected_for_gathers(factor) for factor in factors]
        if sum(factor.side in ("query", "key") for factor in factors) <= 1:
            # a bias alone (T5's, whose gradient is [H, 2K + 1]) or one projection
            # (Shaw's and BERT relative_key's query side): span by span, where the band's
            # terms gathered at once and their gradient would be two [B or 1, H, N, w]
            # (the per-span form keeps the projections until the backward: with both
            # sides, BERT relative_key_query's step peaked higher that way)
            trained = TrainedBand(parts, q_pos, k_pos, band, clip, causal)
            return ClippedLayout(
                far_left, band, far_right, trained, trained.inputs, q_positions, k_positions
            )
        mask = _band_terms(parts, q_pos, k_pos, band, clip, causal)
    else:
        mask = _span_terms(factors, q_pos, k_pos, band, clip, causal)
    return ClippedLayout(far_left, band, far_right, mask, [], q_positions, k_positions)


def clipped_attention_at_positions(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    factors: list[RelativeFactors],
    q_positions: Tensor | None,
    k_positions: Tensor | None,
    clip: int,
    scale: float,
    causal: bool,
    value_term: Any = None,
) -> Tensor | None:
    """``clipped_relative_attention`` of the terms ``factors`` (clipped at ``clip``:
    ``_clipped_relative_factors`` or ``clipped_bias_factors``) at explicit positions
    ([N] or [B, N] and [M] or [B, M]; None: the defaults), its band and far keys found
    by position (``position_layout``): [B, H, N, value_dim] in v's dtype, or None where
    the layout declines. q: [B, H, N, D]; k, v: [B, H, M, D] (heads repeated for GQA
    by the caller)."""
    n, m = q.shape[2], k.shape[2]
    q_positions = positions_or_default(q_positions, m - n, n, q.device)
    k_positions = positions_or_default(k_positions, 0, m, q.device)
    layout = position_layout(factors, q_positions, k_positions, clip, causal)
    if layout is None:
        return None
    out = clipped_relative_attention(q, k, v, factors, clip, scale, causal, value_term, layout)
    return out.to(v.dtype)


def clipped_bias_factors(clipped: Tensor) -> list[RelativeFactors]:
    """A position bias c[clip(j - i, -K, K) + K] (T5's buckets past max_distance,
    Raffel et al. 2020), c = ``clipped`` [H, 2K + 1] as the logits add it, as the one
    relative term of the clipped path: a "global" term whose x is 1 per head and whose
    rows are c's entries ([2K + 1, H, 1]), row t read at diagonal t. Its far keys then
    add a constant per head, and the band's terms are c read per pair; c trains through
    both where it needs a gradient."""
    heads, width = clipped.shape
    ones = clipped.new_ones(heads, 1)  # [H, 1]
    rows = clipped.t().unsqueeze(-1)  # [2K + 1, H, 1]
    diagonal = torch.arange(width, device=clipped.device)
    return [RelativeFactors("global", ones, rows, diagonal, 1.0)]


def _batched(q_positions: Tensor, k_positions: Tensor) -> tuple[Tensor, Tensor]:
    """Both positions as [P, N] and [P, M], P the batch where either has one, else 1,
    contiguous (as ``torch.searchsorted`` reads them without a copy and a warning)."""
    q_pos = q_positions.reshape(-1, q_positions.shape[-1])
    k_pos = k_positions.reshape(-1, k_positions.shape[-1])
    rows = max(q_pos.shape[0], k_pos.shape[0])
    return q_pos.expand(rows, -1).contiguous(), k_pos.expand(rows, -1).contiguous()


def _sorted(positions: Tensor) -> Tensor:
    """Whether each row of ``positions`` [P, L] is non-decreasing (a 0-d bool)."""
    return (positions[:, 1:] >= positions[:, :-1]).all()


def _position_spans(
    q_pos: Tensor, k_pos: Tensor, clip: int, causal: bool
) -> tuple[list[Span], list[Span], list[Span]] | None:
    """Per chunk of queries (``clipped_query_chunks``), the spans of its far-left
    keys (at least ``clip`` before each of its queries, in every batch row), of its band
    and of its far-right keys (at least ``clip`` after; none when ``causal``), from
    sorted positions q_pos [P, N] and k_pos [P, M]; None where ``causal`` leaves a query
    no key in its band. One host sync."""
    n, m = q_pos.shape[-1], k_pos.shape[-1]
    chunks = clipped_query_chunks(n)
    starts, ends = torch.tensor(chunks, dtype=torch.int64, device=q_pos.device).unbind(1)  # [S]
    first, last = q_pos[:, starts], q_pos[:, ends - 1]  # [P, S]: each chunk's extremes
    # keys at s <= first - K, and the first key at s >= last + K, over every batch row
    left = torch.searchsorted(k_pos, first - clip, right=True).amin(0)  # [S]
    right = torch.searchsorted(k_pos, last + clip).amax(0)  # [S]
    # the keys each chunk reads: those at s <= last under a causal mask
    hi = torch.searchsorted(k_pos, last, right=True).amax(0) if causal else torch.full_like(left, m)
    lo = torch.minimum(left, hi)  # [S]: the band's first key
    band_end = torch.maximum(lo, torch.minimum(right, hi))  # [S]: past its last
    if causal:
        # every query has a key at or before it, and one in its chunk's band unless the
        # band is empty (the CPU flash kernel gives a row masked throughout a
        # log-sum-exp of 0, not -inf)
        reach = torch.searchsorted(k_pos, q_pos, right=True)  # [P, N]: keys at s <= p
        sizes = ends - starts
        band_first = lo.repeat_interleave(sizes)  # [N]
        band_empty = (band_end <= lo).repeat_interleave(sizes)  # [N]
        rows_served = ((reach > band_first) | band_empty) & (reach > 0)
    else:
        rows_served = torch.ones(1, dtype=torch.bool, device=q_pos.device)
    served = rows_served.all().unsqueeze(0).long()
    bounds = torch.cat([lo, band_end, hi, served]).tolist()  # one sync
    if not bounds[-1]:
        return None
    count = len(chunks)
    far_left, band, far_right = [], [], []
    for chunk, (i0, i1) in enumerate(chunks):
        first_band, past_band = bounds[chunk], bounds[count + chunk]
        far_left.append((i0, i1, 0, first_band))
        band.append((i0, i1, first_band, past_band))
        far_right.append((i0, i1, past_band, bounds[2 * count + chunk]))
    return far_left, band, far_right


def _band_terms(
    parts: list[RelativePart],
    q_pos: Tensor,
    k_pos: Tensor,
    band: list[Span],
    clip: int,
    causal: bool,
) -> Tensor:
    """The band's terms of every query at once, gathered through autograd from the
    projections ``parts`` (``projected_for_gathers``): [B or 1, H, N, width], column w
    of query i at key lo + w of its span (columns past the span filled but unread),
    -inf where ``causal`` masks the pair (key position after the query's)."""
    keys = band_key_grid(band, k_pos.shape[-1], q_pos.device)  # [N, w]
    keys_at, queries_at = k_pos[:, keys], q_pos.unsqueeze(-1)  # [P, N, w], [P, N, 1]
    entry = (keys_at - queries_at).clamp(-clip, clip) + clip  # the row among the 2K + 1
    total = gathered_terms(parts, entry, keys, 0)
    if causal:
        total = total.masked_fill_((keys_at > queries_at).unsqueeze(1), float("-inf"))
    return total


class TrainedBand:
    """The band's terms of each span as a mask of ``_ChunkedAttention`` that trains:
    callable on a span for its terms [B or 1, H, r, w] (-inf where ``causal`` masks the
    pair), gathered at its positions from the projections ``inputs`` into buffers the
    spans reuse (valid until the next span's; in the backward again), whose gradients
    ``add_gradient`` adds dS into at the rows each pair read (``PositionedParts``). No
    [B, H, N, w] tensor of the terms or of their gradient exists at once.

    parts: the projections of ``projected_for_gathers`` (with autograd: the node's
    inputs); q_pos [P, N], k_pos [P, M]; band: its spans (i0, i1, lo, hi)."""

    def __init__(
        self,
        parts: list[RelativePart],
        q_pos: Tensor,
        k_pos: Tensor,
        band: list[Span],
        clip: int,
        causal: bool,
    ) -> None:
        masked = _causal_masked if causal else _unmasked
        self.layout = PositionedParts(parts, clip, q_pos, k_pos, masked(q_pos, k_pos))
        self.inputs = [part.scores for part in parts]
        self.scratch = self.layout.scratch(tuple(self.inputs), band)
        self.grads: list[Tensor | None] | None = None

    def __call__(self, span: Span) -> Tensor:
        """Span (i0, i1, lo, hi)'s terms [B or 1, H, r, w], valid until the next span's."""
        return self.layout.terms(span, tuple(self.inputs), self.scratch)

    def add_gradient(self, span: Span, grad_terms: Tensor) -> None:
        """Adds span's dS [B, H, r, w] into the gradients of ``inputs``."""
        if self.grads is None:
            self.grads = [torch.zeros_like(t) for t in self.inputs]
        self.layout.add_gradient(span, grad_terms, tuple(self.inputs), self.grads, self.scratch)

    def gradients(self) -> list[Tensor | None]:
        """The gradients of ``inputs`` (None before any ``add_gradient``), handed over:
        a later ``add_gradient`` starts from zeros again."""
        grads, self.grads = self.grads, None
        return [None for _ in self.inputs] if grads is None else list(grads)


def _causal_masked(q_pos: Tensor, k_pos: Tensor) -> SpanMasks:
    """(span, its terms) -> the terms with -inf where the key's position is after the
    query's, in place."""

    def masked(span: Span, terms: Tensor) -> Tensor:
        i0, i1, lo, hi = span
        later = k_pos[:, lo:hi].unsqueeze(-2) > q_pos[:, i0:i1].unsqueeze(-1)  # [P, r, w]
        return terms.masked_fill_(later.unsqueeze(1), float("-inf"))

    return masked


def _unmasked(q_pos: Tensor, k_pos: Tensor) -> SpanMasks:
    """(span, its terms) -> the terms as they are."""
    return lambda span, terms: terms


def _span_terms(
    factors: list[RelativeFactors],
    q_pos: Tensor,
    k_pos: Tensor,
    band: list[Span],
    clip: int,
    causal: bool,
) -> Any:
    """span -> its band terms at its positions ([B or 1, H, r, w], -inf where ``causal``
    masks the pair), for terms that get no gradient: gathered into buffers the spans
    reuse (``clipped_span_terms``), so valid until the next span's."""
    terms_of = clipped_span_terms(factors, clip, band)
    masked = (_causal_masked if causal else _unmasked)(q_pos, k_pos)

    def terms(span: Span) -> Tensor:
        i0, i1, lo, hi = span
        return masked(span, terms_of(span, q_pos[:, i0:i1], k_pos[:, lo:hi]))

    return terms
