"""CPU FlashAttention (Dao et al. 2022) over query chunks with a mask that needs no
gradient, trained without a per-chunk slice of q, k or v through autograd.

The sdpa backend sends causal and windowed attention to SDPA a chunk of queries at a
time, each chunk against only the keys it may read (``query_chunks``). Sliced under
autograd, every chunk's q[:, :, i0:i1], k[:, :, lo:hi] and v[:, :, lo:hi] gets a
backward (``slice_backward``) that zero-fills a gradient as large as the whole tensor
and adds it to the others: work of the chunk count times the size of q, k and v. For an
ALiBi causal training step (2-core CPU, float32, batch 2, 16 heads, head_dim 64,
N = 2048, 8 chunks) those fills, adds and copies took 127 ms of 490 ms.

Here one autograd node spans every chunk: the forward runs the CPU flash kernel per
chunk into one output and its log-sum-exp, the backward the flash backward per chunk,
each chunk's gradients added into a slice of one gradient per input. Each chunk's
mask is made again in the backward (``mask_of``) rather than kept, so memory stays
that of one chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ._first_order import first_order_only
from ._mask_buffer import ChunkBuffer, largest_span

#: (i0, i1, lo, hi): queries i0 .. i1 - 1 read keys lo .. hi - 1
Span = tuple[int, int, int, int]
#: a span's mask, [rows, keys] or [1 or B, H, rows, keys], float or bool (True: read);
#: rows in reverse query order where the queries go in reversed; None: no mask
MaskOf = Callable[[int, int, int, int], "Tensor | None"]


#: devices where the sdpa backend's chunked training steps run as one autograd node
#: (``chunked_flash_attention``); only the CPU's flash kernel returns the log-sum-exp
#: its backward needs
CHUNKED_FLASH_DEVICES: set[str] = {"cpu"}


def cpu_flash_kernel_takes(q: Tensor) -> bool:
    """Whether the CPU flash kernels, called directly for their log-sum-exp, take q: the
    CPU, float32 or float64, no autocast."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64)
        and not torch.is_autocast_enabled("cpu")
    )


def cpu_flash_serves(q: Tensor, v: Tensor) -> bool:
    """Whether the chunked CPU flash paths run for q and v: ``cpu_flash_kernel_takes``,
    eager mode, values as wide as the queries."""
    return (
        cpu_flash_kernel_takes(q)
        and not torch.compiler.is_compiling()
        and v.shape[-1] == q.shape[-1]
    )


def unit_rows(t: Tensor) -> Tensor:
    """t with unit stride along its last dimension: itself where it has it, else a
    contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def cpu_flash_forward(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, causal: bool = False
) -> tuple[Tensor, Tensor]:
    """softmax(scale q kᵀ + mask) v and each query row's log-sum-exp by the CPU flash
    kernel, called directly: [B, H, N, value_dim], [B, H, N].

    The kernel reads each row of q, k and v as contiguous features, so they go in with
    unit stride along the last dimension (``unit_rows``): a transposed view gave wrong
    outputs, NaN among them. ``F.scaled_dot_product_attention`` makes that copy itself
    before it calls the kernel.
    """
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        unit_rows(q), unit_rows(k), unit_rows(v), 0.0, causal, attn_mask=mask, scale=scale
    )
    return out, lse


def cpu_flash_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    mask: Tensor | None,
    scale: float,
    causal: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of ``cpu_flash_forward`` into q, k and v (each dense input with
    unit stride along its last dimension, as there): dq, dk, dv."""
    dense = (unit_rows(t) for t in (grad_out, q, k, v, out))
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *dense, lse, 0.0, causal, attn_mask=mask, scale=scale
    )
    return dq, dk, dv


def chunked_flash_serves(q: Tensor, k: Tensor, v: Tensor, spans: list[Span]) -> bool:
    """Whether ``chunked_flash_attention`` runs a chunked call: more than one span, a
    training step (a gradient reaches q, k or v), a device in ``CHUNKED_FLASH_DEVICES``
    and ``cpu_flash_serves``. The caller checks that the masks need no gradient."""
    return (
        len(spans) > 1
        and torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad)
        and q.device.type in CHUNKED_FLASH_DEVICES
        and cpu_flash_serves(q, v)
    )


def chunked_flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spans: list[Span],
    mask_of: MaskOf,
    scale: float,
    queries_reversed: bool = False,
) -> Tensor:
    """softmax(scale q kᵀ + mask) v, span by span: queries i0 .. i1 - 1 against keys
    lo .. hi - 1 with ``mask_of(i0, i1, lo, hi)``, whose rows run in reverse query order
    where ``queries_reversed`` (the chunk's queries then go in reversed and its output
    comes back in order). The spans partition the queries, and every query reads a key
    its mask allows.

    q: [B, H, N, D]; k, v: [B, H, M, D] (heads repeated for grouped queries by the
    caller) -> [B, H, N, D], differentiable in q, k and v (once); the masks get no
    gradient.
    """
    out: Tensor = _ChunkedFlash.apply(q, k, v, spans, mask_of, scale, queries_reversed)
    return out


