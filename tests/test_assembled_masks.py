"""Long query chunks whose masks are built a few rows at a time into one buffer
(``_mask_buffer.AssembledMasks``), and the floor under each row of such a mask
(``_distances.floored_rows``): the CPU sdpa backend's path for a position bias per pair
where no gradient flows, against slices of a known mask, the floor's formula and the
eager oracle."""

from __future__ import annotations

import importlib
import math
from typing import Any

import pytest
import torch

from generated import _distances as distances
from generated import _mask_buffer as mask_buffer
from tests.conftest import assert_sdpa_matches_eager, generated_class, spy_calls

masks = importlib.import_module("generated._masks")
backend = importlib.import_module("generated._sdpa_backend")
chunks = importlib.import_module("generated._sdpa_chunks")

FLOOR = distances.BIAS_FLOOR


def test_a_span_is_its_parts_joined_in_one_buffer() -> None:
    """Spans of 7 and 3 queries over different keys, parts of 2 rows: each span's mask
    equals its block of the full mask; the first part of a pass is built on its own (it
    shows the leading dims), every later part is written into its rows of the span's
    mask, both spans sit at the start of one buffer, and a second pass over the spans
    makes its buffer again. With parts of 3 rows the span of 3 is the builder's own."""
    full = torch.randn(2, 3, 10, 12, generator=torch.Generator().manual_seed(0))
    given_out: list[bool] = []

    def mask_of(i0: int, i1: int, lo: int, hi: int, out: torch.Tensor | None) -> torch.Tensor:
        given_out.append(out is not None)
        block = full[..., i0:i1, lo:hi]
        return block.clone() if out is None else out.copy_(block)

    def served(i0: int, i1: int, lo: int, hi: int) -> list[bool]:
        given_out.clear()
        mask = masks_of(i0, i1, lo, hi)
        torch.testing.assert_close(mask, full[..., i0:i1, lo:hi], rtol=0, atol=0)
        addresses.append(mask.data_ptr())
        return list(given_out)

    spans = [(0, 7, 0, 12), (7, 10, 2, 9)]
    addresses: list[int] = []
    masks_of = mask_buffer.AssembledMasks(mask_of, 2, spans)
    assert served(0, 7, 0, 12) == [False, True, True, True]  # rows 0-1 alone, then in place
    assert served(7, 10, 2, 9) == [True, True]
    assert addresses[0] == addresses[1]
    assert served(0, 7, 0, 12) == [False, True, True, True]  # a new pass, a new buffer
    masks_of = mask_buffer.AssembledMasks(mask_of, 3, spans)
    assert served(0, 7, 0, 12) == [False, True, True]
    assert served(7, 10, 2, 9) == [False]


