"""Device mix-ups named: an encoding's public method raises ValueError naming the
argument where it sits on another device than the module's parameters and buffers,
or on the meta device (no values) where the encoding reads values.

Two checks, both cheap on a call that works:
- before the call, the first tensor argument's device against the devices of the
  module's parameters and buffers, kept per module (dropped by ``module.to`` and
  ``load_state_dict``; a set that is out of date is read afresh before it refuses);
  a module without parameters or buffers (RoPE, NoPE) computes on its inputs' device;
- after torch fails inside the call (RuntimeError, NotImplementedError), or returns a
  meta result for real inputs, the arguments' devices are read to name the cause.
Meta inputs to an encoding that needs no values (ALiBi) give meta outputs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

ENTRY_POINTS = ("forward", "embed", "rotate", "rotate_keys", "score_terms", "scores", "score_bias")
"""The public methods of an encoding whose arguments' devices are checked."""

_DEVICES = "_posgen_tensor_devices"  # the module's attribute holding its tensors' devices


def names_device_mixups(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (of an nn.Module) raising ValueError, not torch's RuntimeError,
    NotImplementedError or a silent result, where an argument's device is wrong."""

    @functools.wraps(method)
    def checked(module: nn.Module, *args: Any, **keywords: Any) -> Any:
        if not torch.compiler.is_compiling():
            first = args[0] if args else next(iter(keywords.values()), None)
            if isinstance(first, Tensor) and not first.is_meta:
                devices = module.__dict__.get(_DEVICES)
                if devices is None:
                    devices = module.__dict__[_DEVICES] = tensor_devices(module)
                if devices and first.device not in devices:
                    problem = device_mixup(module, method, args, keywords)
                    if problem is not None:
                        raise ValueError(problem)
                    forget_devices(module)  # out of date: the module agrees with the inputs
        try:
            result = method(module, *args, **keywords)
        except (RuntimeError, NotImplementedError) as error:
            problem = device_mixup(module, method, args, keywords)
            if problem is None:
                raise
            raise ValueError(problem) from error
        if isinstance(result, Tensor) and result.is_meta:  # from meta inputs, or a meta module
            problem = device_mixup(module, method, args, keywords, meta_inputs_fail=False)
            if problem is not None:
                raise ValueError(problem)
        return result

    return checked


def tensor_devices(module: nn.Module) -> frozenset[torch.device]:
    """The devices of the module's parameters and buffers (empty where it has none)."""
    return frozenset(t.device for t in (*module.parameters(), *module.buffers()))


def forget_devices(module: nn.Module) -> None:
    """Drop the module's kept devices: its tensors moved or were replaced."""
    module.__dict__.pop(_DEVICES, None)


def forget_devices_after_loading(module: nn.Module, incompatible_keys: Any) -> None:
    """``forget_devices`` as a load_state_dict post-hook (a named function: it pickles)."""
    forget_devices(module)


def _tensor_arguments(
    method: Callable[..., Any], args: tuple[Any, ...], keywords: dict[str, Any]
) -> list[tuple[str, Tensor]]:
    """(name, tensor) of each tensor argument, positional ones first, in order."""
    code = method.__code__
    positional = code.co_varnames[1 : code.co_argcount]  # after self
    named = [*zip(positional, args, strict=False), *keywords.items()]  # args may stop early
    return [(name, value) for name, value in named if isinstance(value, Tensor)]


def device_mixup(
    module: nn.Module,
    method: Callable[..., Any],
    args: tuple[Any, ...],
    keywords: dict[str, Any],
    meta_inputs_fail: bool = True,
) -> str | None:
    """Why a call of ``method`` with these arguments cannot run on ``module``'s device,
    or None where the devices agree (a failure has another cause). Meta arguments
    explain a failure; where ``meta_inputs_fail`` is False (the call gave a meta
    result), they make the meta result the right one."""
    arguments = _tensor_arguments(method, args, keywords)
    for name, value in arguments:
        if value.device.type == "meta":
            if not meta_inputs_fail:
                return None
            return (
                f"{name} is on the meta device (it holds no values), and this encoding "
                "reads values here (positions, tables): pass real tensors"
            )
    own = [*module.named_parameters(), *module.named_buffers()]
    for name, value in arguments:
        for own_name, tensor in own:
            if tensor.device == value.device:
                continue
            if tensor.device.type == "meta":
                return (
                    f"the module's {own_name} is on the meta device (no values yet), {name} "
                    f"on {value.device}: call module.to_empty(device={name}.device) and "
                    "module.reset_parameters(), then load the weights (buffers outside the "
                    "state dict, such as fixed slopes, get their values only that way)"
                )
            return (
                f"{name} is on {value.device}, the module's {own_name} on {tensor.device}: "
                f"move the module (module.to({name}.device)) or the inputs"
            )
    return None


def check_argument_devices(cls: type[nn.Module]) -> None:
    """Wrap the entry points ``cls`` itself defines with ``names_device_mixups``."""
    for name in ENTRY_POINTS:
        method = cls.__dict__.get(name)
        if callable(method) and not hasattr(method, "__wrapped__"):
            setattr(cls, name, names_device_mixups(method))
