"""Relative terms of query chunks as strided views of projections in diagonal order
(``_band_views``), the mask of a training step: on the clipped path's band and on the
chunks of every key (``chunked_relative_attention``), outputs and gradients against the
eager oracle in float64, with the views forced on at the small clips of the tests and
spied on, so that each test runs them, with autograd and without; and the rule that
picks the views at the catalogue's clips.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import (
    assert_sdpa_matches_eager,
    generated_class,
    runtime_modules,
    set_runtime,
    small_clip_module,
    spec_variant,
    spy_calls,
)

F64 = torch.float64
NAMES = ["bert_relative_key", "bert_relative_key_query", "deberta", "deberta_p2c"]
SHAPES = [(40, 40, 4), (25, 50, 2), (37, 41, 1)]  # (n, m, kv_heads): N < M, grouped heads


def make(name: str) -> torch.nn.Module:
    """A small-clip module; ``deberta_p2c``: DeBERTa with its key-side term (p2c) alone."""
    if name != "deberta_p2c":
        return small_clip_module(name)
    c2p = (
        "  content_position:     # c2p: q_i . (W_k R + b_k)[bucket(i - j)]\n"
        "    relative: {sign: query_minus_key, projection: key, placement: before_scale}\n"
    )
    variant = spec_variant(
        "deberta",
        ("buckets: 256, max_distance: 512", "buckets: 8, max_distance: 12"),
        (c2p, "  content_position: drop\n"),
        name="deberta_p2c",
    )
    torch.manual_seed(3)
    return variant(heads=4, head_dim=8, model_dim=16).double()


def trains(factors: list, *_: object) -> bool:
    """Whether gradients flow into the relative terms of ``factors``."""
    return any(factor.x.requires_grad or factor.rows.requires_grad for factor in factors)


def views_made(monkeypatch: pytest.MonkeyPatch, pe: torch.nn.Module) -> list[bool]:
    """Each time ``pe``'s terms are made into views, whether they train."""
    return spy_calls(monkeypatch, runtime_modules(pe), "band_views", trains)


def force_views(monkeypatch: pytest.MonkeyPatch, pe: torch.nn.Module) -> list[bool]:
    """The views at any width (the tests' clips are a few rows): ``views_made``."""
    set_runtime(monkeypatch, "BAND_VIEW_MAX_WIDTH_RATIO", 10**6, pe)
    return views_made(monkeypatch, pe)


def clipped_path(monkeypatch: pytest.MonkeyPatch, pe: torch.nn.Module) -> None:
    """``pe``'s clipped path at any count of queries and keys, in chunks of 8 queries."""
    set_runtime(monkeypatch, "CLIPPED_RELATIVE_QUERY_CHUNK", 8, pe)
    set_runtime(monkeypatch, "CLIPPED_RELATIVE_MIN_KEYS", {False: 0, True: 0}, pe)
    set_runtime(monkeypatch, "CLIPPED_RELATIVE_MIN_QUERIES", 0, pe)


