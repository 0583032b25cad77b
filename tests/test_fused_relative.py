"""The fused kernel's forward with relative terms read from their projections
(``fused_relative_attention``) and the flex backend's route to it, against float64
oracles.

softmax(q kᵀ · s + P[b, h, i, d(j - i)] + P'[b, h, j, d'(j - i)] + mask) v is written
out score by score here: a query-side term (BERT's relative_key, DeBERTa's c2p,
Transformer-XL's (q_i + v) · R) and a key-side one (relative_key_query's and DeBERTa's
p2c, Transformer-XL's u · k_j: row 0 for every query), each row from its diagonal. The
kernels run on CPU tensors under TRITON_INTERPRET=1 (``interpret_distance_kernels``),
on small shapes: the interpreter runs each program in NumPy, and half precision is
checked in float16 (see tests/test_fused_distance.py).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import torch

import generated._flex_backend as flex_backend
import generated._fused_distance as runtime
from generated._terms import RelativePart
from tests.conftest import (
    generated_class,
    interpret_distance_kernels,
    needs_triton,
    run_backend,
    runtime_modules,
    set_runtime,
    small_clip_variant,
    spy_calls,
)

pytestmark = needs_triton

RelativeRows = runtime.RelativeRows


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    interpret_distance_kernels(monkeypatch)
    yield runtime


def formula(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    query_rows: RelativeRows | None,
    key_rows: RelativeRows | None,
    causal: bool,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 softmax(q kᵀ scale + relative terms + mask) v and the row log-sum-exp,
    every score's terms gathered from their tables (differentiable in q, k, v and the
    tables); query i at position i + M - N; key head h // (H / H_kv) serves query head
    h."""
    q, k, v = q.double(), k.double(), v.double()
    batch, heads, n = q.shape[:3]
    m = k.shape[2]
    groups = heads // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * scale  # [B, H, N, M]
    index = torch.arange(m)[None, :] - torch.arange(n)[:, None] + n - 1  # [N, M]
    for rows, query_side in ((query_rows, True), (key_rows, False)):
        if rows is None:
            continue
        table = rows.scores.double()  # [B, H, N or M, K]
        row = torch.zeros_like(index) if rows.diagonal is None else rows.diagonal.long()[index]
        if query_side:  # table[b, h, i, row[i, j]]
            spread = table[:, :, :, None, :].expand(batch, heads, n, m, table.shape[-1])
        else:  # table[b, h, j, row[i, j]]
            spread = table[:, :, None, :, :].expand(batch, heads, n, m, table.shape[-1])
        picked = row[None, None, :, :, None].expand(batch, heads, n, m, 1)
        scores = scores + spread.gather(4, picked)[..., 0]
    r = torch.arange(m)[None, :] - (torch.arange(n)[:, None] + m - n)  # key - query position
    allowed = torch.ones(n, m, dtype=torch.bool)
    if causal:
        allowed &= r <= 0
    if window is not None:
        allowed &= r.abs() < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def _rows(
    form: str | None, batch: int, heads: int, length: int, n: int, m: int, generator: Any
) -> RelativeRows | None:
    """A term of ``form``: "table" (7 rows, a random diagonal), "clip 3" or "clip 2"
    (the rows of key minus query position clipped at 3 or 2, with the ends past which
    the diagonal is constant, so that tiles past the clip read one value per row),
    "row0" (no diagonal: one value per query or key) or None (no term)."""
    if form is None:
        return None
    rows = 1 if form == "row0" else 7
    scores = torch.randn(batch, heads, length, rows, generator=generator)
    if form == "row0":
        return RelativeRows(scores, None)
    if form.startswith("clip"):
        clip = int(form.split()[1])
        distance = torch.arange(n + m - 1) - (m - 1)  # j - i - (M - N) at index j - i + N - 1
        diagonal = (distance.clamp(-clip, clip) + clip).int()
        return RelativeRows(scores, diagonal, m - 1 - clip, m - 1 + clip)
    diagonal = torch.randint(0, rows, (n + m - 1,), generator=generator, dtype=torch.int32)
    return RelativeRows(scores, diagonal)


