"""CPU attention over query chunks whose masks train, each chunk's mask made again in the
backward instead of kept.

A position bias of (head, query, key) that is not a function of j - i alone (FIRE's MLP
of ψ(i − j)/ψ(max(i, L)), TUPE-R's untied and relative terms) goes to SDPA a chunk of
queries at a time, its mask built per chunk (``_sdpa_in_chunks``). Where that bias
trains, autograd through each chunk keeps the chunk's softmax weights [B, H, rows, M]
and the graph that built its mask (FIRE: a [hidden, rows, M] layer): over all chunks,
O(N · M) memory in the batch, heads and hidden width.

Here one autograd node spans the chunks. The forward runs the CPU flash kernel per chunk
with the mask computed without a graph, and keeps only q, k, v, the output and each
row's log-sum-exp (Dao et al. 2022, FlashAttention). The backward takes one chunk at a
time: it makes the chunk's mask again with a graph, recomputes its weights from the
log-sum-exp, P = exp(scale q kᵀ + mask − lse), and forms

    dP = dO vᵀ,   dS = P ⊙ (dP − δ),   δ_i = dO_i · O_i,
    dq = scale dS k,   dk += scale dSᵀ q,   dv += Pᵀ dO,

and passes dS (summed over the dimensions the mask broadcasts) into the mask's graph,
from which the tensors it was built from (``mask_inputs``: the module's parameters) get
their gradients. Memory is that of one chunk.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._chunked_flash import (
    MaskOf,
    Span,
    cpu_flash_serves,
    explicit_backward_scratch,
    explicit_span_backward,
    flash_chunks_forward,
    flash_mask,
)
from ._first_order import first_order_only

#: devices where a chunked training step whose masks train runs as one autograd node
#: (``recomputed_mask_attention``); only the CPU's flash kernel returns the log-sum-exp
#: its backward needs
RECOMPUTED_MASK_DEVICES: set[str] = {"cpu"}


#: the node serves calls of at least this many keys. It trades the mask's second
#: computation for memory; against one call per chunk through autograd in one run
#: (attention_backends_cpu_float32_fire.md, 2-core CPU, float32, batch 2, 16 heads,
#: head_dim 64, training steps as time over plain SDPA's, peak extra memory): FIRE at
#: N = 2048 6.68x against 7.64x and 465 against 1342 MiB (causal 4.56x against 4.28x,
#: 457 against 840 MiB); at 1024 5.07x against 4.98x and 232 against 382 MiB (causal
#: 3.30x against 3.45x); at 512 3.73x against 3.32x (causal 2.66x against 2.29x), and
#: TUPE-R, whose table ends at 512 positions, 8.41x against 8.23x (causal 6.39x
#: against 5.58x)
RECOMPUTED_MASK_MIN_KEYS = 1024


def recomputed_mask_serves(
    q: Tensor, k: Tensor, v: Tensor, mask_inputs: tuple[Tensor, ...]
) -> bool:
    """Whether ``recomputed_mask_attention`` runs a chunked call: gradients on and into
    one of ``mask_inputs``, at least ``RECOMPUTED_MASK_MIN_KEYS`` keys, a device in
    ``RECOMPUTED_MASK_DEVICES`` and ``cpu_flash_serves`` (float32 or float64, eager
    mode, values as wide as the queries)."""
    return (
        torch.is_grad_enabled()
        and any(t.requires_grad for t in mask_inputs)
        and k.shape[2] >= RECOMPUTED_MASK_MIN_KEYS
        and q.device.type in RECOMPUTED_MASK_DEVICES
        and cpu_flash_serves(q, v)
    )


def recomputed_mask_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spans: list[Span],
    mask_of: MaskOf,
    scale: float,
    mask_inputs: tuple[Tensor, ...],
) -> Tensor:
    """softmax(scale q kᵀ + mask) v, span by span: queries i0 .. i1 - 1 against keys
    lo .. hi - 1 with the float mask ``mask_of(i0, i1, lo, hi)`` ([rows, keys] or
    [1 or B, 1 or H, rows, keys], rows in query order), built from ``mask_inputs`` and
    nothing else that needs a gradient. The spans partition the queries, and every query
    reads a key its mask allows.

    q: [B, H, N, D]; k, v: [B, H, M, D] (heads repeated for grouped queries by the
    caller) -> [B, H, N, D], differentiable (once) in q, k, v and ``mask_inputs``. See the
    module docstring.
    """
    out: Tensor = _RecomputedMask.apply(q, k, v, spans, mask_of, scale, *mask_inputs)
    return out


class _RecomputedMask(torch.autograd.Function):
    """``recomputed_mask_attention`` as one autograd node (see the module docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        spans: list[Span],
        mask_of: MaskOf,
        scale: float,
        *mask_inputs: Tensor,
    ) -> Tensor:
        out, lse = flash_chunks_forward(q, k, v, spans, mask_of, scale, False)
        ctx.save_for_backward(q, k, v, out, lse, *mask_inputs)  # inputs: version checks
        ctx.spans, ctx.mask_of, ctx.scale = spans, mask_of, scale
        return out

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, *mask_inputs = ctx.saved_tensors
        trained = [t for t in mask_inputs if t.requires_grad]
        grads = _chunk_gradients(
            grad_out, q, k, v, out, lse, ctx.spans, ctx.mask_of, ctx.scale, trained
        )
        dq, dk, dv, trained_grads = grads
        by_input = iter(trained_grads)
        input_grads = [next(by_input) if t.requires_grad else None for t in mask_inputs]
        return dq, dk, dv, None, None, None, *input_grads


def _chunk_gradients(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    spans: list[Span],
    mask_of: MaskOf,
    scale: float,
    trained: list[Tensor],
) -> tuple[Tensor, Tensor, Tensor, list[Tensor | None]]:
    """dq, dk, dv and the gradients of ``trained`` (the mask inputs that need one, None
    where a mask does not reach an input), one span at a time from its recomputed
    weights (``explicit_span_backward``, as the other chunked nodes: P and dP in
    buffers the spans reuse)."""
    grads = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    scratch = explicit_backward_scratch(q, spans)  # P and dP of a span
    trained_grads: list[Tensor | None] = [None] * len(trained)
    for span in spans:
        with torch.enable_grad():
            mask = mask_of(*span)  # [rows, keys] or [1 or B, 1 or H, rows, keys]
        assert mask is not None and mask.dtype != torch.bool  # a bias that trains
        additive = flash_mask(mask.detach(), q.dtype)
        assert additive is not None  # of a mask
        grad_scores = explicit_span_backward(
            grad_out, q, k, v, out, lse, span, additive, scale, grads, scratch
        )  # dS [B, H, rows, keys]
        if not mask.requires_grad:
            continue
        grad_mask = grad_scores.sum_to_size(mask.shape).to(mask.dtype)  # over broadcast dims
        parts = torch.autograd.grad(mask, trained, grad_mask, allow_unused=True)
        for index, part in enumerate(parts):
            if part is not None:
                total = trained_grads[index]  # a first part may alias dS's buffer: copied
                trained_grads[index] = part.clone() if total is None else total.add_(part)
    return (*grads, trained_grads)
