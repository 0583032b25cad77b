"""CoPE's attention as one node over query chunks (templates/runtime/_counted_positions.py)
against the eager oracle (itself checked against a float64 loop and x-transformers in
tests/test_cope.py): outputs and gradients into q, k, v and the table, in small chunks
and count blocks so that every case runs several of each."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tests.conftest import (
    generated_class,
    run_backend,
    runtime_modules,
    runtime_value,
    set_runtime,
    spy_calls,
    spy_method,
)

F64 = torch.float64
N, M = 40, 40


def _cope(dtype: torch.dtype = F64) -> torch.nn.Module:
    torch.manual_seed(0)
    pe = generated_class("cope")(heads=4, head_dim=8).to(dtype)
    with torch.no_grad():
        pe.cope_positions.normal_(std=0.5)  # a term the size of the content logits
    return pe


def _inputs(
    n: int = N, m: int = M, kv_heads: int = 4, dtype: torch.dtype = F64, gates: str = "mixed"
) -> dict[str, torch.Tensor]:
    """q, k, v; gates "mixed" (logits around 0: counts reach 15 some 30 keys back),
    "closed" (logits far below 0: no count reaches 15) or "open" (far above: counts
    reach it at once)."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, n, 8, generator=generator, dtype=dtype)
    k = torch.randn(2, kv_heads, m, 8, generator=generator, dtype=dtype)
    v = torch.randn(2, kv_heads, m, 8, generator=generator, dtype=dtype)
    if gates != "mixed":
        sign = -1.0 if gates == "closed" else 1.0
        q, k = q.abs() + 1.0, sign * (k.abs() + 1.0)
    return {"q": q, "k": k, "v": v}


