"""CoPE (Golovneva et al. 2024) against x-transformers' CoPE and a float64 formula."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import cope_beside_x_transformers, generated_class, runtime_modules

F64 = torch.float64


def _cope64(q: torch.Tensor, k: torch.Tensor, table: torch.Tensor, scale: float) -> torch.Tensor:
    """The paper's term, loop by loop in float64, for causal default positions (N = M)."""
    b, h, n, _ = q.shape
    out = torch.zeros(b, h, n, n, dtype=F64)
    for bi in range(b):
        for hi in range(h):
            for i in range(n):
                gates = [torch.sigmoid(q[bi, hi, i] @ k[bi, hi, t] * scale) for t in range(n)]
                for j in range(i + 1):
                    p = min(float(sum(gates[t] for t in range(j, i + 1))), table.shape[0] - 1)
                    low, high = math.floor(p), math.ceil(p)
                    w = p - low
                    out[bi, hi, i, j] = (1 - w) * (q[bi, hi, i] @ table[low]) + w * (
                        q[bi, hi, i] @ table[high]
                    )
    return out


def test_cope_term_matches_the_formula_in_float64() -> None:
    pe = generated_class("cope")(heads=2, head_dim=8).double()
    q, k = torch.randn(1, 2, 5, 8, dtype=F64), torch.randn(1, 2, 5, 8, dtype=F64)
    with torch.no_grad():
        pe.cope_positions.copy_(torch.randn(16, 8, dtype=F64))
    terms = pe.score_terms(q, k)
    want = _cope64(q, k, pe.cope_positions.detach(), pe.scale)
    visible = torch.ones(5, 5, dtype=torch.bool).tril()
    torch.testing.assert_close(
        terms["content_position"][..., visible], want[..., visible], rtol=1e-12, atol=1e-12
    )


def test_cope_attention_matches_x_transformers() -> None:
    torch.manual_seed(0)
    heads, dim, n = 4, 16, 12
    reference, pe = cope_beside_x_transformers(heads, dim)
    q, k, v = (torch.randn(2, heads, n, dim) for _ in range(3))
    scale = dim**-0.5
    sim = (q @ k.transpose(-1, -2)) * scale
    causal = torch.ones(n, n, dtype=torch.bool).triu(1)
    sim = sim.masked_fill(causal, -torch.finfo(sim.dtype).max)
    sim = sim + reference(q, sim)
    want = sim.softmax(-1) @ v
    for backend in ("eager", "sdpa"):
        got = pe(q, k, v, causal=True, backend=backend)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cope_gradients_reach_the_table_on_every_backend() -> None:
    pe = generated_class("cope")(heads=4, head_dim=8)
    q = torch.randn(2, 4, 6, 8, requires_grad=True)
    k, v = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)  # GQA
    grads = []
    for backend in ("eager", "sdpa"):
        pe.zero_grad()
        out = pe(q, k, v, causal=True, backend=backend, q_positions=torch.arange(3, 9),
                 k_positions=torch.arange(3, 9))  # fmt: skip
        (table_grad, q_grad) = torch.autograd.grad(out.square().sum(), (pe.cope_positions, q))
        assert float(table_grad.abs().sum()) > 0
        grads.append((table_grad, q_grad))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("chunk", [4, 256])
def test_a_packed_document_is_encoded_as_it_would_be_alone(
    backend: str, chunk: int, monkeypatch
) -> None:
    """CoPE counts gates over the keys of the query's own document only: two documents
    packed with positions restarting at each give each one the output (and the
    gradients) it has alone, on every path, with query chunks of 4 as of 256."""
    for module in runtime_modules():
        if module.__name__.endswith("_masks"):
            monkeypatch.setitem(module.SDPA_QUERY_CHUNK, "cpu", chunk)
    torch.manual_seed(0)
    pe = generated_class("cope")(heads=2, head_dim=8).double()
    with torch.no_grad():
        pe.cope_positions.copy_(torch.randn(*pe.cope_positions.shape, dtype=F64))
    lengths = (5, 7)
    q, k, v = (torch.randn(1, 2, sum(lengths), 8, dtype=F64, requires_grad=True) for _ in "qkv")
    documents = torch.tensor([0] * lengths[0] + [1] * lengths[1])
    positions = torch.cat([torch.arange(length) for length in lengths])
    packed = pe(
        q,
        k,
        v,
        q_positions=positions,
        k_positions=positions,
        document_ids=documents,
        causal=True,
        backend=backend,
    )
    packed_grads = torch.autograd.grad(packed.square().sum(), (q, k, v))
    start = 0
    for length in lengths:
        rows = slice(start, start + length)
        alone_inputs = [t.detach()[:, :, rows].requires_grad_() for t in (q, k, v)]
        alone = pe(*alone_inputs, causal=True, backend="eager")
        alone_grads = torch.autograd.grad(alone.square().sum(), alone_inputs)
        torch.testing.assert_close(packed[:, :, rows], alone, rtol=1e-10, atol=1e-12)
        for got, want in zip(packed_grads, alone_grads, strict=True):
            torch.testing.assert_close(got[:, :, rows], want, rtol=1e-9, atol=1e-11)
        start += length


@pytest.mark.parametrize("n", [1, 2, 3])
def test_few_queries_at_default_positions_count_only_the_keys_before_them(n: int) -> None:
    """The last N of M = 6 queries at default positions (a decode step, N = 1: it sees
    every key; N > 1: a later key is gated out for the earlier queries): each query's
    term on the keys at or before it equals the float64 formula's row at its position."""
    pe = generated_class("cope")(heads=2, head_dim=8).double()
    generator = torch.Generator().manual_seed(n)
    q, k = (torch.randn(1, 2, 6, 8, generator=generator, dtype=F64) for _ in "qk")
    with torch.no_grad():
        pe.cope_positions.copy_(torch.randn(16, 8, generator=generator, dtype=F64))
    want = _cope64(q, k, pe.cope_positions.detach(), pe.scale)[:, :, 6 - n :]  # [1, 2, N, 6]
    got = pe.score_terms(q[:, :, 6 - n :], k)["content_position"]
    visible = torch.ones(6, 6, dtype=torch.bool).tril()[6 - n :]  # key <= query
    torch.testing.assert_close(got[..., visible], want[..., visible], rtol=1e-12, atol=1e-12)
