"""Relative terms clipped at a distance, at explicit positions or under masks, on the
CPU sdpa backend without autograd: projected once for every query chunk
(``_clipped_relative_factors``, ``projected_once``) and gathered per pair at each chunk's positions
(``_clipped_relative.terms_at_positions``), against the eager oracle (float64)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

from tests.conftest import (
    assert_sdpa_matches_eager,
    runtime_modules,
    runtime_value,
    set_runtime,
    small_clip_module,
    spy_calls,
    spy_method,
)

N, M = 10, 12
KEY_SIDE = ("bert_relative_key_query", "deberta")  # the encodings with a key-side term
TOKEN = torch.arange(M)
GIVEN = {"q_positions": 3 * torch.arange(2, 2 + N), "k_positions": 3 * TOKEN + 1}
CASES: dict[str, dict[str, Any]] = {
    "explicit positions": GIVEN,
    "batched positions": {"k_positions": torch.stack([TOKEN, 2 * TOKEN])},
    "causal and window": {**GIVEN, "causal": True, "window": 9},
    "attn_mask": {"attn_mask": torch.rand(N, M, generator=torch.Generator().manual_seed(2)) > 0.3},
    "documents": {"document_ids": (TOKEN >= 5).long()},
}


@pytest.mark.parametrize("per_span", [False, True])
@pytest.mark.parametrize(
    "name", ["bert_relative_key", "bert_relative_key_query", "deberta", "shaw"]
)
@pytest.mark.parametrize("case", sorted(CASES))
def test_terms_projected_once_match_eager(
    name: str, case: str, per_span: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tables clipped at a few rows (distances up to 33 reach past the clip), chunks of
    4 queries: the output without autograd equals the eager oracle's, each chunk's
    terms read from the projections made once for the call, or with
    ``QUERY_PROJECTION_WHOLE_BYTES`` 0 (``per_span``) the query side projected per
    chunk. Shaw's value term reads each chunk's weights, formed in place in its terms
    (``_chunk_weights``)."""
    pe = small_clip_module(name)
    set_runtime(monkeypatch, "SDPA_QUERY_CHUNK", {"cpu": 4}, pe)
    if per_span:
        set_runtime(monkeypatch, "QUERY_PROJECTION_WHOLE_BYTES", 0, pe)
    spans = spy_calls(monkeypatch, runtime_modules(pe), "terms_at_positions", lambda *args: args[3])
    by_rows = spy_calls(monkeypatch, runtime_modules(pe), "rows_major_projection", _side)
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, N, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, 2, M, 8, generator=generator, dtype=torch.float64) for _ in "kv")
    with torch.no_grad():
        got = pe(q, k, v, backend="sdpa", **CASES[case])
        want = pe(q, k, v, backend="eager", **CASES[case])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert [i1 - i0 for i0, i1, _, _ in spans] == [4, 4, 2]
    # a key-side term's projection is stored row by row for the gathers
    assert by_rows == ["key"] * (name in KEY_SIDE)


def _distinct_distances(q_positions: torch.Tensor, k_positions: torch.Tensor) -> int:
    """How many distinct key minus query positions the pairs have (over batch rows)."""
    queries = q_positions.reshape(-1, q_positions.shape[-1])  # [1 or B, r]
    keys = k_positions.reshape(-1, k_positions.shape[-1])  # [1 or B, w]
    return int((keys.unsqueeze(1) - queries.unsqueeze(2)).unique().numel())


@pytest.mark.parametrize("case", sorted(CASES))
def test_ranged_terms_match_eager(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Transformer-XL, whose rows are read by distance with no clip, in chunks of 4
    queries: the output without autograd equals the eager oracle's, and each chunk
    projects exactly the rows its own pairs read (``span_rows``: one per distinct
    distance, here positions 3 apart leave most of a chunk's range unread)."""
    pe = small_clip_module("transformer_xl")
    set_runtime(monkeypatch, "SDPA_QUERY_CHUNK", {"cpu": 4}, pe)
    spans: list[tuple[int, int, int, int]] = []
    spy_calls(monkeypatch, runtime_modules(pe), "span_part", lambda *args: spans.append(args[1]))
    span_rows = runtime_value("span_rows", pe)  # the rows a chunk projects: used [K']
    used = spy_calls(monkeypatch, runtime_modules(pe), "span_rows", lambda *a: span_rows(*a)[0])
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, N, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, 2, M, 8, generator=generator, dtype=torch.float64) for _ in "kv")
    with torch.no_grad():
        got = pe(q, k, v, backend="sdpa", **CASES[case])
        want = pe(q, k, v, backend="eager", **CASES[case])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # Transformer-XL's merged query-side term, then u . k per key: two parts per chunk
    chunks = spans[::2]
    assert [i1 - i0 for i0, i1, _, _ in chunks] == [4, 4, 2]
    k_positions = CASES[case].get("k_positions", TOKEN)
    q_positions = CASES[case].get("q_positions", k_positions[..., M - N :])  # the last N
    for (i0, i1, lo, hi), read in zip(chunks, used, strict=True):
        assert read.numel() == _distinct_distances(q_positions[..., i0:i1], k_positions[..., lo:hi])