class _ChunkedFlash(torch.autograd.Function):
    """``chunked_flash_attention`` as one autograd node (see the module docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        spans: list[Span],
        mask_of: MaskOf,
        scale: float,
        queries_reversed: bool,
    ) -> Tensor:
        out, lse = flash_chunks_forward(q, k, v, spans, mask_of, scale, queries_reversed)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spans, ctx.mask_of, ctx.scale, ctx.reversed = spans, mask_of, scale, queries_reversed
        return out

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_chunks_backward(
            grad_out, q, k, v, out, lse, ctx.spans, ctx.mask_of, ctx.scale, ctx.reversed
        )
        return dq, dk, dv, None, None, None, None


def flash_chunks_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spans: list[Span],
    mask_of: MaskOf,
    scale: float,
    queries_reversed: bool,
) -> tuple[Tensor, Tensor]:
    """The CPU flash kernel per span (no autograd): the output [B, H, N, value_dim] and
    each query row's log-sum-exp [B, H, N], in query order."""
    out = q.new_empty(q.shape[:-1] + v.shape[-1:])  # [B, H, N, value_dim]
    lse = q.new_empty(q.shape[:-1])  # [B, H, N]
    for i0, i1, lo, hi in spans:
        chunk_out, chunk_lse = cpu_flash_forward(
            _rows(q, i0, i1, queries_reversed),
            k[:, :, lo:hi],
            v[:, :, lo:hi],
            flash_mask(mask_of(i0, i1, lo, hi), q.dtype),
            scale,
        )
        out[:, :, i0:i1] = chunk_out.flip(2) if queries_reversed else chunk_out
        lse[:, :, i0:i1] = chunk_lse.flip(-1) if queries_reversed else chunk_lse
    return out, lse


