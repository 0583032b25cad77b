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


def _clipped_diagonals(n: int, m: int, clip: int) -> torch.Tensor:
    """The table row of each diagonal t = j - i + N - 1 of a table clipped at ``clip``
    (BERT's): clamp(j - i, -clip, clip) + clip, int64 [N + M - 1]."""
    return (torch.arange(n + m - 1) - (n - 1)).clamp(-clip, clip) + clip


@pytest.mark.parametrize(
    ("diagonal", "causal", "want"),
    [
        # span (4, 8, 0, 12) of 12 queries and keys reads diagonals 4 .. 18: distances
        # -7 .. 7, clipped at 3 to rows 0 0 0 0 0 1 2 3 4 5 6 6 6 6 6
        (_clipped_diagonals(12, 12, 3), False, (4, 10, 15)),
        # causal: diagonals from 12 - 4 = 8 on read keys after the query
        (_clipped_diagonals(12, 12, 3), True, (4, 7, 8)),
        # a row per distance (Transformer-XL's): every column projected
        (torch.arange(23), False, (0, 14, 15)),
        # one row for every distance: one column projected
        (torch.zeros(23, dtype=torch.int64), False, (0, 0, 15)),
    ],
)
def test_a_span_projects_each_run_of_one_clipped_row_once(
    diagonal: torch.Tensor, causal: bool, want: tuple[int, int, int]
) -> None:
    """``diagonal_window``: the columns projected run from the last of the leading
    run of one row to the first of the trailing run, up to the causal mask."""
    window = skewed.diagonal_window(diagonal, (4, 8, 0, 12), 12, causal)
    assert (window.first, window.last, window.visible) == want
    assert torch.equal(window.rows, diagonal[4:19])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("span", [(4, 8, 0, 12), (0, 4, 0, 6), (8, 12, 5, 12)])
def test_skewed_terms_are_the_clipped_table_read_per_pair(
    span: tuple[int, int, int, int], causal: bool
) -> None:
    """Each entry (a, c) of a span's terms is x_(i0 + a) . R[h, row(lo + c - i0 - a)]
    (float64, read pair by pair), -inf where ``causal`` hides key lo + c from query
    i0 + a; the projection buffer's runs are copies of the one column projected."""
    generator = torch.Generator().manual_seed(5)
    n, clip = 12, 3
    x = torch.randn(2, 3, n, 4, generator=generator, dtype=torch.float64)
    table = torch.randn(3, 2 * clip + 1, 4, generator=generator, dtype=torch.float64)
    diagonal = _clipped_diagonals(n, n, clip)
    buffer = skewed.projection_buffer(x, [span])
    got, _ = skewed.skewed_terms(x, table, diagonal, span, n, causal, buffer)
    i0, i1, lo, hi = span
    want = torch.empty(2, 3, i1 - i0, hi - lo, dtype=torch.float64)
    for a in range(i1 - i0):
        for c in range(hi - lo):
            i, j = i0 + a, lo + c
            row = table[:, min(max(j - i, -clip), clip) + clip]  # [H, D]
            hidden = causal and j > i
            want[:, :, a, c] = float("-inf") if hidden else (x[:, :, i] * row).sum(-1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
