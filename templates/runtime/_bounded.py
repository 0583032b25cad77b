"""Trained parameters read within a range, whose gradient still brings them back into it.

KERPLE's r1 and r2 (Chi et al. 2022, arXiv:2205.09921) and an expression parameter's
``bounds`` are read clamped: value = clamp(p, low, high). A plain clamp passes no
gradient to a p outside [low, high], so a parameter that starts there or steps there
stays for good (KERPLE-log's r2 ~ U(0, 1) starts below its 0.01 on 1% of heads). The
authors' code writes the clamp back into the parameter at every forward, so the
gradient, taken at the bound, always reaches it, and the next forward undoes an outward
step. ``clamp_toward_range`` gives that without changing the stored value:

    forward:  clamp(p, low, high)
    backward: g where low <= p <= high; outside, g where a descent step (p - lr g)
              moves p toward the range, else 0

so p outside its range never drifts further out and returns as soon as the gradient
points back in (lagging the authors' by how far it lay outside: an initial value or one
step's overshoot).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class _ClampTowardRange(torch.autograd.Function):
    """``clamp_toward_range``'s forward and backward (with ``setup_context`` and a
    generated vmap rule, so torch.func's grad and vmap take it)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(value: Tensor, low: float | None, high: float | None) -> Tensor:
        return value.clamp(low, high)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        value, low, high = inputs
        ctx.save_for_backward(value)
        ctx.low, ctx.high = low, high

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (value,) = ctx.saved_tensors
        outward = torch.zeros_like(value, dtype=torch.bool)
        if ctx.low is not None:  # below: descent raises p where g < 0
            outward |= (value < ctx.low) & (grad > 0)
        if ctx.high is not None:  # above: descent lowers p where g > 0
            outward |= (value > ctx.high) & (grad < 0)
        return grad.masked_fill(outward, 0.0), None, None


def clamp_toward_range(value: Tensor, low: float | None, high: float | None = None) -> Tensor:
    """clamp(value, low, high), whose gradient reaches a value outside the range where
    it points back into it (module docstring); ``value``'s shape and dtype."""
    if not value.requires_grad:
        return value.clamp(low, high)
    return _ClampTowardRange.apply(value, low, high)
