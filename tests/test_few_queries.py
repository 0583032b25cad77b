"""Relative terms of a few queries (a decode step) on the sdpa backend: no key is
projected over every table row (``few_query_inputs``), terms with one value per key
ride in the queries, and projected rows are kept across calls without gradients
(``_reused_relative_rows``).

Every case is checked against the eager oracle, which builds each term densely from the
index map (outputs, and gradients into q, k, v and every parameter); the kept rows
against a fresh copy of the module, which has nothing kept.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from tests.conftest import (
    HostReads,
    assert_sdpa_matches_eager,
    generated_class,
    runtime_modules,
    set_runtime,
    small_clip_module,
    spec_variant,
    spy_calls,
    spy_query_shapes,
)

F64 = torch.float64
NAMES = ["shaw", "bert_relative_key", "bert_relative_key_query", "deberta", "transformer_xl"]
SHAPES = [  # (n, m, kv_heads)
    (1, 30, 4),  # a decode step with keys past the clip: the far row rides in q
    (3, 30, 2),  # a few queries, grouped-query heads; the window's keys projected
    (2, 30, 4),  # two queries, each near pair reading its own row
    (16, 40, 1),  # the most queries
    (2, 5, 4),  # no key past the clip
    (1, 5, 4),  # one key past BERT's clip
    (1, 1, 4),  # one key
]


def make(name: str) -> torch.nn.Module:
    return small_clip_module(name)


def rows_projected(monkeypatch: pytest.MonkeyPatch, pe: torch.nn.Module) -> list[int]:
    """The number of rows each call of ``pe._relative_rows`` (this instance's) projects."""
    sizes: list[int] = []
    original = pe._relative_rows

    def spy(projection: str, rows: torch.Tensor, *args: object) -> torch.Tensor:
        sizes.append(rows.numel())
        return original(projection, rows, *args)

    monkeypatch.setattr(pe, "_relative_rows", spy)
    return sizes


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("n", "m", "kv_heads"), SHAPES)
@pytest.mark.parametrize("name", NAMES)
def test_few_queries_match_eager_with_gradients(
    name: str, n: int, m: int, kv_heads: int, causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    pe = make(name)
    route = spy_query_shapes(monkeypatch, pe, "few_query_inputs")
    assert_sdpa_matches_eager(pe, n, m, kv_heads, causal=causal)
    assert route == [(2, 4, n, 8)]  # the sdpa call took the path


@pytest.mark.parametrize(("n", "m", "kv_heads"), SHAPES)
def test_distance_rows_of_either_sign_match_eager(
    n: int, m: int, kv_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Transformer-XL's rows are the distances themselves, read as views of kept integer
    ranges (``arange_view``) per sign: the catalogue's i - j and, in a variant, j - i
    give the eager oracle's outputs and gradients, causal or not."""
    flipped = spec_variant(
        "transformer_xl",
        ("sign: query_minus_key", "sign: key_minus_query"),
        name="transformer_xl_key_minus_query",
    )
    torch.manual_seed(3)
    for pe in (make("transformer_xl"), flipped(heads=4, head_dim=8, model_dim=16).double()):
        route = spy_query_shapes(monkeypatch, pe, "few_query_inputs")
        for causal in (False, True):
            assert_sdpa_matches_eager(pe, n, m, kv_heads, causal=causal)
        assert len(route) == 2


def test_a_position_only_term_alone_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative term of the rows alone (Transformer-XL's v . R without the q . R term
    it joins in the catalogue) is read per diagonal as well, its [H, K] projection the
    same for every query: outputs and gradients equal the eager oracle's."""
    alone = spec_variant(
        "transformer_xl",
        ("    relative: {sign: query_minus_key, projection: relative,", ""),
        (" placement: before_scale}\n  position_content", "  position_content"),
        ("  content_position:                            # (b)", "  content_position: drop  #"),
        name="transformer_xl_position_only",
    )
    torch.manual_seed(3)
    pe = alone(heads=4, head_dim=8, model_dim=16).double()
    sides = spy_calls(
        monkeypatch, runtime_modules(pe), "_diagonal_terms", lambda part, *_: part.side
    )
    for n, m, kv_heads in SHAPES:
        for causal in (False, True):
            assert_sdpa_matches_eager(pe, n, m, kv_heads, causal=causal)
    assert sides == ["global"] * 2 * len(SHAPES)


@pytest.mark.parametrize("budget", [1, 3000, None])  # one key at a time; two or three; all
@pytest.mark.parametrize(("n", "kv_heads", "batch"), [(1, 4, 2), (1, 2, 1), (2, 2, 2)])
@pytest.mark.parametrize("name", ["bert_relative_key_query", "deberta"])
def test_key_side_terms_in_chunks_of_keys(
    name: str,
    n: int,
    kv_heads: int,
    batch: int,
    budget: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A key-side term's near keys gathered a few at a time (``KEY_SIDE_CHUNK_BYTES``)
    give the eager oracle's outputs and gradients, causal or not; one query of a batch
    of one takes the products into the gathered rows."""
    pe = make(name)
    set_runtime(monkeypatch, "KEY_SIDE_CHUNK_BYTES", {"cpu": budget}, pe)
    route = spy_query_shapes(monkeypatch, pe, "few_query_inputs")
    for causal in (False, True):
        assert_sdpa_matches_eager(pe, n, 30, kv_heads, batch=batch, causal=causal)
    assert route == [(batch, 4, n, 8)] * 2


@pytest.mark.parametrize("name", NAMES)
def test_grouped_heads_copy_out_no_cache(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under grouped-query heads a decode step copies no cached key or value out per
    query head (``repeat_kv``): a key-side term reads each query head's key-value head
    as it is (or, projecting its few keys near the queries over the rows, copies
    those), and the attention (Shaw's value term's weights too) runs each key-value
    head's query heads as the rows of one matmul; the output equals the eager oracle's."""
    pe = make(name)
    copied = spy_calls(
        monkeypatch, runtime_modules(pe), "repeat_kv", lambda x, groups: x.shape[2] * (groups > 1)
    )
    generator = torch.Generator().manual_seed(6)
    q = torch.randn(1, 4, 1, 8, generator=generator, dtype=F64)
    k, v = (torch.randn(1, 2, 30, 8, generator=generator, dtype=F64) for _ in "kv")
    with torch.no_grad():
        got = pe(q, k, v, causal=True, backend="sdpa")
        keys_copied = max(copied, default=0)  # the most keys one copy took
        want = pe(q, k, v, causal=True, backend="eager")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert keys_copied < 30


AT_POSITIONS = [  # (n, m, kv_heads, batch)
    (1, 30, 2, 1),  # a decode step of a batch of one: the products into the gathered rows
    (1, 30, 4, 2),
    (3, 30, 2, 2),  # a few queries, grouped heads
    (1, 5, 4, 1),  # every key within the clip
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("n", "m", "kv_heads", "batch"), AT_POSITIONS)
@pytest.mark.parametrize("name", NAMES)
def test_few_queries_at_explicit_positions_match_eager(
    name: str, n: int, m: int, kv_heads: int, batch: int, causal: bool, monkeypatch
) -> None:
    """A few queries at explicit positions (keys two apart, as a cache with evicted keys
    has them, the queries among the last keys or past them) read each pair's row of
    their clipped terms, or of Transformer-XL's span of distances
    (``few_query_inputs_at_positions``): outputs and gradients equal the eager
    oracle's."""
    pe = make(name)
    route = spy_query_shapes(monkeypatch, pe, "few_query_inputs_at_positions")
    keys = 3 + 2 * torch.arange(m)
    queries = keys[m - n :] + (0 if causal else 1)
    assert_sdpa_matches_eager(
        pe, n, m, kv_heads, batch=batch, causal=causal, q_positions=queries, k_positions=keys
    )
    assert route == [(batch, 4, n, 8)]  # the sdpa call took the path


@pytest.mark.parametrize(
    ("queries", "keys", "span"),
    [
        ([2, 9], [10, 13, 16, 19, 22], 21),  # every key after the queries: r = 1 .. 20
        ([1_000_061], 1_000_000 + 2 * torch.arange(30), 62),  # far from 0, r = -61 .. -3
        ([5], [0, 3, 5, 9], 10),  # keys on both sides: r = -5 .. 4, at most 4 (N + M)
    ],
)
def test_transformer_xl_at_explicit_positions_reads_a_span_of_distances(
    queries: list[int], keys: list[int] | torch.Tensor, span: int, monkeypatch
) -> None:
    """Transformer-XL's terms at explicit positions of one row, read by distance with
    no clip, come from its rows over a span of distances holding 0 and every key minus
    query position present (``_relative_factors_at_positions``), each pair reading its
    own entry: outputs and gradients equal the eager oracle's, and without gradients
    the rows projected are the span's (kept, then read as a slice)."""
    pe = make("transformer_xl")
    route = spy_query_shapes(monkeypatch, pe, "few_query_inputs_at_positions")
    given = {"q_positions": torch.tensor(queries), "k_positions": torch.as_tensor(keys)}
    n, m = len(queries), given["k_positions"].numel()
    assert_sdpa_matches_eager(pe, n, m, 2, batch=1, **given)
    sizes = rows_projected(monkeypatch, pe)
    q, k, v = torch.randn(1, 4, n, 8, dtype=F64), *torch.randn(2, 1, 2, m, 8, dtype=F64)
    with torch.no_grad():
        got = pe(q, k, v, backend="sdpa", **given)
    assert sizes == [span]
    torch.testing.assert_close(got, pe(q, k, v, backend="eager", **given))
    assert route == [(1, 4, n, 8)] * 2  # both sdpa calls took the path


def test_transformer_xl_at_sparse_positions_keeps_the_dense_terms(monkeypatch) -> None:
    """Past a span of ``DISTANCE_VECTOR_PER_POSITION`` (N + M) distances (here 4 (1 +
    3) = 16 against 51), and for batched positions, Transformer-XL's terms at explicit
    positions stay dense, over the distances present."""
    pe = make("transformer_xl")
    route = spy_query_shapes(monkeypatch, pe, "few_query_inputs_at_positions")
    given = {"q_positions": torch.tensor([50]), "k_positions": torch.tensor([0, 25, 50])}
    assert_sdpa_matches_eager(pe, 1, 3, 2, batch=1, **given)
    batched = {
        "q_positions": torch.tensor([[5], [6]]),
        "k_positions": torch.tensor([[0, 3, 5]] * 2),
    }
    assert_sdpa_matches_eager(pe, 1, 3, 2, **batched)
    assert route == []


def test_shaw_weights_take_the_plain_softmax_where_every_row_reads(monkeypatch) -> None:
    """Shaw's decode step forms its weights itself (for the value term): at default
    positions with no attn_mask every query reads its own key, so the plain softmax
    serves; with an attn_mask that masks a batch row's every key, the softmax that
    gives that row zeros. Outputs and gradients equal the eager oracle's."""
    pe = make("shaw")
    careful = spy_query_shapes(monkeypatch, pe, "masked_softmax_in_place")
    assert_sdpa_matches_eager(pe, 1, 30, 2, causal=True)
    assert_sdpa_matches_eager(pe, 2, 30, 2, window=3, causal=True)
    assert careful == []
    keep = torch.ones(2, 1, 1, 30, dtype=torch.bool)
    keep[1] = False  # batch row 1 reads no key: zeros
    assert_sdpa_matches_eager(pe, 1, 30, 2, attn_mask=keep)
    assert careful == [(2, 4, 1, 30)]


@pytest.mark.parametrize("budget", [1, 3000])
def test_pair_rows_in_chunks_of_keys(budget: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each pair's row gathered a few keys at a time (``KEY_SIDE_CHUNK_BYTES``), batch
    rows and grouped heads too: outputs and gradients equal the eager oracle's; batched
    positions keep the dense terms."""
    pe = make("deberta")
    set_runtime(monkeypatch, "KEY_SIDE_CHUNK_BYTES", {"cpu": budget}, pe)
    route = spy_query_shapes(monkeypatch, pe, "few_query_inputs_at_positions")
    keys = 3 + 2 * torch.arange(30)
    given = {"q_positions": keys[-2:], "k_positions": keys}
    for batch in (1, 2):
        assert_sdpa_matches_eager(pe, 2, 30, 2, batch=batch, causal=True, **given)
    batched = {name: t.expand(2, -1) for name, t in given.items()}
    assert_sdpa_matches_eager(pe, 2, 30, 2, causal=True, **batched)
    assert route == [(1, 4, 2, 8), (2, 4, 2, 8)]


@pytest.mark.parametrize("positions", [False, True])
@pytest.mark.parametrize("name", ["cope", "shaw", "bert_relative_key"])
def test_dense_terms_under_grouped_heads_copy_out_no_values(
    name: str, positions: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dense terms (CoPE's decode step; the relative tables at explicit positions)
    under grouped-query heads: CoPE's gates and Shaw's weights come from each key-value
    head's query heads as the rows of one matmul, and the attention runs on the grouped
    heads, so no key (bar a key-side term's, none here) or value is copied out per query
    head (``repeat_kv``); outputs equal the eager oracle's."""
    pe = generated_class(name)(heads=4, head_dim=8).double()
    copied = spy_calls(
        monkeypatch, runtime_modules(pe), "repeat_kv", lambda x, groups: x.shape[2] * (groups > 1)
    )
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(1, 4, 1, 8, generator=generator, dtype=F64)
    k, v = (torch.randn(1, 2, 30, 8, generator=generator, dtype=F64) for _ in "kv")
    given = {"q_positions": torch.tensor([61]), "k_positions": 2 * torch.arange(30)}
    options = {"causal": True, **(given if positions else {})}
    with torch.no_grad():
        got = pe(q, k, v, backend="sdpa", **options)
        keys_copied = max(copied, default=0)
        want = pe(q, k, v, backend="eager", **options)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert keys_copied == 0


@pytest.mark.parametrize("name", ["bert_relative_key_query", "deberta", "transformer_xl"])
def test_few_queries_with_masks(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A window, a boolean and an additive attn_mask, and packed documents go on top of
    the terms, as on the dense path."""
    pe = make(name)
    route = spy_query_shapes(monkeypatch, pe, "few_query_inputs")
    generator = torch.Generator().manual_seed(6)
    n, m = 3, 30
    keep = torch.rand(2, 1, n, m, generator=generator) > 0.3
    keep[..., -1] = True  # every query keeps a key
    additive = torch.randn(2, 4, n, m, generator=generator, dtype=F64)
    documents = torch.zeros(2, m, dtype=torch.int64)
    documents[:, 12:] = 1
    cases: list[dict[str, object]] = [
        {"window": 5, "causal": True},
        {"attn_mask": keep},
        {"attn_mask": additive, "causal": True},
        {"document_ids": documents, "causal": True},
    ]
    for options in cases:
        assert_sdpa_matches_eager(pe, n, m, 2, **options)
    assert len(route) == len(cases)


def test_more_queries_or_explicit_positions_build_dense_terms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past FEW_QUERY_RELATIVE_MAX_QUERIES, and at explicit positions, the terms come
    from ``_relative_terms`` (dense, per pair); a lower setting is obeyed."""
    pe = make("deberta")
    route = spy_query_shapes(monkeypatch, pe, "few_query_inputs")
    q, k, v = (torch.randn(1, 4, 17, 8, dtype=F64) for _ in range(3))
    with torch.no_grad():
        pe(q, k, v, backend="sdpa")  # 17 queries
        positions = torch.arange(0, 34, 2)  # no shift of the defaults (which take the route)
        pe(q[:, :, :2], k, v, q_positions=positions[-2:], k_positions=positions, backend="sdpa")
        assert route == []
        set_runtime(monkeypatch, "FEW_QUERY_RELATIVE_MAX_QUERIES", 2, pe)
        pe(q[:, :, :3], k, v, backend="sdpa")
        assert route == []
        pe(q[:, :, :2], k, v, backend="sdpa")
    assert route == [(1, 4, 2, 8)]


@pytest.mark.parametrize("name", ["bert_relative_key_query", "deberta", "transformer_xl"])
def test_bfloat16_within_bfloat16_error(name: str) -> None:
    pe = make(name).float()
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 1, 8, generator=generator)
    k, v = (torch.randn(2, 2, 40, 8, generator=generator) for _ in range(2))
    want = pe(q, k, v, backend="eager")  # float32, from the rounded inputs below
    low = [t.bfloat16() for t in (q, k, v)]
    got = pe(*low, backend="sdpa")
    assert got.dtype == torch.bfloat16
    want = pe(*(t.float() for t in low), backend="eager")
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_transformer_xl_reads_one_query_side_projection() -> None:
    """(q_i + v) . R: the position-only term folds into the query-side one (Dai et al.
    2019, eq. 2), whose rows and diagonals it shares; u . k_j stays per key."""
    pe = make("transformer_xl")
    q, k = torch.randn(1, 4, 3, 8, dtype=F64), torch.randn(1, 4, 9, 8, dtype=F64)
    parts = pe._relative_parts(q, k, F64)
    assert parts is not None
    assert [part.side for part in parts] == ["query", "content"]
    factors = pe._relative_factors(q, k, F64)
    query, position = factors[0], factors[1]
    rows = (query.rows * query.scale).transpose(0, 1)  # [H, K, D]
    want = torch.einsum("bhnd,hkd->bhnk", q + position.x[None, :, None, :], rows)
    torch.testing.assert_close(parts[0].scores, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["deberta", "transformer_xl"])
def test_a_decode_loop_projects_its_rows_a_few_times(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without gradients the projected rows are kept: DeBERTa's table is projected once
    per projection, Transformer-XL's block of distances doubles as the cache grows (16
    keys, then 32, then 64), and each step equals a fresh module with nothing kept."""
    pe = make(name)
    fresh = copy.deepcopy(pe)
    calls = rows_projected(monkeypatch, pe)
    generator = torch.Generator().manual_seed(8)
    keys = torch.randn(1, 2, 48, 8, generator=generator, dtype=F64)
    values = torch.randn(1, 2, 48, 8, generator=generator, dtype=F64)
    steps = 0
    for m in range(16, 49):
        q = torch.randn(1, 4, 1, 8, generator=generator, dtype=F64)
        with torch.no_grad():
            got = pe(q, keys[:, :, :m], values[:, :, :m], causal=True, backend="sdpa")
        want = fresh(q, keys[:, :, :m], values[:, :, :m], causal=True, backend="eager")
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        steps += 1
    assert len(calls) == (2 if name == "deberta" else 3) < steps  # one per projection
    # the kept blocks: distances heads first ([H, K, D], so that a query's projection over
    # them reads each head's rows at once), table rows rows first (gathered per key)
    with torch.no_grad():
        kept = pe._kept_relative_rows(F64, keys.device)
    assert kept is not None
    for _, block in kept.values():
        if name == "transformer_xl":
            assert block.shape[0] == 4 and block.is_contiguous()  # [H, K, D]
        else:
            assert block.shape[1] == 4 and block.is_contiguous()  # [K, H, D]


def test_a_decode_step_compares_the_parameters_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeBERTa reads two kept projections a step (W_k R and W_q R); the parameters are
    compared with their kept copy once per step, not once per projection."""
    pe = make("deberta")
    runtime = pe._kept_relative_rows.__func__.__globals__  # the runtime the module imports
    compare = runtime["parameters_unchanged"]
    comparisons: list[int] = []

    def counting(module: torch.nn.Module, snapshot: tuple[torch.Tensor, ...]) -> bool:
        comparisons.append(1)
        return bool(compare(module, snapshot))

    monkeypatch.setitem(runtime, "parameters_unchanged", counting)
    generator = torch.Generator().manual_seed(10)
    keys, values = (torch.randn(1, 2, 30, 8, generator=generator, dtype=F64) for _ in range(2))
    fresh = copy.deepcopy(pe)
    for _ in range(4):
        q = torch.randn(1, 4, 1, 8, generator=generator, dtype=F64)
        with torch.no_grad():
            got = pe(q, keys, values, causal=True, backend="sdpa")
        want = fresh(q, keys, values, causal=True, backend="eager")
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert len(comparisons) == 3  # the first step projects; each later one compares once


def test_kept_distances_grow_on_both_sides() -> None:
    """Transformer-XL's kept block of distances i - j grows down (more queries reach
    negative distances) and up (more keys), and serves calls inside it."""
    pe = make("transformer_xl")
    fresh = copy.deepcopy(pe)
    generator = torch.Generator().manual_seed(9)
    for n, m in [(1, 20), (3, 20), (1, 50), (12, 12), (2, 7)]:
        q = torch.randn(1, 4, n, 8, generator=generator, dtype=F64)
        k, v = (torch.randn(1, 2, m, 8, generator=generator, dtype=F64) for _ in range(2))
        with torch.no_grad():
            got = pe(q, k, v, backend="sdpa")
        torch.testing.assert_close(got, fresh(q, k, v, backend="eager"), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("at_once", [False, True])
@pytest.mark.parametrize("update", ["in_place", "load_state_dict", "data", "edit_through_data"])
@pytest.mark.parametrize("name", ["deberta", "transformer_xl"])
def test_an_update_of_the_parameters_is_seen(
    name: str, update: str, at_once: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept rows are dropped after any update of the parameters, compared one parameter
    at a time (``torch.equal``) or all at once with one read (a GPU's form, on
    ``PARAMETERS_COMPARED_AT_ONCE`` devices)."""
    pe = make(name)
    if at_once:
        set_runtime(monkeypatch, "PARAMETERS_COMPARED_AT_ONCE", {"cpu"}, pe)
    q, k, v = torch.randn(1, 4, 1, 8, dtype=F64), *(torch.randn(1, 4, 20, 8, dtype=F64),) * 2
    with torch.no_grad():
        before = pe(q, k, v, backend="sdpa")  # rows kept
        changed = {key: value * 1.5 for key, value in pe.state_dict().items()}
        if update == "in_place":
            for parameter in pe.parameters():
                parameter.mul_(1.5)
        elif update == "data":  # a new tensor: the version counter stays as it was
            for parameter in pe.parameters():
                parameter.data = parameter.data * 1.5
        elif update == "edit_through_data":  # an EMA-style edit: .data counts no version
            for parameter in pe.parameters():
                parameter.data.mul_(1.5)
        else:
            pe.load_state_dict(changed)
        after = pe(q, k, v, backend="sdpa")
    fresh = make(name)
    fresh.load_state_dict(changed)
    want = fresh(q, k, v, backend="eager")
    torch.testing.assert_close(after, want, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(before, after)


def test_rows_kept_in_inference_mode_are_not_saved_for_backward() -> None:
    pe = make("deberta")
    q = torch.randn(1, 4, 1, 8, dtype=F64)
    k = torch.randn(1, 4, 20, 8, dtype=F64, requires_grad=True)
    v = torch.randn(1, 4, 20, 8, dtype=F64)
    with torch.inference_mode():
        pe(q, k, v, backend="sdpa")
    pe.requires_grad_(False)  # rows may be kept again, but not the inference ones
    got = pe(q, k, v, backend="sdpa")
    (grad,) = torch.autograd.grad(got.sum(), k)
    want = pe(q, k, v, backend="eager")
    (want_grad,) = torch.autograd.grad(want.sum(), k)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)


def test_far_apart_positions_do_not_project_the_range_between(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Transformer-XL's rows are distances: explicit positions a million apart project
    the three distances present, not a million rows."""
    pe = make("transformer_xl")
    sizes = rows_projected(monkeypatch, pe)
    q, k, v = (torch.randn(1, 4, 2, 8, dtype=F64) for _ in range(3))
    positions = torch.tensor([0, 1_000_000])
    with torch.no_grad():
        got = pe(q, k, v, q_positions=positions, k_positions=positions, backend="sdpa")
    want = pe(q, k, v, q_positions=positions, k_positions=positions, backend="eager")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert sizes and max(sizes) <= 3  # distances -1e6, 0 and 1e6


def test_a_range_far_from_the_kept_block_replaces_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Transformer-XL: distances near a million (both positions shifted far apart), then
    default positions near zero: the second call projects its own few distances, not
    the million between the two ranges."""
    pe = make("transformer_xl")
    sizes = rows_projected(monkeypatch, pe)
    q, k, v = (torch.randn(1, 4, 20, 8, dtype=F64) for _ in range(3))
    far = {"q_positions": torch.arange(1_000_000, 1_000_020), "k_positions": torch.arange(20)}
    with torch.no_grad():
        got_far = pe(q, k, v, backend="sdpa", **far)
        got = pe(q, k, v, backend="sdpa")
    torch.testing.assert_close(got_far, pe(q, k, v, backend="eager", **far))
    torch.testing.assert_close(got, pe(q, k, v, backend="eager"))
    assert sizes and max(sizes) <= 100  # 39 distances a call, grown at most 2x


INDEXED = ["shaw", "bert_relative_key", "bert_relative_key_query", "deberta"]


@pytest.mark.parametrize("name", INDEXED)
def test_each_relative_index_is_monotone_in_the_distance(name: str) -> None:
    """``diagonal_rows`` finds the rows a call reaches at its end distances, which holds
    only for an index monotone in the key minus query position: every index kind of the
    catalogue is (a clip, DeBERTa's signed log buckets), checked over r = -5000 .. 5000
    at the specs' own clips and at a small one."""
    small = importlib.import_module(type(make(name)).__module__)
    for module in (importlib.import_module(f"generated.{name}"), small):
        rows = module._relative_index(torch.arange(-5000, 5001))
        assert (rows.diff() >= 0).all()


@pytest.mark.parametrize("name", INDEXED)
def test_a_decode_loop_gets_the_rows_each_shape_reaches(name: str) -> None:
    """The diagonals' rows of a decode loop (one key more each step, after a prefill,
    causal and not), sliced from a kept index vector with the reached rows found at
    its ends, are those found by scanning the call's own index (min and max of the
    diagonals read, the first M with causal) and count from the least, which the host
    knows too."""
    pe = make(name)
    module = importlib.import_module(type(pe).__module__)
    sign = "query_minus_key"  # the specs' convention; both are checked on the index
    shapes = [(12, 12)] + [(1, m) for m in range(13, 60)] + [(5, 60)]
    for causal in (False, True):
        for n, m in shapes:
            diagonal, rows, first = pe._relative_diagonals(n, m, torch.device("cpu"), sign, causal)
            index = module._relative_index(-torch.arange(-(m - 1), n))  # [N + M - 1]
            reached = index[:m] if causal else index
            low, high = int(reached.min()), int(reached.max())
            assert torch.equal(rows, torch.arange(low, high + 1)) and first == low
            assert torch.equal(diagonal, index.clamp(low, high) - low)


@pytest.mark.parametrize("name", NAMES)
def test_a_decode_loop_reads_no_value_back_from_the_device(name: str) -> None:
    """At default positions the table rows a relative term reads are found on the host
    (the index's ends, ``diagonal_rows``; the first of them goes to
    ``_reused_relative_rows``): a decoding loop, one key more every step, reads no
    tensor's value back (the kept rows' comparison with the parameters, ``torch.equal``,
    aside), and each step equals a fresh copy's eager output."""
    pe = make(name).float()
    fresh = copy.deepcopy(pe)
    generator = torch.Generator().manual_seed(4)
    k, v = (torch.randn(1, 4, 40, 8, generator=generator) for _ in range(2))
    reads = HostReads()
    with torch.no_grad():
        for m in range(20, 40):
            q = torch.randn(1, 4, 1, 8, generator=generator)
            with reads:
                got = pe(q, k[:, :, :m], v[:, :, :m], causal=True)
            want = fresh(q, k[:, :, :m], v[:, :, :m], causal=True, backend="eager")
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert reads.count == 0


def test_kept_rows_are_compared_with_one_read_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On ``PARAMETERS_COMPARED_AT_ONCE`` devices a decode step that reads kept rows
    compares DeBERTa's parameters (its table, LayerNorm and both projections) with one
    read of the device, not one per parameter, and equals a fresh copy's output."""
    pe = make("deberta").float()
    set_runtime(monkeypatch, "PARAMETERS_COMPARED_AT_ONCE", {"cpu"}, pe)
    set_runtime(monkeypatch, "BIAS_FLOOR_DEVICES", set(), pe)
    assert len(list(pe.parameters())) > 2
    fresh = copy.deepcopy(pe)
    generator = torch.Generator().manual_seed(8)
    k, v = (torch.randn(1, 4, 30, 8, generator=generator) for _ in range(2))
    q = torch.randn(1, 4, 1, 8, generator=generator)
    with torch.no_grad():
        pe(q, k[:, :, :29], v[:, :, :29])  # rows projected and kept
        with HostReads() as reads:
            got = pe(q, k, v)
        want = fresh(q, k, v, backend="eager")
    assert reads.count == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_decode_steps_leave_the_parameters_as_they_were(name: str) -> None:
    """The terms that ride in the queries start from the parameters' own rows where
    they need no scale (Transformer-XL's u): decode steps, with and without gradients
    and inside ``parameters_frozen``, never write into a parameter or its kept rows."""
    pe = small_clip_module(name).float()
    before = copy.deepcopy(pe.state_dict())
    generator = torch.Generator().manual_seed(9)
    q = torch.randn(2, 4, 1, 8, generator=generator)
    k, v = (torch.randn(2, 4, 30, 8, generator=generator) for _ in "kv")
    with pe.parameters_frozen(), torch.no_grad():
        first = pe(q, k, v, causal=True)
        again = pe(q, k, v, causal=True)  # the kept rows read once more
    pe(q, k, v, causal=True).sum().backward()
    for key, value in pe.state_dict().items():
        assert torch.equal(value, before[key]), key
    torch.testing.assert_close(again, first, rtol=0, atol=0)
