"""Relative terms at default positions on the sdpa backend, gathered per query chunk from
their projections over the table rows (``_sdpa_relative_parts``): on the CPU in float32
or float64 through ``chunked_relative_attention`` (flash calls per chunk, the terms'
gradient span by span), elsewhere through one SDPA call per chunk.

Each case is checked against the eager oracle, outputs and gradients into q, k, v and
every parameter, with chunks of 8 queries so that every sequence spans several.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.conftest import (
    assert_sdpa_matches_eager,
    assert_sdpa_matches_eager_without_trained_terms,
    runtime_modules,
    set_runtime,
    small_clip_module,
    spy_calls,
    spy_query_shapes,
)

F64 = torch.float64
NAMES = ["bert_relative_key", "bert_relative_key_query", "deberta", "transformer_xl"]
SHAPES = [(40, 40, 4), (25, 50, 2), (17, 30, 1)]  # (n, m, kv_heads)


def make(name: str) -> torch.nn.Module:
    return small_clip_module(name)


@pytest.fixture
def chunks_of_8(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 8 queries, and Transformer-XL's lone query-side term gathered here
    rather than viewed per chunk (``_skewed_relative``, tested in test_skewed_relative)."""
    masks = [module for module in runtime_modules() if module.__name__.endswith("_masks")]
    monkeypatch.setitem(masks[0].SDPA_QUERY_CHUNK, "cpu", 8)
    set_runtime(monkeypatch, "SKEWED_RELATIVE_DEVICES", set())


