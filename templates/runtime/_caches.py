"""Bounded caches of values computed from shapes, devices and parameters.

Every runtime cache is a dict in recency order that keeps the ``CACHE_SIZE`` most recent
entries; an entry made under torch.inference_mode() is not served to a call that
records autograd, and while torch.compile traces, nothing is read or kept (the values
are computed in the graph). Integer ranges and other values that grow with a call's
positions are kept over power-of-two reaches (``kept_over_reach``), so a decode loop's
steps, one key more each, make no new tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ._triton import power_of_two_at_least

CACHE_SIZE = 8  # shape-keyed caches keep this many most recent entries


def cache_get(cache: dict[tuple[Any, ...], Any], key: tuple[Any, ...]) -> Any:
    """The cached value for key (a tensor or a tuple of them), or None.

    An entry made under torch.inference_mode() is dropped when autograd is active now:
    inference tensors cannot be saved for backward. A hit becomes the most recent entry.
    While torch.compile traces, caches are bypassed (the values are computed in the graph).
    """
    if torch.compiler.is_compiling():
        return None
    value = cache.pop(key, None)
    if value is None:
        return None
    tensors = value if isinstance(value, tuple) else (value,)
    if not torch.is_inference_mode_enabled() and any(
        isinstance(t, Tensor) and t.is_inference() for t in tensors
    ):
        return None
    cache[key] = value  # dict order is recency order
    return value


def cache_put(cache: dict[tuple[Any, ...], Any], key: tuple[Any, ...], value: Any) -> Any:
    """Store value as the most recent entry, keeping the CACHE_SIZE most recent ones."""
    if torch.compiler.is_compiling():
        return value
    cache.pop(key, None)
    cache[key] = value
    while len(cache) > CACHE_SIZE:
        del cache[next(iter(cache))]  # least recently used first
    return value


def arange_view(
    cache: dict[tuple[Any, ...], Any],
    start: int,
    stop: int,
    device: torch.device,
    descending: bool = False,
) -> Tensor:
    """torch.arange(start, stop), int64 (``descending``: stop - 1 down to start), as a
    view of a vector kept in ``cache`` for the integers -R .. R, R a power of two that
    grows as calls need: a decode step's new key count makes no new tensor. Read-only
    (a view of the kept vector). While compiling, made in the graph."""
    if torch.compiler.is_compiling():
        values = torch.arange(start, stop, device=device)
        return values.flip(0) if descending else values

    def integers(reach: int) -> Tensor:  # -R .. R, [2 R + 1]
        values = torch.arange(-reach, reach + 1, device=device)
        return values.flip(0) if descending else values

    key = ("arange", descending, str(device))
    reach, values = kept_over_reach(cache, key, max(abs(start), abs(stop - 1)), integers)
    if descending:  # entry t holds R - t
        return values[reach - stop + 1 : reach - start + 1]
    return values[start + reach : stop + reach]


def kept_over_reach(
    cache: dict[tuple[Any, ...], Any], key: tuple[Any, ...], needed: int, make: Callable[[int], Any]
) -> tuple[int, Any]:
    """(R, make(R)) kept in ``cache`` under ``key``, R the least power of two (at least
    1) that covers ``needed``: made again, wider, only when a call needs more than the
    kept R (``arange_view``'s integers, ``monotone_index_ends``' host list)."""
    reach = power_of_two_at_least(max(needed, 1))
    kept = cache_get(cache, key)
    if kept is None or kept[0] < reach:
        kept = cache_put(cache, key, (reach, make(reach)))
    return kept
