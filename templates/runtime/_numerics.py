"""Numerics every path shares: the dtype computations run in, autocast switched off
around the exact paths, and flushing CPU denormals (opt-in, process-wide)."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from torch import Tensor


def compute_dtype(x: Tensor) -> torch.dtype:
    """float64 inputs are computed in float64; everything else in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def autocast_off(device_type: str) -> Any:
    """A context turning autocast off for ``device_type`` where it is on, else a no-op
    (entering ``torch.autocast`` costs about 8 us: a fifth of a CPU decode step's host
    time). The meta device has no autocast (and no values to compute in any dtype)."""
    if device_type != "meta" and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def autocast_dtype(dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype that SDPA (or any op autocast runs in lower precision) computes in
    and returns for floating inputs of ``dtype`` on ``device_type``: autocast's, where
    it is on there and ``dtype`` is one it casts (any floating type but float64), else
    ``dtype`` itself."""
    lowered = dtype.is_floating_point and dtype != torch.float64
    if lowered and device_type != "meta" and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return dtype


def in_autocast_dtype(x: Tensor) -> Tensor:
    """x in the dtype SDPA would have returned it in under the current autocast state
    (``autocast_dtype``); x itself where that is its dtype (a no-op ``.to`` costs about
    1 us of a decode step)."""
    dtype = autocast_dtype(x.dtype, x.device.type)
    return x if dtype == x.dtype else x.to(dtype)


def flush_denormals() -> bool:
    """Flush float32/float64 denormals to zero on the CPU threads torch computes on;
    True if every thread now does.

    Softmax weights below 2^-126 (a steep bias: ALiBi at long range, KERPLE, Sandwich)
    are denormal, and CPU arithmetic on denormals is slow: on 2 threads a training step
    of ALiBi through CPU SDPA took 3.3x the bias-free step with them, 1.05x without
    (N = 2048, float32; benchmarks/results/attention_backends_cpu_float32_bias*.md).

    ``torch.set_flush_denormal`` sets the calling thread's mode only; torch's intra-op
    threads copy it when they are created, at the first parallel operation. So call
    this before any tensor operation; called later it returns False (a probe multiplies
    denormals on every thread), and a warning says so. The change is process-wide:
    values below 2^-126 become 0.
    """
    if not torch.set_flush_denormal(True):
        return False
    # the largest float32 denormal, from its bits (a conversion would already flush it),
    # enough of them to be split across every thread
    probe = torch.full((2**17 * torch.get_num_threads(),), 0x007FFFFF, dtype=torch.int32)
    flushed = bool(((probe.view(torch.float32) * 1.5) == 0).all())
    if not flushed:
        warnings.warn(
            "flush_denormals: torch's worker threads existed before this call and keep "
            "denormals; call it before the first tensor operation",
            stacklevel=2,
        )
    return flushed
