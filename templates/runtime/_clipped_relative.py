"""Relative terms clipped at a distance, on the CPU: exact terms on a band of keys, and
the far keys as plain flash attention.

Where every relative term reads one table row for all key-minus-query distances r >= K
and one for all r <= -K (``relative_clip`` = K: Shaw et al. 2018's clip, BERT's
relative_key, the log buckets of DeBERTa-v2, He et al. 2021, past max_distance), the
logits of query i against a key j at least K before it are

    a_ij = s q_i . k_j + A_i + B_j

with A_i the query-side and position-only terms at the far-left row and B_j the
key-side and content terms there (past K after it likewise, with their own A and B).
A_i is a constant of the row, which only shifts that side's log-sum-exp, and B_j rides
in one more feature, s [q_i, 1] . [k_j, B_j / s]: the far keys need no [N, M] tensor,
CPU FlashAttention runs them (with no extra feature at all where no term reads the
key, as in Shaw's and BERT's relative_key). Queries go ``CLIPPED_RELATIVE_QUERY_CHUNK``
at a time; only the band of keys within K - 1 of one of a chunk's queries has its terms
gathered (or, where the table has rows enough, viewed: ``_band_views``), and its
attention is one more flash call with those terms as the mask. The
three calls (far left, band, far right) are merged by their log-sum-exp, which is
softmax over the union of their keys; a value-side term (Shaw's z_i = sum_j a_ij
R^V[index(j - i)]) reads the band's weights and, for each far side, that side's total
weight times its row.

Gradients: ``_ChunkedAttention`` runs one of those calls for every chunk and is
differentiable in q, k, v, the band's terms, its weights and the log-sum-exp, so the
relative tables and projections train through the terms; nothing of size [N, M] is
built, and no per-chunk slice of a full-size tensor goes through autograd.

The geometry of a call, its spans and its band's terms, is a ``ClippedLayout``: at
default positions ``default_layout``; at explicit, sorted positions
``_position_band.position_layout``, whose far keys are found by position.

Terms that are not clipped, or too few keys for the far calls to pay, go through
``chunked_relative_attention``: the same chunks and the same gather (``band_terms``)
over every key a chunk may read, one flash call per chunk with its terms as the mask.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._band_views import band_views, band_views_serve
from ._chunked_flash import (
    Span,
    cpu_flash_backward,
    cpu_flash_forward,
    cpu_flash_kernel_takes,
    explicit_backward_scratch,
    explicit_flash_backward,
)
from ._first_order import first_order_only
from ._mask_buffer import ChunkBuffer, largest_span
from ._masks import accumulated, relative_positions
from ._terms import (
    RelativeFactors,
    RelativePart,
    merged_factors,
    project_factors,
    scaled_factors,
)

#: queries per chunk: each chunk is one flash call over its far keys on each side and
#: one over the band of about C + 2K keys (C + K causal) within K - 1 of its queries
CLIPPED_RELATIVE_QUERY_CHUNK = 256
#: the clipped path serves at least this many keys per unit of the clip, without and
#: with gradients: with fewer, the band spans nearly every key and the far calls only
#: add work (2-core CPU, float32, batch 2, 8 heads, against plain SDPA: at N = 1024,
#: twice the clip, every kind's forward gained, BERT relative_key_query 14.2x -> 6.7x,
#: BERT relative_key 5.6x -> 5.0x, but BERT relative_key trained at 5.5x against the
#: dense 5.0x; at N = 512, about the clip, its forward lost, 4.0x -> 5.2x)
CLIPPED_RELATIVE_MIN_KEYS_PER_CLIP: dict[bool, int] = {False: 2, True: 3}
#: and at least this many keys, without and with gradients: below them the fixed cost
#: of its calls outweighs the dense terms (Shaw, clip 16, same machine: forward 8.7x
#: -> 5.7x plain SDPA at N = 256; a training step 3.3x -> 3.6x at N = 512, 6.6x ->
#: 3.2x at N = 1024)
CLIPPED_RELATIVE_MIN_KEYS: dict[bool, int] = {False: 256, True: 1024}
#: and at least this many queries: a few queries (a decode step) pay the path's fixed
#: cost and gain little (2048 keys, batch 2, 8 heads, no gradients: one query 1.1 ->
#: 1.3 ms for Shaw and 0.8 -> 1.3 ms for BERT relative_key; at 64 queries every kind
#: was as fast or faster, Shaw 19 -> 6 ms)
CLIPPED_RELATIVE_MIN_QUERIES = 64
#: terms that get no gradient project their query side over every query at once up to
#: this many bytes, and per span of queries past it (``span_terms``): glibc maps an
#: allocation of 32 MiB or more afresh each time, which is then faulted in a page at a
#: time (2-core CPU, BERT relative_key_query's [2, 8, 2048, 1023] float32 projection:
#: 105 ms into a new tensor, 61 ms into one already paged in). No gradient, batch 2,
#: 8 heads, against plain SDPA in one loop: BERT relative_key_query at N = 2048 4.44x
#: -> 4.00x (causal 3.12x -> 2.86x), at 1024 7.00x -> 5.80x; BERT relative_key 2.51x ->
#: 2.29x (2.50x -> 2.24x), at 1024 3.18x -> 2.86x; Shaw, whose 33 rows make a 4 MB
#: projection, lost 5% per span at N = 2048 (1.93x -> 2.04x)
#: (benchmarks/results/revisions_cpu_float32_span_terms.md)
QUERY_PROJECTION_WHOLE_BYTES = 32 << 20

#: a span's relative terms from its queries' and keys' positions ([r] or [B, r], [w] or
#: [B, w]): [B or 1, H, r, w], valid until the next span's are made
TermsAtPositions = Callable[[Span, Tensor, Tensor], Tensor]


class ClippedLayout(NamedTuple):
    """Where the keys of each chunk of queries lie for ``clipped_relative_attention``:
    the spans (i0, i1, lo, hi) of its far-left keys, of its band and of its far-right
    keys (``band_spans`` at default positions), the band's terms as a mask of
    ``_ChunkedAttention`` and the tensors that follow it (``band_mask``), and the
    queries' and keys' positions ([N] or [B, N], [M] or [B, M]) that a value-side term
    reads."""

    far_left: list[Span]
    band: list[Span]
    far_right: list[Span]
    mask: Any
    mask_inputs: list[Tensor]
    q_positions: Tensor
    k_positions: Tensor


def default_layout(
    factors: list[RelativeFactors], n: int, m: int, clip: int, causal: bool, device: torch.device
) -> ClippedLayout:
    """The ``ClippedLayout`` at default positions (query i at M - N + i, key j at j),
    ``factors`` merged."""
    far_left, band, far_right = band_spans(n, m, clip, causal)
    mask, inputs = band_mask(factors, n, m, band, causal)
    q_positions = torch.arange(m - n, m, device=device)
    return ClippedLayout(
        far_left, band, far_right, mask, inputs, q_positions, torch.arange(m, device=device)
    )


def clipped_relative_serves(q: Tensor, m: int, clip: int | None, trains: bool) -> bool:
    """Whether ``clipped_relative_attention`` runs relative terms clipped at ``clip``
    (None: not clipped) for queries ``q`` over ``m`` keys, for a training step
    (``trains``) or not: the CPU (its flash kernel returns the log-sum-exp), float32 or
    float64, no autocast, eager mode, at least ``CLIPPED_RELATIVE_MIN_KEYS_PER_CLIP``
    keys per unit of the clip, ``CLIPPED_RELATIVE_MIN_KEYS`` keys and
    ``CLIPPED_RELATIVE_MIN_QUERIES`` queries. The caller checks the rest: default
    positions, no window, documents, attn_mask or position bias."""
    return (
        clip is not None
        and cpu_flash_kernel_takes(q)
        and not torch.compiler.is_compiling()
        and m >= CLIPPED_RELATIVE_MIN_KEYS_PER_CLIP[trains] * clip
        and m >= CLIPPED_RELATIVE_MIN_KEYS[trains]
        and q.shape[2] >= CLIPPED_RELATIVE_MIN_QUERIES
    )


class _ChunkedAttention(torch.autograd.Function):
    """softmax(scale q kᵀ + mask) v for each span: queries i0 .. i1 - 1 against keys
    lo .. hi - 1, with the mask's rows i0 .. i1 - 1 and columns 0 .. hi - lo - 1 (None:
    no mask; a function of the span: the span's mask, made when needed and given no
    gradient, or a mask that trains, ``BandViews`` or ``_position_band.TrainedBand``,
    whose ``inputs`` follow as ``mask_inputs`` and get their gradients through its
    ``add_gradient`` and ``gradients``). Returns the output [B, H, N, W], the
    rows' log-sum-exp [B, H, N] (-inf, and a zero output, where a span has no keys) and,
    with ``with_weights``, the weights in the mask's layout (else an empty tensor).

    q, k: [B, H, N or M, W]; v: [B, H, M, W]. Where the log-sum-exp gets a gradient,
    v's column ``ones_column`` is all ones: the log-sum-exp's gradient g adds g_i P_ij to
    dS_ij, which the flash backward gives with that column's output gradient set to g
    and its output to 0 (ones_column None: the log-sum-exp is not differentiable, and
    v is as it is). Unmasked spans run the CPU FlashAttention kernels forward and backward;
    masked ones (the band) flash forward and an explicit backward, whose dS is also the
    mask's gradient.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | Any,
        spans: list[Span],
        scale: float,
        ones_column: int | None,
        with_weights: bool,
        *mask_inputs: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        batch, heads, n = q.shape[:3]
        out = q.new_empty(batch, heads, n, v.shape[-1])
        lse = q.new_empty(batch, heads, n)
        span_mask = _span_mask(mask)
        widest = max(hi - lo for _, _, lo, hi in spans)
        weights = q.new_zeros((batch, heads, n, widest) if with_weights else (0,))
        for i0, i1, lo, hi in spans:
            if hi <= lo:  # no keys: softmax over nothing
                out[:, :, i0:i1] = 0.0
                lse[:, :, i0:i1] = float("-inf")
                continue
            rows, keys, values = q[:, :, i0:i1], k[:, :, lo:hi], v[:, :, lo:hi]
            chunk_mask = span_mask((i0, i1, lo, hi))
            chunk_out, chunk_lse = cpu_flash_forward(rows, keys, values, chunk_mask, scale)
            out[:, :, i0:i1] = chunk_out
            lse[:, :, i0:i1] = chunk_lse
            if weights.numel():
                logits = torch.matmul(rows, keys.transpose(-1, -2)).mul_(scale).add_(chunk_mask)
                weights[:, :, i0:i1, : hi - lo] = logits.sub_(chunk_lse.unsqueeze(-1)).exp_()
        if ones_column is None:
            ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, mask if isinstance(mask, Tensor) else None, out, lse)
        ctx.span_mask, ctx.spans, ctx.scale, ctx.ones_column = span_mask, spans, scale, ones_column
        ctx.views = mask if mask_inputs else None  # a mask that trains its inputs
        return out, lse, weights

    @staticmethod
    @first_order_only
    def backward(
        ctx: Any, grad_out: Tensor, grad_lse: Tensor, grad_weights: Tensor
    ) -> tuple[Tensor | None, ...]:
        q, k, v, mask, out, lse = ctx.saved_tensors
        column, span_mask, scale = ctx.ones_column, ctx.span_mask, ctx.scale
        grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        grad_mask = None
        views = ctx.views if any(ctx.needs_input_grad[8:]) else None  # a mask to train
        if mask is not None and ctx.needs_input_grad[3]:
            # every span writes its block and zeros the columns past its keys (no fill
            # of the whole [B, H, N, widest] gradient first)
            grad_mask = q.new_empty((q.shape[0], *mask.shape[1:]))
        scratch = explicit_backward_scratch(q, ctx.spans)  # P and dP of a span
        for i0, i1, lo, hi in ctx.spans:
            if grad_mask is not None:
                grad_mask[:, :, i0:i1, max(hi - lo, 0) :] = 0.0
            if hi <= lo:
                continue
            rows, keys, values = q[:, :, i0:i1], k[:, :, lo:hi], v[:, :, lo:hi]
            grad = grad_out[:, :, i0:i1].clone(memory_format=torch.contiguous_format)
            chunk_out = out[:, :, i0:i1].clone(memory_format=torch.contiguous_format)
            if column is not None:  # the log-sum-exp's gradient through the ones
                grad[..., column] = grad_lse[:, :, i0:i1]  # [B, H, C, W]
                chunk_out[..., column] = 0.0
            chunk_mask = span_mask((i0, i1, lo, hi))
            if chunk_mask is None:
                dq, dk, dv = cpu_flash_backward(
                    grad, rows, keys, values, chunk_out, lse[:, :, i0:i1], None, scale
                )
            else:
                extra = grad_weights[:, :, i0:i1, : hi - lo] if grad_weights.numel() else None
                dq, dk, dv, grad_logits = explicit_flash_backward(
                    grad,
                    rows,
                    keys,
                    values,
                    chunk_out,
                    lse[:, :, i0:i1],
                    chunk_mask,
                    scale,
                    extra,
                    scratch,
                )
                if grad_mask is not None:
                    grad_mask[:, :, i0:i1, : hi - lo] = grad_logits
                if views is not None:
                    views.add_gradient((i0, i1, lo, hi), grad_logits)
            grad_q[:, :, i0:i1] += dq
            grad_k[:, :, lo:hi] += dk
            grad_v[:, :, lo:hi] += dv
        if grad_mask is not None and mask is not None and grad_mask.shape != mask.shape:
            grad_mask = grad_mask.sum_to_size(mask.shape)
        # None for each input where no add_gradient ran (they needed no gradient)
        input_grads = [] if ctx.views is None else ctx.views.gradients()
        return grad_q, grad_k, grad_v, grad_mask, None, None, None, None, *input_grads


