"""Trained weights for ``posgen check --weights``: judge an encoding as trained.

A learned table's claims (does it decay? is it unique?) depend on its values, so the
checker can load a state_dict into the module it builds instead of its seeded random
initialisation. The file is read with ``torch.load(weights_only=True)`` (tensors only,
no code runs); it holds the module's state_dict, or a mapping with one under
``state_dict``. Keys and shapes must match the module built with the spec's defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn


class WeightsError(ValueError):
    """Weights that cannot be read or do not fit the module (one line, for the CLI)."""


def load_weights(path: Path) -> dict[str, Tensor]:
    """The state_dict stored in ``path`` (tensors only)."""
    try:
        stored = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - unpickling errors come in many types
        raise WeightsError(
            f"{path}: cannot read weights: {type(error).__name__}: {error}"
        ) from None
    if isinstance(stored, Mapping) and isinstance(stored.get("state_dict"), Mapping):
        stored = stored["state_dict"]
    if not isinstance(stored, Mapping) or not all(
        isinstance(key, str) and isinstance(value, Tensor) for key, value in stored.items()
    ):
        raise WeightsError(f"{path}: expected a state_dict (a mapping of names to tensors)")
    return dict(stored)


def check_fit(module: nn.Module, weights: Mapping[str, Tensor], path: Path) -> None:
    """Raise WeightsError unless ``weights`` has exactly ``module``'s keys and shapes."""
    expected = {key: tuple(value.shape) for key, value in module.state_dict().items()}
    given = {key: tuple(value.shape) for key, value in weights.items()}
    problems = []
    if missing := sorted(set(expected) - set(given)):
        problems.append(f"missing {', '.join(missing)}")
    if unexpected := sorted(set(given) - set(expected)):
        problems.append(f"unexpected {', '.join(unexpected)}")
    for key in sorted(set(expected) & set(given)):
        if expected[key] != given[key]:
            problems.append(f"{key} is {list(given[key])}, the module's is {list(expected[key])}")
    if problems:
        raise WeightsError(f"{path} does not fit the module: {'; '.join(problems)}")
