"""Regressions from a differential fuzz of the shared runtime: each call here once
raised on the sdpa backend (or its backward) where the eager oracle computes. Every test
compares sdpa with eager in float64, outputs and gradients (``assert_sdpa_matches_eager``)
and, where the failing path ran without autograd only, outputs under ``torch.no_grad``."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import (
    assert_sdpa_matches_eager,
    generated_class,
    runtime_modules,
    spec_variant,
)


def chunks_of(monkeypatch: pytest.MonkeyPatch, pe: torch.nn.Module, size: int) -> None:
    """Query chunks of ``size`` rows on the CPU for ``pe``'s runtime, as
    tests/test_differential.py shrinks them: ``SDPA_QUERY_CHUNK``, and the chunks sized
    by their masks' bytes cut to ``size`` rows."""
    for module in runtime_modules(pe):
        if hasattr(module, "SDPA_QUERY_CHUNK"):
            monkeypatch.setitem(module.SDPA_QUERY_CHUNK, "cpu", size)
            monkeypatch.setitem(module.SDPA_MASK_CHUNK_BYTES, "cpu", 1)
        if hasattr(module, "SDPA_MASK_CHUNK_MIN_ROWS"):
            monkeypatch.setattr(module, "SDPA_MASK_CHUNK_MIN_ROWS", size)


def assert_no_grad_sdpa_matches_eager(
    pe: torch.nn.Module, n: int, m: int, kv_heads: int, **options: object
) -> None:
    """Outputs of sdpa and auto equal the eager oracle's under ``torch.no_grad`` (where
    sdpa's paths made once per call serve), float64, 4 query heads of width 8."""
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, n, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, m, 8, generator=generator, dtype=torch.float64) for _ in "kv")
    with torch.no_grad():
        want = pe(q, k, v, backend="eager", **options)
        for backend in ("sdpa", "auto"):
            got = pe(q, k, v, backend=backend, **options)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# Shaw's spec without its relative key term: a relative value term alone
SHAW_KEY_TERM = (
    "  content_position:\n"
    "    relative: {sign: key_minus_query, projection: none, placement: before_scale}"
    "   # q_i . a^K_ij\n"
)
SHAW_TABLE = (
    "  table: {kind: learned, width: head_dim, heads: shared, init_std: 0.02}"
    "   # a^K, shared by heads\n"
)


@pytest.mark.parametrize("causal", [False, True])
def test_a_relative_value_term_alone_at_explicit_positions(monkeypatch, causal: bool) -> None:
    """A clipped relative value-side term with no relative logit term, at explicit
    positions in chunks of 3: ``_terms_at_positions`` handed ``clipped_span_terms`` no
    factors, and ``batch_and_heads`` raised ValueError (max() of an empty sequence);
    with none the chunks build their own terms."""
    torch.manual_seed(0)
    cls = spec_variant(
        "shaw",
        (SHAW_KEY_TERM, "  content_position: drop\n"),
        (SHAW_TABLE, ""),
        name="shaw_values_alone",
    )
    pe = cls(heads=4, head_dim=8).double()
    with torch.no_grad():
        for parameter in pe.parameters():
            parameter.normal_()
    chunks_of(monkeypatch, pe, 3)
    positions = 2 * torch.arange(12)
    options = {"causal": causal, "q_positions": positions, "k_positions": positions}
    assert_no_grad_sdpa_matches_eager(pe, 12, 12, 2, **options)
    assert_sdpa_matches_eager(pe, 12, 12, 2, **options)


@pytest.mark.parametrize("name", ["nope", "alibi", "rope", "t5"])
@pytest.mark.parametrize("q_positions", [None, torch.zeros(0, dtype=torch.long)])
def test_no_queries_with_key_positions_and_an_attn_mask(name: str, q_positions) -> None:
    """N = 0 with k_positions and an attn_mask: the test of the defaults over the keys the
    mask reads compared each key's offset with the last query's, an empty slice, and
    raised RuntimeError (sizes 9 and 0) on every backend, eager included. The output is
    empty, and the gradients into k and v are zeros."""
    pe = generated_class(name)(heads=4, head_dim=8).double()
    q = torch.randn(2, 4, 0, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 9, 8, dtype=torch.float64, requires_grad=True) for _ in "kv")
    masks = (torch.ones(9, dtype=torch.bool), torch.zeros(1, 1, 1, 9, dtype=torch.float64))
    for attn_mask in masks:
        options = {"k_positions": 3 * torch.arange(9), "attn_mask": attn_mask}
        if q_positions is not None:
            options["q_positions"] = q_positions
        for backend in ("eager", "sdpa", "flex", "auto"):
            out = pe(q, k, v, backend=backend, **options)
            assert out.shape == (2, 4, 0, 8)
            grads = torch.autograd.grad(out.sum(), (k, v))
            assert all(torch.equal(grad, torch.zeros_like(grad)) for grad in grads)
