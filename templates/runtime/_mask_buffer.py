"""Long query chunks whose masks are built a few rows at a time into one reused buffer.

CPU SDPA with a mask runs fastest on long query chunks: its flash kernel reads every
block of keys once per block of queries, and those blocks are short in a short call.
With masks made beforehand (float32, 2-core CPU, batch 2, 16 heads, head_dim 64,
N = 2048, against plain SDPA, two runs of a microbenchmark): one call 1.16x, chunks of
256 queries 1.21-1.41x, of 128 1.51x, of 64 1.70-1.82x. A chunk of 256 queries' own
mask, [1, 16, 256, 2048] float32, is 32 MiB, which glibc's malloc maps afresh for every
chunk (a page fault per 4 KiB), so masks built per chunk were cut to 8 MiB
(``SDPA_MASK_CHUNK_BYTES``, 64 queries here).

``AssembledMasks`` keeps both: the chunks stay long, each chunk's mask is built
``rows`` queries at a time (each part within the budget, reused from the heap) and
copied into one buffer that every chunk of the call reuses, so the call pages in one
chunk's mask once. Only for consumers done with each mask before they ask for the next
one: the eager chunk loop without autograd, and ``chunked_flash_attention``, which
builds each chunk's mask again in its backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

#: a span (i0, i1, lo, hi)'s mask, [rows, keys] or [1 or B, H, rows, keys], written into
#: the last argument where one is given (a view of that shape) and returned
BuiltMask = Callable[[int, int, int, int, "Tensor | None"], Tensor]


class AssembledMasks:
    """Each span's mask for the ``spans`` (i0, i1, lo, hi), built ``rows`` queries at a
    time (``mask_of`` of the part's queries over the span's keys, written into the
    part's rows) in one buffer for the largest span, which every later span overwrites:
    a span's mask is valid until the next call. The buffer is let go once every span
    has been served (the view just returned keeps it until its consumer is done), so a
    node that builds the masks again in its backward holds none in between. The masks
    must need no gradient.

    Masks are separable by query row (a position bias, its floor per row, the masks by
    position, document and ``attn_mask``), so the parts joined are the span's mask. A
    span of at most ``rows`` queries gets ``mask_of``'s own.
    """

    def __init__(self, mask_of: BuiltMask, rows: int, spans: list[tuple[int, int, int, int]]):
        self.mask_of, self.rows, self.spans = mask_of, rows, len(spans)
        self.largest = largest_span(spans)  # queries x keys
        self.buffer: Tensor | None = None  # flat, while held
        self.lead: tuple[int, ...] = ()  # the masks' leading dims: () or (1 or B, H)
        self.served = 0  # masks given since the buffer was made

    def __call__(self, i0: int, i1: int, lo: int, hi: int) -> Tensor:
        if i1 - i0 <= self.rows:
            mask = self.mask_of(i0, i1, lo, hi, None)
        else:
            mask = self._joined(i0, i1, lo, hi)
        self.served += 1
        if self.served == self.spans:  # a pass over the spans ends
            self.served, self.buffer = 0, None
        return mask

    def _joined(self, i0: int, i1: int, lo: int, hi: int) -> Tensor:
        """The mask of span (i0, i1, lo, hi), its parts written into the buffer."""
        rows, first = self.rows, None
        if self.buffer is None:  # the first part shows the masks' leading dims and dtype
            first = self.mask_of(i0, i0 + rows, lo, hi, None)  # [..., rows, keys]
            self.lead = tuple(first.shape[:-2])
            size = math.prod(self.lead) * self.largest
            self.buffer = torch.empty(size, dtype=first.dtype, device=first.device)
        shape = (*self.lead, i1 - i0, hi - lo)
        out = self.buffer[: math.prod(shape)].view(shape)  # [..., span rows, keys]
        if first is not None:
            out[..., :rows, :].copy_(first)
        for s0 in range(i0 if first is None else i0 + rows, i1, rows):
            self.mask_of(s0, min(s0 + rows, i1), lo, hi, out[..., s0 - i0 : s0 - i0 + rows, :])
        return out


def largest_span(spans: list[tuple[int, int, int, int]]) -> int:
    """The most (query, key) pairs of one span (i0, i1, lo, hi) of ``spans``."""
    return max((i1 - i0) * (hi - lo) for i0, i1, lo, hi in spans)


class ChunkBuffer:
    """One flat buffer for a tensor that each chunk of a call makes afresh and is done
    with before the next chunk makes its own (a chunk's projection or terms, given to
    its attention call): ``view`` gives each chunk its tensor at the buffer's start,
    valid until the next ``view``. glibc maps an allocation of 32 MiB or more afresh
    each time and the kernel faults it in a page at a time, so such a tensor made per
    chunk costs its pages per chunk; here once per call. ``largest``: the most entries
    any chunk's tensor has (the buffer is made at the first ``view``)."""

    def __init__(self, largest: int):
        self.largest = largest
        self.flat: Tensor | None = None

    def view(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """A contiguous tensor of ``shape`` at the buffer's start (uninitialised)."""
        size = math.prod(shape)
        assert size <= self.largest, (shape, self.largest)
        if self.flat is None:
            self.flat = torch.empty(self.largest, dtype=dtype, device=device)
        assert self.flat.dtype == dtype and self.flat.device == device  # one kind per buffer
        return self.flat[:size].view(shape)
