"""CPU sdpa in query chunks (``SDPA_QUERY_CHUNK``, ``query_chunks``, ``key_span``):
where a mask or a trained bias would make SDPA do work it cannot skip, the queries go a
chunk at a time, each against only the keys it may read. Biases of j - i alone (ALiBi,
T5, KERPLE) take a strided view of a slice of the per-distance vector per chunk;
encodings without a bias a slice of the boolean mask; other biases and relative terms
(FIRE, BERT, DeBERTa, Transformer-XL, CoPE, Shaw) are built per chunk at the chunk's
explicit positions. Every case is checked against the eager oracle, outputs and
gradients.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import assert_sdpa_matches_eager, generated_class

runtime = importlib.import_module("generated._sdpa_backend")
chunks = importlib.import_module("generated._sdpa_chunks")
masks = importlib.import_module("generated._masks")
trained = importlib.import_module("generated._trained_bias")
relative = importlib.import_module("generated._sdpa_relative")


CHUNK_CASES = [  # (n, m, kv_heads, causal, window)
    (10, 10, 4, True, None),
    (7, 12, 2, True, None),
    (10, 10, 4, False, 3),
    (7, 12, 1, True, 4),
    (9, 9, 4, False, None),  # trained tables (T5, KERPLE): chunked for the gradient
    (9, 9, 2, True, None),  # bias-free: SDPA's own causal mask, one call
]


ENCODINGS = [
    "alibi",  # fixed bias of j - i: its per-distance vector
    "t5",  # trained bias of j - i
    "kerple_log",
    "rope",  # no bias: a slice of the boolean mask
    "nope",
    "fire",  # a bias of positions: built per chunk at the chunk's positions
    "bert_relative_key",  # relative terms: per chunk at the chunk's positions
    "deberta",
    "transformer_xl",
    "cope",
    "shaw",  # a value term: the weights per chunk, no SDPA call
]


@pytest.mark.parametrize("name", ENCODINGS)
@pytest.mark.parametrize(("n", "m", "kv_heads", "causal", "window"), CHUNK_CASES)
def test_query_chunks_match_eager_with_gradients(
    name: str, n: int, m: int, kv_heads: int, causal: bool, window: int | None, monkeypatch
) -> None:
    monkeypatch.setitem(masks.SDPA_QUERY_CHUNK, "cpu", 3)
    key_counts: list[int] = []  # keys per attention call: SDPA, or trained-mask attention
    original = runtime.F.scaled_dot_product_attention
    original_trained = chunks.trained_mask_attention

    def spy(q, k, v, **kwargs):
        key_counts.append(k.shape[2])
        return original(q, k, v, **kwargs)

    def spy_trained(q, k, v, mask, scale):
        key_counts.append(k.shape[2])
        return original_trained(q, k, v, mask, scale)

    original_flash = chunks.chunked_flash_attention
    original_recomputed = chunks.recomputed_mask_attention

    def spy_flash(q, k, v, spans, *args):  # a training step's chunks as one node
        key_counts.extend(hi - lo for _, _, lo, hi in spans)
        return original_flash(q, k, v, spans, *args)

    def spy_recomputed(q, k, v, spans, *args):  # the same, where the masks train
        key_counts.extend(hi - lo for _, _, lo, hi in spans)
        return original_recomputed(q, k, v, spans, *args)

    original_positioned = relative.relative_attention_at_positions

    def spy_positioned(q, k, v, parts, clip, spans, *args):  # the same, clipped terms
        key_counts.extend(hi - lo for _, _, lo, hi in spans)
        return original_positioned(q, k, v, parts, clip, spans, *args)

    original_ranged = relative.ranged_attention_at_positions

    def spy_ranged(q, k, v, factors, diagonals, bounds, spans, *args):  # unclipped terms
        key_counts.extend(hi - lo for _, _, lo, hi in spans)
        return original_ranged(q, k, v, factors, diagonals, bounds, spans, *args)

    original_counted = relative.counted_position_attention

    def spy_counted(q, k, v, table, counted_chunks):  # the same, CoPE's counted terms
        key_counts.extend(hi - lo for _, _, lo, hi in counted_chunks.spans)
        return original_counted(q, k, v, table, counted_chunks)

    torch.manual_seed(0)
    pe = generated_class(name)(heads=4, head_dim=8).double()
    monkeypatch.setattr(runtime.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(chunks, "trained_mask_attention", spy_trained)
    monkeypatch.setattr(chunks, "chunked_flash_attention", spy_flash)
    monkeypatch.setattr(chunks, "recomputed_mask_attention", spy_recomputed)
    monkeypatch.setattr(relative, "relative_attention_at_positions", spy_positioned)
    monkeypatch.setattr(relative, "ranged_attention_at_positions", spy_ranged)
    monkeypatch.setattr(relative, "counted_position_attention", spy_counted)
    assert_sdpa_matches_eager(pe, n, m, kv_heads, causal=causal, window=window)
    if pe.has_value_term:
        return  # no SDPA call to count
    masked = causal or window is not None
    plain = not (pe.has_position_bias or pe.has_relative_terms)
    trained_by_distance = pe.bias_by_distance and any(True for _ in pe.parameters())
    of_positions = pe.has_position_bias and not pe.bias_by_distance  # FIRE: per chunk
    counted = name == "cope"  # a node over query chunks, masked or not (its buffers)
    if plain and causal and window is None and n == m:  # SDPA's own is_causal, no mask
        assert key_counts == [m]
    elif masked or trained_by_distance or of_positions or counted:
        assert len(key_counts) == -(-n // 3)  # one call per chunk of 3 queries
        if masked:
            assert min(key_counts) < m  # masked keys are not read
    else:
        assert key_counts == [m]


@pytest.mark.parametrize(("n", "m"), [(6, 6), (4, 9)])
@pytest.mark.parametrize(("causal", "window"), [(True, None), (False, 2), (True, 3), (False, 20)])
def test_key_span_is_exactly_the_keys_some_query_may_read(
    n: int, m: int, causal: bool, window: int | None
) -> None:
    allowed = masks.attention_allowed(None, None, n, m, torch.device("cpu"), causal, window, None)
    for i0 in range(n):
        for i1 in range(i0 + 1, n + 1):
            readable = allowed[i0:i1].any(0).nonzero().flatten().tolist()
            lo, hi = masks.key_span(i0, i1, n, m, causal, window)
            assert readable == list(range(lo, hi)), (i0, i1)


@pytest.mark.parametrize("name", ["alibi", "t5", "rope"])
def test_query_chunks_in_bfloat16_stay_within_bfloat16_error(name: str, monkeypatch) -> None:
    """bf16 through the chunked calls against the float32 oracle on the same bf16
    inputs: outputs and gradients within bf16 error."""
    monkeypatch.setitem(masks.SDPA_QUERY_CHUNK, "cpu", 5)
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


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    name=st.sampled_from(["alibi", "t5", "rope", "fire", "deberta", "transformer_xl", "shaw"]),
    n=st.integers(1, 12),
    extra_keys=st.integers(0, 6),
    causal=st.booleans(),
    window=st.sampled_from([None, 1, 2, 5, 40]),
    chunk=st.integers(1, 5),
    kv_heads=st.sampled_from([1, 2, 4]),
)
def test_any_chunking_matches_eager(
    name: str,
    n: int,
    extra_keys: int,
    causal: bool,
    window: int | None,
    chunk: int,
    kv_heads: int,
) -> None:
    """Random shapes, masks and chunk sizes: the chunked sdpa paths give the eager
    oracle's outputs and gradients (float64)."""
    chunks = dict(masks.SDPA_QUERY_CHUNK)
    masks.SDPA_QUERY_CHUNK["cpu"] = chunk
    try:
        torch.manual_seed(0)
        pe = generated_class(name)(heads=4, head_dim=8).double()
        assert_sdpa_matches_eager(pe, n, n + extra_keys, kv_heads, causal=causal, window=window)
    finally:
        masks.SDPA_QUERY_CHUNK.clear()
        masks.SDPA_QUERY_CHUNK.update(chunks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_trained_mask_attention_equals_sdpa_with_gradients(
    dtype: torch.dtype, kv_heads: int
) -> None:
    """The three-op attention that replaces SDPA's math kernel for a mask that needs a
    gradient gives SDPA's outputs and gradients (into q, k, v and the mask), with
    grouped-query heads, a batch-broadcast mask and -inf entries (each row keeps one)."""
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 5, 8, generator=generator, dtype=dtype)
    k, v = (torch.randn(2, kv_heads, 7, 8, generator=generator, dtype=dtype) for _ in "kv")
    bias = torch.randn(1, 4, 5, 7, generator=generator, dtype=dtype)
    bias[..., 0:2, 5:] = float("-inf")  # masked keys, every row keeps others
    cotangent = torch.randn(2, 4, 5, 8, generator=generator, dtype=dtype)
    grads = []
    for attend in ("runtime", "sdpa"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        assert trained.trained_mask_attention_serves(leaves[0], leaves[3])
        if attend == "runtime":
            out = trained.trained_mask_attention(*leaves, 0.3)
        else:
            gqa = {"enable_gqa": True} if kv_heads != 4 else {}
            out = torch.nn.functional.scaled_dot_product_attention(
                *leaves[:3], attn_mask=leaves[3], scale=0.3, **gqa
            )
        grads.append((out, *torch.autograd.grad(out, leaves, cotangent)))
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(
    ("name", "m", "window", "train", "chunk"),
    [
        ("alibi", 12, None, False, 4),  # the per-distance vector's view
        ("alibi", 12, None, True, 4),  # ... in a training step (one autograd node)
        ("t5", 12, None, True, 2),  # a trained vector: each chunk's scores are its own
        ("rope", 14, None, False, 4),  # the boolean grid's view (queries last N of M)
        ("rope", 12, 3, False, 2),  # a window keeps the short chunks
        ("fire", 12, None, False, 2),  # a bias built per chunk
    ],
)
def test_long_sequences_take_long_chunks_where_masks_are_views(
    name: str, m: int, window: int | None, train: bool, chunk: int, monkeypatch
) -> None:
    """From ``SDPA_LONG_QUERY_CHUNK``'s query count on, chunks whose masks are views of
    one tensor (a per-distance vector that needs no gradient, the boolean grid) grow to
    its chunk size; a window, a trained vector and a bias built per chunk keep
    ``SDPA_QUERY_CHUNK``. Outputs and gradients stay the eager oracle's."""
    monkeypatch.setitem(masks.SDPA_QUERY_CHUNK, "cpu", 2)
    monkeypatch.setitem(masks.SDPA_LONG_QUERY_CHUNK, "cpu", (12, 4))
    widths: list[int] = []  # the widest chunk of each chunked call
    original = chunks.SdpaChunks._sdpa_in_chunks

    def spy(self, q, k, v, spans, *args, **kwargs):
        widths.append(max(i1 - i0 for i0, i1, _, _ in spans))
        return original(self, q, k, v, spans, *args, **kwargs)

    monkeypatch.setattr(chunks.SdpaChunks, "_sdpa_in_chunks", spy)
    torch.manual_seed(0)
    pe = generated_class(name)(heads=4, head_dim=8).double()
    if not train:
        for parameter in pe.parameters():
            parameter.requires_grad_(False)
    assert_sdpa_matches_eager(pe, 12, m, 2, causal=True, window=window)
    assert widths and set(widths) == {chunk}
    assert masks.query_chunks(11, 11, "cpu", True, None, views=True)[0][1] == 2  # below 12
