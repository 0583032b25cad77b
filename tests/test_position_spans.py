"""Explicit positions with a causal mask or a window on the CPU sdpa backend: each chunk
of queries reads only the keys from the first to the last that its mask may let it read
at those positions (``position_spans``), checked against a brute-force reading of the
mask and, end to end, against the eager oracle (float64, outputs and gradients)."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import assert_sdpa_matches_eager, generated_class

masks = importlib.import_module("generated._masks")

N, M = 10, 12


def _spans(n: int, m: int, chunk: int) -> list[tuple[int, int, int, int]]:
    return [(i0, min(i0 + chunk, n), 0, m) for i0 in range(0, n, chunk)]


def _readable_keys(
    q_pos: torch.Tensor, k_pos: torch.Tensor, span: tuple[int, int, int, int], causal: bool, window
) -> list[int]:
    """The keys some query of ``span`` may read in some batch row, pair by pair."""
    q_rows, k_rows = q_pos.reshape(-1, q_pos.shape[-1]), k_pos.reshape(-1, k_pos.shape[-1])
    keys: set[int] = set()
    for b in range(max(q_rows.shape[0], k_rows.shape[0])):
        q_row = q_rows[b % q_rows.shape[0]]
        k_row = k_rows[b % k_rows.shape[0]]
        for i in range(span[0], span[1]):
            for j in range(k_row.shape[0]):
                d = int(q_row[i]) - int(k_row[j])  # query minus key
                ok = d >= 0 if causal else True
                if window is not None:
                    ok = ok and (d < window if causal else abs(d) < window)
                if ok:
                    keys.add(j)
    return sorted(keys)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    n=st.integers(2, 9),
    m=st.integers(1, 12),
    chunk=st.integers(1, 4),
    batched=st.booleans(),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 6)),
    sorted_keys=st.booleans(),
)
def test_each_span_holds_every_key_its_queries_may_read(
    data, n: int, m: int, chunk: int, batched: bool, causal: bool, window, sorted_keys: bool
) -> None:
    """Any positions (sorted or not, batched or not): every key a span's queries may
    read lies in its narrowed key range; for one row of positions under a causal mask
    alone, the range runs exactly from the first such key to the last."""
    rows = 2 if batched else 1
    position = st.integers(0, 30)
    q_pos = torch.tensor(data.draw(st.lists(position, min_size=rows * n, max_size=rows * n)))
    k_pos = torch.tensor(data.draw(st.lists(position, min_size=rows * m, max_size=rows * m)))
    if sorted_keys:
        q_pos, k_pos = q_pos.sort().values, k_pos.sort().values
    q_pos, k_pos = q_pos.view(rows, n).squeeze(0), k_pos.view(rows, m).squeeze(0)
    spans = _spans(n, m, chunk)
    narrowed = masks.position_spans(spans, q_pos, k_pos, causal, window, n, m)
    assert [span[:2] for span in narrowed] == [span[:2] for span in spans]
    for span, (_, _, lo, hi) in zip(spans, narrowed, strict=True):
        readable = _readable_keys(q_pos, k_pos, span, causal, window)
        exact = causal and window is None and not batched
        assert 0 <= lo < hi <= m
        if not causal and window is None or len(spans) < 2:
            assert (lo, hi) == (0, m)
        elif readable:
            assert lo <= readable[0] and readable[-1] < hi
            if exact:
                assert (lo, hi) == (readable[0], readable[-1] + 1)
        elif exact:
            assert (lo, hi) == (0, m)  # a span that may read nothing keeps its keys


def test_increasing_positions_skip_the_keys_after_each_chunk() -> None:
    """Positions two apart, causal: the chunks of four queries read up to their own
    last key, as default positions would."""
    keys = 2 * torch.arange(M)
    spans = masks.position_spans(_spans(N, M, 4), keys[M - N :], keys, True, None, N, M)
    assert spans == [(0, 4, 0, 6), (4, 8, 0, 10), (8, 10, 0, 12)]
    windowed = masks.position_spans(_spans(N, M, 4), keys[M - N :], keys, True, 3, N, M)
    assert windowed == [(0, 4, 1, 6), (4, 8, 5, 10), (8, 10, 9, 12)]  # within 2 positions


def test_spans_stay_as_given_unmasked_or_while_compiling(monkeypatch) -> None:
    keys = 2 * torch.arange(M)
    spans = _spans(N, M, 4)
    assert masks.position_spans(spans, keys[M - N :], keys, False, None, N, M) == spans
    assert masks.position_spans(spans, None, None, True, None, N, M) == spans
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert masks.position_spans(spans, keys[M - N :], keys, True, None, N, M) == spans


INCREASING = {"q_positions": 2 * torch.arange(M - N, M), "k_positions": 2 * torch.arange(M)}
SHUFFLED = {"q_positions": torch.randperm(N, generator=torch.Generator().manual_seed(0)) * 3}


@pytest.mark.parametrize("name", ["alibi", "t5", "fire", "deberta", "rope"])
@pytest.mark.parametrize("positions", ["increasing", "shuffled", "increasing, batched"])
@pytest.mark.parametrize("window", [None, 3])
def test_narrowed_chunks_match_eager(name: str, positions: str, window, monkeypatch) -> None:
    """Biases, relative terms and a rotation at explicit positions, causal, in chunks of
    4 queries narrowed to their keys: outputs and gradients equal the eager oracle's."""
    monkeypatch.setitem(masks.SDPA_QUERY_CHUNK, "cpu", 4)
    given_positions = {
        "increasing": INCREASING,
        "shuffled": SHUFFLED,
        "increasing, batched": {
            "k_positions": torch.stack([2 * torch.arange(M), 3 * torch.arange(M)])
        },
    }[positions]
    cls = generated_class(name)
    spans: list[list[tuple[int, int, int, int]]] = []
    original = masks.position_spans

    def recording(*args, **keywords):
        out = original(*args, **keywords)
        spans.append(out)
        return out

    monkeypatch.setattr(masks, "position_spans", recording)
    torch.manual_seed(0)
    pe = cls(heads=4, head_dim=8).double()
    assert_sdpa_matches_eager(pe, N, M, 2, causal=True, window=window, **given_positions)
    if positions != "shuffled":
        assert any(hi < M for call in spans for _, _, _, hi in call)  # keys were skipped