def _span_mask(mask: Tensor | Any) -> Any:
    """span -> that span's mask (or None) from ``_ChunkedAttention``'s mask argument."""
    if mask is None:
        return lambda span: None
    if isinstance(mask, Tensor):
        return lambda span: mask[:, :, span[0] : span[1], : span[3] - span[2]]
    return mask


def chunked_relative_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    factors: list[RelativeFactors],
    spans: list[Span],
    scale: float,
    causal: bool,
) -> Tensor:
    """softmax(scale q kᵀ + terms) v at default positions, each span (i0, i1, lo, hi):
    queries i0 .. i1 - 1 against keys lo .. hi - 1, its terms gathered from the
    projections of ``factors`` (merged) over its keys (``band_terms``, -inf after each
    query where ``causal`` masks them).

    q: [B, H, N, D]; k, v: [B, H, M, D] (heads repeated for GQA by the caller) -> [B, H,
    N, D]. The terms are ``band_mask``'s: strided views made per span where they serve;
    else, where the terms' projections get gradients, every span's terms gathered at
    once ([B, H, N, widest]), which ``_ChunkedAttention`` gives their gradient span by
    span (a slice per span through autograd would zero-fill a gradient of the full
    projections for each: BERT relative_key_query's training step at N = 512 on a
    2-core CPU took 10.3x plain SDPA that way); otherwise each span's terms when its
    call needs them (``span_terms``), in the backward again.
    """
    n, m = q.shape[2], k.shape[2]
    mask, inputs = band_mask(factors, n, m, spans, causal)
    out, _, _ = _ChunkedAttention.apply(q, k, v, mask, spans, scale, None, False, *inputs)
    return out


