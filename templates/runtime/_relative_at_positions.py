"""A CPU training step with relative terms at any positions, as one autograd node over the
query chunks (``attention_at_positions``): the forward makes each chunk's terms from the
node's inputs (a ``SpanTerms`` layout), joins its masks and runs the CPU flash kernel;
the backward makes them again, forms dS (``explicit_flash_backward``) and lets the
layout route it into the inputs' gradients. This module's layout is for terms clipped
at a distance (``relative_attention_at_positions``); ``_ranged_relative`` has one for
terms read by distance with no clip.

Where the terms are clipped at K (``relative_clip``: Shaw et al. 2018's clip, BERT's
relative_key and relative_key_query, Huang et al. 2020, DeBERTa's log buckets, He et al.
2021), the term of query position i and key position j reads row
diagonal[clip(j - i, -K, K) + K] of the table's 2K + 1 rows at any positions, so the
terms' projections over those rows (``_clipped_relative_factors``: q R^Tᵀ, [B, H, N,
2K + 1], and k R^Qᵀ, [B, H, M, 2K + 1]) are made once per call, with autograd, and are
this node's inputs. The forward gathers each chunk's terms from them at its positions
(``terms_at_positions``, into buffers the chunks reuse), joins its masks and runs the
CPU flash kernel; it keeps q, k, v, the projections, the output and each row's
log-sum-exp. The backward makes each chunk's terms again, forms dq, dk, dv and dS from
the recomputed weights (``explicit_flash_backward``), and adds dS into the projections'
gradients at the rows each pair read (a scatter-add per term into the chunk's rows of
the query side, and into the keys' rows of the key side), from where autograd takes
them to q, k and the tables. No [B, H, N, M] tensor and no per-chunk graph is kept.

Before, each chunk built its terms at its positions through autograd: it projected every
key it reads on the table again, and SDPA ran its math kernel, its mask needing a
gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from ._chunked_flash import (
    Span,
    explicit_backward_scratch,
    explicit_span_backward,
    flash_chunks_forward,
)
from ._clipped_relative import clipped_entry, flat_key_side, gather_buffers, terms_at_positions
from ._first_order import first_order_only
from ._mask_buffer import ChunkBuffer
from ._terms import RelativeFactors, RelativePart

#: a span's terms with its masks joined (in place where it can): (span, terms) -> masked
SpanMasks = Callable[[Span, Tensor], Tensor]


def relative_attention_at_positions(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    parts: list[RelativePart],
    clip: int,
    spans: list[Span],
    q_positions: Tensor,
    k_positions: Tensor,
    masked: SpanMasks,
    scale: float,
) -> Tensor:
    """softmax(scale q kᵀ + terms + masks) v, span by span (queries i0 .. i1 - 1 against
    keys lo .. hi - 1, partitioning the queries, each with a key), the terms read from
    ``parts`` (the query- and key-side projections of ``_clipped_relative_factors``,
    clipped at ``clip``) at the positions of each pair. See the module docstring.

    q: [B, H, N, D]; k, v: [B, H, M, D] (heads repeated for GQA by the caller);
    q_positions: [N] or [B, N]; k_positions: [M] or [B, M]; ``masked``: a span's
    terms with its masks joined (no gradient) -> [B, H, N, D], differentiable (once) in
    q, k, v and the parts' projections.
    """
    layout = PositionedParts(parts, clip, q_positions, k_positions, masked)
    return attention_at_positions(q, k, v, spans, layout, scale, [part.scores for part in parts])


class SpanTerms(Protocol):
    """How ``attention_at_positions`` makes a span's terms from its differentiable
    ``inputs`` (the tensors the terms are made of) and routes dS back into them."""

    def scratch(self, inputs: tuple[Tensor, ...], spans: list[Span]) -> Any:
        """Buffers that the spans of one pass (forward or backward) reuse."""
        ...

    def terms(self, span: Span, inputs: tuple[Tensor, ...], scratch: Any) -> Tensor:
        """The span's (i0, i1, lo, hi) terms with its masks joined: [B or 1, H, r, w],
        valid until the next span's."""
        ...

    def add_gradient(
        self,
        span: Span,
        grad_logits: Tensor,
        inputs: tuple[Tensor, ...],
        grads: list[Tensor | None],
        scratch: Any,
    ) -> None:
        """dS of the span [B, H, r, w], whose terms were the last made, added into
        ``grads`` (one per input, None where that input needs none)."""
        ...


def attention_at_positions(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spans: list[Span],
    layout: SpanTerms,
    scale: float,
    inputs: list[Tensor],
) -> Tensor:
    """softmax(scale q kᵀ + terms) v span by span as one autograd node, each span's
    terms made by ``layout`` from ``inputs`` in the forward and again in the backward
    (see the module docstring): [B, H, N, value_dim], differentiable (once) in q, k, v
    and ``inputs``. q: [B, H, N, D]; k, v: [B, H, M, D] (heads repeated for GQA)."""
    out: Tensor = _AttentionAtPositions.apply(q, k, v, spans, layout, scale, *inputs)
    return out


def relative_attention_at_positions_serves(factors: list[RelativeFactors]) -> bool:
    """Whether ``relative_attention_at_positions`` takes the terms of these factors:
    query- and key-side terms only (the node scatters dS into those two layouts)."""
    return all(factor.side in ("query", "key") for factor in factors)


