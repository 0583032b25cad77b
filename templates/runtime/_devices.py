"""Device mix-ups named: an encoding's public method raises ValueError naming the
argument where it sits on another device than the module's parameters and buffers,
or on the meta device (no values) where the encoding reads values.

Two checks, both cheap on a call that works:
- before the call, every parameter and buffer of the module (its submodules' too) must
  be on the device of the first tensor argument: a walk of their dicts, 0.5-4 us on
  the 2-core CPU (read afresh each call, so ``.to``, ``load_state_dict``,
  ``functional_call`` or an assigned parameter are always seen). A module without
  parameters or buffers (RoPE, NoPE) computes on its inputs' device. Meta inputs are
  let through: an encoding that reads no values (ALiBi's shapes) gives meta outputs;
- after torch fails inside the call (RuntimeError, NotImplementedError) over a meta
  argument, or the call returns a meta result for real inputs, the cause is named.
Under torch.compile neither runs (the graph's own device guards apply).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

ENTRY_POINTS = (
    "forward",
    "embed",
    "rotate",
    "rotate_keys",
    "scale_queries",
    "score_terms",
    "scores",
    "score_bias",
)
"""The public methods of an encoding whose arguments' devices are checked."""


def names_device_mixups(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (of an nn.Module) raising ValueError, not torch's RuntimeError,
    NotImplementedError or a silent result, where an argument's device is wrong."""

    @functools.wraps(method)
    def checked(module: nn.Module, *args: Any, **keywords: Any) -> Any:
        if torch.compiler.is_compiling():
            return method(module, *args, **keywords)
        first = args[0] if args and isinstance(args[0], Tensor) else _first_tensor(args, keywords)
        if first is not None and not first.is_meta and not _all_on(module, first.device):
            problem = _module_mixup(module, method, args, keywords)
            assert problem is not None  # a parameter or buffer is elsewhere
            raise ValueError(problem)
        try:
            result = method(module, *args, **keywords)
        except (RuntimeError, NotImplementedError) as error:
            problem = _meta_argument(method, args, keywords) if "meta" in str(error) else None
            if problem is None:
                raise
            raise ValueError(problem) from error
        if isinstance(result, Tensor) and result.is_meta:  # for real inputs: a meta module
            problem = _module_mixup(module, method, args, keywords)
            if problem is not None:
                raise ValueError(problem)
        return result

    return checked


def _first_tensor(args: tuple[Any, ...], keywords: dict[str, Any]) -> Tensor | None:
    for value in (*args, *keywords.values()):
        if isinstance(value, Tensor):
            return value
    return None


def _all_on(module: nn.Module, device: torch.device) -> bool:
    """Whether every parameter and buffer of ``module`` and its submodules is on ``device``."""
    pending = [module]
    while pending:
        current = pending.pop()
        for parameter in current._parameters.values():
            if parameter is not None and parameter.device != device:
                return False
        for buffer in current._buffers.values():
            if buffer is not None and buffer.device != device:
                return False
        for child in current._modules.values():
            if child is not None:
                pending.append(child)
    return True


def _tensor_arguments(
    method: Callable[..., Any], args: tuple[Any, ...], keywords: dict[str, Any]
) -> list[tuple[str, Tensor]]:
    """(name, tensor) of each tensor argument, positional ones first, in order."""
    code = method.__code__
    positional = code.co_varnames[1 : code.co_argcount]  # after self
    named = [*zip(positional, args, strict=False), *keywords.items()]  # args may stop early
    return [(name, value) for name, value in named if isinstance(value, Tensor)]


def _meta_argument(
    method: Callable[..., Any], args: tuple[Any, ...], keywords: dict[str, Any]
) -> str | None:
    """The message for the first argument on the meta device, or None where none is."""
    for name, value in _tensor_arguments(method, args, keywords):
        if value.is_meta:
            return (
                f"{name} is on the meta device (it holds no values), and this encoding "
                "reads values here (positions, tables): pass real tensors"
            )
    return None


def _module_mixup(
    module: nn.Module, method: Callable[..., Any], args: tuple[Any, ...], keywords: dict[str, Any]
) -> str | None:
    """The message for the first of the module's tensors off the device of the first
    argument, where every argument is real and one such tensor exists; else None."""
    arguments = _tensor_arguments(method, args, keywords)
    if not arguments or any(value.is_meta for _, value in arguments):
        return None
    name, value = arguments[0]
    own = (*module.named_parameters(), *module.named_buffers())
    found = next(((n, t) for n, t in own if t.device != value.device), None)
    if found is None:
        return None
    own_name, tensor = found
    if tensor.is_meta:
        return (
            f"the module's {own_name} is on the meta device (no values yet), {name} on "
            f"{value.device}: call module.to_empty(device={name}.device) and "
            "module.reset_parameters(), then load the weights (buffers outside the state "
            "dict, such as fixed slopes, get their values only that way)"
        )
    return (
        f"{name} is on {value.device}, the module's {own_name} on {tensor.device}: move "
        f"the module (module.to({name}.device)) or the inputs"
    )


def check_argument_devices(cls: type[nn.Module]) -> None:
    """Wrap the entry points ``cls`` itself defines with ``names_device_mixups``."""
    for name in ENTRY_POINTS:
        method = cls.__dict__.get(name)
        if callable(method) and not hasattr(method, "__wrapped__"):
            setattr(cls, name, names_device_mixups(method))
