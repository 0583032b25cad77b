"""The sdpa backend's chunked CPU training steps as one autograd node
(``chunked_flash_attention``): per-chunk flash forward and backward, against an
independent float64 softmax attention, and the cases the path leaves to the per-chunk
SDPA calls."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.conftest import generated_class

chunked = importlib.import_module("generated._chunked_flash")
masks = importlib.import_module("generated._masks")
sdpa_chunks = importlib.import_module("generated._sdpa_chunks")

SPANS = [(0, 3, 0, 5), (3, 7, 1, 9), (7, 10, 2, 12)]  # queries i0..i1-1, keys lo..hi-1


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(scale q kᵀ + bias) v over the whole [N, M] grid, float64."""
    scores = scale * q.double() @ k.double().transpose(-1, -2) + bias.double()
    return scores.softmax(-1) @ v.double()


def _grid_bias(generator: torch.Generator, n: int, m: int) -> torch.Tensor:
    """[1, 2, N, M]: random values on each span's keys, -inf elsewhere."""
    bias = torch.full((1, 2, n, m), float("-inf"), dtype=torch.float64)
    for i0, i1, lo, hi in SPANS:
        bias[..., i0:i1, lo:hi] = torch.randn(1, 2, i1 - i0, hi - lo, generator=generator)
    return bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("queries_reversed", [False, True])
@pytest.mark.parametrize("boolean", [False, True])
def test_spans_match_softmax_attention_with_gradients(
    dtype: torch.dtype, queries_reversed: bool, boolean: bool
) -> None:
    """Three overlapping spans (each query's keys a window of the others'), masks as
    float biases or booleans, in query order or reversed: output and gradients into q,
    k and v equal softmax attention over the whole grid with -inf off the spans."""
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(2, 2, 10, 4, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 12, 4, generator=generator, dtype=torch.float64) for _ in "kv")
    bias = _grid_bias(generator, 10, 12)
    if boolean:
        bias = torch.where(bias.isinf(), bias, torch.zeros_like(bias))
    cotangent = torch.randn(2, 2, 10, 4, generator=generator, dtype=torch.float64)

    def mask_of(i0: int, i1: int, lo: int, hi: int) -> torch.Tensor:
        span = bias[0, :, i0:i1, lo:hi]  # [H, rows, keys]
        span = span.flip(1) if queries_reversed else span
        return span.isfinite() if boolean else span.to(dtype)

    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = chunked.chunked_flash_attention(*leaves, SPANS, mask_of, 0.4, queries_reversed)
    grads = torch.autograd.grad(out, leaves, cotangent.to(dtype))

    leaves64 = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _reference(*leaves64, bias, 0.4)
    want_grads = torch.autograd.grad(want, leaves64, cotangent)
    tolerance = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), want, rtol=tolerance, atol=tolerance)
    for got, expected in zip(grads, want_grads, strict=True):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)


def test_a_causal_alibi_training_step_in_float32_takes_the_path(monkeypatch) -> None:
    """ALiBi, causal, N = 600 in the default chunks of 256, float32, grouped-query heads:
    one chunked call, whose output and gradients equal the eager oracle's."""
    assert masks.SDPA_QUERY_CHUNK["cpu"] == 256
    calls: list[int] = []
    original = sdpa_chunks.chunked_flash_attention

    def spy(q, k, v, spans, *args):
        calls.append(len(spans))
        return original(q, k, v, spans, *args)

    monkeypatch.setattr(sdpa_chunks, "chunked_flash_attention", spy)
    pe = generated_class("alibi")(heads=4, head_dim=16)
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 600, 16, generator=generator)
    k, v = (torch.randn(1, 2, 600, 16, generator=generator) for _ in "kv")
    cotangent = torch.randn(1, 4, 600, 16, generator=generator)
    results = []
    for backend in ("sdpa", "eager"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = pe(*leaves, causal=True, backend=backend)
        results.append((out, *torch.autograd.grad(out, leaves, cotangent)))
    assert calls == [3]
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    ("case", "name"),
    [
        ("no gradient", "alibi"),
        ("bfloat16", "alibi"),
        ("a trained bias", "fire"),
        ("device not listed", "alibi"),
    ],
)
def test_the_path_leaves_other_calls_to_sdpa_per_chunk(case: str, name: str, monkeypatch) -> None:
    """Without a gradient, in half precision, with a mask that needs a gradient (FIRE's
    trained bias) or with the CPU taken out of ``CHUNKED_FLASH_DEVICES``, each chunk
    goes to SDPA or the trained-mask ops as before."""
    monkeypatch.setitem(masks.SDPA_QUERY_CHUNK, "cpu", 4)
    if case == "device not listed":
        monkeypatch.setattr(chunked, "CHUNKED_FLASH_DEVICES", set())

    def refuse(*args, **kwargs):
        raise AssertionError("chunked_flash_attention ran")

    monkeypatch.setattr(sdpa_chunks, "chunked_flash_attention", refuse)
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    pe = generated_class(name)(heads=2, head_dim=8).to(dtype)
    q, k, v = (torch.randn(1, 2, 10, 8, dtype=dtype, requires_grad=True) for _ in "qkv")
    with torch.set_grad_enabled(case != "no gradient"):
        out = pe(q, k, v, causal=True, backend="sdpa")
        want = pe(q, k, v, causal=True, backend="eager")
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), want.float(), rtol=tolerance, atol=tolerance)


def test_a_boolean_mask_becomes_additive_and_four_dimensional() -> None:
    allowed = torch.tensor([[True, False], [True, True]])
    mask = chunked.flash_mask(allowed, torch.float32)
    assert mask.shape == (1, 1, 2, 2) and mask.dtype == torch.float32
    assert mask[0, 0].tolist() == [[0.0, float("-inf")], [0.0, 0.0]]
    assert chunked.flash_mask(None, torch.float32) is None


def test_sequence_slices_sum_their_gradients_into_one_buffer() -> None:
    """Overlapping ranges, one slice unused: the slices are x's rows, and x's gradient
    is what plain slicing gives (each row's gradients summed, zero where unread)."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 9, 4, generator=generator, dtype=torch.float64)
    ranges = [(0, 4), (2, 7), (5, 6), (1, 9)]
    weights = [torch.randn(2, 3, b - a, 4, generator=generator, dtype=x.dtype) for a, b in ranges]
    grads = []
    for take in (chunked.sequence_slices, lambda t, r: [t[:, :, a:b] for a, b in r]):
        leaf = x.clone().requires_grad_()
        parts = take(leaf, ranges)
        for (a, b), part in zip(ranges, parts, strict=True):
            assert torch.equal(part, x[:, :, a:b])
        used = [
            (part * w).sum() for part, w in zip(parts, weights, strict=True) if part.shape[2] != 1
        ]
        (grad,) = torch.autograd.grad(sum(used), leaf)
        grads.append(grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-15)
    assert type(chunked.sequence_slices(x.requires_grad_(), ranges)[0].grad_fn).__name__ == (
        "_SequenceSlicesBackward"
    )
