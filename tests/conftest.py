"""Shared fixtures: the catalogue's generated classes, built once per session."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"
GENERATED = ROOT / "generated"


def spec_names() -> list[str]:
    """Every spec in the catalogue, sorted."""
    return sorted(path.stem for path in SPECS.glob("*.yaml"))


def generated_class(name: str) -> type[torch.nn.Module]:
    """The class exported by generated/<name>.py."""
    module = importlib.import_module(f"generated.{name}")
    (class_name,) = module.__all__
    return getattr(module, class_name)


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)
