"""A position bias per pair on the CPU sdpa backend where masking follows positions or
the caller's masks (explicit positions, attn_mask, documents): a chunk of queries at a
time over every key (``_sdpa_bias_in_chunks``), against the eager oracle with gradients
into q, k, v, the module's parameters and a float attn_mask; rows that read no key
included."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.conftest import assert_sdpa_matches_eager, generated_class, spy_method

masks = importlib.import_module("generated._masks")
recomputed = importlib.import_module("generated._recomputed_mask")

N, M = 10, 12
TOKEN = torch.arange(M)
EMPTY_ROW = torch.ones(N, M, dtype=torch.bool)
EMPTY_ROW[3] = False  # query 3 reads no key

# explicit positions: keys 1 .. M and queries 4 .. N + 3, one further along than the
# last N keys (so no shift of the defaults, which take the defaults' paths)
CASES = {
    "explicit positions": {"q_positions": torch.arange(4, 4 + N), "k_positions": TOKEN + 1},
    "batched positions": {"k_positions": torch.stack([TOKEN, 2 * TOKEN])},
    "attn_mask, a row reading nothing": {"attn_mask": EMPTY_ROW},
    "attn_mask, causal": {"attn_mask": EMPTY_ROW, "causal": True},
    "documents": {"document_ids": (TOKEN >= 5).long()},
    "positions, causal and window": {
        "q_positions": torch.arange(4, 4 + N),
        "k_positions": TOKEN + 1,
        "causal": True,
        "window": 4,
    },
}


def _spy_span_counts(monkeypatch, cls: type, method: str) -> list[int]:
    """The number of spans of each call of the chunk method ``method`` of ``cls``
    (called as (self, q, k, v, spans, ...)); each call still runs."""
    return spy_method(monkeypatch, cls, method, lambda q, k, v, spans, *_: len(spans))


@pytest.mark.parametrize("name", ["alibi", "t5", "kerple_log", "fire"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("node", [False, True])
def test_chunks_of_a_bias_per_pair_match_eager(
    name: str, case: str, node: bool, monkeypatch
) -> None:
    """Chunks of 4 queries (three spans, over every key but where documents or a causal
    mask at default positions narrow them); per-chunk SDPA calls, or with
    ``node`` the recomputed-mask node for the masks that train: outputs and gradients
    equal the eager oracle's (float64)."""
    monkeypatch.setitem(masks.SDPA_QUERY_CHUNK, "cpu", 4)
    if node:
        monkeypatch.setattr(recomputed, "RECOMPUTED_MASK_MIN_KEYS", 1)
    cls = generated_class(name)
    spans = _spy_span_counts(monkeypatch, cls, "_sdpa_bias_in_chunks")
    torch.manual_seed(0)
    pe = cls(heads=4, head_dim=8).double()
    assert_sdpa_matches_eager(pe, N, M, 2, **CASES[case])
    assert spans == [3]  # one call, in three spans


