"""Chunked CPU attention whose masks train, each chunk's mask made again in the backward
(``recomputed_mask_attention``): against an independent float64 softmax attention, and
through the sdpa backend against the eager oracle for biases of (query, key) positions
(FIRE, TUPE-R), with gradients into q, k, v and the module's parameters."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from tests.conftest import generated_class, sdpa_extra_memory

recomputed = importlib.import_module("generated._recomputed_mask")
sdpa_chunks = importlib.import_module("generated._sdpa_chunks")
masks = importlib.import_module("generated._masks")

SPANS = [(0, 3, 0, 5), (3, 7, 1, 9), (7, 10, 2, 12)]  # queries i0..i1-1, keys lo..hi-1
MIB = 1 << 20


def _off_spans(n: int, m: int) -> torch.Tensor:
    """[N, M]: 0 on each span's keys, -inf elsewhere."""
    grid = torch.full((n, m), float("-inf"), dtype=torch.float64)
    for i0, i1, lo, hi in SPANS:
        grid[i0:i1, lo:hi] = 0.0
    return grid


def _reference(q, k, v, bias, scale):
    """softmax(scale q kᵀ + bias) v over the whole [N, M] grid, float64."""
    scores = scale * q.double() @ k.double().transpose(-1, -2) + bias.double()
    return scores.softmax(-1) @ v.double()


def _close(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    """got equals want to ``tolerance`` of want's largest magnitude."""
    scale = max(want.abs().max().item(), 1e-30)
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shared", [False, True])
def test_spans_match_softmax_attention_with_gradients_into_the_mask_inputs(
    dtype: torch.dtype, shared: bool
) -> None:
    """Three overlapping spans; each span's mask is built from two trained tensors (a
    per-head table and a per-key offset), as [1, H, rows, keys], or from one table
    shared by the heads as [rows, keys] (``shared``): output and gradients into q, k, v
    and both tensors equal float64 softmax attention over the grid with -inf off the
    spans, the mask gradients summed over the dimensions the mask broadcasts."""
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 10, 4, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 12, 4, generator=generator, dtype=torch.float64) for _ in "kv")
    shape = (10, 12) if shared else (2, 10, 12)
    table = torch.randn(shape, generator=generator, dtype=torch.float64)
    offset = torch.randn(12, generator=generator, dtype=torch.float64)
    cotangent = torch.randn(2, 2, 10, 4, generator=generator, dtype=torch.float64)
    off = _off_spans(10, 12)

    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, table, offset)]
    q_, k_, v_, table_, offset_ = leaves

    def mask_of(i0: int, i1: int, lo: int, hi: int) -> torch.Tensor:
        part = table_[..., i0:i1, lo:hi] * 2 + offset_[lo:hi]  # [(H,) rows, keys]
        part = part + off[i0:i1, lo:hi].to(dtype)
        return part if shared else part.unsqueeze(0)

    out = recomputed.recomputed_mask_attention(q_, k_, v_, SPANS, mask_of, 0.4, (table_, offset_))
    grads = torch.autograd.grad(out, leaves, cotangent.to(dtype))

    leaves64 = [t.clone().requires_grad_() for t in (q, k, v, table, offset)]
    bias = leaves64[3] * 2 + leaves64[4] + off
    want = _reference(*leaves64[:3], bias, 0.4)
    want_grads = torch.autograd.grad(want, leaves64, cotangent)
    tolerance = 1e-12 if dtype == torch.float64 else 2e-5
    _close(out, want, tolerance)
    for got, expected in zip(grads, want_grads, strict=True):
        assert got.dtype == dtype
        _close(got, expected, tolerance)


def test_strided_inputs_and_a_mask_that_is_a_view_of_its_input() -> None:
    """q, k and v as [B, N, H, D] tensors seen as [B, H, N, D], and two spans of one
    shape whose masks are the same trained tensor unsqueezed: its gradient through the
    view is a view of a span's dS, which the next span's weights overwrite in their
    buffer, so the first part is copied. Output and gradients equal float64 softmax
    attention."""
    generator = torch.Generator().manual_seed(7)
    q, k, v = (
        torch.randn(1, 8, 3, 4, generator=generator, dtype=torch.float64).transpose(1, 2)
        for _ in "qkv"
    )  # [B, H, N, D] views of [B, N, H, D] tensors; one batch row: dS is not summed
    pattern = torch.randn(3, 4, 8, generator=generator, dtype=torch.float64)
    cotangent = torch.randn(1, 3, 8, 4, generator=generator, dtype=torch.float64)
    spans = [(0, 4, 0, 8), (4, 8, 0, 8)]
    leaves = [t.float().requires_grad_() for t in (q, k, v, pattern)]

    def mask_of(i0: int, i1: int, lo: int, hi: int) -> torch.Tensor:
        return leaves[3].unsqueeze(0)  # [1, H, 4, 8], every span alike

    out = recomputed.recomputed_mask_attention(*leaves[:3], spans, mask_of, 0.5, (leaves[3],))
    grads = torch.autograd.grad(out, leaves, cotangent.float())

    leaves64 = [t.clone().requires_grad_() for t in (q, k, v, pattern)]
    want = _reference(*leaves64[:3], leaves64[3].repeat(1, 2, 1), 0.5)
    want_grads = torch.autograd.grad(want, leaves64, cotangent)
    _close(out, want, 2e-5)
    for got, expected in zip(grads, want_grads, strict=True):
        _close(got, expected, 2e-5)