def flash_chunks_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    spans: list[Span],
    mask_of: MaskOf,
    scale: float,
    queries_reversed: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The CPU flash backward per span of ``flash_chunks_forward``'s output and
    log-sum-exp: dq (each span's rows written once), and dk and dv summed over the
    spans that read each key; the widest span first, so that one reading every key
    (a causal step's last) gives dk and dv their first values without a zero fill."""
    grad_out = grad_out.contiguous()
    m = k.shape[2]
    dq = torch.empty_like(q)
    dk: Tensor | None = None
    dv: Tensor | None = None
    for i0, i1, lo, hi in sorted(spans, key=lambda span: span[2] - span[3]):
        grads = cpu_flash_backward(
            _rows(grad_out, i0, i1, queries_reversed),
            _rows(q, i0, i1, queries_reversed),
            k[:, :, lo:hi],
            v[:, :, lo:hi],
            _rows(out, i0, i1, queries_reversed),
            lse[:, :, i0:i1].flip(-1) if queries_reversed else lse[:, :, i0:i1],
            flash_mask(mask_of(i0, i1, lo, hi), q.dtype),
            scale,
        )
        dq[:, :, i0:i1] = grads[0].flip(2) if queries_reversed else grads[0]
        if dk is None or dv is None:
            if (lo, hi) == (0, m):
                dk, dv = grads[1], grads[2]
                continue
            dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        dk[:, :, lo:hi] += grads[1]
        dv[:, :, lo:hi] += grads[2]
    assert dk is not None and dv is not None  # spans is not empty
    return dq, dk, dv


def explicit_flash_backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    mask: Tensor,
    scale: float,
    grad_weights: Tensor | None = None,
    scratch: tuple[ChunkBuffer, ChunkBuffer] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of softmax(scale q kᵀ + mask) v from its rows' log-sum-exp, as the
    flash backward forms them, but explicit so that dS (also the additive mask's
    gradient) comes out: P = exp(scale q kᵀ + mask - lse), dP = dO vᵀ, δ_i = dO_i . O_i,
    dS = P ⊙ (dP - δ), dq = scale dS k, dk = scale dSᵀ q, dv = Pᵀ dO. ``grad_weights``:
    a gradient into P as well (added to dP, and its share to δ). q: [B, H, r, D]; k, v:
    [B, H, c, D]; mask: broadcastable to [B, H, r, c]; lse: [B, H, r] -> dq, dk, dv, dS.
    ``scratch``: buffers for P and dP ([B, H, r, c] each), where a loop over chunks
    reuses them (dS, made in P's, is then valid until the next call)."""
    shape = (*q.shape[:-1], k.shape[-2])  # [B, H, r, c]
    weights_into = grad_into = None
    if scratch is not None:
        weights_into = scratch[0].view(shape, q.dtype, q.device)
        grad_into = scratch[1].view(shape, q.dtype, q.device)
    weights = recomputed_weights(q, k, mask, lse, scale, weights_into)  # P
    grad_logits = torch.matmul(grad, v.transpose(-1, -2), out=grad_into)  # dP
    delta = (grad * out).sum(-1, keepdim=True)  # δ_i = dO_i . O_i
    if grad_weights is not None:
        grad_logits += grad_weights
        delta += (weights * grad_weights).sum(-1, keepdim=True)
    grad_v = torch.matmul(weights.transpose(-1, -2), grad)
    grad_logits = weights.mul_(grad_logits.sub_(delta))  # dS = P ⊙ (dP - δ)
    grad_q = torch.matmul(grad_logits, k).mul_(scale)
    grad_k = torch.matmul(grad_logits.transpose(-1, -2), q).mul_(scale)
    return grad_q, grad_k, grad_v, grad_logits


def explicit_span_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    span: Span,
    mask: Tensor,
    scale: float,
    grads: tuple[Tensor, Tensor, Tensor],
    scratch: tuple[ChunkBuffer, ChunkBuffer],
) -> Tensor:
    """``explicit_flash_backward`` of one span (i0, i1, lo, hi) of a chunked node:
    queries i0 .. i1 - 1 of q [B, H, N, D] (and of grad_out, out, lse) against keys
    lo .. hi - 1 of k and v, with the span's additive ``mask``. Adds dq into the span's
    rows of grads[0] and dk, dv into its keys' rows of grads[1], grads[2]; returns dS
    [B, H, r, keys], in ``scratch`` (``explicit_backward_scratch``: valid until the
    next span's)."""
    i0, i1, lo, hi = span
    grad_q, grad_k, grad_v = grads
    dq, dk, dv, grad_logits = explicit_flash_backward(
        grad_out[:, :, i0:i1],
        q[:, :, i0:i1],
        k[:, :, lo:hi],
        v[:, :, lo:hi],
        out[:, :, i0:i1],
        lse[:, :, i0:i1],
        mask,
        scale,
        scratch=scratch,
    )
    grad_q[:, :, i0:i1] += dq
    grad_k[:, :, lo:hi] += dk
    grad_v[:, :, lo:hi] += dv
    return grad_logits


def explicit_backward_scratch(q: Tensor, spans: list[Span]) -> tuple[ChunkBuffer, ChunkBuffer]:
    """Buffers for ``explicit_flash_backward``'s P and dP ([B, H, r, keys] each) that a
    loop over ``spans`` (i0, i1, lo, hi) of q [B, H, N, D] reuses span by span."""
    pairs = q.shape[0] * q.shape[1] * largest_span(spans)
    return ChunkBuffer(pairs), ChunkBuffer(pairs)


def recomputed_weights(
    rows: Tensor,
    keys: Tensor,
    mask: Tensor | None,
    lse: Tensor,
    scale: float,
    out: Tensor | None = None,
) -> Tensor:
    """A span's softmax weights recomputed from its rows' log-sum-exp (as a flash
    backward does): P = exp(scale q kᵀ + mask - lse), a fresh tensor (or ``out``).
    rows: [B, H, r, D]; keys: [B, H, c, D]; mask: additive, broadcastable to
    [B, H, r, c]; lse: [B, H, r] -> [B, H, r, c]."""
    scores = torch.matmul(rows, keys.transpose(-1, -2), out=out).mul_(scale)  # [B, H, r, c]
    if mask is not None:
        scores += mask
    return scores.sub_(lse.unsqueeze(-1)).exp_()


def _rows(x: Tensor, i0: int, i1: int, reversed_order: bool) -> Tensor:
    """Rows i0 .. i1 - 1 of x [B, H, N, D], in reverse order where asked (a copy)."""
    rows = x[:, :, i0:i1]
    return rows.flip(2) if reversed_order else rows


def flash_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A span's mask as the CPU flash kernel takes it: 4-D, additive, in the queries'
    dtype (a bool mask becomes 0 where True and -inf where False)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            ~mask, float("-inf")
        )
    mask = mask.to(dtype)
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask


def sequence_slices(x: Tensor, ranges: list[tuple[int, int]]) -> tuple[Tensor, ...]:
    """x[:, :, a:b] for each (a, b) of ``ranges`` (x: [B, H, L, D]), as one autograd node
    where x needs a gradient: the slices' gradients are added into one buffer of x's
    size, where a slice through autograd (``slice_backward``) would zero-fill a gradient
    of x's size for each and autograd would then sum them. For the chunks that
    ``chunked_flash_attention`` does not serve (a mask that needs a gradient, half
    precision)."""
    trains = torch.is_grad_enabled() and x.requires_grad
    if not trains or len(ranges) < 2 or torch.compiler.is_compiling():
        return tuple(x[:, :, a:b] for a, b in ranges)
    slices: tuple[Tensor, ...] = _SequenceSlices.apply(x, ranges)
    return slices


class _SequenceSlices(torch.autograd.Function):
    """``sequence_slices`` as one autograd node."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, ranges: list[tuple[int, int]]) -> tuple[Tensor, ...]:
        ctx.ranges, ctx.shape, ctx.dtype, ctx.device = ranges, x.shape, x.dtype, x.device
        return tuple(x[:, :, a:b] for a, b in ranges)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        grad = torch.zeros(ctx.shape, dtype=ctx.dtype, device=ctx.device)  # [B, H, L, D]
        for (a, b), part in zip(ctx.ranges, grads, strict=True):
            if part is not None:
                grad[:, :, a:b] += part
        return grad, None