@pytest.mark.parametrize(
    ("case", "budget_rows", "min_rows", "chunk_rows"),
    [
        ("explicit positions", 3, 1, 3),  # a row of [1, H, 1, M]: three rows fit
        ("batched positions", 3, 1, 1),  # a row of [B, H, 1, M], B = 2: one fits
        ("explicit positions", 1, 2, 2),  # never fewer than the least rows
    ],
)
def test_chunks_whose_masks_are_their_own_fit_the_byte_budget(
    case: str, budget_rows: int, min_rows: int, chunk_rows: int, monkeypatch
) -> None:
    """Each chunk of queries builds its own bias, so chunks are cut to queries whose
    float64 mask rows (heads x keys x 8 bytes, times the batch where positions are
    batched) fit ``SDPA_MASK_CHUNK_BYTES``, never below ``SDPA_MASK_CHUNK_MIN_ROWS``,
    with ``SDPA_QUERY_CHUNK`` left at its default (which would take all 10 queries at
    once); outputs and gradients still equal the eager oracle's."""
    heads = 4
    monkeypatch.setitem(masks.SDPA_MASK_CHUNK_BYTES, "cpu", budget_rows * heads * M * 8)
    monkeypatch.setattr(masks, "SDPA_MASK_CHUNK_MIN_ROWS", min_rows)
    cls = generated_class("t5")
    spans = _spy_span_counts(monkeypatch, cls, "_sdpa_bias_in_chunks")
    torch.manual_seed(0)
    pe = cls(heads=heads, head_dim=8).double()
    assert_sdpa_matches_eager(pe, N, M, 2, **CASES[case])
    assert spans == [-(-N // chunk_rows)]  # one call, in ceil(N / rows) spans


def test_the_mask_budget_never_lengthens_a_chunk() -> None:
    """A mask row of one byte leaves ``SDPA_QUERY_CHUNK`` as the chunk; a device with no
    budget is not cut."""
    chunk = masks.SDPA_QUERY_CHUNK["cpu"]
    spans = masks.query_chunks(3 * chunk, 3 * chunk, "cpu", False, None, mask_row_bytes=1)
    assert [i1 - i0 for i0, i1, _, _ in spans] == [chunk] * 3
    assert masks.mask_chunk_rows("no such device", 1 << 40) >= 1 << 40


def test_a_float_attn_mask_gets_its_gradient(monkeypatch) -> None:
    """A trained float attn_mask beside FIRE's trained bias, through the recomputed-mask
    node: its gradient equals the eager oracle's."""
    monkeypatch.setitem(masks.SDPA_QUERY_CHUNK, "cpu", 4)
    monkeypatch.setattr(recomputed, "RECOMPUTED_MASK_MIN_KEYS", 1)
    calls: list[int] = []
    backend = importlib.import_module("generated._sdpa_chunks")
    original = backend.recomputed_mask_attention

    def spy(q, k, v, spans, mask_of, scale, inputs):
        calls.append(len(inputs))
        return original(q, k, v, spans, mask_of, scale, inputs)

    monkeypatch.setattr(backend, "recomputed_mask_attention", spy)
    torch.manual_seed(0)
    pe = generated_class("fire")(heads=4, head_dim=8).double()
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, N, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(1, 4, M, 8, generator=generator, dtype=torch.float64) for _ in "kv")
    mask = torch.randn(4, N, M, generator=generator, dtype=torch.float64)
    grads = []
    for name in ("sdpa", "eager"):
        leaf = mask.clone().requires_grad_()
        out = pe(q, k, v, attn_mask=leaf, backend=name)
        (grad,) = torch.autograd.grad(out.square().sum(), leaf)
        grads.append(grad)
    assert calls == [len(list(pe.parameters())) + 1]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("name", ["bert_relative_key", "deberta", "transformer_xl", "shaw"])
@pytest.mark.parametrize("case", sorted(set(CASES) - {"documents"}))
def test_chunks_of_relative_terms_match_eager(name: str, case: str, monkeypatch) -> None:
    """Relative terms (and Shaw's value term) at explicit positions or with an
    attn_mask, chunks of 4 queries over every key (``_sdpa_relative_in_chunks``):
    outputs and gradients equal the eager oracle's (float64)."""
    monkeypatch.setitem(masks.SDPA_QUERY_CHUNK, "cpu", 4)
    cls = generated_class(name)
    spans = _spy_span_counts(monkeypatch, cls, "_sdpa_relative_in_chunks")
    torch.manual_seed(0)
    pe = cls(heads=4, head_dim=8).double()
    assert_sdpa_matches_eager(pe, N, M, 2, **CASES[case])
    assert spans == [3]  # one call, in three spans


@pytest.mark.parametrize("name", ["alibi", "fire"])
def test_spans_that_skip_keys_take_their_part_of_every_mask(name: str) -> None:
    """``_sdpa_bias_in_chunks`` over spans that each read a window of the keys, with
    documents and an attn_mask: each span's bias, documents and attn_mask columns are
    its keys', so the result equals the eager oracle with the keys outside each span
    masked as well (float64)."""
    spans = [(0, 3, 0, 5), (3, 7, 1, 9), (7, 10, 2, 12)]
    outside = torch.ones(N, M, dtype=torch.bool)
    for i0, i1, lo, hi in spans:
        outside[i0:i1, lo:hi] = False
    documents = (TOKEN >= 4).long()
    allowed = torch.rand(N, M, generator=torch.Generator().manual_seed(4)) > 0.2
    allowed[torch.arange(N), torch.arange(N) + M - N] = True  # each query's own key
    torch.manual_seed(0)
    pe = generated_class(name)(heads=4, head_dim=8).double()
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, N, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, 4, M, 8, generator=generator, dtype=torch.float64) for _ in "kv")
    masked = {"attn_mask": allowed & ~outside, "document_ids": documents}
    given = {"q_positions": 2 * TOKEN[M - N :], "k_positions": 2 * TOKEN}  # no shift of them
    for positions in ({}, given):
        at = (positions.get("q_positions"), positions.get("k_positions"))
        with torch.no_grad():
            got = pe._sdpa_bias_in_chunks(q, k, v, spans, *at, False, None, documents, allowed)
            want = pe(q, k, v, **masked, **positions, backend="eager")
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    masks_module = importlib.import_module("generated._masks")
    mask = torch.arange(N * M).view(N, M)
    assert torch.equal(masks_module.attn_mask_span(mask, N, M, 3, 7, 1, 9), mask[3:7, 1:9])
    row = mask[:1]  # a row that broadcasts stays whole along the queries
    assert torch.equal(masks_module.attn_mask_span(row, N, M, 3, 7, 1, 9), row[:, 1:9])
