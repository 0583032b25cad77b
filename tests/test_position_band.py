"""Relative terms clipped at a distance at explicit, sorted positions on the CPU's sdpa
backend: the clipped path's band and far keys found by position (``_position_band``,
``clipped_relative_attention`` with a layout).

Checked against Shaw et al. 2018's formula in float64 (tests/reference/formulas.py) at
explicit positions, and, outputs and gradients into q, k, v and every parameter, against
the eager oracle for every kind of clipped term (query side, both sides, a value-side
term) at positions spread out, batched, repeated and of queries between the keys; the
spans against hand-worked ones; and the positions the path leaves to the chunks.
"""

from __future__ import annotations

import importlib
from typing import Any

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
    spy_query_shapes,
)
from tests.reference import formulas

position_band = importlib.import_module("generated._position_band")
F64 = torch.float64
N, M = 30, 40
NAMES = ["shaw", "bert_relative_key", "bert_relative_key_query", "deberta"]
KEYS = torch.arange(M)
CASES: dict[str, dict[str, torch.Tensor]] = {
    # the defaults' layout two apart: bands of about half the keys
    "stride 2": {"q_positions": 2 * torch.arange(M - N, M) + 5, "k_positions": 2 * KEYS + 5},
    # queries between the keys, three apart against two
    "queries between keys": {"q_positions": 3 * torch.arange(N) + 1, "k_positions": 2 * KEYS},
    "batched": {
        "q_positions": torch.stack([torch.arange(M - N, M), 2 * torch.arange(M - N, M) + 1]),
        "k_positions": torch.stack([KEYS, 2 * KEYS]),
    },
    # positions repeated (two tokens at each), queries past every key
    "repeated": {"q_positions": torch.arange(N) // 2 + 10, "k_positions": KEYS // 2},
}


def serve_short(monkeypatch: pytest.MonkeyPatch, pe: torch.nn.Module, rows: int = 8) -> None:
    """``pe``'s clipped path in chunks of ``rows`` queries, at any number of keys."""
    set_runtime(monkeypatch, "CLIPPED_RELATIVE_QUERY_CHUNK", rows, pe)
    set_runtime(monkeypatch, "CLIPPED_RELATIVE_MIN_KEYS", {False: 0, True: 0}, pe)
    set_runtime(monkeypatch, "CLIPPED_RELATIVE_MIN_QUERIES", 0, pe)


def layouts(monkeypatch: pytest.MonkeyPatch, pe: torch.nn.Module) -> list[bool]:
    """One record per ``position_layout`` call: whether it served (gave a layout)."""
    served: list[bool] = []
    for module in runtime_modules(pe):
        if "position_layout" not in vars(module):
            continue
        original = vars(module)["position_layout"]

        def spy(*args: Any, _original: Any = original) -> Any:
            layout = _original(*args)
            served.append(layout is not None)
            return layout

        monkeypatch.setattr(module, "position_layout", spy)
    return served


def inputs(n: int = N, m: int = M, kv_heads: int = 2, seed: int = 5) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(2, 4, n, 8), (2, kv_heads, m, 8), (2, kv_heads, m, 8)]
    return [torch.randn(*shape, generator=generator, dtype=F64) for shape in shapes]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", NAMES)