def _assert_sdpa_matches_eager(
    pe: torch.nn.Module, inputs: dict[str, torch.Tensor], **options: Any
) -> None:
    """The sdpa output and its gradients into q, k, v and the table equal the eager
    oracle's (float64)."""
    want, want_grads = run_backend(pe, inputs, "eager", **options)
    got, got_grads = run_backend(pe, inputs, "sdpa", **options)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert len(got_grads) == len(want_grads) == 4  # q, k, v, the table
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Chunks of 4 queries and count blocks of 8 keys; the spans each chunk runs."""
    for module in runtime_modules():
        if module.__name__.endswith("_masks"):
            monkeypatch.setitem(module.SDPA_MASK_CHUNK_BYTES, "cpu", 1)
    set_runtime(monkeypatch, "SDPA_MASK_CHUNK_MIN_ROWS", 4)
    set_runtime(monkeypatch, "COUNT_BLOCK", 8)
    return spy_calls(monkeypatch, runtime_modules(), "_chunk_logits", lambda *a, **_: a[3])


POSITIONS = torch.arange(M) * 2 + 5
PERMUTED = torch.randperm(M, generator=torch.Generator().manual_seed(3))
OUTLIER = torch.cat([POSITIONS[:-1], torch.zeros(1, dtype=torch.long)])
DOCUMENTS = torch.tensor([0] * 13 + [1] * 20 + [2] * 7)
CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "causal": {"causal": True},
    "positions": {"q_positions": POSITIONS, "k_positions": POSITIONS},
    "positions causal": {"q_positions": POSITIONS, "k_positions": POSITIONS, "causal": True},
    "batched positions causal": {
        "q_positions": torch.stack([POSITIONS, POSITIONS.flip(0)]),
        "k_positions": torch.stack([POSITIONS, POSITIONS + 3]),
        "causal": True,
    },
    "permuted window": {"q_positions": PERMUTED, "k_positions": PERMUTED, "window": 9},
    "permuted window causal": {
        "q_positions": PERMUTED,
        "k_positions": PERMUTED,
        "window": 9,
        "causal": True,
    },
    # the last key, at position 0, is outside every window but the first queries' and
    # yet counted by every query: each chunk must read it (causal or not)
    "window and an early last key": {
        "q_positions": OUTLIER,
        "k_positions": OUTLIER,
        "window": 6,
    },
    "causal window and an early last key": {
        "q_positions": OUTLIER,
        "k_positions": OUTLIER,
        "window": 6,
        "causal": True,
    },
    "window": {"window": 6},
    "window causal": {"window": 6, "causal": True},
    "documents": {"document_ids": DOCUMENTS},
    "documents causal": {"document_ids": DOCUMENTS, "causal": True},
    "bool mask": {"attn_mask": torch.rand(N, M, generator=torch.Generator().manual_seed(4)) > 0.3},
    "float mask causal": {
        "attn_mask": torch.randn(2, 1, N, M, generator=torch.Generator().manual_seed(5), dtype=F64),
        "causal": True,
    },
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_counted_attention_matches_the_eager_oracle(case: str, small_chunks: list[Any]) -> None:
    pe, inputs = _cope(), _inputs()
    _assert_sdpa_matches_eager(pe, inputs, **CASES[case])
    assert len(small_chunks) >= N // 4 * 2  # every chunk, forward and backward
    with torch.no_grad():
        inference = pe(**inputs, backend="sdpa", **CASES[case])
        want = pe(**inputs, backend="eager", **CASES[case])
    torch.testing.assert_close(inference, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("gates", ["closed", "open"])
@pytest.mark.parametrize("causal", [False, True])
def test_counts_that_never_or_at_once_reach_the_end(
    gates: str, causal: bool, small_chunks: list[Any]
) -> None:
    """Gates near 0 keep every count below 15 over every key (every count block runs);
    gates near 1 make it 15 at the second counted key."""
    _assert_sdpa_matches_eager(_cope(), _inputs(gates=gates), causal=causal)


def test_grouped_keys_and_fewer_queries_than_keys(small_chunks: list[Any]) -> None:
    """GQA (2 key heads for 4 query heads) and 12 queries, the last 12 of 40 keys."""
    pe, inputs = _cope(), _inputs(n=12, kv_heads=2)
    for causal in (False, True):
        _assert_sdpa_matches_eager(pe, inputs, causal=causal)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_float32_and_bfloat16_stay_within_their_precision(
    dtype: torch.dtype, tolerance: float
) -> None:
    """The node computes in float32 whatever the inputs: on inputs and a table rounded to
    ``dtype``, it agrees with the float64 oracle to float32 error, or to bfloat16's
    rounding of its output and gradients (relative to their largest entries)."""
    low = _cope(dtype)
    oracle = copy.deepcopy(low).to(F64)
    inputs = {key: value.to(dtype) for key, value in _inputs(n=300, m=300).items()}
    want, want_grads = run_backend(
        oracle, {key: value.to(F64) for key, value in inputs.items()}, "eager", causal=True
    )
    got, got_grads = run_backend(low, inputs, "sdpa", causal=True)
    assert got.dtype == dtype and len(got_grads) == 4
    for a, b in zip([got, *got_grads], [want, *want_grads], strict=True):
        torch.testing.assert_close(a.to(F64), b, rtol=0, atol=tolerance * float(b.abs().max()))


def test_the_sdpa_backend_builds_no_dense_terms(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sdpa backend runs the node: CoPE's dense [B, H, N, M] terms are not made, in
    training and in inference alike."""
    pe, inputs = _cope(), _inputs()
    dense = spy_method(monkeypatch, type(pe), "_relative_terms", lambda *a, **_: True)
    runs = spy_calls(
        monkeypatch, runtime_modules(), "counted_position_attention", lambda *a, **_: True
    )
    run_backend(pe, inputs, "sdpa", causal=True)
    with torch.no_grad():
        pe(**inputs, backend="sdpa")
    assert (len(runs), dense) == (2, [])


