"""Trained weights for ``posgen check --weights``: judge an encoding as trained.

A learned table's claims (does it decay? is it unique?) depend on its values, so the
checker can load a state_dict into the module it builds instead of its seeded random
initialisation. The file is read with ``torch.load(weights_only=True)`` (tensors only,
no code runs); it holds the module's state_dict, or a mapping with one under
``state_dict``. Keys and shapes must match the module built with the spec's defaults,
and every value must be dense, hold data, and be finite, of a dtype the module's tensor
takes (a real floating dtype for a floating parameter): ``check_fit``.
"""

from __future__ import annotations

import re
import stat
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn


class WeightsError(ValueError):
    """Weights that cannot be read or do not fit the module (one line, for the CLI)."""


def load_weights(path: Path) -> dict[str, Tensor]:
    """The state_dict stored in ``path`` (tensors only)."""
    try:
        regular = stat.S_ISREG(path.stat().st_mode)
    except OSError as error:
        raise WeightsError(f"{path}: cannot read weights: {_reason(error)}") from None
    if not regular:  # a named pipe would block torch.load for ever
        raise WeightsError(f"{path}: cannot read weights: not a regular file")
    try:
        with warnings.catch_warnings():  # e.g. a pickle protocol torch.save does not use
            warnings.simplefilter("ignore")
            stored = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - unpickling errors come in many types
        raise WeightsError(
            f"{path}: cannot read weights: not a file of tensors that torch.save wrote "
            f"({type(error).__name__}: {_reason(error)})"
        ) from None
    if isinstance(stored, Mapping) and isinstance(stored.get("state_dict"), Mapping):
        stored = stored["state_dict"]
    if not isinstance(stored, Mapping) or not all(
        isinstance(key, str) and isinstance(value, Tensor) for key, value in stored.items()
    ):
        raise WeightsError(f"{path}: expected a state_dict (a mapping of names to tensors)")
    return dict(stored)


def _reason(error: Exception) -> str:
    """One line of why torch.load failed: the unpickler's own reason where its message
    gives one (the rest is advice to load with weights_only=False, which runs code),
    else the message's first line."""
    text = str(error)
    found = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
    if found is not None:
        text = found.group(1).strip()
    # torch's advice to allow-list a class is for code: a pickled object (a whole
    # module, say) is no state_dict, which is what the command takes
    pickled = re.match(r"(Unsupported global: GLOBAL \S+)", text)
    if pickled is not None:
        return f"{pickled.group(1)}; save module.state_dict(), not the module"
    if found is not None:
        return text
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else "no reason given"


def check_fit(module: nn.Module, weights: Mapping[str, Tensor], path: Path) -> None:
    """Raise WeightsError unless ``weights`` has exactly ``module``'s keys and shapes, and
    every value is one the module can be judged at (``value_problem``)."""
    state = module.state_dict()
    expected = {key: tuple(value.shape) for key, value in state.items()}
    given = {key: tuple(value.shape) for key, value in weights.items()}
    problems = []
    if missing := sorted(set(expected) - set(given)):
        problems.append(f"missing {', '.join(missing)}")
    if unexpected := sorted(set(given) - set(expected)):
        problems.append(f"unexpected {', '.join(unexpected)}")
    for key in sorted(set(expected) & set(given)):
        if expected[key] != given[key]:
            problems.append(f"{key} is {list(given[key])}, the module's is {list(expected[key])}")
        elif (problem := value_problem(weights[key], state[key])) is not None:
            problems.append(f"{key} {problem}")
    if problems:
        hint = _prefix_hint(set(expected), set(given))
        raise WeightsError(f"{path} does not fit the module: {'; '.join(problems)}{hint}")


def _prefix_hint(expected: set[str], given: set[str]) -> str:
    """Advice where ``given`` holds every expected key under one prefix (a whole layer's
    or model's state_dict, ``pe.expr_m`` for ``expr_m``), else ``""``."""
    if not expected or expected <= given:
        return ""
    anchor = min(expected)
    for key in sorted(given):
        prefix = key.removesuffix(anchor)
        if prefix != key and prefix.endswith(".") and {prefix + e for e in expected} <= given:
            return (
                f" (every key the module has is there under the prefix {prefix!r}: save "
                f"{{k.removeprefix({prefix!r}): v for k, v in state.items() if "
                f"k.startswith({prefix!r})}}, or the encoding's own state_dict())"
            )
    return ""


def value_problem(value: Tensor, like: Tensor) -> str | None:
    """Why ``value`` cannot stand for the module's tensor ``like``, or None.

    The value must be a dense (strided) tensor holding data (not on the meta device, which
    has none), of a dtype the module's tensor takes without losing meaning: a real
    floating dtype for a real floating parameter (``load_state_dict`` would silently drop
    a complex value's imaginary part and read a bool or integer as a number), complex for
    a complex one, the same dtype otherwise; and every floating value finite (NaN or inf
    would make every property fail, or pass, for a reason that is not the encoding's).
    """
    if value.layout != torch.strided or value.is_nested:
        layout = "nested" if value.is_nested else str(value.layout).removeprefix("torch.")
        return f"is a {layout} tensor; a dense (strided) one is needed"
    if value.is_meta:
        return "is on the meta device (it holds no values)"
    if like.is_complex():
        if not value.is_complex():
            return f"has dtype {_dtype_name(value)}; the module's is complex ({_dtype_name(like)})"
    elif like.is_floating_point():
        if not value.is_floating_point():
            return (
                f"has dtype {_dtype_name(value)}; the module's is {_dtype_name(like)}, "
                "so a real floating dtype is needed"
            )
    elif value.dtype != like.dtype:
        return f"has dtype {_dtype_name(value)}; the module's is {_dtype_name(like)}"
    if not (value.is_floating_point() or value.is_complex()):
        return None
    bad = _non_finite_count(value)
    if bad:
        return f"has {bad} non-finite value{_plural(bad)} (NaN or ±inf); finite values are needed"
    bad = _non_finite_count(value.to(like.dtype))  # as loaded (1e300 is inf in float32)
    if bad:
        return (
            f"has {bad} value{_plural(bad)} past what the module's {_dtype_name(like)} holds "
            "(±inf once loaded); finite values are needed"
        )
    return None


def _non_finite_count(value: Tensor) -> int:
    """NaN and ±inf entries of a floating or complex tensor, counted after widening
    (torch has no isfinite for some narrow dtypes, float8_e4m3fn)."""
    wide = torch.complex128 if value.is_complex() else torch.float64
    return int((~torch.isfinite(value.to(wide))).sum())


def _plural(count: int) -> str:
    return "s" if count > 1 else ""


def _dtype_name(tensor: Tensor) -> str:
    """``float32`` for torch.float32."""
    return str(tensor.dtype).removeprefix("torch.")
