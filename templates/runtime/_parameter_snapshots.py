"""The parameters a kept value was computed from: their states and snapshots.

A value kept across calls (a table, a bias vector, a trajectory) is keyed on its
module's parameter states (``parameter_states``: identity, storage and version counter)
and kept beside a snapshot of the parameters (``parameter_snapshot``), compared before
each reuse (``parameters_unchanged``) except inside a ``parameters_frozen`` block, where
values found equal once are trusted until the next optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

#: device types where ``parameters_unchanged`` compares every parameter on the device
#: and reads one flag back (one sync on a GPU, where a comparison per parameter is one
#: sync each); elsewhere ``torch.equal`` per parameter, which stops at the first
#: difference (on a CPU 1.5-2x faster than forming the comparison, and a read costs no
#: sync there). Tests add "cpu" to run the one-read form.
PARAMETERS_COMPARED_AT_ONCE: set[str] = {"cuda"}


def parameter_states(module: torch.nn.Module) -> tuple[tuple[int, int, int], ...]:
    """(id, storage address, version counter) of each of module's parameters: a cache key
    part that changes with an in-place update (an optimizer step, load_state_dict) and
    with a new tensor assigned to ``.data`` (which leaves the version counter as it is)."""
    return tuple((id(p), p.data_ptr(), p._version) for p in module_parameters(module))


def module_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """list(module.parameters()), in its order (each module's own, then its children's,
    depth first, each parameter once), read from the modules' parameter dicts, not
    through the generators over named members: ``parameter_states`` of DeBERTa's 7
    parameters in 5.1 us where it took 8.4 us, Transformer-XL's 3 in 2.6 where 3.9
    (2-core AMD EPYC), once or twice per decode step."""
    found: dict[int, torch.nn.Parameter] = {}
    pending = [module]
    while pending:
        current = pending.pop()
        for p in current._parameters.values():
            if p is not None:
                found.setdefault(id(p), p)
        pending.extend(child for child in reversed(current._modules.values()) if child is not None)
    return list(found.values())


class ParameterSnapshot:
    """Detached copies of a module's parameters, kept beside a value cached from them so
    that ``parameters_unchanged`` can tell later whether the value still holds, and the
    ``parameters_frozen`` block and optimizer step (``frozen_in``, ``frozen_since``) at
    which they were last found equal to the parameters: until the next step within that
    block they are not compared again."""

    __slots__ = ("tensors", "frozen_in")

    def __init__(self, tensors: tuple[Tensor, ...], frozen_in: tuple[object, int] | None) -> None:
        self.tensors = tensors
        self.frozen_in = frozen_in


def frozen_block(module: torch.nn.Module) -> object | None:
    """The ``parameters_frozen`` block module is inside (a token per block), or None."""
    return getattr(module, "_frozen_block", None)


class _OptimizerSteps:
    """How many ``torch.optim`` steps this process has taken since the first
    ``parameters_frozen`` block (a global step post hook, registered once): a fused step
    (``fused=True``, Hugging Face's default AdamW) writes the parameters without moving
    their version counters, so a block's promise holds between steps only."""

    count = 0
    hook: Any = None

    @classmethod
    def start(cls) -> None:
        if cls.hook is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            cls.hook = register_optimizer_step_post_hook(cls.taken)

    @classmethod
    def taken(cls, optimizer: Any, args: Any, kwargs: Any) -> None:
        cls.count += 1


def count_optimizer_steps() -> None:
    """Start counting optimizer steps (``_OptimizerSteps``); a ``parameters_frozen``
    block calls it on entry."""
    _OptimizerSteps.start()


def frozen_since(module: torch.nn.Module) -> tuple[object, int] | None:
    """module's ``parameters_frozen`` block and the optimizer steps taken so far: values
    found equal under one such pair are not compared again; None outside a block."""
    block = frozen_block(module)
    return None if block is None else (block, _OptimizerSteps.count)


def parameter_snapshot(module: torch.nn.Module) -> ParameterSnapshot:
    """Detached copies of module's parameters, taken now (so equal to them within the
    ``parameters_frozen`` block that module is in, if any)."""
    copies = tuple(p.detach().clone() for p in module_parameters(module))
    return ParameterSnapshot(copies, frozen_since(module))


def parameters_unchanged(module: torch.nn.Module, snapshot: ParameterSnapshot) -> bool:
    """Whether module's parameters hold the values of ``snapshot``, element for element.

    ``parameter_states`` misses an in-place edit through ``p.data`` (an EMA update,
    Hugging Face's ``_init_weights``): ``.data`` is a tensor with a version counter of its
    own. Comparing the values sees every edit, at the cost of one read of each parameter
    and a host sync (eager mode only; the caches are bypassed under torch.compile): one
    for all of them on ``PARAMETERS_COMPARED_AT_ONCE`` devices. Inside a
    ``parameters_frozen`` block a snapshot found equal once is not compared again until
    an optimizer step (``frozen_since``): the block's promise is that no parameter
    changes unseen by its version counter, and a fused step moves none.
    """
    block = frozen_since(module)
    if block is not None and snapshot.frozen_in == block:
        return True
    parameters = module_parameters(module)
    if len(parameters) != len(snapshot.tensors):
        return False
    pairs = [(p.detach(), kept) for p, kept in zip(parameters, snapshot.tensors, strict=True)]
    if not parameters_equal(pairs):
        return False
    snapshot.frozen_in = block
    return True


def parameters_equal(pairs: list[tuple[Tensor, Tensor]]) -> bool:
    """Whether each pair of tensors has one shape, dtype, device and the same values."""
    if any(
        p.shape != kept.shape or p.dtype != kept.dtype or p.device != kept.device
        for p, kept in pairs
    ):
        return False
    devices = {p.device for p, _ in pairs}
    if len(devices) != 1 or next(iter(devices)).type not in PARAMETERS_COMPARED_AT_ONCE:
        return all(torch.equal(p, kept) for p, kept in pairs)
    same = [torch.eq(p, kept).all() for p, kept in pairs]
    return bool(torch.stack(same).all())  # one read for every parameter