def band_spans(
    n: int, m: int, clip: int, causal: bool
) -> tuple[list[Span], list[Span], list[Span]]:
    """Per chunk of queries (default positions: query i at M - N + i), the spans of the
    far-left keys (at least ``clip`` before every query of the chunk), of the band, and
    of the far-right keys (at least ``clip`` after every query; none when causal)."""
    far_left, band, far_right = [], [], []
    for i0, i1 in clipped_query_chunks(n):
        first, last = m - n + i0, m - n + i1 - 1  # the chunk's query positions
        hi = last + 1 if causal else m
        left = max(0, min(hi, first - clip + 1))
        right = max(left, min(hi, last + clip))
        far_left.append((i0, i1, 0, left))
        band.append((i0, i1, left, right))
        far_right.append((i0, i1, right, hi))
    return far_left, band, far_right


def clipped_query_chunks(n: int) -> list[tuple[int, int]]:
    """The chunks (i0, i1) of ``CLIPPED_RELATIVE_QUERY_CHUNK`` queries (the last one
    shorter) that the clipped path takes N queries in."""
    chunk = CLIPPED_RELATIVE_QUERY_CHUNK
    return [(i0, min(n, i0 + chunk)) for i0 in range(0, n, chunk)]


def band_terms(
    parts: list[RelativePart],
    n: int,
    m: int,
    band: list[Span],
    causal: bool,
    band_queries_only: bool = False,
    scratch: tuple[ChunkBuffer, ChunkBuffer] | None = None,
) -> Tensor:
    """The relative terms on the band of consecutive spans (queries band[0][0] ..
    band[-1][1] - 1, each span's own keys), summed: [B or 1, H, rows, width] with column
    w of query i at key lo + w of i's span (columns past the span are filled but
    unread), -inf where ``causal`` masks the key. ``band_queries_only``: the query-side
    parts were projected for the band's queries alone ([B, H, rows, K]), not all N.
    ``scratch``: see ``gathered_terms``."""
    device = parts[0].scores.device
    first_row, last_row = band[0][0], band[-1][1]
    keys = band_key_grid(band, m, device)  # [rows, w]
    queries = torch.arange(first_row, last_row, device=device).unsqueeze(1)  # [rows, 1]
    diagonal_index = keys - queries + (n - 1)  # [rows, w]: entry kv - q + N - 1
    query_row = 0 if band_queries_only else first_row  # the band's first query's row
    total = gathered_terms(parts, diagonal_index.unsqueeze(0), keys, query_row, scratch)
    if causal:
        masked = keys > queries + (m - n)  # key after the query
        total = total.masked_fill_(masked, float("-inf"))
    return total