def test_the_band_by_position_matches_eager_with_gradients(
    name: str, case: str, causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clips of 2-3 rows, chunks of 8 queries (far keys on both sides of most chunks):
    the output and the gradients into q, k, v and the tables equal the eager oracle's,
    and so does a call without autograd (each chunk's terms gathered into buffers). With
    autograd, terms with one projection (Shaw's, BERT relative_key's) read the band span
    by span (``TrainedBand``), both sides' terms gather it at once."""
    pe = small_clip_module(name)
    serve_short(monkeypatch, pe)
    served = layouts(monkeypatch, pe)
    route = spy_query_shapes(monkeypatch, pe, "clipped_relative_attention")
    by_span = spy_calls(monkeypatch, runtime_modules(pe), "TrainedBand", lambda *args: 1)
    assert_sdpa_matches_eager(pe, N, M, 2, causal=causal, **CASES[case])
    q, k, v = inputs()
    with torch.no_grad():
        got = pe(q, k, v, causal=causal, backend="sdpa", **CASES[case])
        want = pe(q, k, v, causal=causal, backend="eager", **CASES[case])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert served == [True] * 2  # a call with autograd, one without
    assert route == [(2, 4, N, 8)] * 2
    assert by_span == [1] * (name in ("shaw", "bert_relative_key"))


@pytest.mark.parametrize("name", ["bert_relative_key_query", "deberta"])
def test_frozen_tables_and_a_query_side_per_chunk(name: str, monkeypatch) -> None:
    """Tables that do not train, gradients into q, k, v only: the band's terms come per
    chunk, in the backward again; with ``QUERY_PROJECTION_WHOLE_BYTES`` 0 each chunk
    projects its own queries."""
    pe = small_clip_module(name).requires_grad_(False)
    serve_short(monkeypatch, pe)
    set_runtime(monkeypatch, "QUERY_PROJECTION_WHOLE_BYTES", 0, pe)
    served = layouts(monkeypatch, pe)
    q, k, v = (t.requires_grad_() for t in inputs())
    for causal in (False, True):
        options = {"causal": causal, **CASES["stride 2"]}
        got = pe(q, k, v, backend="sdpa", **options)
        want = pe(q, k, v, backend="eager", **options)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        got_grads = torch.autograd.grad(got.square().sum(), (q, k, v))
        want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
        for a, b in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    assert served == [True, True]


@pytest.mark.parametrize("causal", [False, True])
def test_shaw_at_explicit_positions_matches_the_paper_formula(causal: bool, monkeypatch) -> None:
    """The catalogue's Shaw (clip 16) with 48 queries at positions 3 apart against 64
    keys at uneven sorted positions, against z_i = sum_j a_ij (v_j + R^V[clip(s_j -
    p_i)]) with a_ij = softmax(q_i . (k_j + R^K[clip(s_j - p_i)]) / sqrt(d))."""
    pe = generated_class("shaw")(heads=2, head_dim=4).double()
    serve_short(monkeypatch, pe, rows=16)
    route = spy_query_shapes(monkeypatch, pe, "clipped_relative_attention")
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(2, 2, 48, 4, generator=generator, dtype=F64)
    k, v = (torch.randn(2, 2, 64, 4, generator=generator, dtype=F64) for _ in "kv")
    rel_k, rel_v = (torch.randn(33, 4, generator=generator, dtype=F64) for _ in "kv")
    with torch.no_grad():
        pe.distance_embedding.weight.copy_(rel_k)
        pe.value_embedding.weight.copy_(rel_v)
    q_positions = 3 * torch.arange(48) + 20
    k_positions = torch.randint(1, 5, (64,), generator=generator).cumsum(0)  # gaps of 1 to 4
    expected = formulas.shaw_relative_attention(
        q, k, v, rel_k, rel_v, clip=16, causal=causal, q_positions=q_positions,
        k_positions=k_positions,
    )  # fmt: skip
    out = pe(
        q, k, v, causal=causal, backend="sdpa", q_positions=q_positions, k_positions=k_positions
    )
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)
    assert route == [(2, 2, 48, 4)]


def test_the_spans_by_position(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 3 queries at 4, 5, 6 | 9, 10, 20 against keys at 0, 2, ..., 22, clip 3:
    far left are the keys at or below the chunk's first position minus 3, far right
    those at or above its last plus 3 (under a causal mask, only keys at or below its
    last position are read)."""
    set_runtime(monkeypatch, "CLIPPED_RELATIVE_QUERY_CHUNK", 3)
    q_pos = torch.tensor([[4, 5, 6, 9, 10, 20]])
    k_pos = 2 * torch.arange(12).unsqueeze(0)  # 0, 2, ..., 22
    spans = position_band._position_spans(q_pos, k_pos, 3, False)
    causal_spans = position_band._position_spans(q_pos, k_pos, 3, True)
    # chunk 1: keys <= 1 (index 0) far left, >= 9 (index 5 on) far right
    # chunk 2: keys <= 6 (indices 0-3) far left, >= 23 (none) far right
    assert spans == (
        [(0, 3, 0, 1), (3, 6, 0, 4)],
        [(0, 3, 1, 5), (3, 6, 4, 12)],
        [(0, 3, 5, 12), (3, 6, 12, 12)],
    )
    # causal: chunk 1 reads keys <= 6 (indices 0-3), chunk 2 keys <= 20 (0-10)
    assert causal_spans == (
        [(0, 3, 0, 1), (3, 6, 0, 4)],
        [(0, 3, 1, 4), (3, 6, 4, 11)],
        [(0, 3, 4, 4), (3, 6, 11, 11)],
    )


BATCHED_KEYS = torch.stack([KEYS, 3 * KEYS])
NOT_SERVED: dict[str, dict[str, Any]] = {
    "queries not sorted": {"q_positions": torch.arange(N).flip(0), "k_positions": KEYS},
    "keys not sorted in one batch row": {
        "k_positions": torch.stack([KEYS, KEYS.roll(1)]),
        "q_positions": torch.arange(N),
    },
    # causal: the first queries come before every key
    "a query with no key": {"q_positions": torch.arange(N), "k_positions": KEYS + 5},
    # causal: positions 0 .. 9 ten times over; each chunk's keys at or before its first
    # query lie 3 or more before it, while its band holds later keys
    "a query whose keys are all far": {
        "q_positions": torch.arange(N) + 6,
        "k_positions": torch.cat([torch.zeros(M - 10, dtype=torch.int64), 20 + torch.arange(10)]),
    },
}


@pytest.mark.parametrize("case", sorted(NOT_SERVED))
def test_positions_the_band_leaves_to_the_chunks(case: str, monkeypatch) -> None:
    """Unsorted positions, and under a causal mask a query left with no key or none in
    its band while the band holds keys (the CPU flash kernel would give that row a
    log-sum-exp of 0): the layout declines and the chunks' path serves, as eager."""
    pe = small_clip_module("bert_relative_key_query")
    serve_short(monkeypatch, pe)
    served = layouts(monkeypatch, pe)
    route = spy_query_shapes(monkeypatch, pe, "clipped_relative_attention")
    q, k, v = inputs()
    options = {"causal": True, **NOT_SERVED[case]}
    with torch.no_grad():
        got = pe(q, k, v, backend="sdpa", **options)
        want = pe(q, k, v, backend="eager", **options)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, equal_nan=True)
    assert served == [False]
    assert route == []


def test_masks_and_documents_keep_the_chunks(monkeypatch) -> None:
    """A window, documents or an attn_mask at explicit positions: the band by position
    does not serve (the masks are not in its layout)."""
    pe = small_clip_module("deberta")
    serve_short(monkeypatch, pe)
    served = layouts(monkeypatch, pe)
    q, k, v = inputs()
    given = CASES["stride 2"]
    for extra in (
        {"window": 9},
        {"document_ids": (KEYS >= 20).long()},
        {"attn_mask": torch.ones(N, M, dtype=torch.bool)},
    ):
        with torch.no_grad():
            got = pe(q, k, v, backend="sdpa", **given, **extra)
            want = pe(q, k, v, backend="eager", **given, **extra)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert served == []


def test_grouped_queries_and_float32(monkeypatch) -> None:
    """One key head for four query heads, float32: within float32 error of the float64
    oracle, through the band by position."""
    pe = small_clip_module("bert_relative_key_query")
    serve_short(monkeypatch, pe)
    served = layouts(monkeypatch, pe)
    q, k, v = inputs(kv_heads=1)
    given = {"causal": True, **CASES["queries between keys"]}
    want = pe(q, k, v, backend="eager", **given)
    got = pe.float()(q.float(), k.float(), v.float(), backend="sdpa", **given)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    assert served == [True]


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_a_global_content_term_beside_one_projection_trains(
    rotate: bool, causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BERT relative_key (one query-side projection) with a global position_content term
    u . k_j (a "content" part, one value per key), with and without RoPE on the content:
    a training step at explicit positions reads the band span by span
    (``TrainedBand``), and its backward adds dS summed over each span's queries into the
    content part's keys, where ``PositionedParts.add_gradient`` asserted every part had
    a diagonal. Gradients into q, k, v, the table and u equal the oracle's."""
    global_term = "  position_content:\n    global: {placement: before_scale, init_std: 0.3}\n"
    edits = [
        ("max_distance: 511", "max_distance: 2"),
        ("  position_content: drop\n", global_term),
    ]
    if rotate:
        edits.append(
            (
                "  content_content: keep\n",
                "  content_content:\n    rotate: {base: 100, pairing: half}\n",
            )
        )
    name = "bert_relative_key_global" + ("_rope" if rotate else "")
    torch.manual_seed(3)
    pe = spec_variant("bert_relative_key", *edits, name=name)(heads=4, head_dim=8).double()
    with torch.no_grad():
        for parameter in pe.parameters():
            parameter.normal_(std=0.3)
    serve_short(monkeypatch, pe)
    by_span = spy_calls(monkeypatch, runtime_modules(pe), "TrainedBand", lambda *args: 1)
    assert_sdpa_matches_eager(pe, N, M, 2, causal=causal, **CASES["stride 2"])
    assert by_span == [1]


def t5_module(name: str = "t5") -> torch.nn.Module:
    """The catalogue's T5 bias (32 buckets, clipped at 128), 4 heads of width 8, float64,
    with a table drawn from a normal distribution (its zeros would hide a wrong row);
    "t5_inside_scale": T5 with a 1/sqrt(d) scale that its bias sits inside of."""
    torch.manual_seed(0)
    if name == "t5_inside_scale":
        inside = spec_variant(
            "t5",
            ("scale: none ", "scale: inv_sqrt_head_dim "),
            ("placement: after_scale", "placement: before_scale"),
            name=name,
        )
        pe = inside(heads=4, head_dim=8).double()
    else:
        pe = generated_class(name)(heads=4, head_dim=8).double()
    with torch.no_grad():
        pe.relative_attention_bias.weight.normal_()
    return pe


T5_N, T5_M = 300, 400
T5_CASES: dict[str, dict[str, torch.Tensor]] = {
    "stride 2": {
        "q_positions": 2 * torch.arange(T5_M - T5_N, T5_M) + 5,
        "k_positions": 2 * torch.arange(T5_M) + 5,
    },
    "batched": {
        "q_positions": torch.stack(
            [3 * torch.arange(T5_M - T5_N, T5_M), torch.arange(T5_M - T5_N, T5_M) + 7]
        ),
        "k_positions": torch.stack([3 * torch.arange(T5_M), torch.arange(T5_M) + 7]),
    },
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", sorted(T5_CASES))
@pytest.mark.parametrize("name", ["t5", "t5_decoder", "t5_inside_scale"])
def test_a_clipped_bias_at_positions_matches_eager_with_gradients(
    name: str, case: str, causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """T5's bias (one row per direction past 128) at explicit sorted positions, chunks
    of 64 queries: the far keys run as flash attention with the end entry added to
    their log-sum-exp, the band reads the bias per pair (with autograd, span by span:
    ``TrainedBand``). Output and gradients into q, k, v and the table equal the eager
    oracle's, and so does a call without autograd."""
    pe = t5_module(name)
    serve_short(monkeypatch, pe, rows=64)
    served = layouts(monkeypatch, pe)
    route = spy_query_shapes(monkeypatch, pe, "clipped_relative_attention")
    by_span = spy_calls(monkeypatch, runtime_modules(pe), "TrainedBand", lambda *args: 1)
    assert_sdpa_matches_eager(pe, T5_N, T5_M, 2, causal=causal, **T5_CASES[case])
    q, k, v = inputs(T5_N, T5_M)
    with torch.no_grad():
        got = pe(q, k, v, causal=causal, backend="sdpa", **T5_CASES[case])
        want = pe(q, k, v, causal=causal, backend="eager", **T5_CASES[case])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert served == [True] * 2
    assert route == [(2, 4, T5_N, 8)] * 2
    assert by_span == [1]  # the call with autograd


@pytest.mark.parametrize("causal", [False, True])
def test_t5_at_explicit_positions_matches_the_paper_formula(causal: bool, monkeypatch) -> None:
    """The catalogue's T5 with 300 queries 3 apart against 400 keys at uneven sorted
    positions, against softmax(q_i . k_j + table[bucket(s_j - p_i), h]) v (Raffel et
    al. 2020; no 1/sqrt(d)) written out in float64 (tests/reference/formulas.py)."""
    pe = t5_module()
    serve_short(monkeypatch, pe, rows=64)
    route = spy_query_shapes(monkeypatch, pe, "clipped_relative_attention")
    generator = torch.Generator().manual_seed(8)
    q = torch.randn(1, 4, T5_N, 8, generator=generator, dtype=F64)
    k, v = (torch.randn(1, 4, T5_M, 8, generator=generator, dtype=F64) for _ in "kv")
    q_positions = 3 * torch.arange(T5_N) + 100
    k_positions = torch.randint(1, 5, (T5_M,), generator=generator).cumsum(0)  # gaps of 1 to 4
    table = pe.relative_attention_bias.weight.detach()
    bias = formulas.t5_bias(table, q_positions, k_positions, True, 32, 128)  # [H, N, M]
    causal_at = {"causal_q_positions": q_positions, "causal_k_positions": k_positions}
    expected = formulas.attention(q, k, v, bias, scale=1.0, **(causal_at if causal else {}))
    out = pe(
        q, k, v, causal=causal, backend="sdpa", q_positions=q_positions, k_positions=k_positions
    )
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)
    assert route == [(1, 4, T5_N, 8)]
