"""Packed documents on the CPU sdpa backend: each chunk of queries reads only the keys
of its own documents (``document_spans``), at default positions, at positions that
restart per document and at explicit ones, against the eager oracle (float64, outputs
and gradients into q, k, v and the parameters)."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.conftest import (
    assert_sdpa_matches_eager,
    generated_class,
    runtime_modules,
    spy_calls,
    spy_method,
)

masks = importlib.import_module("generated._masks")

N = M = 24
# three packed documents: keys 0-6, 7-16, 17-23
DOCUMENTS = torch.tensor([0] * 7 + [1] * 10 + [2] * 7)
RESTARTED = torch.cat([torch.arange(7), torch.arange(10), torch.arange(7)])
# batch row 1: two documents, the first one in two runs (ids 5, 9, 5)
BATCHED = torch.stack([DOCUMENTS, torch.tensor([5] * 4 + [9] * 16 + [5] * 4)])


@pytest.fixture
def chunks_of_6(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in runtime_modules():
        if module.__name__.endswith("_masks"):
            monkeypatch.setitem(module.SDPA_QUERY_CHUNK, "cpu", 6)


def test_spans_are_narrowed_to_the_documents_of_their_queries() -> None:
    spans = [(0, 6, 0, 24), (6, 12, 0, 24), (12, 18, 0, 24), (18, 24, 0, 24)]
    assert masks.document_spans(spans, DOCUMENTS, N, M) == [
        (0, 6, 0, 7),  # document 0
        (6, 12, 0, 17),  # queries 6 (document 0) and 7-11 (document 1)
        (12, 18, 7, 24),  # documents 1 and 2
        (18, 24, 17, 24),  # document 2
    ]
    # causal spans of 12 queries (keys 12-23) keep within the keys they were given
    causal = [(0, 6, 0, 18), (6, 12, 0, 24)]
    assert masks.document_spans(causal, DOCUMENTS, 12, M) == [(0, 6, 7, 18), (6, 12, 17, 24)]


def test_spans_take_the_union_over_batch_rows() -> None:
    """Row 1's document 9 holds keys 4-19, its document 5 keys 0-3 and 20-23."""
    spans = [(6, 12, 0, 24), (12, 18, 0, 24)]
    # queries 6-11: row 0 reads keys 0-16 (documents 0 and 1), row 1 keys 4-19
    # queries 12-17: row 0 reads keys 7-23 (documents 1 and 2), row 1 keys 4-19
    assert masks.document_spans(spans, BATCHED, N, M) == [(6, 12, 0, 20), (12, 18, 4, 24)]


def test_spans_stay_as_given_for_one_span_no_documents_or_while_compiling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spans = [(0, 12, 0, 24), (12, 24, 0, 24)]
    assert masks.document_spans(spans, None, N, M) == spans
    assert masks.document_spans(spans[:1], DOCUMENTS, N, M) == spans[:1]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert masks.document_spans(spans, DOCUMENTS, N, M) == spans


def test_a_span_whose_keys_hold_none_of_its_documents_keeps_its_keys() -> None:
    """``position_spans`` may narrow a span to keys that exclude its queries' own: queries
    12-17 (documents 1 and 2) at position 0 read, causally, key 0 alone (document 0). The
    span keeps its key (the mask hides it), where ``at[0]`` of no shared key raised
    IndexError."""
    spans = [(0, 6, 0, 6), (6, 12, 0, 12), (12, 18, 0, 1), (18, 24, 0, 24)]
    assert masks.document_spans(spans, DOCUMENTS, N, M) == [
        (0, 6, 0, 6),
        (6, 12, 0, 12),
        (12, 18, 0, 1),  # as given
        (18, 24, 17, 24),
    ]


# queries 12-17 (documents 1 and 2) at position 0: causally they read key 0 (document 0)
# alone, so each of their rows is masked throughout
EARLY_QUERIES = torch.arange(N).masked_fill((torch.arange(N) >= 12) & (torch.arange(N) < 18), 0)


@pytest.mark.usefixtures("chunks_of_6")
@pytest.mark.parametrize("name", ["nope", "rope", "alibi", "t5", "shaw"])
def test_a_chunk_reading_no_key_of_its_documents_matches_eager(name: str) -> None:
    """A chunk whose queries' positions reach no key of their documents: sdpa equals the
    oracle (fully masked rows are zeros), where ``document_spans`` raised IndexError."""
    torch.manual_seed(0)
    pe = generated_class(name)(heads=4, head_dim=8).double()
    options = {"causal": True, "q_positions": EARLY_QUERIES, "document_ids": DOCUMENTS}
    assert_sdpa_matches_eager(pe, N, M, 2, **options)


