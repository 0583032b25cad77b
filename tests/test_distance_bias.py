"""Biases of j - i alone (ALiBi, T5) on the sdpa backend: a per-distance vector viewed
as the mask with queries reversed, never an [H, N, M] tensor; outputs and gradients equal
the eager oracle's."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.conftest import generated_class

runtime = importlib.import_module("generated._attention")
NAMES = ["alibi", "t5", "t5_decoder"]


def _module(name: str, heads: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    return generated_class(name)(heads=heads, head_dim=8).double()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("n", "m", "kv_heads"), [(6, 6, 4), (3, 9, 2), (1, 12, 1)])
def test_sdpa_by_distance_matches_eager_with_gradients(
    name: str, causal: bool, n: int, m: int, kv_heads: int
) -> None:
    _assert_sdpa_matches_eager(_module(name), n, m, kv_heads, causal=causal)


def _assert_sdpa_matches_eager(
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
    results = []
    for backend in ("eager", "sdpa"):
        leaves = {key: value.clone().requires_grad_() for key, value in inputs.items()}
        pe.zero_grad()
        out = pe(leaves["q"], leaves["k"], leaves["v"], backend=backend, **options)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads = [leaves[key].grad for key in ("q", "k", "v")]
        grads += [p.grad.clone() for p in pe.parameters() if p.grad is not None]
        results.append((out.detach(), grads))
    (eager, eager_grads), (sdpa, sdpa_grads) = results
    torch.testing.assert_close(sdpa, eager, rtol=1e-10, atol=1e-12)
    assert len(sdpa_grads) == len(eager_grads)
    for got, want in zip(sdpa_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def test_diagonal_view_backward_is_the_sum_of_each_diagonal() -> None:
    n, m = 5, 7
    vec = torch.randn(3, n + m - 1, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: runtime.query_reversed_bias(x, n, m), (vec,))
    grad = torch.randn(3, n, m, dtype=torch.float64)
    (got,) = torch.autograd.grad(runtime.expand_distance_bias(vec, n, m), vec, grad)
    want = torch.zeros_like(got)
    for i in range(n):
        for j in range(m):
            want[:, j - i + n - 1] += grad[:, i, j]  # query i, key j: distance j - i - (m - n)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", NAMES)
def test_sdpa_mask_is_a_view_of_a_per_distance_vector(name: str, monkeypatch) -> None:
    pe = generated_class(name)(heads=4, head_dim=8)
    n = m = 64
    seen = []
    original = runtime.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("attn_mask"))
        return original(*args, **kwargs)

    monkeypatch.setattr(runtime.F, "scaled_dot_product_attention", spy)
    q = torch.randn(1, 4, n, 8)
    for causal in (False, True):
        pe(q, q, q, causal=causal, backend="sdpa")
    assert len(seen) == 2
    for mask in seen:
        assert mask.shape == (1, 4, n, m)
        assert mask.untyped_storage().nbytes() == 4 * (n + m - 1) * mask.element_size()
    for value in pe._cache.values():  # nothing cached grows with N * M
        tensors = value if isinstance(value, tuple) else (value,)
        assert all(t.numel() <= 4 * (n + m) for t in tensors)


CHUNK_CASES = [  # (n, m, kv_heads, causal, window)
    (10, 10, 4, True, None),
    (7, 12, 2, True, None),
    (10, 10, 4, False, 3),
    (7, 12, 1, True, 4),
    (9, 9, 4, False, None),  # trained T5 table: chunked for the gradient
]


@pytest.mark.parametrize("name", ["alibi", "t5", "kerple_log"])
@pytest.mark.parametrize(("n", "m", "kv_heads", "causal", "window"), CHUNK_CASES)
def test_query_chunks_match_eager_with_gradients(
    name: str, n: int, m: int, kv_heads: int, causal: bool, window: int | None, monkeypatch
) -> None:
    monkeypatch.setitem(runtime.SDPA_QUERY_CHUNK, "cpu", 3)
    key_counts: list[int] = []
    original = runtime.F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        key_counts.append(k.shape[2])
        return original(q, k, v, **kwargs)

    pe = _module(name)
    monkeypatch.setattr(runtime.F, "scaled_dot_product_attention", spy)
    _assert_sdpa_matches_eager(pe, n, m, kv_heads, causal=causal, window=window)
    trained = any(True for _ in pe.parameters())
    if causal or window is not None or trained:
        assert len(key_counts) == -(-n // 3)  # one SDPA call per chunk of 3 queries
    if causal or window is not None:
        assert min(key_counts) < m  # masked keys are not read


@pytest.mark.parametrize(("n", "m"), [(6, 6), (4, 9)])
@pytest.mark.parametrize(("causal", "window"), [(True, None), (False, 2), (True, 3), (False, 20)])
def test_key_span_is_exactly_the_keys_some_query_may_read(
    n: int, m: int, causal: bool, window: int | None
) -> None:
    allowed = runtime.attention_allowed(None, None, n, m, torch.device("cpu"), causal, window, None)
    for i0 in range(n):
        for i1 in range(i0 + 1, n + 1):
            readable = allowed[i0:i1].any(0).nonzero().flatten().tolist()
            lo, hi = runtime.key_span(i0, i1, n, m, causal, window)
            assert readable == list(range(lo, hi)), (i0, i1)


@pytest.mark.parametrize("name", ["alibi", "t5"])
def test_query_chunks_in_bfloat16_stay_within_bfloat16_error(name: str, monkeypatch) -> None:
    """bf16 through the chunked calls against the float32 oracle on the same bf16
    inputs: outputs and gradients within bf16 error."""
    monkeypatch.setitem(runtime.SDPA_QUERY_CHUNK, "cpu", 5)
    torch.manual_seed(0)
    pe = generated_class(name)(heads=4, head_dim=16)
    generator = torch.Generator().manual_seed(4)
    q, k, v, cotangent = (
        torch.randn(2, 4, 23, 16, generator=generator).bfloat16() for _ in range(4)
    )
    results = []
    for backend, dtype in (("eager", torch.float32), ("sdpa", torch.bfloat16)):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = pe(*leaves, causal=True, window=9, backend=backend)
        grads = torch.autograd.grad(out, leaves, cotangent.to(dtype))
        results.append([t.float() for t in (out, *grads)])
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
