"""Shared fixtures: the catalogue's generated classes, built once per session."""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from posgen.codegen.inmemory import encoding_class, module_from_spec

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


@functools.cache
def head_dim_for(name: str, wanted: int) -> int:
    """``wanted``, or the spec's own head_dim where its rotation is sized for it (M-RoPE
    sections, LongRoPE factor lists: other widths raise ValueError by design)."""
    cls = generated_class(name)
    try:
        cls(head_dim=wanted)
    except ValueError:
        default = inspect.signature(cls.__init__).parameters["head_dim"].default
        assert isinstance(default, int)
        return default
    return wanted


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)


_VARIANTS = tempfile.TemporaryDirectory(prefix="posgen-variants-")


def spec_variant(
    base: str, *replacements: tuple[str, str], name: str | None = None
) -> type[torch.nn.Module]:
    """The class of ``specs/<base>.yaml`` with text replacements, built in memory.

    Each ``(old, new)`` replaces ``old``, which must occur in the spec, so a stale edit
    fails loudly; ``name`` renames the spec (and its module) when given.
    """
    text = (SPECS / f"{base}.yaml").read_text(encoding="utf-8")
    if name is not None:
        replacements = ((f"name: {base}\n", f"name: {name}\n"), *replacements)
    for old, new in replacements:
        assert old in text, old
        text = text.replace(old, new)
    path = Path(_VARIANTS.name) / f"{name or base}.yaml"
    path.write_text(text, encoding="utf-8")
    return encoding_class(module_from_spec(path))


def run_backend(
    pe: torch.nn.Module, inputs: dict[str, torch.Tensor], backend: str, **options: object
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The output for ``inputs`` (q, k, v) on ``backend`` and the gradients of a fixed
    weighting of it into q, k, v and the module's parameters (those it reaches)."""
    leaves = {key: value.clone().requires_grad_() for key, value in inputs.items()}
    pe.zero_grad()
    out = pe(leaves["q"], leaves["k"], leaves["v"], backend=backend, **options)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    grads = [leaves[key].grad for key in ("q", "k", "v")]
    grads += [p.grad.clone() for p in pe.parameters() if p.grad is not None]
    return out.detach(), grads


def assert_sdpa_matches_eager(
    pe: torch.nn.Module, n: int, m: int, kv_heads: int, **options: object
) -> None:
    """Outputs and gradients (into q, k, v and the parameters) of the sdpa backend equal
    the eager oracle's, float64, with 4 query heads of width 8."""
    generator = torch.Generator().manual_seed(2)
    shapes = {"q": (2, 4, n, 8), "k": (2, kv_heads, m, 8), "v": (2, kv_heads, m, 8)}
    inputs = {
        key: torch.randn(*shape, generator=generator, dtype=torch.float64)
        for key, shape in shapes.items()
    }
    eager, eager_grads = run_backend(pe, inputs, "eager", **options)
    sdpa, sdpa_grads = run_backend(pe, inputs, "sdpa", **options)
    torch.testing.assert_close(sdpa, eager, rtol=1e-10, atol=1e-12)
    assert len(sdpa_grads) == len(eager_grads)
    for got, want in zip(sdpa_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def runtime_of(pe: torch.nn.Module) -> ModuleType:
    """The runtime module whose globals ``pe`` reads (a variant built in memory inlines
    its own copy of the runtime)."""
    return sys.modules[type(pe)._attend.__module__]


def spy_calls(
    monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str, record: Callable[..., Any]
) -> list[Any]:
    """Wrap ``module.name`` for the test: each call still runs, and ``record`` of its
    arguments is appended to the returned list."""
    calls: list[Any] = []
    original = getattr(module, name)

    def spy(*args: Any, **keywords: Any) -> Any:
        calls.append(record(*args, **keywords))
        return original(*args, **keywords)

    monkeypatch.setattr(module, name, spy)
    return calls


def bias_kind(q: Any, k: Any, v: Any, scale: float, *args: Any, **keywords: Any) -> str:
    """The ``bias_kind`` of a ``fused_distance_attention`` call (a ``spy_calls`` record)."""
    return str(args[1] if len(args) > 1 else keywords.get("bias_kind", "none"))