def band_key_grid(band: list[Span], m: int, device: torch.device) -> Tensor:
    """The key index of each column of the band's terms laid out one row per query:
    [rows, widest], row i of span (i0, i1, lo, hi) holding lo, lo + 1, ... (past the
    span's keys, clamped to the last of the M keys: filled but unread)."""
    width = max(hi - lo for _, _, lo, hi in band)
    starts = torch.tensor(
        [lo for i0, i1, lo, _ in band for _ in range(i0, i1)], dtype=torch.int64, device=device
    )  # [rows]
    return (starts.unsqueeze(1) + torch.arange(width, device=device)).clamp(max=m - 1)


def band_mask(
    factors: list[RelativeFactors], n: int, m: int, spans: list[Span], causal: bool
) -> tuple[Any, list[Tensor]]:
    """The terms of every span of ``spans``, ``factors`` merged, as a mask of
    ``_ChunkedAttention`` and the tensors to pass after it (``mask_inputs``): where they
    serve (``band_views_serve``), strided views of projections in diagonal order, made
    per span, whose inputs follow where the terms train (without autograd 5-29% faster
    than the gathers at N = 1024 and 2048, 8 and 16 heads, but for one case within 1%,
    with up to 44% more peak memory for the projections over every diagonal,
    benchmarks/results/revisions_cpu_float32_views_inference_h*.md); else, where the
    terms train, ``band_terms`` gathered from the projections over the table rows into
    one [B, H, N, widest] tensor, and otherwise each span's terms when a call needs
    them (``span_terms``)."""
    trains = terms_train(factors)
    if band_views_serve(factors, spans, n):
        views = band_views(factors, n, m, spans, causal)
        return views, views.inputs if trains else []
    if trains:
        parts = [project_factors(factor) for factor in factors]
        return band_terms(parts, n, m, spans, causal), []
    return span_terms(factors, n, m, causal, spans), []