class PositionedParts:
    """What the node needs to make a span's terms again and route their gradient: the
    parts' sides and diagonals, the clip, the positions and the masks."""

    def __init__(
        self,
        parts: list[RelativePart],
        clip: int,
        q_positions: Tensor,
        k_positions: Tensor,
        masked: SpanMasks,
    ):
        self.sides = [part.side for part in parts]
        self.diagonals = [part.diagonal for part in parts]
        self.clip, self.masked = clip, masked
        self.q_positions, self.k_positions = q_positions, k_positions

    def parts(self, scores: tuple[Tensor, ...]) -> list[RelativePart]:
        """The parts with these projections."""
        return [
            RelativePart(side, part, diagonal)
            for side, part, diagonal in zip(self.sides, scores, self.diagonals, strict=True)
        ]

    def entry(self, span: Span) -> Tensor:
        """Each pair's diagonal: [1 or B, r, w], clip(j - i, -K, K) + K."""
        i0, i1, lo, hi = span
        q_at, k_at = self.q_positions[..., i0:i1], self.k_positions[..., lo:hi]
        return clipped_entry(q_at, k_at, span, self.clip)

    def scratch(
        self, inputs: tuple[Tensor, ...], spans: list[Span]
    ) -> tuple[ChunkBuffer, ChunkBuffer]:
        """Buffers for a span's gathered terms ([B, H, r, w] each) that the spans reuse."""
        return gather_buffers(inputs[0].shape[0], inputs[0].shape[1], spans)

    def terms(
        self, span: Span, inputs: tuple[Tensor, ...], scratch: tuple[ChunkBuffer, ChunkBuffer]
    ) -> Tensor:
        """The span's terms with its masks joined: [B or 1, H, r, w], in ``scratch``
        (valid until the next span's)."""
        i0, i1, lo, hi = span
        q_at, k_at = self.q_positions[..., i0:i1], self.k_positions[..., lo:hi]
        terms = terms_at_positions(self.parts(inputs), q_at, k_at, span, self.clip, False, scratch)
        return self.masked(span, terms)

    def add_gradient(
        self,
        span: Span,
        grad_logits: Tensor,
        inputs: tuple[Tensor, ...],
        grads: list[Tensor | None],
        scratch: Any,
    ) -> None:
        """dS of the span [B, H, r, w] added into each projection's gradient (``grads``,
        [B, H, N or M, K] each, [H, K] for a "global" part, [B, H, M] for a "content"
        one; None where that part needs none) at the rows its pairs read. A "content"
        part (one value per key, u . k_j: ``TrainedBand``'s terms beside a query-side
        one) is read by every query of the span, so its keys' gradient is dS summed over
        the queries."""
        i0, i1, lo, hi = span
        entry = self.entry(span)
        batch, heads, rows, width = grad_logits.shape
        for side, diagonal, grad in zip(self.sides, self.diagonals, grads, strict=True):
            if grad is None:
                continue
            if side == "content":  # [B or 1, H, M]: read as scores[:, :, lo:hi] per query
                per_key = grad_logits.sum(-2)  # [B, H, w]
                grad[:, :, lo:hi] += (
                    per_key.sum(0, keepdim=True) if grad.shape[0] < batch else per_key
                )
                continue
            assert diagonal is not None  # a query-side, key-side or global part
            read = diagonal[entry].unsqueeze(1)  # [1 or B, 1, r, w]: the row each pair read
            if side == "query":  # [B, H, N, K]: the span's queries' rows
                index = read.expand(batch, heads, rows, width)
                grad[:, :, i0:i1].scatter_add_(-1, index, grad_logits)
            elif side == "global":  # [H, K]: every batch row's pairs into one row per head
                index = read.expand(batch, 1, rows, width).reshape(1, -1)  # [1, B r w]
                by_head = grad_logits.transpose(0, 1).reshape(heads, -1)  # [H, B r w]
                grad.scatter_add_(-1, index.expand(heads, -1), by_head)
            else:  # "key", [B, H, M, K] laid out as its projection (``flat_key_side``)
                keys = torch.arange(lo, hi, device=entry.device)  # [w]
                flat_grad, flat = flat_key_side(grad, keys, read)  # flat: [1 or B, 1, r w]
                index = flat.expand(batch, heads, rows * width)
                flat_grad.scatter_add_(-1, index, grad_logits.flatten(-2))


class _AttentionAtPositions(torch.autograd.Function):
    """``attention_at_positions`` as one autograd node (see the module docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        spans: list[Span],
        layout: SpanTerms,
        scale: float,
        *inputs: Tensor,
    ) -> Tensor:
        scratch = layout.scratch(inputs, spans)

        def terms_of(i0: int, i1: int, lo: int, hi: int) -> Tensor:  # [B or 1, H, r, w]
            return layout.terms((i0, i1, lo, hi), inputs, scratch)

        out, lse = flash_chunks_forward(q, k, v, spans, terms_of, scale, False)
        ctx.save_for_backward(q, k, v, out, lse, *inputs)
        ctx.spans, ctx.layout, ctx.scale = spans, layout, scale
        return out

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, *saved = ctx.saved_tensors
        inputs = tuple(saved)
        layout: SpanTerms = ctx.layout
        qkv_grads = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        trained = ctx.needs_input_grad[6:]
        grads = [
            torch.zeros_like(t) if needs else None for t, needs in zip(inputs, trained, strict=True)
        ]
        scratch = layout.scratch(inputs, ctx.spans)
        weights_scratch = explicit_backward_scratch(q, ctx.spans)  # P and dP of a span
        for span in ctx.spans:
            terms = layout.terms(span, inputs, scratch).to(q.dtype)
            grad_logits = explicit_span_backward(
                grad_out, q, k, v, out, lse, span, terms, ctx.scale, qkv_grads, weights_scratch
            )  # dS [B, H, r, w]
            layout.add_gradient(span, grad_logits, inputs, grads, scratch)
        return *qkv_grads, None, None, None, *grads