@pytest.mark.usefixtures("chunks_of_8")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("n", "m", "kv_heads"), SHAPES)
@pytest.mark.parametrize("name", NAMES)
def test_chunked_terms_match_eager_with_gradients(
    name: str, n: int, m: int, kv_heads: int, causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    pe = make(name)
    route = spy_query_shapes(monkeypatch, pe, "chunked_relative_attention")
    assert_sdpa_matches_eager(pe, n, m, kv_heads, causal=causal)
    key_side = name in ("bert_relative_key_query", "deberta")
    if causal and not key_side:  # a causal training step without key-side terms
        assert route == []  # builds each chunk's terms at its positions
    else:
        assert route == [(2, 4, n, 8)]


@pytest.mark.usefixtures("chunks_of_8")
@pytest.mark.parametrize("per_span", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_without_gradients_and_with_frozen_tables(
    name: str, per_span: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No gradient into the terms: each chunk's terms are gathered when its call needs
    them (forward, and again in the backward for q and k), with the queries projected
    once or (``per_span``: ``QUERY_PROJECTION_WHOLE_BYTES`` 0) per chunk."""
    pe = make(name)
    if per_span:
        set_runtime(monkeypatch, "QUERY_PROJECTION_WHOLE_BYTES", 0, pe)
    pe.requires_grad_(False)
    route = spy_query_shapes(monkeypatch, pe, "chunked_relative_attention")
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 30, 8, generator=generator, dtype=F64, requires_grad=True)
    k = torch.randn(2, 2, 36, 8, generator=generator, dtype=F64, requires_grad=True)
    v = torch.randn(2, 2, 36, 8, generator=generator, dtype=F64)
    assert_sdpa_matches_eager_without_trained_terms(pe, q, k, v)
    key_side = name in ("bert_relative_key_query", "deberta")
    assert len(route) == (4 if key_side else 3)  # causal with gradients into q: per chunk


@pytest.mark.usefixtures("chunks_of_8")
@pytest.mark.parametrize("name", ["bert_relative_key_query", "deberta", "transformer_xl"])
def test_windows_documents_and_other_value_widths_take_sdpa_per_chunk(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window or documents, and values of another width, go through one SDPA call per
    chunk with the chunk's terms (and its mask) as attn_mask."""
    pe = make(name)
    flash = spy_query_shapes(monkeypatch, pe, "chunked_relative_attention")
    route = spy_calls(monkeypatch, runtime_modules(pe), "band_terms", lambda *_, **__: None)
    documents = torch.zeros(2, 30, dtype=torch.int64)
    documents[:, 11:] = 1
    for options in ({"window": 6}, {"window": 5, "causal": True}, {"document_ids": documents}):
        assert_sdpa_matches_eager(pe, 30, 30, 2, **options)
    generator = torch.Generator().manual_seed(6)
    q, k = (torch.randn(1, 4, 24, 8, generator=generator, dtype=F64) for _ in range(2))
    v = torch.randn(1, 4, 24, 5, generator=generator, dtype=F64)
    with torch.no_grad():
        want = pe(q, k, v, backend="eager")
        torch.testing.assert_close(pe(q, k, v, backend="sdpa"), want, rtol=1e-10, atol=1e-12)
    assert flash == [] and len(route) > 0


@pytest.mark.usefixtures("chunks_of_8")
@pytest.mark.parametrize("name", ["bert_relative_key_query", "deberta"])
def test_bfloat16_within_bfloat16_error(name: str) -> None:
    pe = make(name).float()
    generator = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 30, 8, generator=generator).bfloat16() for _ in range(3))
    for causal in (False, True):
        got = pe(q, k, v, causal=causal, backend="sdpa")
        want = pe(q.float(), k.float(), v.float(), causal=causal, backend="eager")
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_explicit_positions_and_attn_mask_keep_the_dense_terms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pe = make("deberta")
    route = spy_calls(monkeypatch, runtime_modules(pe), "band_terms", lambda *_, **__: None)
    flash = spy_query_shapes(monkeypatch, pe, "chunked_relative_attention")
    few = spy_query_shapes(monkeypatch, pe, "few_query_inputs")
    positions = torch.arange(0, 60, 2)  # no shift of the defaults (those take their paths)
    q, k, v = (torch.randn(1, 4, 30, 8, dtype=F64) for _ in range(3))
    with torch.no_grad():
        pe(q, k, v, q_positions=positions, k_positions=positions, backend="sdpa")
        pe(q, k, v, attn_mask=torch.ones(30, 30, dtype=torch.bool), backend="sdpa")
    assert route == []
    set_runtime(monkeypatch, "FEW_QUERY_RELATIVE_MAX_QUERIES", 40, pe)
    with torch.no_grad():
        pe(q, k, v, backend="sdpa")  # 30 queries are few now: not the chunked terms
    assert flash == [] and few == [(1, 4, 30, 8)]


@pytest.mark.parametrize("per_span", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_span_terms_project_each_spans_queries_alone(
    causal: bool, per_span: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``span_terms``, the terms of a span without gradients: a query-side, a key-side,
    a global and a content term (rows clipped by a diagonal index, N < M) equal, span by
    span, the terms gathered from projections of every query at once. Past
    ``QUERY_PROJECTION_WHOLE_BYTES`` each query-side projection covers only that span's
    queries; within it, every query is projected once."""
    clipped = importlib.import_module("generated._clipped_relative")
    monkeypatch.setattr(clipped, "QUERY_PROJECTION_WHOLE_BYTES", 0 if per_span else 1 << 30)
    terms_module = importlib.import_module("generated._terms")
    generator = torch.Generator().manual_seed(8)
    n, m, rows_count = 11, 15, 7

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=F64)

    diagonal = (torch.arange(n + m - 1) - (m - 1)).clamp(-3, 3) + 3  # [N + M - 1] in 0..6
    factors = [
        terms_module.RelativeFactors(
            "query", rand(2, 3, n, 4), rand(rows_count, 3, 4), diagonal, 0.5
        ),
        terms_module.RelativeFactors(
            "key", rand(2, 3, m, 4), rand(rows_count, 3, 4), diagonal, 1.0
        ),
        terms_module.RelativeFactors("global", rand(3, 4), rand(rows_count, 3, 4), diagonal, 1.0),
        terms_module.RelativeFactors("content", rand(2, 3, m, 4), rand(1, 3, 4), None, 1.0),
    ]
    whole = [terms_module.project_factors(factor) for factor in factors]
    projected = spy_calls(
        monkeypatch, [clipped], "project_factors", lambda factor: (factor.side, factor.x.shape[-2])
    )
    spans = [(0, 4, 0, 9), (4, 8, 2, 13), (8, 11, 5, 15)]
    terms_of = clipped.span_terms(factors, n, m, causal, spans)
    for i0, i1, lo, hi in spans:
        got = terms_of((i0, i1, lo, hi))
        want = clipped.band_terms(whole, n, m, [(i0, i1, lo, hi)], causal)[..., : hi - lo]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    # the others once (rows of x: a global term's [H, D] has H), then each span's
    others = [("key", m), ("global", 3), ("content", m)]
    if per_span:
        assert projected == [*others, *(("query", i1 - i0) for i0, i1, _, _ in spans)]
    else:
        assert projected == [("query", n), *others]


LARGE_TERM_CALLS = {
    "decode": (1, 40, {"causal": True}),
    "chunks": (30, 30, {"causal": True}),
    "positions": (
        12,
        30,
        {"q_positions": torch.arange(36, 60, 2), "k_positions": torch.arange(0, 60, 2)},
    ),
}


#: how much each encoding's parameters are scaled for logits of about 40 to 100
LARGE_TERM_SCALES = {"transformer_xl": 40.0, "deberta": 3.0}


@pytest.mark.usefixtures("chunks_of_8")
@pytest.mark.parametrize("name", sorted(LARGE_TERM_SCALES))
@pytest.mark.parametrize("call", sorted(LARGE_TERM_CALLS))
def test_large_terms_in_bfloat16_keep_eager_precision(name: str, call: str) -> None:
    """Relative terms with logits of about 40 to 100 (the parameters scaled up),
    bfloat16 inputs on the sdpa backend (one decode query, chunks of queries, explicit
    positions): the terms go to SDPA shifted by each row's largest
    (``half_precision_bias``), so the output stays as close to float64 eager's as
    eager's own bfloat16 output is; cast as they were, bfloat16's spacing of 0.5 near 75
    moved outputs by up to 0.35 (Transformer-XL, one query against 17 keys)."""
    torch.manual_seed(11)
    pe = make(name).float()
    with torch.no_grad():
        for parameter in pe.parameters():
            parameter.mul_(LARGE_TERM_SCALES[name])
    n, m, keywords = LARGE_TERM_CALLS[call]
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, n, 8, generator=generator)
    k, v = (torch.randn(1, 4, m, 8, generator=generator) for _ in "kv")
    with torch.no_grad():
        want = pe.double()(q.double(), k.double(), v.double(), backend="eager", **keywords)
        pe.float()
        half = [t.bfloat16() for t in (q, k, v)]
        got = pe(*half, backend="sdpa", **keywords).double()
        eager = pe(*half, backend="eager", **keywords).double()
    assert (want - eager).abs().max() < 0.05 < want.abs().max()  # the terms are large
    assert (got - want).abs().max() <= 2 * (eager - want).abs().max() + 1e-3
