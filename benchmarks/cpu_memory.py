"""Peak CPU memory of one call, from the PyTorch profiler's allocation records.

torch has no ``max_memory_allocated`` for the CPU. With ``profile_memory=True`` the
profiler records every allocation and free of torch's CPU allocator (size and sign) in
its event tree; the running sum of those sizes, in time order, peaks at the most the
call held at once beyond what was allocated before it (its output included, as CUDA's
``max_memory_allocated`` counts it). The records come from the profiler's private
``_ExtraFields_Allocation``; where a torch lacks them this returns None.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def cpu_peak_extra_bytes(fn: Callable[[], object]) -> int | None:
    """The most bytes ``fn`` holds at once through torch's CPU allocator, beyond what
    was held before the call, or None where the profiler gives no allocation records."""
    allocation = getattr(torch._C._profiler, "_ExtraFields_Allocation", None)
    if allocation is None:
        return None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    changes: list[tuple[int, int]] = []  # (time ns, bytes: + allocated, - freed)
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        node = pending.pop()
        fields = node.extra_fields
        if isinstance(fields, allocation) and fields.device.type == "cpu":
            changes.append((node.start_time_ns, fields.alloc_size))
        pending.extend(node.children)
    held = peak = 0
    for _, size in sorted(changes):
        held += size
        peak = max(peak, held)
    return peak