def test_an_input_no_mask_reaches_gets_no_gradient() -> None:
    """A mask input that no span's mask is built from gets None, the one used its
    gradient."""
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 10, 4, generator=generator)
    k, v = (torch.randn(1, 2, 12, 4, generator=generator) for _ in "kv")
    used, unused = torch.zeros(12, requires_grad=True), torch.zeros(3, requires_grad=True)
    off = _off_spans(10, 12).float()

    def mask_of(i0: int, i1: int, lo: int, hi: int) -> torch.Tensor:
        return off[i0:i1, lo:hi] + used[lo:hi]

    out = recomputed.recomputed_mask_attention(q, k, v, SPANS, mask_of, 0.5, (used, unused))
    grad_used, grad_unused = torch.autograd.grad(out.sum(), (used, unused), allow_unused=True)
    assert grad_unused is None
    assert grad_used is not None and grad_used.abs().sum() > 0


def _training_step(pe, q, k, v, cotangent, causal: bool, backend: str):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    params = list(pe.parameters())
    out = pe(*leaves, causal=causal, backend=backend)
    grads = torch.autograd.grad(out, leaves + params, cotangent, allow_unused=True)
    return [out, *grads]


@pytest.mark.parametrize(("name", "n"), [("fire", 600), ("tupe_r", 500)])
@pytest.mark.parametrize("causal", [False, True])
def test_a_trained_bias_of_positions_takes_the_node_in_float32(
    name: str, n: int, causal: bool, monkeypatch
) -> None:
    """FIRE and TUPE-R, causal and not, in the default chunks of 256 queries, float32,
    grouped-query heads: one call of the node over every chunk, whose output and
    gradients (q, k, v and every parameter) equal the eager oracle's in float64."""
    assert masks.SDPA_QUERY_CHUNK["cpu"] == 256
    monkeypatch.setattr(recomputed, "RECOMPUTED_MASK_MIN_KEYS", n)  # from 1024 by default
    calls: list[int] = []
    original = sdpa_chunks.recomputed_mask_attention

    def spy(q, k, v, spans, *args):
        calls.append(len(spans))
        return original(q, k, v, spans, *args)

    monkeypatch.setattr(sdpa_chunks, "recomputed_mask_attention", spy)
    torch.manual_seed(0)
    pe = generated_class(name)(heads=4, head_dim=16)
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, n, 16, generator=generator)
    k, v = (torch.randn(2, 2, n, 16, generator=generator) for _ in "kv")
    cotangent = torch.randn(2, 4, n, 16, generator=generator)
    got = _training_step(pe, q, k, v, cotangent, causal, "sdpa")
    exact = copy.deepcopy(pe).double()  # the oracle in float64
    want = _training_step(
        exact, q.double(), k.double(), v.double(), cotangent.double(), causal, "eager"
    )
    assert calls == [-(-n // 256)]
    assert all(t is not None for t in got + want)
    for a, b in zip(got[:4], want[:4], strict=True):  # output, q, k, v
        _close(a, b, 2e-5)
    # parameters: a gradient that softmax makes 0 (FIRE's output-layer bias: a constant
    # per head and query row) is rounding noise in both, small on the others' scale
    largest = max(b.abs().max().item() for b in want[4:])
    for a, b in zip(got[4:], want[4:], strict=True):
        if b.abs().max().item() <= 1e-6 * largest:
            assert a.abs().max().item() <= 1e-4 * largest
        else:
            _close(a, b, 2e-5)


@pytest.mark.parametrize(
    "case", ["frozen", "no gradient", "bfloat16", "device not listed", "few keys"]
)
def test_the_node_leaves_other_calls(case: str, monkeypatch) -> None:
    """Frozen parameters, no gradient, half precision, the CPU taken out of
    ``RECOMPUTED_MASK_DEVICES``, or fewer keys than ``RECOMPUTED_MASK_MIN_KEYS``: the
    node does not run, and the result still equals the eager oracle's."""
    monkeypatch.setitem(masks.SDPA_QUERY_CHUNK, "cpu", 4)
    if case != "few keys":
        monkeypatch.setattr(recomputed, "RECOMPUTED_MASK_MIN_KEYS", 1)
    if case == "device not listed":
        monkeypatch.setattr(recomputed, "RECOMPUTED_MASK_DEVICES", set())

    def refuse(*args, **kwargs):
        raise AssertionError("recomputed_mask_attention ran")

    monkeypatch.setattr(sdpa_chunks, "recomputed_mask_attention", refuse)
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    pe = generated_class("fire")(heads=2, head_dim=8).to(dtype).requires_grad_(case != "frozen")
    q, k, v = (torch.randn(1, 2, 10, 8, dtype=dtype, requires_grad=True) for _ in "qkv")
    with torch.set_grad_enabled(case != "no gradient"):
        out = pe(q, k, v, backend="sdpa")
        want = pe(q, k, v, backend="eager")
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), want.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("train", [False, True])
def test_fire_holds_memory_linear_in_the_sequence(causal: bool, train: bool) -> None:
    """FIRE's bias of (query, key) positions on the CPU sdpa backend, built a chunk of
    queries at a time, beyond what plain SDPA holds for the same call: doubling N at
    most 2.5x that extra memory (a quadratic term would quadruple it), and at N = 2048
    under the [hidden, N, N] float32 layer that evaluating the MLP over every pair at
    once holds."""
    extras = []
    for n in (1024, 2048):
        torch.manual_seed(0)
        pe = generated_class("fire")(heads=4, head_dim=16)
        extras.append(sdpa_extra_memory(pe, n, causal, train))
    hidden = pe.fire_mlp[0].out_features
    assert extras[1] <= 2.5 * max(extras[0], 0) + MIB, [e / MIB for e in extras]
    assert extras[1] < hidden * 2048 * 2048 * 4, extras[1] / MIB