def _spy_spans(monkeypatch: pytest.MonkeyPatch, pe: torch.nn.Module) -> list[list[tuple]]:
    """The spans of each ``_sdpa_in_chunks`` call of pe's class (each call still runs)."""
    return spy_method(monkeypatch, type(pe), "_sdpa_in_chunks", lambda q, k, v, s, *_, **__: s)


CASES = {
    "default positions": {},
    "default positions, causal": {"causal": True},
    "default positions, causal window": {"causal": True, "window": 5},
    "restarting positions, causal": {
        "causal": True,
        "q_positions": RESTARTED,
        "k_positions": RESTARTED,
    },
    "explicit positions": {"q_positions": 2 * RESTARTED, "k_positions": 2 * RESTARTED},
    # document 1's keys one position further on: its first query (7) reads no key
    "explicit positions, a query reading no key": {
        "causal": True,
        "q_positions": RESTARTED,
        "k_positions": RESTARTED + (DOCUMENTS == 1).long(),
    },
}


@pytest.mark.usefixtures("chunks_of_6")
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", ["nope", "rope", "alibi", "t5", "kerple_log", "fire"])
def test_packed_documents_match_eager(name: str, case: str, monkeypatch) -> None:
    """Every chunk of 6 queries reads at most its documents' keys (17 of 24 for the
    chunk that straddles documents 0 and 1), and sdpa equals the oracle, with 2
    key-value heads for 4 query heads."""
    torch.manual_seed(0)
    pe = generated_class(name)(heads=4, head_dim=8).double()
    calls = _spy_spans(monkeypatch, pe)
    assert_sdpa_matches_eager(pe, N, M, 2, document_ids=DOCUMENTS, **CASES[case])
    assert calls, "the chunks ran"
    for spans in calls:
        assert max(hi - lo for _, _, lo, hi in spans) <= 17, spans


@pytest.mark.usefixtures("chunks_of_6")
@pytest.mark.parametrize("name", ["bert_relative_key_query", "deberta", "transformer_xl"])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_documents_of_relative_terms_match_eager(name: str, causal: bool) -> None:
    torch.manual_seed(0)
    pe = generated_class(name)(heads=4, head_dim=8).double()
    assert_sdpa_matches_eager(pe, N, M, 2, document_ids=BATCHED, causal=causal)


@pytest.mark.usefixtures("chunks_of_6")
@pytest.mark.parametrize("name", ["bert_relative_key_query", "deberta"])
@pytest.mark.parametrize("causal", [False, True])
def test_relative_terms_per_chunk_span_only_its_documents(name, causal, monkeypatch) -> None:
    """The terms made per chunk from their projections (``band_mask``: gathered, or
    strided views) span only the chunk's documents' keys: at most 17 of 24."""
    pe = generated_class(name)(heads=4, head_dim=8).double()
    bands = spy_calls(monkeypatch, runtime_modules(pe), "band_mask", lambda *args: args[3])
    q, k, v = (torch.randn(2, 4, N, 8, dtype=torch.float64) for _ in "qkv")
    with torch.no_grad():
        pe(q, k, v, backend="sdpa", document_ids=DOCUMENTS, causal=causal)
    spans = [span for band in bands for span in band]
    assert spans and max(hi - lo for _, _, lo, hi in spans) <= 17, spans


@pytest.mark.usefixtures("chunks_of_6")
def test_without_a_position_term_chunks_serve_where_they_skip_enough(monkeypatch) -> None:
    """``rope`` with documents: in chunks where they hold at most
    ``DOCUMENT_CHUNKS_MAX_COVER`` (3/4) of the pairs, else one SDPA call with the mask;
    the oracle's output either way."""
    pe = generated_class("rope")(heads=4, head_dim=8).double()
    calls = _spy_spans(monkeypatch, pe)
    one_document = torch.zeros(M, dtype=torch.int64)
    assert_sdpa_matches_eager(pe, N, M, 2, document_ids=one_document)
    assert calls == []  # every pair: one call
    assert_sdpa_matches_eager(pe, N, M, 2, document_ids=one_document, causal=True)
    assert calls == [[(0, 6, 0, 6), (6, 12, 0, 12), (12, 18, 0, 18), (18, 24, 0, 24)]]  # 15/24
    assert_sdpa_matches_eager(pe, N, M, 2, document_ids=DOCUMENTS)
    assert calls[1:] == [[(0, 6, 0, 7), (6, 12, 0, 17), (12, 18, 7, 24), (18, 24, 17, 24)]]