def eager_and_sdpa_without_grad(pe: torch.nn.Module, n: int, m: int, **options: object) -> None:
    """The sdpa output without autograd equals the eager oracle's, float64."""
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, n, 8, generator=generator, dtype=F64)
    k, v = (torch.randn(2, 2, m, 8, generator=generator, dtype=F64) for _ in range(2))
    with torch.no_grad():
        want = pe(q, k, v, backend="eager", **options)
        got = pe(q, k, v, backend="sdpa", **options)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_chunk_of_queries_before_every_key_matches_eager(monkeypatch) -> None:
    """Causal, explicit positions: keys at 10 .. 49, queries at 0 .. 29, so the first
    chunks of queries have no key at or before them (rows of zeros on every backend)."""
    pe = small_clip_module("bert_relative_key_query")
    clipped_path(monkeypatch, pe)
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 30, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 40, 8, generator=generator, dtype=torch.float64) for _ in "kv")
    options = {
        "causal": True,
        "q_positions": torch.arange(30),
        "k_positions": torch.arange(40) + 10,
    }
    with torch.no_grad():
        want = pe(q, k, v, backend="eager", **options)
        got = pe(q, k, v, backend="sdpa", **options)
    assert bool((want[:, :, :10] == 0).all())
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("n", "m", "kv_heads"), SHAPES)
@pytest.mark.parametrize("name", NAMES)
def test_the_band_as_views_matches_eager_with_gradients(
    name: str, n: int, m: int, kv_heads: int, causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    pe = make(name)
    clipped_path(monkeypatch, pe)
    calls = force_views(monkeypatch, pe)
    assert_sdpa_matches_eager(pe, n, m, kv_heads, causal=causal)
    assert calls == [True]  # the band's terms, trained, came from the views


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_without_autograd_the_band_is_views_too(
    name: str, causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    pe = make(name)
    clipped_path(monkeypatch, pe)
    calls = force_views(monkeypatch, pe)
    eager_and_sdpa_without_grad(pe, 37, 45, causal=causal)
    assert calls == [False]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_views_as_a_plain_mask_where_only_values_train(
    name: str, causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gradients into v alone (q, k and the relative tables frozen): the views are a
    mask that gets no gradient; the output and v's gradient equal the eager oracle's."""
    pe = make(name).requires_grad_(False)
    clipped_path(monkeypatch, pe)
    calls = force_views(monkeypatch, pe)
    generator = torch.Generator().manual_seed(6)
    q = torch.randn(2, 4, 37, 8, generator=generator, dtype=F64)
    k = torch.randn(2, 2, 45, 8, generator=generator, dtype=F64)
    v = torch.randn(2, 2, 45, 8, generator=generator, dtype=F64, requires_grad=True)
    outputs, grads = [], []
    for backend in ("eager", "sdpa"):
        out = pe(q, k, v, causal=causal, backend=backend)
        outputs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), v)[0])
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-9, atol=1e-11)
    assert calls == [False]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["bert_relative_key_query", "deberta_p2c"])
def test_chunks_over_every_key_as_views(
    name: str, causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the clipped path (too few keys for it): each chunk of queries over every
    key it reads (``chunked_relative_attention``), with autograd and without."""
    pe = make(name)
    set_runtime(monkeypatch, "CLIPPED_RELATIVE_MIN_KEYS", {False: 10**6, True: 10**6}, pe)
    set_runtime(monkeypatch, "SDPA_QUERY_CHUNK", {"cpu": 8}, pe)
    calls = force_views(monkeypatch, pe)
    assert_sdpa_matches_eager(pe, 30, 33, 2, causal=causal)
    eager_and_sdpa_without_grad(pe, 30, 33, causal=causal)
    assert calls == [True, False]


@pytest.mark.parametrize(
    ("name", "serves"),
    [("bert_relative_key_query", True), ("deberta", False), ("shaw", False)],
)
def test_the_views_serve_tables_wide_enough_for_their_bands(
    name: str, serves: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the catalogue's clips and N = 2048, the band's chunks reach 1533 diagonals:
    1.5x BERT's 1023 rows serve a forward whose terms train; 3x DeBERTa's 512 and
    Shaw's 33 rows (clip 16) keep their gathers."""
    pe = generated_class(name)(heads=2, head_dim=8)
    calls = views_made(monkeypatch, pe)
    q = k = v = torch.zeros(1, 2, 2048, 8)
    pe(q, k, v, backend="sdpa")  # the module's tables train
    assert calls == ([True] if serves else [])


def test_the_views_serve_only_the_devices_they_were_measured_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Off the devices of ``BAND_VIEW_DEVICES`` (CUDA, unmeasured) the band keeps its
    gathers."""
    pe = generated_class("bert_relative_key_query")(heads=2, head_dim=8)
    set_runtime(monkeypatch, "BAND_VIEW_DEVICES", set(), pe)
    calls = views_made(monkeypatch, pe)
    q = k = v = torch.zeros(1, 2, 2048, 8)
    pe(q, k, v, backend="sdpa")  # the module's tables train
    assert calls == []