def terms_train(factors: list[RelativeFactors]) -> bool:
    """Whether gradients flow into the relative terms of ``factors``."""
    return torch.is_grad_enabled() and any(
        t.requires_grad for factor in factors for t in (factor.x, factor.rows)
    )


def span_terms(
    factors: list[RelativeFactors], n: int, m: int, causal: bool, spans: list[Span]
) -> Callable[[Span], Tensor]:
    """Each span's relative terms (``band_terms`` over its keys) for terms that get no
    gradient, ``factors`` merged, projected as ``projected_once`` and
    ``parts_of_span`` split the work, and gathered into two buffers that every span of
    ``spans`` reuses (``gathered_terms``' scratch): a span's terms are valid until the
    next span's are made."""
    once, per_span = projected_once(factors)
    scratch = gather_scratch(factors, spans)

    def terms(span: Span) -> Tensor:
        i0, i1, lo, hi = span
        parts = parts_of_span(factors, once, i0, i1)
        return band_terms(parts, n, m, [span], causal, per_span, scratch)[..., : hi - lo]

    return terms


def gather_scratch(
    factors: list[RelativeFactors], spans: list[Span]
) -> tuple[ChunkBuffer, ChunkBuffer]:
    """Buffers for ``gathered_terms``' gathers ([B, H, r, keys] each) that a loop over
    ``spans`` (i0, i1, lo, hi) of the terms of ``factors`` reuses span by span."""
    return gather_buffers(*batch_and_heads(factors), spans)


def gather_buffers(batch: int, heads: int, spans: list[Span]) -> tuple[ChunkBuffer, ChunkBuffer]:
    """Two buffers of [batch, heads, r, keys] for the largest span (i0, i1, lo, hi) of
    ``spans``: ``gathered_terms``' scratch."""
    largest = batch * heads * largest_span(spans)
    return ChunkBuffer(largest), ChunkBuffer(largest)


def batch_and_heads(factors: list[RelativeFactors]) -> tuple[int, int]:
    """The batch (1 where no factor has one) and the heads the terms of ``factors``
    have."""
    batch = max(factor.x.shape[0] if factor.x.dim() == 4 else 1 for factor in factors)
    return batch, max(factor.rows.shape[1] for factor in factors)


def projected_once(
    factors: list[RelativeFactors], rows_major_keys: bool = False
) -> tuple[list[RelativePart | None], bool]:
    """The projections of ``factors`` made once for every span of a call: the key-side,
    global and content terms, and the query-side ones too where their projections of
    every query come to at most ``QUERY_PROJECTION_WHOLE_BYTES``; else those are None
    (``parts_of_span`` projects them per span over only its queries), and the flag says
    so. ``rows_major_keys``: the key side's stored row by row (``projected_for_gathers``,
    for pairs at any positions; at default positions the band's pairs read rows near
    their diagonal, and BERT relative_key_query's forward at N = 2048 took 5.05x plain
    SDPA that way against 4.65x key by key, 2-core x86)."""
    query_bytes = sum(
        factor.x.numel() // factor.x.shape[-1] * factor.rows.shape[0] * factor.x.element_size()
        for factor in factors
        if factor.side == "query"
    )  # [B, H, N, K] per query-side term
    per_span = query_bytes > QUERY_PROJECTION_WHOLE_BYTES
    project = projected_for_gathers if rows_major_keys else project_factors
    once = [None if per_span and factor.side == "query" else project(factor) for factor in factors]
    return once, per_span


def parts_of_span(
    factors: list[RelativeFactors], once: list[RelativePart | None], i0: int, i1: int
) -> list[RelativePart]:
    """The parts of queries i0 .. i1 - 1: those of ``projected_once``, the query-side
    ones it left out projected over these queries alone ([B, H, i1 - i0, K])."""
    return [
        project_factors(factor._replace(x=factor.x[:, :, i0:i1])) if part is None else part
        for factor, part in zip(factors, once, strict=True)
    ]


