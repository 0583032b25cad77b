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

The rule reads the whole gradient of a call: a call that builds its bias a chunk of
queries at a time reads each value once for every chunk (``BoundedReads``), not once
per chunk, whose gradients of mixed signs would each be judged alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn


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


class BoundedReads(nn.Module):
    """Values read through ``clamp_toward_range`` made once for a call whose bias is
    built a chunk of queries at a time, and shared by its chunks.

    Each chunk's bias read afresh would put a clamp node in every chunk's graph, each
    judging its own part of the gradient: a value below its range whose chunks' parts
    have mixed signs got their negative parts' sum, where the eager oracle judges their
    total (KERPLE-log, r1 = -0.1, explicit positions, one query per chunk: -1.053
    against -0.972). Blocks whose parameters are read so list every read a call can
    make (``_bounded_read_calls``) and read through ``_bounded_read``; the sdpa backend's
    chunk loop makes them once in the call's graph, builds every chunk's mask with
    them (``sharing_bounded_reads``, in the backward's rebuilt masks too) and passes
    them, not the parameters under them (``_bounded_parameters``), to the node that
    rebuilds the masks for their gradient. In eager mode; under torch.compile each chunk
    reads afresh.
    """

    #: the reads a chunked call shares while its masks are built, or None
    _shared_bounded_reads: dict[Any, Any] | None = None

    def _bounded_read_calls(self, device: torch.device) -> list[tuple[Callable[..., Any], tuple]]:
        """Every read this module makes through ``clamp_toward_range`` in a call on
        ``device``, as (the method that makes it, its arguments): [] where it makes none."""
        return []

    def _bounded_reads(self, device: torch.device) -> dict[Any, Any]:
        """The reads of ``_bounded_read_calls``, made now, by their keys."""
        calls = self._bounded_read_calls(device)
        return {_read_key(make, args): make(*args) for make, args in calls}

    def _bounded_parameters(self) -> list[Tensor]:
        """The parameters ``_bounded_reads`` are made from (and that nothing else reads)."""
        return []

    def _bounded_read(self, make: Callable[..., Any], *args: Any) -> Any:
        """``make(*args)``, or its value made once for a chunked call that shares it."""
        shared = self._shared_bounded_reads
        key = _read_key(make, args)
        if shared is not None and key in shared:
            return shared[key]
        return make(*args)

    @contextlib.contextmanager
    def sharing_bounded_reads(self, reads: dict[Any, Any]) -> Iterator[None]:
        """Within the block, ``_bounded_read`` gives the values of ``reads``."""
        previous = self._shared_bounded_reads
        self._shared_bounded_reads = reads
        try:
            yield
        finally:
            self._shared_bounded_reads = previous


def _read_key(make: Callable[..., Any], args: tuple) -> tuple:
    """A read's key: the name of the method that makes it and its arguments."""
    return (make.__name__, *args)


def bounded_read_tensors(reads: dict[Any, Any]) -> list[Tensor]:
    """The tensors of ``reads`` (a value, or a tuple or list of them) that need a
    gradient."""
    found: list[Tensor] = []
    for value in reads.values():
        values = value if isinstance(value, (tuple, list)) else (value,)
        found.extend(t for t in values if isinstance(t, Tensor) and t.requires_grad)
    return found
