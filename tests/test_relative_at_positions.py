"""Relative terms clipped at a distance, at explicit positions or under masks, on the
CPU sdpa backend without autograd: projected once for every query chunk
(``_clipped_relative_factors``, ``projected_once``) and gathered per pair at each chunk's positions
(``_clipped_relative.terms_at_positions``), against the eager oracle (float64)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.conftest import runtime_modules, set_runtime, small_clip_module, spy_calls

N, M = 10, 12
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
@pytest.mark.parametrize("name", ["bert_relative_key", "bert_relative_key_query", "deberta"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_terms_projected_once_match_eager(
    name: str, case: str, per_span: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tables clipped at a few rows (distances up to 33 reach past the clip), chunks of
    4 queries: the output without autograd equals the eager oracle's, each chunk's
    terms read from the projections made once for the call, or with
    ``QUERY_PROJECTION_WHOLE_BYTES`` 0 (``per_span``) the query side projected per
    chunk."""
    pe = small_clip_module(name)
    set_runtime(monkeypatch, "SDPA_QUERY_CHUNK", {"cpu": 4}, pe)
    if per_span:
        set_runtime(monkeypatch, "QUERY_PROJECTION_WHOLE_BYTES", 0, pe)
    spans = spy_calls(monkeypatch, runtime_modules(pe), "terms_at_positions", lambda *args: args[3])
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, N, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, 2, M, 8, generator=generator, dtype=torch.float64) for _ in "kv")
    with torch.no_grad():
        got = pe(q, k, v, backend="sdpa", **CASES[case])
        want = pe(q, k, v, backend="eager", **CASES[case])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert [i1 - i0 for i0, i1, _, _ in spans] == [4, 4, 2]