def _assert_kernel_matches_formula(
    n: int,
    m: int,
    forms: tuple[str | None, str | None],
    causal: bool,
    window: int | None,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Outputs, lse and the gradients into q, k, v and both terms' scores against the
    float64 formula."""
    generator = torch.Generator().manual_seed(n * 100 + m)
    # one batch entry (the interpreter runs each program in NumPy; the modules' tests
    # below take two), two key/value heads for four query heads
    q = torch.randn(1, 4, n, 16, generator=generator)
    k = torch.randn(1, 2, m, 16, generator=generator)  # grouped-query heads
    v = torch.randn(1, 2, m, 32, generator=generator)  # value width != head width
    weight = torch.randn(1, 4, n, 32, generator=generator)  # d loss / d out
    terms = [_rows(forms[0], 1, 4, n, n, m, generator), _rows(forms[1], 1, 4, m, n, m, generator)]
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    leaves += [rows.scores.requires_grad_() for rows in terms if rows is not None]
    out, lse = runtime.fused_relative_attention(
        *leaves[:3], 0.3, *terms, causal=causal, window=window
    )
    grads = torch.autograd.grad((out * weight.to(dtype)).sum(), leaves)
    wide = [t.detach().double().requires_grad_() for t in leaves]
    wide_terms = iter(wide[3:])
    wide_rows = [None if rows is None else rows._replace(scores=next(wide_terms)) for rows in terms]
    want, want_lse = formula(*wide[:3], 0.3, *wide_rows, causal, window)
    want_grads = torch.autograd.grad((want * weight.double()).sum(), wide)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(lse.double(), want_lse, rtol=tolerance, atol=tolerance)
    names = ["q", "k", "v"] + [
        side for side, rows in zip(("query", "key"), terms, strict=True) if rows
    ]
    for name, got, expected in zip(names, grads, want_grads, strict=True):
        scale = max(expected.abs().max().item(), 1.0)
        torch.testing.assert_close(
            got.double(),
            expected,
            rtol=tolerance,
            atol=tolerance * scale,
            msg=lambda text, name=name: f"grad {name}: {text}",
        )


# a window of 15: the tile below the diagonal has r = -15 = -window, just outside
MASKS = [(False, None), (True, None), (False, 15), (True, 7)]
FORMS = [
    ("table", "table"),
    ("table", None),
    (None, "table"),
    ("row0", "row0"),
    ("clip 3", "clip 2"),
]


@pytest.mark.parametrize(("causal", "window"), MASKS)
@pytest.mark.parametrize("forms", FORMS)
def test_the_kernel_matches_the_formula(interpreted, forms, causal, window) -> None:
    _assert_kernel_matches_formula(20, 37, forms, causal, window)


@pytest.mark.parametrize(("n", "m"), [(1, 33), (16, 16), (5, 5)])
def test_queries_are_the_last_n_keys_and_edges_are_masked(interpreted, n, m) -> None:
    _assert_kernel_matches_formula(n, m, ("table", "table"), True, None)


@pytest.mark.parametrize(("n", "m"), [(48, 48), (20, 70)])
def test_tiles_past_either_end_of_a_clip_read_its_end_rows(interpreted, n, m) -> None:
    # 16-wide tiles: at (48, 48) the corner tiles lie wholly past clip 2 on each side
    _assert_kernel_matches_formula(n, m, ("clip 2", "clip 3"), False, None)


def test_float16_stays_within_float16_error(interpreted) -> None:
    _assert_kernel_matches_formula(20, 37, ("table", "row0"), False, None, torch.float16)


def test_expanded_and_strided_projections_are_read_through_their_strides(interpreted) -> None:
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 24, 16, generator=generator) for _ in range(3))
    per_head = torch.randn(4, 5, generator=generator)  # [H, K], the same for every query
    shared = RelativeRows(
        per_head[None, :, None, :].expand(2, 4, 24, 5),
        torch.randint(0, 5, (47,), generator=generator, dtype=torch.int32),
    )
    wide = torch.randn(2, 4, 9, 24, generator=generator)  # [B, H, K, M]: transposed
    keyed = RelativeRows(wide.transpose(2, 3), torch.zeros(47, dtype=torch.int32) + 8)
    out, _ = runtime.fused_relative_attention(q, k, v, 0.25, shared, keyed, causal=True)
    want, _ = formula(q, k, v, 0.25, shared, keyed, True, None)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_bad_arguments_raise_value_errors_naming_them(interpreted) -> None:
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    table = torch.randn(1, 2, 8, 3)
    diagonal = torch.zeros(15, dtype=torch.int32)
    ramp = (torch.arange(15) // 7).int()  # rows 0 (7 times), 1 (7 times), 2
    cases = {
        "query_rows.scores must be \\[1, 2, 8, K\\]": (RelativeRows(table[:, :1], diagonal), None),
        "key_rows.scores must be float32": (None, RelativeRows(table.double(), diagonal)),
        "query_rows.diagonal must be int32 \\[15\\]": (
            RelativeRows(table, diagonal.long()),
            None,
        ),
        "key_rows.diagonal must be int32 \\[15\\]": (None, RelativeRows(table, diagonal[:14])),
        "query_rows.diagonal must hold rows in \\[0, 3\\)": (
            RelativeRows(table, diagonal + 3),
            None,
        ),
        "key_rows.below and .above must be": (None, RelativeRows(table, ramp, 7)),
        "query_rows.below and .above must be": (RelativeRows(table, ramp, 0, 13), None),
    }
    for message, (query_rows, key_rows) in cases.items():
        with pytest.raises(ValueError, match=message):
            runtime.fused_relative_attention(q, k, v, 1.0, query_rows, key_rows)
    with pytest.raises(ValueError, match="k's heads must divide"):
        runtime.fused_relative_attention(q, k[:, :, :4], v[:, :, :4], 1.0)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_nothing_is_served_where_the_devices_are_not_listed(monkeypatch) -> None:
    # the relative route stays off until the kernel is timed against flex on a GPU
    assert flex_backend.FUSED_RELATIVE_DEVICES == set()
    pe = generated_class("bert_relative_key")(heads=2, head_dim=16)
    calls = spy_calls(
        monkeypatch, runtime_modules(pe), "distance_attention_forward", lambda *_, **__: 1
    )
    with torch.no_grad():
        pe(*(torch.randn(1, 2, 8, 16) for _ in range(3)), backend="flex")
    assert calls == []


# ---- the generated modules' flex backend on the fused relative route ----

ENCODINGS = ["bert_relative_key", "bert_relative_key_query", "deberta", "transformer_xl"]


def _module(name: str, heads: int = 4) -> torch.nn.Module:
    """``name`` with ``heads`` heads of width 16, clipped near (BERT at 4, DeBERTa's log buckets
    at 12), its parameters drawn at unit scale so that the relative terms matter."""
    torch.manual_seed(7)
    extra = {"model_dim": 32} if name in ("deberta", "transformer_xl") else {}
    cls = generated_class(name) if name == "transformer_xl" else small_clip_variant(name)
    pe = cls(heads=heads, head_dim=16, **extra)
    with torch.no_grad():
        for parameter in pe.parameters():
            parameter.normal_()
    return pe


def spy_terms(pe: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """Serve ``pe``'s runtime interpreted and record which relative terms each forward
    launch of the kernel read ("query", "key", each with "row0" where it has no
    diagonal)."""
    interpret_distance_kernels(monkeypatch, pe)

    def record(*args: Any) -> tuple[str, ...]:
        terms = []
        for side, rows in zip(("query", "key"), args[9:11], strict=True):
            if rows is not None:
                terms.append(side if rows.diagonal is not None else f"{side} row0")
        return tuple(terms)

    return spy_calls(monkeypatch, runtime_modules(pe), "distance_attention_forward", record)


EXPECTED_TERMS = {
    "bert_relative_key": ("query",),
    "bert_relative_key_query": ("query", "key"),
    "deberta": ("query", "key"),
    "transformer_xl": ("query", "key row0"),  # (q_i + v) . R merged, then u . k_j
}


@pytest.mark.parametrize(("causal", "window"), [(False, None), (True, None), (True, 9)])
@pytest.mark.parametrize("name", ENCODINGS)
def test_relative_encodings_run_the_kernel_and_match_eager(name, causal, window, monkeypatch):
    """A forward, and a training step with gradients into q, k, v and every parameter
    (the tables and projections behind the terms), against the eager oracle of a
    float64 copy."""
    pe = _module(name, heads=2)
    terms = spy_terms(pe, monkeypatch)
    generator = torch.Generator().manual_seed(5)
    inputs = {"q": torch.randn(2, 2, 40, 16, generator=generator)}  # one key/value head
    inputs |= {key: torch.randn(2, 1, 56, 16, generator=generator) for key in ("k", "v")}
    options = {"causal": causal, "window": window}
    with torch.no_grad():
        forward = pe(*inputs.values(), backend="flex", **options)
    got, got_grads = run_backend(pe, inputs, "flex", **options)
    oracle = copy.deepcopy(pe).double()
    wide = {key: value.double() for key, value in inputs.items()}
    want, want_grads = run_backend(oracle, wide, "eager", **options)
    assert terms == [EXPECTED_TERMS[name]] * 2
    torch.testing.assert_close(forward.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert len(got_grads) == len(want_grads) == 3 + len(list(pe.parameters()))
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5 * max(w.abs().max(), 1))


def test_float16_modules_stay_within_float16_error(monkeypatch) -> None:
    pe = _module("deberta")
    terms = spy_terms(pe, monkeypatch)
    generator = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 4, 32, 16, generator=generator).half() for _ in range(3))
    with torch.no_grad():
        got = pe(q, k, v, backend="flex", causal=True)
        want = pe(q, k, v, backend="eager", causal=True)  # float32 inside, float16 out
    assert terms == [("query", "key")]
    assert got.dtype == want.dtype == torch.float16
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_route_serves_only_what_it_computes(monkeypatch) -> None:
    pe = _module("bert_relative_key_query")
    terms = spy_terms(pe, monkeypatch)
    q, k, v = (torch.randn(1, 4, 24, 16) for _ in range(3))
    with torch.no_grad():
        pe(q, k, v, backend="flex", k_positions=torch.arange(24) * 2)  # explicit positions
        pe(q, k, v, backend="flex", attn_mask=torch.ones(24, 24, dtype=torch.bool))
        pe(q, k, v, backend="flex", document_ids=torch.zeros(24, dtype=torch.long))
        pe(q.double(), k.double(), v.double(), backend="flex")  # float64
    assert terms == []
    # training steps take the kernels only where FUSED_RELATIVE_TRAINED_DEVICES says
    set_runtime(monkeypatch, "FUSED_RELATIVE_TRAINED_DEVICES", set(), pe)
    pe(q, k, v, backend="flex").sum().backward()  # gradients into the parameters
    pe.requires_grad_(False)
    pe(q.clone().requires_grad_(), k, v, backend="flex").sum().backward()  # into q alone
    assert terms == []
    with torch.no_grad():
        pe(q, k, v, backend="flex")
    assert terms == [("query", "key")]


def test_two_terms_on_one_side_are_left_to_flex(monkeypatch) -> None:
    pe = _module("bert_relative_key")
    interpret_distance_kernels(monkeypatch, pe)
    q, k, v = (torch.randn(1, 4, 8, 16) for _ in range(3))
    diagonal = torch.arange(15) % 3
    query = RelativePart("query", torch.randn(1, 4, 8, 3), diagonal)
    per_head = RelativePart("global", torch.randn(4, 3), diagonal)
    content = RelativePart("content", torch.randn(1, 4, 8), None)
    key = RelativePart("key", torch.randn(1, 4, 8, 3), diagonal)
    with torch.no_grad():
        fused = pe._fused_relative_attention  # type: ignore[operator]
        assert fused(q, k, v, [query, per_head], False, None, None) is None
        assert fused(q, k, v, [content, key], False, None, None) is None
        got = fused(q, k, v, [per_head, content], False, None, None)
    # a vector per head is read alike by every query; u . k_j once per key
    shared = RelativeRows(per_head.scores[None, :, None].expand(1, 4, 8, 3), diagonal.int())
    per_key = RelativeRows(content.scores[..., None], None)
    want, _ = formula(q, k, v, pe.scale, shared, per_key, False, None)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_the_route_finds_where_a_clipped_diagonal_turns_constant() -> None:
    pe = _module("bert_relative_key")  # clipped at 4
    n, m = 6, 10
    distance = torch.arange(n + m - 1) - (m - 1)  # key minus query position per index
    clipped = distance.clamp(-4, 4) + 4
    rows, below, above = pe._kernel_diagonal(clipped, ("test", n, m))  # type: ignore[operator]
    assert rows.dtype == torch.int32 and torch.equal(rows, clipped.int())
    # the last index at distance -4 and the first at distance 4
    assert (below, above) == (m - 1 - 4, m - 1 + 4)
    # a diagonal with one row throughout is constant from either end
    _, below, above = pe._kernel_diagonal(torch.zeros(9, dtype=torch.long), ("flat",))  # type: ignore[operator]
    assert (below, above) == (8, 0)


def test_each_term_gets_its_gradient_whatever_the_other_needs(interpreted) -> None:
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=generator) for _ in range(3))
    query_rows = _rows("table", 1, 2, 20, 20, 20, generator)
    key_rows = _rows("clip 2", 1, 2, 20, 20, 20, generator)
    assert query_rows is not None and key_rows is not None
    for trained, frozen in ((key_rows, query_rows), (query_rows, key_rows)):
        leaf = trained.scores.clone().requires_grad_()
        rows = {id(trained): trained._replace(scores=leaf), id(frozen): frozen}
        terms = (rows[id(query_rows)], rows[id(key_rows)])
        out, _ = runtime.fused_relative_attention(q, k, v, 0.5, *terms)
        (got,) = torch.autograd.grad(out.square().sum(), [leaf])
        wide = leaf.detach().double().requires_grad_()
        wide_terms = [t._replace(scores=wide) if t.scores is leaf else t for t in terms]
        want_out, _ = formula(q, k, v, 0.5, *wide_terms, False, None)
        (want,) = torch.autograd.grad(want_out.square().sum(), [wide])
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