def test_ranged_terms_far_apart_positions_stay_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    """Positions so far apart that the distances they reach pass
    ``RANGED_DIAGONALS_PER_POSITION`` per query and key: no factors over that range;
    the chunks build their terms at the distances present, and agree with the eager
    oracle."""
    pe = small_clip_module("transformer_xl")
    set_runtime(monkeypatch, "SDPA_QUERY_CHUNK", {"cpu": 4}, pe)
    calls = spy_calls(monkeypatch, runtime_modules(pe), "span_part", lambda *args: args[1])
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, N, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(1, 4, M, 8, generator=generator, dtype=torch.float64) for _ in "kv")
    given = {"q_positions": 50 * torch.arange(N), "k_positions": 50 * TOKEN + 7}
    with torch.no_grad():
        got = pe(q, k, v, backend="sdpa", **given)
        want = pe(q, k, v, backend="eager", **given)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert calls == []


TRAINING_CASES: dict[str, dict[str, Any]] = {
    **CASES,
    # the first 5 queries come before every key (the first chunk reads none): rows
    # that read no key give zeros
    "causal, rows without keys": {
        "q_positions": torch.arange(N),
        "k_positions": TOKEN + 5,
        "causal": True,
    },
    "float attn_mask": {"attn_mask": torch.randn(2, 1, N, M, generator=torch.Generator())},
}


