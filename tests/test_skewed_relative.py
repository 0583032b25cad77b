"""A query-side relative term at default positions as a strided view of each query
chunk's projection over its window of diagonals (``_skewed_relative``): Transformer-XL
on the CPU sdpa backend without autograd, against the eager oracle (float64)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

from tests.conftest import assert_sdpa_matches_eager, generated_class

few = importlib.import_module("generated._few_queries")
masks = importlib.import_module("generated._masks")
relative = importlib.import_module("generated._sdpa_relative")
skewed = importlib.import_module("generated._skewed_relative")
terms = importlib.import_module("generated._terms")


def _spy_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of spans of each ``skewed_relative_attention`` call; each still runs."""
    calls: list[int] = []
    original = relative.skewed_relative_attention

    def spy(q: Any, k: Any, v: Any, factors: Any, spans: Any, scale: Any, causal: Any) -> Any:
        calls.append(len(spans))
        return original(q, k, v, factors, spans, scale, causal)

    monkeypatch.setattr(relative, "skewed_relative_attention", spy)
    return calls


# (4, 14): one chunk against more keys, whose window (17 rows) passes a causal table's
# 14 rows (SKEWED_MAX_WINDOW_RATIO)
@pytest.mark.parametrize(
    ("n", "m", "kv_heads"), [(10, 10, 4), (10, 13, 2), (12, 14, 1), (4, 14, 2)]
)
@pytest.mark.parametrize("causal", [False, True])
def test_transformer_xl_chunks_as_strided_views_match_eager(
    n: int, m: int, kv_heads: int, causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of 4 queries (the last N of M keys), grouped-query heads included, with
    the few-query path off: the output without autograd equals the eager oracle's, and
    the skewed path ran."""
    monkeypatch.setitem(masks.SDPA_QUERY_CHUNK, "cpu", 4)
    monkeypatch.setattr(few, "FEW_QUERY_RELATIVE_MAX_QUERIES", 1)
    calls = _spy_calls(monkeypatch)
    torch.manual_seed(0)
    pe = generated_class("transformer_xl")(heads=4, head_dim=8).double()
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, n, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, m, 8, generator=generator, dtype=torch.float64) for _ in "kv")
    with torch.no_grad():
        got = pe(q, k, v, causal=causal, backend="sdpa")
        want = pe(q, k, v, causal=causal, backend="eager")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert calls == [-(-n // 4)]


# (4, 14): one chunk against more keys, whose window (17 rows) passes a causal table's
# 14 rows (SKEWED_MAX_WINDOW_RATIO)
@pytest.mark.parametrize(
    ("n", "m", "kv_heads"), [(10, 10, 4), (10, 13, 2), (12, 14, 1), (4, 14, 2)]
)
@pytest.mark.parametrize("causal", [False, True])
def test_transformer_xl_training_steps_through_the_views_match_eager(
    n: int, m: int, kv_heads: int, causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same chunks with gradients (``_SkewedAttention``): outputs and gradients into
    q, k, v and every parameter (W_R, u, v) equal the eager oracle's (float64)."""
    monkeypatch.setitem(masks.SDPA_QUERY_CHUNK, "cpu", 4)
    monkeypatch.setattr(few, "FEW_QUERY_RELATIVE_MAX_QUERIES", 1)
    calls = _spy_calls(monkeypatch)
    torch.manual_seed(0)
    pe = generated_class("transformer_xl")(heads=4, head_dim=8).double()
    assert len(list(pe.parameters())) == 3
    assert_sdpa_matches_eager(pe, n, m, kv_heads, causal=causal)
    assert calls == [-(-n // 4)]


def _query_term(table_rows: int, n: int, m: int) -> Any:
    """A query-side term of n queries and m keys over ``table_rows`` rows."""
    x = torch.zeros(1, 2, n, 4)
    rows = torch.zeros(table_rows, 2, 4)
    diagonal = torch.arange(n + m - 1).clamp(max=table_rows - 1)
    return terms.RelativeFactors("query", x, rows, diagonal, 1.0)


@pytest.mark.parametrize(("table_rows", "serves"), [(8 + 8 - 1, True), (6, True), (5, False)])
def test_the_view_serves_where_its_windows_are_cheaper_than_the_table(
    table_rows: int, serves: bool
) -> None:
    """Chunks of 4 of 8 queries over 8 keys project windows of 11 rows each (88 in all):
    fewer than 8 queries on 15 rows (one row per distance), at most
    ``SKEWED_MAX_WINDOW_RATIO`` (2) times 8 queries on a clipped table's 6 (96), more
    than that on 5 (80)."""
    assert skewed.SKEWED_MAX_WINDOW_RATIO == 2
    q = k = v = torch.zeros(1, 2, 8, 4)
    spans = [(0, 4, 0, 8), (4, 8, 0, 8)]
    factors = [_query_term(table_rows, 8, 8)]
    assert skewed.skewed_relative_serves(factors, q, k, v, spans) is serves