DENSE_CASES = [
    "explicit positions",
    "explicit positions, a query reading no key",
    "default positions, causal window",
]


@pytest.mark.usefixtures("chunks_of_6")
@pytest.mark.parametrize("case", DENSE_CASES)
@pytest.mark.parametrize("name", ["shaw", "bert_relative_key_query", "deberta", "transformer_xl"])
def test_dense_relative_terms_go_a_chunk_at_a_time_over_its_documents(
    name: str, case: str, monkeypatch
) -> None:
    """Where the terms are built per pair (explicit positions, a value term, a window),
    each chunk of 6 queries builds them over its documents' keys only (at most 17 of
    24), densely or, a few queries of clipped terms at explicit positions, from their
    factors (``few_query_inputs_at_positions``), forward and backward, and sdpa equals
    the oracle; a training step with terms
    clipped at a distance and a key-side term does so inside one node over the chunks
    (``relative_attention_at_positions``), and Transformer-XL's, read by distance with
    no clip, too (``ranged_attention_at_positions``), in every case."""
    torch.manual_seed(0)
    pe = generated_class(name)(heads=4, head_dim=8).double()
    assert_sdpa_matches_eager(pe, N, M, 2, document_ids=DOCUMENTS, **CASES[case])
    assert_sdpa_matches_eager(pe, N, M, 2, document_ids=BATCHED, **CASES[case])
    shapes = spy_method(
        monkeypatch, type(pe), "_relative_terms", lambda q, k, *_, **__: (q.shape[2], k.shape[2])
    )
    pairs = per_pair_shapes(monkeypatch, pe)
    node = spy_calls(
        monkeypatch, runtime_modules(pe), "relative_attention_at_positions", lambda *a: a[5]
    )
    ranged = spy_calls(
        monkeypatch, runtime_modules(pe), "ranged_attention_at_positions", lambda *a: a[6]
    )
    q, k, v = (torch.randn(2, 4, N, 8, dtype=torch.float64, requires_grad=True) for _ in "qkv")
    pe(q, k, v, backend="sdpa", document_ids=DOCUMENTS, **CASES[case]).sum().backward()
    shapes += pairs + [(i1 - i0, hi - lo) for spans in node + ranged for i0, i1, lo, hi in spans]
    if case.startswith("explicit") or name in ("shaw", "transformer_xl"):
        assert shapes, "the per-pair terms ran"
    assert bool(node) == (name in ("bert_relative_key_query", "deberta"))
    assert bool(ranged) == (name == "transformer_xl")
    assert all(rows <= 6 and keys <= 17 for rows, keys in shapes), shapes


@pytest.mark.usefixtures("chunks_of_6")
def test_a_causal_training_step_of_query_side_terms_goes_per_chunk_with_documents(
    monkeypatch,
) -> None:
    """BERT relative_key's causal training step builds each chunk's terms at its own
    positions (``relative_parts_serve``): with documents too, over its documents' keys."""
    pe = generated_class("bert_relative_key")(heads=4, head_dim=8).double()
    shapes = spy_method(
        monkeypatch, type(pe), "_relative_terms", lambda q, k, *_, **__: (q.shape[2], k.shape[2])
    )
    pairs = per_pair_shapes(monkeypatch, pe)
    q, k, v = (torch.randn(2, 4, N, 8, dtype=torch.float64, requires_grad=True) for _ in "qkv")
    pe(q, k, v, backend="sdpa", document_ids=DOCUMENTS, causal=True).sum().backward()
    shapes += pairs
    assert shapes and all(rows <= 6 and keys <= 17 for rows, keys in shapes), shapes


def per_pair_shapes(monkeypatch: pytest.MonkeyPatch, pe: torch.nn.Module) -> list[tuple[int, int]]:
    """(queries, keys) of each call of ``few_query_inputs_at_positions`` (a chunk of a
    few queries at its own positions, reading each pair's row of clipped terms)."""
    return spy_calls(
        monkeypatch,
        runtime_modules(pe),
        "few_query_inputs_at_positions",
        lambda q, factors, clipped, scale: tuple(clipped.shape),
    )
