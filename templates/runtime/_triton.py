"""Triton support shared by the runtime's optional kernels (rotation, distance bias).

Triton is optional: it is imported lazily, inside the functions that define kernels,
and ``triton_available`` says once per process whether it imports. Kernels are defined
on first use, after TRITON_INTERPRET is read, and kept in ``TRITON_CACHE`` with the
facts asked of the device.
"""

from __future__ import annotations

from typing import Any

import torch

TRITON_CACHE: dict[str, Any] = {}  # "kernel": the @triton.jit rotation, defined on first use


def triton_available() -> bool:
    """Whether Triton imports here (it is optional: checked once per process)."""
    if "available" not in TRITON_CACHE:
        try:
            import triton  # noqa: F401
        except ImportError:
            TRITON_CACHE["available"] = False
        else:
            TRITON_CACHE["available"] = True
    return bool(TRITON_CACHE["available"])


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (asked once per device)."""
    key = f"sms:{device}"
    if key not in TRITON_CACHE:
        TRITON_CACHE[key] = torch.cuda.get_device_properties(device).multi_processor_count
    return int(TRITON_CACHE[key])


def power_of_two_at_least(value: int) -> int:
    """The smallest power of two >= value (and >= 1): Triton tiles are powers of two."""
    return 1 << max(value - 1, 0).bit_length()
