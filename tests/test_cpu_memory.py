"""The CPU peak-memory measure the benchmarks report (benchmarks/cpu_memory.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.conftest import generated_class, sdpa_extra_memory

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "cpu_memory.py"
_SPEC = importlib.util.spec_from_file_location("cpu_memory", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
cpu_memory = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cpu_memory)

MIB = 2**20


def test_the_peak_is_the_most_held_at_once() -> None:
    """Two 8 MiB tensors live together, then one is freed before a third: 16 MiB at
    most, with the returned one counted and what existed before the call not."""
    before = torch.ones(4 * MIB)  # 16 MiB held throughout, not the call's

    def call() -> torch.Tensor:
        first = torch.empty(2 * MIB)  # 8 MiB of float32
        second = first + 1
        del first
        third = before[: 2 * MIB] * 2
        return second.add_(third)

    peak = cpu_memory.cpu_peak_extra_bytes(call)
    assert peak is not None
    assert 16 * MIB <= peak < 17 * MIB


def test_attention_scores_show_as_quadratic_memory() -> None:
    """Softmax attention through explicit scores holds two [H, N, N] float32 tensors
    at once (the scores and their softmax)."""
    q = torch.randn(4, 512, 32)
    scores = 4 * 512 * 512 * 4  # bytes of one [4, 512, 512] float32 tensor
    dense = cpu_memory.cpu_peak_extra_bytes(lambda: (q @ q.transpose(-1, -2)).softmax(-1) @ q)
    assert dense is not None
    assert 2 * scores <= dense < 2 * scores + MIB


@pytest.mark.parametrize("name", ["alibi", "t5", "kerple_log"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("train", [False, True])
def test_biases_of_distance_hold_memory_linear_in_the_sequence(
    name: str, causal: bool, train: bool
) -> None:
    """The sdpa backend's per-distance view, query chunks and training paths on the CPU,
    beyond what plain SDPA holds for the same call (its kernel's per-thread buffers
    included): doubling N at most 2.5x that extra memory (a quadratic term would
    quadruple it), and at N = 2048 it stays under one [H, N, N] float32 bias, which a
    materialised bias alone would need."""
    extras = []
    heads = 4
    for n in (1024, 2048):
        torch.manual_seed(0)
        pe = generated_class(name)(heads=heads, head_dim=16)
        extras.append(sdpa_extra_memory(pe, n, causal, train))
    assert extras[1] <= 2.5 * max(extras[0], 0) + MIB, [e / MIB for e in extras]
    assert extras[1] < heads * 2048 * 2048 * 4, extras[1] / MIB