def clipped_span_terms(
    factors: list[RelativeFactors], clip: int, spans: list[Span]
) -> TermsAtPositions:
    """The terms of ``factors`` (``_clipped_relative_factors``: clipped at ``clip``) for
    each span of ``spans`` at its positions (``terms_at_positions``), projected once for
    the call (``projected_once``: the query side per span where it is large) and
    gathered into buffers the spans reuse (``gather_scratch``). No autograd."""
    once, per_span = projected_once(factors, rows_major_keys=True)
    scratch = gather_scratch(factors, spans)

    def terms(span: Span, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        parts = parts_of_span(factors, once, span[0], span[1])
        return terms_at_positions(parts, q_positions, k_positions, span, clip, per_span, scratch)

    return terms


def terms_at_positions(
    parts: list[RelativePart],
    q_positions: Tensor,
    k_positions: Tensor,
    span: Span,
    clip: int,
    span_queries_only: bool = False,
    scratch: tuple[ChunkBuffer, ChunkBuffer] | None = None,
) -> Tensor:
    """The relative terms ``parts`` of span (i0, i1, lo, hi) at any positions, summed:
    [B or 1, H, r, keys]. The parts are those of ``_clipped_relative_factors``
    (``parts_of_span``), so the term of query position i and key position j reads row
    diagonal[clip(j - i, -K, K) + K]; a gather per term and per pair, no projection.
    q_positions: the span's queries' positions, [r] or [B, r]; k_positions: its keys',
    [keys] or [B, keys]. ``span_queries_only``: the query-side parts hold the span's
    queries alone, not all N. ``scratch``: see ``gathered_terms``."""
    i0, i1, lo, hi = span
    entry = clipped_entry(q_positions, k_positions, span, clip)  # [1 or B, r, keys]
    keys = torch.arange(lo, hi, device=entry.device).unsqueeze(0)  # [1, keys]
    return gathered_terms(parts, entry, keys, 0 if span_queries_only else i0, scratch)


def span_distances(q_positions: Tensor, k_positions: Tensor, span: Span) -> Tensor:
    """Key minus query position of each pair of span (i0, i1, lo, hi), given its
    queries' positions ([r] or [B, r]) and its keys' ([w] or [B, w]): [1 or B, r, w]."""
    i0, i1, lo, hi = span
    distances = relative_positions(q_positions, k_positions, i1 - i0, hi - lo, q_positions.device)
    return distances.reshape(-1, i1 - i0, hi - lo)


def clipped_entry(q_positions: Tensor, k_positions: Tensor, span: Span, clip: int) -> Tensor:
    """Each pair's diagonal among the 2K + 1 of terms clipped at K = ``clip``
    (``_clipped_relative_factors``), clip(j - i, -K, K) + K: [1 or B, r, w]
    (``span_distances``)."""
    return span_distances(q_positions, k_positions, span).clamp(-clip, clip) + clip


def gathered_terms(
    parts: list[RelativePart],
    diagonal_index: Tensor,
    keys: Tensor,
    first_row: int,
    scratch: tuple[ChunkBuffer, ChunkBuffer] | None = None,
) -> Tensor:
    """The relative terms ``parts`` of queries first_row .. first_row + r - 1, each
    against keys ``keys`` [r or 1, w] (key indices), read from their projections at
    their diagonals' rows (``diagonal[diagonal_index]``, diagonal_index [1 or B, r, w]),
    summed: [B or 1, H, r, w]. ``scratch``: where given (no autograd), the query- and
    key-side gathers write into its buffers (the sum, then each later term), so the
    result is valid until the next call with them."""
    count, width = diagonal_index.shape[-2:]
    total: Tensor | None = None
    for side, scores, diagonal in parts:
        into = None
        if scratch is not None and side in ("query", "key"):
            buffer = scratch[0 if total is None else 1]
            into = buffer.view((*scores.shape[:2], count, width), scores.dtype, scores.device)
        if diagonal is None:  # "content": one value per key, [B, H, M]
            term = scores[:, :, keys]  # [B, H, r or 1, w]
        else:
            rows = diagonal[diagonal_index].unsqueeze(1)  # [1 or B, 1, r, w]
            if side == "query":  # [B, H, N, K]
                chunk = scores[:, :, first_row : first_row + count]
                index = rows.expand(*scores.shape[:2], count, width)
                term = torch.gather(chunk, -1, index, out=into)
            elif side == "key":  # [B, H, M, K], read through a flat index per pair
                flat_scores, flat = flat_key_side(scores, keys, rows)  # flat: [1 or B, 1, r w]
                flat_into = None if into is None else into.view(*scores.shape[:2], -1)
                index = flat.expand(*scores.shape[:2], -1)
                term = torch.gather(flat_scores, -1, index, out=flat_into)
                term = term.view(*scores.shape[:2], count, width)
            else:  # "global": [H, K]
                term = scores[:, rows.squeeze(1)].transpose(0, 1)  # [1 or B, H, r, w]
        total = accumulated(total, term)
    assert total is not None  # parts is not empty
    return total


def flat_key_side(scores: Tensor, keys: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
    """A key-side projection scores [B, H, M, K] as one flat vector per batch row and
    head, a view, and the flat index of each pair's entry in it: keys [r or 1, w] (key
    indices), rows [1 or B, 1, r, w] (the row each pair reads) -> [1 or B, 1, r w].
    Stored row by row (``projected_for_gathers``), the entry is row * M + key; stored
    key by key, key * K + row."""
    m, k_rows = scores.shape[-2], scores.shape[-1]
    if rows_major(scores):
        by_rows = scores.transpose(-1, -2)  # [B, H, K, M], each [K, M] contiguous
        return by_rows.view(*by_rows.shape[:-2], -1), (rows * m + keys).flatten(-2)
    return scores.view(*scores.shape[:-2], -1), (keys * k_rows + rows).flatten(-2)


def rows_major(scores: Tensor) -> bool:
    """Whether a key-side projection [B, H, M, K] is stored row by row, each batch row
    and head's [K, M] contiguous (``projected_for_gathers``)."""
    return scores.stride(-2) == 1 and scores.stride(-1) == scores.shape[-2]


def projected_for_gathers(factor: RelativeFactors) -> RelativePart:
    """``project_factors`` for terms gathered per pair (``gathered_terms``), a key-side
    term's projection stored row by row (``rows_major_projection``)."""
    return rows_major_projection(factor) if factor.side == "key" else project_factors(factor)


def rows_major_projection(factor: RelativeFactors) -> RelativePart:
    """A key-side term's projection k_j . R_row stored row by row: [B, H, K, M] under a
    [B, H, M, K] view. A query's pairs far from it read one row (clipped), along the
    keys; stored key by key, each pair read a cache line of its own: DeBERTa's p2c
    gather of a chunk of 256 queries against 2048 keys at positions 2 apart took
    31-34 ms against about 4 ms (2 batch rows, 8 heads, 512 rows; 2-core x86)."""
    side, x, rows, diagonal, scale = factor
    x, rows = scaled_factors(x, rows, scale)
    by_rows = torch.matmul(rows.transpose(0, 1), x.transpose(-1, -2))  # [B, H, K, M]
    return RelativePart(side, by_rows.transpose(-1, -2), diagonal)  # [B, H, M, K]


def far_terms(factors: list[RelativeFactors], right: bool) -> tuple[Tensor | None, Tensor | None]:
    """A and B of the far keys on one side (see the module docstring): the terms at the
    row of the farthest diagonal, per query [B or 1, H, n] and per key [B or 1, H, m];
    None where no term reads that side.

    Each comes from its factors (x dotted with that one row), not from the terms'
    projection over every row: a column picked from the projection would, in a
    training step, give the projection a full-size gradient that is zero but for it
    (four such for BERT relative_key_query's two terms and two sides)."""
    per_query: Tensor | None = None
    per_key: Tensor | None = None
    for factor in factors:
        query_part = key_part = None
        if factor.diagonal is None:  # "content": one value per key
            key_part = project_factors(factor).scores  # [B, H, m]
        else:
            row = factor.diagonal[-1:] if right else factor.diagonal[:1]  # [1]
            one_row = factor._replace(rows=factor.rows.index_select(0, row))  # [1, H, D]
            value = project_factors(one_row).scores.squeeze(-1)
            if factor.side == "query":
                query_part = value  # [B, H, n]
            elif factor.side == "key":
                key_part = value  # [B, H, m]
            else:  # "global": [H]
                query_part = value[None, :, None]
        if query_part is not None:
            per_query = query_part if per_query is None else per_query + query_part
        if key_part is not None:
            per_key = key_part if per_key is None else per_key + key_part
    return per_query, per_key


def clipped_relative_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    factors: list[RelativeFactors],
    clip: int,
    scale: float,
    causal: bool,
    value_term: Any = None,
    layout: ClippedLayout | None = None,
) -> Tensor:
    """Attention with relative terms clipped at ``clip``, causal or not (see the module
    docstring): at default positions (the queries are the last N of M keys), or where
    ``layout`` gives the spans and the band's terms (``_position_band``: explicit
    positions).

    q: [B, H, N, D]; k: [B, H, M, D]; v: [B, H, M, value_dim] (heads repeated for GQA by
    the caller); factors: ``_relative_factors(q, k, dtype, causal)``, projected over
    their rows for the band (with ``layout``, those its band's terms were made of);
    ``value_term(weights, q_positions, k_positions)``: the encoding's ``_value_term``,
    or None. Returns [B, H, N, value_dim] in q's dtype.
    """
    batch, heads, n, dim = q.shape
    m, value_dim = k.shape[2], v.shape[-1]
    factors = merged_factors(factors)
    if layout is None:
        layout = default_layout(factors, n, m, clip, causal, q.device)
    far_left, band, far_right = layout.far_left, layout.band, layout.far_right
    q_positions, k_positions = layout.q_positions, layout.k_positions
    left_a, left_b = far_terms(factors, right=False)  # [., H, N], [., H, M] or None
    right_a, right_b = far_terms(factors, right=True)
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    trains = grads or terms_train(factors)
    # A_i enters a far side's log-sum-exp (softmax ignores a per-query constant); B_j
    # rides in two more features, q [q_i, 1, 0] (left) or [q_i, 0, 1] (right) against
    # k [k_j, B^L_j / s, B^R_j / s]; with gradients, v carries a column of ones
    # (``_ChunkedAttention``). Everything is padded to one width, as the kernel needs.
    by_key = left_b is not None or right_b is not None
    extra = 2 if by_key else 0
    width = max(dim + extra, value_dim + (1 if trains else 0))

    def features(*columns: Tensor) -> Tensor:
        """[B, H, L, width]: the columns side by side, zeros after them (no copy where
        a single column fills the width)."""
        full = [c.expand(batch, heads, *c.shape[2:]) for c in columns]
        used = sum(c.shape[-1] for c in full)
        if used == width and len(full) == 1:
            return full[0]
        zeros = full[0].new_zeros(1, 1, 1, 1).expand(batch, heads, full[0].shape[2], width - used)
        return torch.cat([*full, zeros], dim=-1)

    one_per_key, zero_per_key = k.new_ones(1, 1, m, 1), k.new_zeros(1, 1, m, 1)
    if by_key:
        left_keys = zero_per_key if left_b is None else left_b.unsqueeze(-1) / scale
        right_keys = zero_per_key if right_b is None else right_b.unsqueeze(-1) / scale
        keys = features(k, left_keys, right_keys)
    else:
        keys = features(k)
    values = features(v, one_per_key) if trains else features(v)  # ones at value_dim
    ones_column = value_dim if trains else None
    band_out, band_lse, band_weights = _ChunkedAttention.apply(
        features(q),
        keys,
        values,
        layout.mask,
        band,
        scale,
        ones_column,
        value_term is not None,
        *layout.mask_inputs,
    )
    pieces: list[tuple[Tensor, Tensor, Tensor | None]] = [(band_out, band_lse, None)]
    one_per_query, zero_per_query = q.new_ones(1, 1, n, 1), q.new_zeros(1, 1, n, 1)
    for spans, per_query, selector, far_key in (
        (far_left, left_a, (one_per_query, zero_per_query), k_positions[..., :1]),
        (far_right, right_a, (zero_per_query, one_per_query), k_positions[..., -1:]),
    ):
        if all(hi <= lo for _, _, lo, hi in spans):
            continue
        queries = features(q, *selector) if by_key else features(q)
        out, lse, _ = _ChunkedAttention.apply(
            queries, keys, values, None, spans, scale, ones_column, False
        )
        if per_query is not None:
            lse = lse + per_query  # A_i
        pieces.append((out, lse, far_key))
    total_lse = pieces[0][1]
    for _, lse, _ in pieces[1:]:
        total_lse = torch.logaddexp(total_lse, lse)  # [B, H, N]
    result: Tensor | None = None
    for out, lse, side_key in pieces:
        share = torch.exp(lse - total_lse).unsqueeze(-1)  # [B, H, N, 1]
        part = share * out[..., :value_dim]
        result = part if result is None else result + part
        if value_term is not None and side_key is not None:
            # that side's total weight times its row of the value table, read at the
            # side's farthest key
            result = result + value_term(share, q_positions, side_key)
    assert result is not None
    if value_term is not None:
        # the band's weights (softmax over the band alone), rescaled to the union
        band_share = torch.exp(band_lse - total_lse).unsqueeze(-1)
        if band_weights.requires_grad:
            weights = band_weights * band_share  # [B, H, N, w]
        else:  # no autograd: in place, no second [B, H, N, w]
            weights = band_weights.mul_(band_share)
        terms = []
        chunks = weights.split(CLIPPED_RELATIVE_QUERY_CHUNK, dim=2)  # one per span of band
        for (i0, i1, lo, hi), chunk in zip(band, chunks, strict=True):
            rows_at, keys_at = q_positions[..., i0:i1], k_positions[..., lo:hi]
            terms.append(value_term(chunk[..., : hi - lo], rows_at, keys_at))
        result = result + torch.cat(terms, dim=2)
    return result