def test_counts_sum_the_counted_gates_in_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_counts``: the clamped prefix sums of the counted gates (float64 by hand) on the
    columns it returns, and (a, b) the first column some row counts and the end of the
    block where every count reached the last position."""
    module = next(m for m in runtime_modules() if m.__name__.endswith("_counted_positions"))
    monkeypatch.setattr(module, "COUNT_BLOCK", 4)
    logits = torch.tensor([[[9.0] * 12, [-9.0] * 12]], dtype=F64)  # [G=1, r=2, w=12]
    counted = torch.ones(2, 12, dtype=torch.bool)
    counted[:, :3] = False  # no row counts the first 3 keys
    counted[1, 3] = False  # the second row counts from key 4
    counts = torch.full_like(logits, float("nan"))
    a, b = module._counts(logits, counts, None, counted, 1, 3)
    gates = torch.sigmoid(logits) * counted
    want = gates.cumsum(-1).clamp(max=3)
    # row 0 reaches 3 at its fourth counted key, 6 (gates near 1); row 1 never (gates
    # near 0): every block runs
    assert (a, b) == (3, 12)
    torch.testing.assert_close(counts[..., a:b], want[..., a:b], rtol=1e-12, atol=0)
    counts.fill_(float("nan"))
    a, b = module._counts(logits[:, :1], counts[:, :1], None, counted[:1], 1, 3)
    assert (a, b) == (3, 7)  # the first block, keys 3 .. 6, ends with the count at 3
    torch.testing.assert_close(counts[0, 0, 3:7], want[0, 0, 3:7], rtol=1e-12, atol=0)
    # gates of exactly 1/2: counts 0.5, 1, ..., 2 at the first block's end, 3 only in the
    # second's, so the blocks stop after it
    half = torch.zeros(1, 1, 12, dtype=F64)
    a, b = module._counts(half, counts[:, :1], None, torch.ones(1, 12, dtype=torch.bool), 1, 3)
    assert (a, b) == (0, 8)
    want = torch.tensor([0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.0, 3.0], dtype=F64)
    torch.testing.assert_close(counts[0, 0, :8], want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "case", ["window and an early last key", "causal window and an early last key"]
)
def test_dense_chunks_read_every_key_they_count(
    case: str, small_chunks: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the node does not run (torch.compile, CUDA), the dense terms per chunk of
    queries read every key their counts read too: a window at explicit positions, causal
    or not, leaves out of a chunk a later key at an earlier position, which its queries
    count."""
    set_runtime(monkeypatch, "counted_position_attention_serves", lambda *_: False)
    monkeypatch.setitem(runtime_value("SDPA_QUERY_CHUNK"), "cpu", 4)
    _assert_sdpa_matches_eager(_cope(), _inputs(), **CASES[case])
    assert small_chunks == []  # the dense terms ran


def test_a_decode_step_keeps_the_dense_terms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below ``COUNTED_MIN_QUERIES`` queries (a decode step) the node's reversed copy of
    the keys and values would cost more than the dense terms of so few rows: those serve
    there, from that many queries on the node, and both agree with the oracle."""
    fewest = runtime_value("COUNTED_MIN_QUERIES")
    runs = spy_calls(
        monkeypatch, runtime_modules(), "counted_position_attention", lambda *a, **_: True
    )
    pe = _cope()
    for n, node in ((1, False), (fewest - 1, False), (fewest, True)):
        inputs = _inputs(n=n)
        runs.clear()
        with torch.no_grad():
            got = pe(**inputs, causal=True, backend="sdpa")
            want = pe(**inputs, causal=True, backend="eager")
        assert runs == ([True] if node else []), n
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("n", [3, N])  # the dense terms; the counted path (N >= 6)
def test_a_nan_in_a_query_gives_its_rows_nan_not_an_index_error(n: int) -> None:
    """A NaN logit's gate counts NaN, which cast to an index read entry -2^63: the count
    is taken as the table's last row instead, so the query's row comes out NaN (its
    content logits are NaN) on both backends, and every other row as without the NaN."""
    pe = _cope()
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 4, rows, 8, generator=generator, dtype=F64) for rows in (n, M, M))
    poisoned = q.clone()
    poisoned[0, 1, 0, 0] = float("nan")
    for backend in ("eager", "sdpa"):
        want = pe(q, k, v, causal=True, backend=backend)
        got = pe(poisoned, k, v, causal=True, backend=backend)
        assert got[0, 1, 0].isnan().all(), backend
        got[0, 1, 0] = want[0, 1, 0]
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
