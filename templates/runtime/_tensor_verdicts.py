"""Verdicts on tensors' values, kept while the tensors are unchanged.

A check that reads positions or a mask from the device (a host sync on a GPU) keeps what
it found (``TensorVerdicts``), so the layers of a model given the same tensors read
them once per forward, not once per layer.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor


class TensorVerdicts:
    """Verdicts on tensors' values (positions in range, positions at the defaults), each
    kept while every tensor it was drawn from is alive, the same object and at the same
    version: a model whose layers are each given the same positions (Hugging Face's
    ``position_ids``) reads them from the device once per forward, not once per layer
    (on a GPU each read is a host sync). The tensors are held by weak reference.
    Inference tensors have no version counter, so no verdict on them is kept (an edit
    in place, such as a position buffer refilled each step, would go unseen). The
    ``VERDICTS_KEPT`` most recent verdicts are kept. A view is known by its base and
    where it sits in it, so the same slice taken anew (a mask cut to the keys in every
    layer) finds the verdict on the last one.

    Some writes move no version counter: through ``.data``, or to memory shared with a
    NumPy array (``torch.from_numpy``) or through DLPack. On
    ``VALUE_CHECKED_VERDICT_DEVICES`` (the CPU, where a read costs no sync) a verdict
    therefore keeps a copy of each tensor's values and is used only while they are
    equal (``torch.equal``), and none is kept on a tensor of more than
    ``VERDICT_SNAPSHOT_MAX_ELEMENTS`` elements. Elsewhere (CUDA) that comparison would be
    the host sync the verdicts save, so a write that moves no version counter goes
    unseen there: pass a new tensor, or call
    ``torch.autograd.graph.increment_version`` on it after such a write. A tensor whose
    data was replaced (``t.data = other``) is seen on every device: its data pointer and
    shape are part of the stamp."""

    def __init__(self) -> None:
        self._kept: dict[tuple[Any, ...], tuple[tuple[Any, ...], Any]] = {}

    @staticmethod
    def _owner(t: Tensor) -> Tensor:
        """The tensor that holds t's data: its base for a view, else t itself."""
        return t if t._base is None else t._base

    @staticmethod
    def _identity(t: Tensor | None) -> Any:
        """What names t in a key: its id, or for a view its base's id, its place and its
        dtype (a view may read the same bytes as another dtype)."""
        if t is None:
            return None
        if t._base is None:
            return id(t)
        return (id(t._base), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)

    def _stamps(self, tensors: tuple[Tensor | None, ...]) -> tuple[Any, ...] | None:
        """(weak reference to the owner, version, data pointer, shape, copy of the values
        or None) of each tensor (None for None); None where a verdict on them cannot be
        kept."""
        stamps: list[Any] = []
        for t in tensors:
            if t is None:
                stamps.append(None)
                continue
            if t.is_inference():
                return None
            values = None
            if t.device.type in VALUE_CHECKED_VERDICT_DEVICES:
                if t.numel() > VERDICT_SNAPSHOT_MAX_ELEMENTS:
                    return None
                values = t.detach().clone()
            owner = weakref.ref(self._owner(t))
            stamps.append((owner, t._version, t.data_ptr(), t.shape, values))
        return tuple(stamps)

    def get(self, what: tuple[Any, ...], tensors: tuple[Tensor | None, ...]) -> Any:
        """The verdict ``what`` kept on these tensors, or None."""
        key = (*what, *(self._identity(t) for t in tensors))
        entry = self._kept.get(key)
        if entry is None:
            return None
        stamps, verdict = entry
        for t, stamp in zip(tensors, stamps, strict=True):
            if t is None:
                continue
            reference, version, pointer, shape, values = stamp  # (no inference tensor)
            stale = reference() is not self._owner(t) or t._version != version
            stale = stale or t.data_ptr() != pointer or t.shape != shape
            if stale or (values is not None and not torch.equal(t, values)):
                self._kept.pop(key, None)  # the tensor died, was replaced or edited
                return None
        return verdict

    def put(self, what: tuple[Any, ...], tensors: tuple[Tensor | None, ...], verdict: Any) -> None:
        """Keep the verdict ``what`` (not None) on these tensors."""
        stamps = self._stamps(tensors)
        if stamps is None:
            return
        key = (*what, *(self._identity(t) for t in tensors))
        self._kept.pop(key, None)
        self._kept[key] = (stamps, verdict)
        while len(self._kept) > VERDICTS_KEPT:
            del self._kept[next(iter(self._kept))]  # the oldest first


VERDICTS_KEPT = 8
# Device types where a kept verdict holds a copy of its tensors' values and is used only
# while they are equal (see ``TensorVerdicts``), and the most elements such a tensor may
# have (a copy of 2^20 is 8 MiB of int64 positions, 1 MiB of a bool mask; a larger one,
# a mask over a long prefill, is read afresh each call, a pass that costs far less than
# the attention over it).
VALUE_CHECKED_VERDICT_DEVICES = {"cpu"}
VERDICT_SNAPSHOT_MAX_ELEMENTS = 1 << 20
POSITION_VERDICTS = TensorVerdicts()
