"""Relative terms clipped at a distance on the CPU's sdpa backend: a band of exact terms
plus the far keys as flash attention with extra features (``clipped_relative_attention``).

The path is checked against the paper's formula written out in float64 (Shaw et al.
2018, tests/reference/formulas.py) and, outputs and gradients into q, k, v and every
parameter, against the eager oracle for each kind of relative term: query-side
(BERT relative_key), both sides (relative_key_query, DeBERTa's c2p and p2c) and a
value-side term (Shaw's), at clips small enough that far keys lie on both sides.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import (
    assert_sdpa_matches_eager,
    assert_sdpa_matches_eager_without_trained_terms,
    generated_class,
    runtime_modules,
    set_runtime,
    small_clip_module,
    spec_names,
    spy_calls,
    spy_query_shapes,
)
from tests.reference import formulas

clipped = importlib.import_module("generated._clipped_relative")
F64 = torch.float64


def make(name: str, **options: int) -> torch.nn.Module:
    return small_clip_module(name, **options)


def serve_short(monkeypatch: pytest.MonkeyPatch, pe: torch.nn.Module, rows: int = 8) -> None:
    """``pe``'s clipped path in chunks of ``rows`` queries, at any number of keys (the
    least count only weighs speed)."""
    set_runtime(monkeypatch, "CLIPPED_RELATIVE_QUERY_CHUNK", rows, pe)
    set_runtime(monkeypatch, "CLIPPED_RELATIVE_MIN_KEYS", {False: 0, True: 0}, pe)
    set_runtime(monkeypatch, "CLIPPED_RELATIVE_MIN_QUERIES", 0, pe)


NAMES = ["shaw", "bert_relative_key", "bert_relative_key_query", "deberta"]
SHAPES = [  # (n, m, kv_heads): far keys on both sides, N < M, one query, odd chunks
    (40, 40, 4),
    (25, 50, 2),
    (1, 45, 1),
    (37, 41, 4),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("n", "m", "kv_heads"), SHAPES)
@pytest.mark.parametrize("name", NAMES)
def test_the_clipped_path_matches_eager_with_gradients(
    name: str, n: int, m: int, kv_heads: int, causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    pe = make(name)
    serve_short(monkeypatch, pe)
    route = spy_query_shapes(monkeypatch, pe, "clipped_relative_attention")
    assert pe.relative_clip is not None
    assert_sdpa_matches_eager(pe, n, m, kv_heads, causal=causal)
    assert route == [(2, 4, n, 8)]  # the sdpa call took the path


@pytest.mark.parametrize("causal", [False, True])
def test_shaw_on_the_clipped_path_matches_the_paper_formula(causal: bool, monkeypatch) -> None:
    """The catalogue's Shaw (clip 16) at 60 tokens, against z_i = sum_j a_ij (v_j +
    R^V[clip(j - i)]) with a_ij = softmax(q_i . (k_j + R^K[clip(j - i)]) / sqrt(d))."""
    pe = generated_class("shaw")(heads=2, head_dim=4).double()
    serve_short(monkeypatch, pe, rows=16)
    route = spy_query_shapes(monkeypatch, pe, "clipped_relative_attention")
    q, k, v = (torch.randn(2, 2, 60, 4, dtype=F64) for _ in range(3))
    rel_k, rel_v = torch.randn(33, 4, dtype=F64), torch.randn(33, 4, dtype=F64)
    with torch.no_grad():
        pe.distance_embedding.weight.copy_(rel_k)
        pe.value_embedding.weight.copy_(rel_v)
    expected = formulas.shaw_relative_attention(q, k, v, rel_k, rel_v, clip=16, causal=causal)
    out = pe(q, k, v, causal=causal, backend="sdpa")
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)
    assert route == [(2, 2, 60, 4)]


@pytest.mark.parametrize("value_dim", [5, 13])
def test_a_value_width_other_than_the_head_width(value_dim: int, monkeypatch) -> None:
    # 5: the values are padded to the keys' width; 13: the queries and keys to the values'
    pe = make("shaw", value_dim=value_dim)
    serve_short(monkeypatch, pe)
    route = spy_query_shapes(monkeypatch, pe, "clipped_relative_attention")
    generator = torch.Generator().manual_seed(4)
    q, k = (torch.randn(2, 4, 30, 8, generator=generator, dtype=F64) for _ in range(2))
    v = torch.randn(2, 4, 30, value_dim, generator=generator, dtype=F64, requires_grad=True)
    for causal in (False, True):
        want = pe(q, k, v, causal=causal, backend="eager")
        got = pe(q, k, v, causal=causal, backend="sdpa")
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        (want_grad,) = torch.autograd.grad(want.square().sum(), v)
        (got_grad,) = torch.autograd.grad(got.square().sum(), v)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)
    assert len(route) == 2


@pytest.mark.parametrize("per_span", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_frozen_tables_and_no_gradients(name: str, per_span: bool, monkeypatch) -> None:
    """Tables that do not train: the band's terms are made per chunk, in the backward
    again; without any gradient the values carry no column of ones. With
    ``QUERY_PROJECTION_WHOLE_BYTES`` 0 (``per_span``) each chunk projects its own
    queries."""
    pe = make(name)
    pe.requires_grad_(False)
    serve_short(monkeypatch, pe)
    if per_span:
        set_runtime(monkeypatch, "QUERY_PROJECTION_WHOLE_BYTES", 0, pe)
    route = spy_query_shapes(monkeypatch, pe, "clipped_relative_attention")
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 30, 8, generator=generator, dtype=F64, requires_grad=True)
    k, v = (torch.randn(2, 2, 40, 8, generator=generator, dtype=F64) for _ in range(2))
    k.requires_grad_()
    assert_sdpa_matches_eager_without_trained_terms(pe, q, k, v)
    assert len(route) == 4


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(["shaw", "bert_relative_key_query", "deberta"]),
    n=st.integers(1, 45),
    extra_keys=st.integers(0, 30),
    chunk=st.integers(1, 50),
    kv_heads=st.sampled_from([1, 2, 4]),
    causal=st.booleans(),
)
def test_any_length_and_chunking_match_eager(name, n, extra_keys, chunk, kv_heads, causal) -> None:
    """Exact at every length, with far keys or none (the least keys per clip only weighs
    speed, so it is lifted here), and any chunking."""
    pe = make(name)
    settings_now = {
        "CLIPPED_RELATIVE_QUERY_CHUNK": chunk,
        "CLIPPED_RELATIVE_MIN_KEYS_PER_CLIP": {False: 0, True: 0},
        "CLIPPED_RELATIVE_MIN_KEYS": {False: 0, True: 0},
        "CLIPPED_RELATIVE_MIN_QUERIES": 0,
    }
    modules = [module for module in runtime_modules(pe) if hasattr(module, "band_spans")]
    saved = [{key: getattr(module, key) for key in settings_now} for module in modules]
    try:
        for module in modules:
            for key, value in settings_now.items():
                setattr(module, key, value)
        assert_sdpa_matches_eager(pe, n, n + extra_keys, kv_heads, causal=causal)
    finally:
        for module, values in zip(modules, saved, strict=True):
            for key, value in values.items():
                setattr(module, key, value)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["shaw", "bert_relative_key_query"])
def test_float32_stays_within_float32_error(name: str, causal: bool, monkeypatch) -> None:
    pe = generated_class(name)(heads=2, head_dim=16)
    serve_short(monkeypatch, pe, rows=32)
    route = spy_query_shapes(monkeypatch, pe, "clipped_relative_attention")
    m = 3 * pe.relative_clip + 30
    generator = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, m, 16, generator=generator) for _ in range(3))
    q.requires_grad_()
    want = pe.double()(q.double(), k.double(), v.double(), causal=causal, backend="eager")
    (want_grad,) = torch.autograd.grad(want.square().sum(), q)
    got = pe.float()(q, k, v, causal=causal, backend="sdpa")
    (got_grad,) = torch.autograd.grad(got.square().sum(), q)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(got_grad.double(), want_grad.double(), rtol=1e-3, atol=1e-4)
    assert route == [(1, 2, m, 16)]


def _run(pe: torch.nn.Module, n: int, m: int, dtype=F64, **options) -> None:
    q = torch.randn(1, 4, n, 8, dtype=dtype)
    k, v = (torch.randn(1, 4, m, 8, dtype=dtype) for _ in range(2))
    pe.to(dtype)(q, k, v, backend="sdpa", **options)


@pytest.mark.parametrize("trains", [False, True])
def test_the_path_serves_from_some_clip_distances_of_keys(trains: bool, monkeypatch) -> None:
    pe = make("bert_relative_key")
    serve_short(monkeypatch, pe)
    route = spy_query_shapes(monkeypatch, pe, "clipped_relative_attention")
    least = clipped.CLIPPED_RELATIVE_MIN_KEYS_PER_CLIP[trains] * pe.relative_clip
    for m in (least - 1, least):
        q, k, v = (torch.randn(1, 4, m, 8, dtype=F64) for _ in range(3))
        with torch.set_grad_enabled(trains):
            pe(q, k, v, backend="sdpa")  # with gradients, the table trains
    assert route == [(1, 4, least, 8)]


def test_the_path_serves_from_its_least_keys_and_queries(monkeypatch) -> None:
    pe = generated_class("shaw")(heads=2, head_dim=4)
    route = spy_query_shapes(monkeypatch, pe, "clipped_relative_attention")
    forward, training = (
        clipped.CLIPPED_RELATIVE_MIN_KEYS[False],
        clipped.CLIPPED_RELATIVE_MIN_KEYS[True],
    )
    queries = clipped.CLIPPED_RELATIVE_MIN_QUERIES
    assert forward >= 3 * pe.relative_clip and training > forward and forward > queries
    assert all(forward >= per_clip * pe.relative_clip for per_clip in (2, 3))
    for m in (forward - 1, forward):
        q, k, v = (torch.randn(1, 2, m, 4) for _ in range(3))
        with torch.no_grad():
            pe(q, k, v, backend="sdpa")
    assert route == [(1, 2, forward, 4)]
    for m in (training - 1, training):
        q, k, v = (torch.randn(1, 2, m, 4) for _ in range(3))
        pe(q, k, v, backend="sdpa").sum().backward()  # the tables train
    assert route == [(1, 2, forward, 4), (1, 2, training, 4)]
    for n in (queries - 1, queries):
        q, k, v = (
            torch.randn(1, 2, n, 4),
            torch.randn(1, 2, forward, 4),
            torch.randn(1, 2, forward, 4),
        )
        with torch.no_grad():
            pe(q, k, v, backend="sdpa")
    assert route[2:] == [(1, 2, queries, 4)]


def test_what_the_path_leaves_to_the_dense_terms(monkeypatch) -> None:
    pe = make("deberta")
    serve_short(monkeypatch, pe)
    route = spy_query_shapes(monkeypatch, pe, "clipped_relative_attention")
    n = m = 40
    # positions not sorted (sorted ones take the path: tests/test_position_band.py)
    positions = torch.arange(0, 2 * m, 2)
    _run(pe, n, m, window=5)
    _run(pe, n, m, q_positions=positions.flip(0), k_positions=positions)
    _run(pe, n, m, attn_mask=torch.ones(n, m, dtype=torch.bool))
    _run(pe, n, m, document_ids=torch.zeros(m, dtype=torch.int64))
    _run(pe, n, m, dtype=torch.bfloat16)
    assert route == []
    _run(pe, n, m, dtype=torch.float32)
    # the relative terms run with autocast off (in float32), so autocast takes the path
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _run(pe, n, m, dtype=torch.float32)
    assert route == [(1, 4, n, 8)] * 2


def test_unclipped_relative_terms_keep_the_dense_path(monkeypatch) -> None:
    pe = generated_class("transformer_xl")(heads=4, head_dim=8).double()
    serve_short(monkeypatch, pe)
    assert pe.relative_clip is None
    calls = spy_calls(
        monkeypatch, runtime_modules(pe), "clipped_relative_attention", lambda *_, **__: 1
    )
    _run(pe, 40, 40)
    assert calls == []


RELATIVE_CLIPS = {
    name: generated_class(name).relative_clip
    for name in spec_names()
    if getattr(generated_class(name), "relative_clip", None) is not None
}


def test_the_catalogue_declares_its_clips() -> None:
    assert RELATIVE_CLIPS == {
        "bert_relative_key": 511,
        "bert_relative_key_query": 511,
        "deberta": 512,
        "deberta_absolute_input": 512,
        "shaw": 16,
    }
    for name in ("transformer_xl", "cope", "t5", "rope"):
        assert generated_class(name).relative_clip is None


@pytest.mark.parametrize("name", sorted(RELATIVE_CLIPS))
def test_every_index_is_constant_past_its_clip(name: str) -> None:
    """relative_clip = K: index(r) is one row for all r >= K and one for all r <= -K,
    read off the generated index function (up to 2^50), and K is the least such
    distance on at least one side."""
    module = importlib.import_module(f"generated.{name}")
    clip = RELATIVE_CLIPS[name]
    far = torch.cat((torch.arange(clip, clip + 5000), torch.tensor([10**6, 2**40, 2**50])))
    for sign in (1, -1):
        rows = module._relative_index(sign * far)
        assert (rows == rows[0]).all(), (name, sign)
    below = module._relative_index(torch.tensor([clip - 1, 1 - clip]))
    at = module._relative_index(torch.tensor([clip, -clip]))
    assert (below != at).any()


def test_causal_parts_read_only_the_rows_of_keys_at_or_before_the_query() -> None:
    pe = generated_class("shaw")(heads=2, head_dim=4)
    q, k = torch.randn(1, 2, 40, 4), torch.randn(1, 2, 40, 4)
    (full,) = pe._relative_parts(q, k, torch.float32)
    (causal,) = pe._relative_parts(q, k, torch.float32, causal=True)
    assert full.scores.shape[-1] == 33 and causal.scores.shape[-1] == 17  # r = -16 .. 0
    # every unmasked diagonal (key index - query index <= 0 here) reads the same table row
    distances = torch.arange(-39, 40)
    allowed = distances <= 0
    rows_full = full.diagonal[allowed]
    rows_causal = causal.diagonal[allowed]
    assert torch.equal(rows_full - rows_full.min(), rows_causal - rows_causal.min())
    assert int(causal.diagonal.max()) < 17


@pytest.mark.parametrize("name", ["shaw", "deberta"])
def test_the_bnhd_layout_takes_the_path_too(name: str, monkeypatch) -> None:
    """Hugging Face's [batch, seq, heads, dim] projections: q, k and v reach the flash
    kernel as strided views (no extra feature to add for Shaw), gradients included."""
    pe = make(name)
    serve_short(monkeypatch, pe)
    route = spy_query_shapes(monkeypatch, pe, "clipped_relative_attention")
    generator = torch.Generator().manual_seed(7)
    q, k, v = (
        torch.randn(2, 40, 4, 8, generator=generator, dtype=F64, requires_grad=True)
        for _ in range(3)
    )
    for causal in (False, True):
        want = pe(q, k, v, layout="bnhd", causal=causal, backend="eager")
        got = pe(q, k, v, layout="bnhd", causal=causal, backend="sdpa")
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
        got_grads = torch.autograd.grad(got.square().sum(), (q, k, v))
        for a, b in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    assert route == [(2, 4, 40, 8)] * 2