def _floor_formula(bias: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
    """max(bias, top - BIAS_FLOOR - spread) per row with -inf kept, in float64."""
    wide = bias.double()
    floor = wide.amax(dim=-1, keepdim=True) - FLOOR - spread.double()
    return torch.where(torch.isneginf(wide), wide, torch.maximum(wide, floor))


@pytest.mark.parametrize(
    "offsets",
    [
        [0.0, -3.0, -39.0, -20.0],  # shallow: every entry at or above the floor
        [0.0, -3.0, -90.0, -300.0],  # steep, finite: a maximum alone
        [0.0, -90.0, -math.inf, -300.0],  # steep with a masked key
        [-math.inf] * 4,  # a row that reads nothing
    ],
    ids=["shallow", "steep", "masked", "empty row"],
)
@pytest.mark.parametrize("into", [False, True])
def test_floored_rows_follow_the_formula(offsets: list[float], into: bool) -> None:
    """Rows of two heads at different tops with a spread of 0.5: the floor per row
    equals max(bias, top - 40 - spread) with -inf kept; given ``out``, a floor that
    changes an entry is written there, and a bias it leaves as it is comes back itself."""
    row = torch.tensor(offsets)
    bias = torch.stack([row + 5.0, row - 7.0]).reshape(2, 1, 4)  # [H, rows, keys]
    spread = torch.full((2, 1, 1), 0.5)
    out = torch.full_like(bias, 123.0) if into else None
    got = distances.floored_rows(bias, spread, out)
    torch.testing.assert_close(got.double(), _floor_formula(bias, spread), rtol=0, atol=0)
    changed = not torch.equal(_floor_formula(bias, spread), bias.double())
    if not changed:
        assert got is bias
    elif into:
        assert got is out


def _inference_outputs(
    name: str, dtype: torch.dtype, spacing: int, **call: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sdpa output without autograd in ``dtype`` and the float64 eager oracle's, for
    10 queries and 12 keys with positions ``spacing`` apart (no shift of the defaults)."""
    torch.manual_seed(0)
    pe = generated_class(name)(heads=4, head_dim=8)
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 10, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 12, 8, generator=generator, dtype=torch.float64) for _ in "kv")
    positions = {
        "q_positions": spacing * torch.arange(2, 12),
        "k_positions": spacing * torch.arange(12) + 1,
    }
    with torch.no_grad():
        pe.to(dtype)
        got = pe(q.to(dtype), k.to(dtype), v.to(dtype), backend="sdpa", **positions, **call)
        pe.double()
        want = pe(q, k, v, backend="eager", **positions, **call)
    return got, want


CASES: dict[str, dict[str, Any]] = {
    "positions": {},
    "causal": {"causal": True},
    "causal and window": {"causal": True, "window": 4},
    "documents": {"document_ids": (torch.arange(12) >= 5).long()},
    "attn_mask": {
        "attn_mask": torch.rand(10, 12, generator=torch.Generator().manual_seed(2)) > 0.3
    },
}


def _chunks_of_4_in_parts_of_3(monkeypatch: pytest.MonkeyPatch, itemsize: int) -> list[int]:
    """Chunks of 4 queries, their masks' parts 3 rows of [1, 4, 1, 12] at ``itemsize``
    bytes an entry: the rows per part of every ``AssembledMasks`` made (each still
    runs)."""
    monkeypatch.setitem(masks.SDPA_QUERY_CHUNK, "cpu", 4)
    monkeypatch.setitem(masks.SDPA_MASK_CHUNK_BYTES, "cpu", 3 * 4 * 12 * itemsize)
    monkeypatch.setattr(masks, "SDPA_MASK_CHUNK_MIN_ROWS", 1)
    return spy_calls(monkeypatch, [chunks], "AssembledMasks", lambda _, rows, __: rows)


@pytest.mark.parametrize("name", ["alibi", "t5", "fire"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_inference_chunks_built_in_parts_match_eager(
    name: str, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of 4 queries whose masks are built 3 rows at a time (a budget of 3 rows of
    [1, 4, 1, 12] float64): the output without autograd equals the eager oracle's, in
    float64, and every chunk took its mask from the parts."""
    parts = _chunks_of_4_in_parts_of_3(monkeypatch, 8)
    got, want = _inference_outputs(name, torch.float64, 2, **CASES[case])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert parts == [3]


@pytest.mark.parametrize("causal", [False, True])
def test_float32_parts_under_the_floor_match_eager(
    causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ALiBi with positions 60 apart (head 0's bias reaches -165, below the floor), in
    float32: the floored masks written into the parts give the float64 oracle's output."""
    _chunks_of_4_in_parts_of_3(monkeypatch, 4)
    floored: list[bool] = []
    original = distances.floored_rows

    def spy(bias: torch.Tensor, spread: torch.Tensor, out: torch.Tensor | None = None) -> Any:
        result = original(bias, spread, out)
        floored.append(out is not None and result is out)
        return result

    monkeypatch.setattr(backend, "floored_rows", spy)
    got, want = _inference_outputs("alibi", torch.float32, 60, causal=causal)
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-6)
    assert any(floored)  # a floor written into the buffer


@pytest.mark.parametrize("name", ["alibi", "t5"])
@pytest.mark.parametrize("causal", [False, True])
def test_training_chunks_built_in_parts_match_eager(
    name: str, causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training step whose masks get no gradient (T5's table frozen) through the
    chunked flash node, chunks of 4 queries with masks built 3 rows at a time, forward
    and again in the backward: outputs and gradients into q, k and v equal the eager
    oracle's (float64)."""
    built = _chunks_of_4_in_parts_of_3(monkeypatch, 8)
    torch.manual_seed(0)
    pe = generated_class(name)(heads=4, head_dim=8).double().requires_grad_(False)
    positions = {"q_positions": 2 * torch.arange(2, 12), "k_positions": 2 * torch.arange(12) + 1}
    assert_sdpa_matches_eager(pe, 10, 12, 2, causal=causal, **positions)
    assert built == [3]


def test_half_precision_parts_are_shifted_before_their_cast(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """T5 with its buckets near +100 (bfloat16's spacing there is 0.5) or at -100 (under
    the floor), q, k and v in bfloat16, chunks of 4 queries with masks built 3 rows at a time: each
    part is floored, then shifted by its row maximum before the cast
    (``half_precision_bias``) as it is written into the buffer, so the output stays
    within bfloat16's error of the float64 oracle."""
    _chunks_of_4_in_parts_of_3(monkeypatch, 4)
    pe = generated_class("t5")(heads=4, head_dim=8)
    with torch.no_grad():
        (table,) = pe.parameters()
        table.copy_(100 + torch.randn(table.shape, generator=torch.Generator().manual_seed(4)))
        table.view(-1)[::3] = -100.0
    generator = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(1, 4, n, 8, generator=generator, dtype=torch.float64) for n in (10, 12, 12)
    )
    positions = {"q_positions": 2 * torch.arange(2, 12), "k_positions": 2 * torch.arange(12) + 1}
    with torch.no_grad():  # a float32 table, its bias made in float32 (not on bf16's grid)
        got = pe(*(t.to(torch.bfloat16) for t in (q, k, v)), backend="sdpa", **positions)
        want = pe.double()(q, k, v, backend="eager", **positions)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=5e-2)  # 0.27 unshifted