@pytest.mark.parametrize("name", ["bert_relative_key", "bert_relative_key_query", "deberta"])
@pytest.mark.parametrize("case", sorted(TRAINING_CASES))
def test_trained_terms_at_positions_match_eager(
    name: str, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training step with terms clipped at a few rows, chunks of 4 queries, as one node
    over the chunks (``relative_attention_at_positions``; causal BERT relative_key, with
    no key-side term, per chunk): the output and the gradients of q, k, v and every
    parameter equal the eager oracle's (float64)."""
    pe = small_clip_module(name)
    set_runtime(monkeypatch, "SDPA_QUERY_CHUNK", {"cpu": 4}, pe)
    calls = spy_calls(
        monkeypatch, runtime_modules(pe), "relative_attention_at_positions", lambda *a: a[5]
    )
    by_rows = spy_calls(monkeypatch, runtime_modules(pe), "rows_major_projection", _side)
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, N, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, 2, M, 8, generator=generator, dtype=torch.float64) for _ in "kv")
    weights = torch.randn(2, 4, N, 8, generator=generator, dtype=torch.float64)
    grads = {}
    for backend in ("sdpa", "eager"):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        pe.zero_grad()
        out = pe(*inputs, backend=backend, **TRAINING_CASES[case])
        (out * weights).sum().backward()
        grads[backend] = [out, *(t.grad for t in inputs)]
        grads[backend] += [p.grad.clone() for p in pe.parameters() if p.grad is not None]
    assert len(grads["sdpa"]) == len(grads["eager"]) > 4  # the tables got gradients
    for got, want in zip(grads["sdpa"], grads["eager"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
    # causal with no key-side term, each chunk's own terms serve instead
    one_node = not (name == "bert_relative_key" and TRAINING_CASES[case].get("causal"))
    assert [[i1 - i0 for i0, i1, _, _ in spans] for spans in calls] == [[4, 4, 2]] * one_node
    assert by_rows == ["key"] * (name in KEY_SIDE)


@pytest.mark.parametrize("case", sorted(TRAINING_CASES))
def test_trained_ranged_terms_match_eager(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Transformer-XL training step (rows read by distance with no clip), chunks of 4
    queries, as one node over the chunks (``ranged_attention_at_positions``), each
    projecting its queries over the rows its pairs read in the forward and again in the
    backward: the output and the gradients of q, k, v and every parameter (W_R, u, v)
    equal the eager oracle's (float64)."""
    pe = small_clip_module("transformer_xl")
    set_runtime(monkeypatch, "SDPA_QUERY_CHUNK", {"cpu": 4}, pe)
    calls = spy_calls(
        monkeypatch, runtime_modules(pe), "ranged_attention_at_positions", lambda *a: a[6]
    )
    assert_sdpa_matches_eager(pe, N, M, 2, **TRAINING_CASES[case])
    assert sum(p.grad is not None for p in pe.parameters()) == 3  # W_R, u and v trained
    assert [[i1 - i0 for i0, i1, _, _ in spans] for spans in calls] == [[4, 4, 2]]


def test_trained_ranged_terms_far_apart_positions_stay_per_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A training step at positions whose distances pass
    ``RANGED_DIAGONALS_PER_POSITION`` per query and key: no node over that range; each
    chunk builds its terms through autograd, and the gradients agree with the eager
    oracle's."""
    pe = small_clip_module("transformer_xl")
    set_runtime(monkeypatch, "SDPA_QUERY_CHUNK", {"cpu": 4}, pe)
    calls = spy_calls(monkeypatch, runtime_modules(pe), "attention_at_positions", lambda *a: 1)
    given = {"q_positions": 50 * torch.arange(N), "k_positions": 50 * TOKEN + 7}
    assert_sdpa_matches_eager(pe, N, M, 4, **given)
    assert calls == []


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize(
    "given", [{"window": 3}, {"document_ids": (TOKEN >= 5).long()}], ids=["window", "documents"]
)
def test_unclipped_terms_under_a_window_or_documents_go_per_chunk(
    given: dict[str, Any], train: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Transformer-XL at default positions (no clip: the parts would project every
    query over all N + M - 1 diagonals) under a window or documents, not causal: each
    chunk of 4 queries projects its own rows, from factors made once per call without
    autograd (``ranged_span_terms``) or in one node when training
    (``ranged_attention_at_positions``), never through ``_sdpa_relative_parts``; the
    output and gradients equal the eager oracle's (float64)."""
    pe = small_clip_module("transformer_xl")
    set_runtime(monkeypatch, "SDPA_QUERY_CHUNK", {"cpu": 4}, pe)
    set_runtime(monkeypatch, "FEW_QUERY_RELATIVE_MAX_QUERIES", 2, pe)  # 12 are not few
    parts = spy_method(monkeypatch, type(pe), "_sdpa_relative_parts", lambda *a, **k: 1)
    ranged = spy_calls(monkeypatch, runtime_modules(pe), "ranged_span_terms", lambda *a: 1)
    node = spy_calls(
        monkeypatch, runtime_modules(pe), "ranged_attention_at_positions", lambda *a: 1
    )
    if train:
        assert_sdpa_matches_eager(pe, M, M, 2, **given)
    else:
        generator = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(2, 4, M, 8, generator=generator, dtype=torch.float64) for _ in "qkv")
        with torch.no_grad():
            got = pe(q, k, v, backend="sdpa", **given)
            want = pe(q, k, v, backend="eager", **given)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert (parts, ranged, node) == ([], [1] * (not train), [1] * train)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "given", [{"window": 3}, {"document_ids": (TOKEN >= 5).long()}], ids=["window", "documents"]
)
@pytest.mark.parametrize("name", ["bert_relative_key", "bert_relative_key_query", "deberta"])
def test_clipped_terms_train_per_chunk_under_a_window_or_documents(
    name: str, given: dict[str, Any], causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training step with clipped terms at default positions under a window or
    documents: its chunks of 4 queries run as one node
    (``relative_attention_at_positions``) rather than gathering their terms from
    projections of every query through autograd (``_sdpa_relative_parts``); BERT
    relative_key's causal step, with no key-side term, builds each chunk's own terms
    (``relative_parts_serve``). The output and gradients equal the eager oracle's
    (float64)."""
    pe = small_clip_module(name)
    set_runtime(monkeypatch, "SDPA_QUERY_CHUNK", {"cpu": 4}, pe)
    set_runtime(monkeypatch, "FEW_QUERY_RELATIVE_MAX_QUERIES", 2, pe)  # 12 are not few
    parts = spy_method(monkeypatch, type(pe), "_sdpa_relative_parts", lambda *a, **k: 1)
    node = spy_calls(
        monkeypatch, runtime_modules(pe), "relative_attention_at_positions", lambda *a: 1
    )
    assert_sdpa_matches_eager(pe, M, M, 2, causal=causal, **given)
    assert parts == []
    assert node == [1] * (not (causal and name == "bert_relative_key"))


def _side(factor: Any) -> str:
    """The side of a ``RelativeFactors`` (a ``spy_calls`` record)."""
    return str(factor.side)


@pytest.mark.parametrize("batched", [False, True])
def test_a_key_side_projection_reads_and_trains_alike_in_either_layout(batched: bool) -> None:
    """``flat_key_side`` reads each pair's entry k_j . R_row alike from a key-side
    projection stored row by row (``rows_major_projection``: [B, H, K, M] under a
    [B, H, M, K] view) and key by key, and a gradient added through its flat index
    lands on the same entries; both against indexing the [B, H, M, K] tensor."""
    runtime = importlib.import_module("generated._clipped_relative")
    terms = importlib.import_module("generated._terms")
    generator = torch.Generator().manual_seed(4)
    batch, heads, m, rows_count, r = 2, 3, 6, 5, 4
    x = torch.randn(batch, heads, m, 8, generator=generator, dtype=torch.float64)
    rows = torch.randn(rows_count, heads, 8, generator=generator, dtype=torch.float64)
    factor = terms.RelativeFactors("key", x, rows, torch.arange(rows_count), 1.0)
    by_rows = runtime.rows_major_projection(factor).scores  # [B, H, M, K]
    by_keys = terms.project_factors(factor).scores
    assert runtime.rows_major(by_rows) and not runtime.rows_major(by_keys)
    torch.testing.assert_close(by_rows, by_keys, rtol=1e-12, atol=1e-12)
    keys = torch.tensor([[1, 2, 4]])  # [1, w]
    read = torch.randint(0, rows_count, (batch if batched else 1, 1, r, 3), generator=generator)
    grad = torch.randn(batch, heads, r * 3, generator=generator, dtype=torch.float64)
    pairs = (  # [B, H, r, w] each: the entry [b, h, key, row] of every pair
        torch.arange(batch)[:, None, None, None].expand(batch, heads, r, 3),
        torch.arange(heads)[None, :, None, None].expand(batch, heads, r, 3),
        keys[None, None].expand(batch, heads, r, 3),
        read.expand(batch, heads, r, 3),
    )
    want_grad = torch.zeros_like(by_keys).index_put_(pairs, grad.view(batch, heads, r, 3), True)
    for scores in (by_rows, by_keys):
        flat_scores, flat = runtime.flat_key_side(scores, keys, read)
        index = flat.expand(batch, heads, -1)
        got = torch.gather(flat_scores, -1, index).view(batch, heads, r, 3)
        torch.testing.assert_close(got, scores[pairs], rtol=0, atol=0)
        got_grad = torch.zeros_like(scores)  # laid out as scores
        flat_grad, _ = runtime.flat_key_side(got_grad, keys, read)
        flat_grad.scatter_add_(-1, index, grad)
        torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-15)


def test_softmax_in_place_matches_a_float64_softmax_with_masked_rows() -> None:
    """``masked_softmax_`` (the weights of a chunk with a value term, formed in its
    terms): a float64 softmax per row, and zeros for a row whose every key is masked,
    written into the logits themselves."""
    masks = importlib.import_module("generated._masks")
    generator = torch.Generator().manual_seed(5)
    logits = 30 * torch.randn(2, 3, 5, 7, generator=generator, dtype=torch.float64)
    logits[0, 1, 2] = float("-inf")  # a row that reads no key
    logits[1, 0, :, :3] = float("-inf")
    want = torch.where(
        torch.isinf(logits).all(-1, keepdim=True), 0.0, torch.softmax(logits, dim=-1)
    )
    got = masks.masked_softmax_(logits)
    assert got.data_ptr() == logits.data_ptr()
    torch.testing.assert_close(got, want.nan_to_num(0.0), rtol=1e-12, atol=0.0)


def test_softmax_node_in_place_gives_softmaxs_weights_and_gradients() -> None:
    """``masked_softmax_in_place`` (Shaw's weights through autograd, formed in the fresh
    logits): the weights and the gradients reaching what the logits were made from
    equal those of autograd through a float64 softmax with masked rows zeroed, a row
    that reads no key giving zeros and no NaN."""
    masks = importlib.import_module("generated._masks")
    generator = torch.Generator().manual_seed(6)
    content = (
        5 * torch.randn(2, 3, 5, 7, generator=generator, dtype=torch.float64)
    ).requires_grad_()
    mask = torch.zeros(2, 3, 5, 7, dtype=torch.float64)
    mask[0, 1, 2] = float("-inf")  # a row that reads no key
    mask[1, 0, :, :3] = float("-inf")
    mask = mask.requires_grad_()  # a trained bias
    cotangent = torch.randn(2, 3, 5, 7, generator=generator, dtype=torch.float64)

    logits = content + mask
    got = masks.masked_softmax_in_place(logits)
    assert got.data_ptr() == logits.data_ptr()  # formed in the logits' storage
    got_grads = torch.autograd.grad((got * cotangent).sum(), [content, mask])

    leaves = [t.detach().clone().requires_grad_() for t in (content, mask)]
    reference = leaves[0] + leaves[1]
    dead = torch.isneginf(reference.detach()).all(-1, keepdim=True)
    want = torch.softmax(reference.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    want_grads = torch.autograd.grad((want * cotangent).sum(), leaves)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0.0)
    for grad, want_grad in zip(got_grads, want_grads, strict=True):
        assert not grad.isnan().any()
        torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-14)
