"""Sliding windows (``window=``) and packed documents (``document_ids=``) on every backend.

The oracle is the eager backend given an explicit boolean ``attn_mask`` that this file
builds on its own, one (query, key) pair at a time, from the positions the module reads
(keys 0 .. M - 1 and queries the last N of them by default) and the documents (query i
reads the keys' entry M - N + i). On CPU flex runs its unfused reference; one test runs
the compiled kernel and checks that a window's block mask skips blocks."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

from tests.conftest import cuda_routes, generated_class, head_dim_for

warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")

ENCODINGS = [
    "nope",
    "rope",
    "alibi",
    "t5",
    "deberta",
    "transformer_xl",
    "kerple_log",
    "tupe_a",
    "cope",
]
BACKENDS = ("eager", "sdpa", "flex", "auto")
BATCH, HEADS, KV_HEADS, N, M = 2, 4, 2, 5, 7

POSITIONS: dict[str, dict[str, torch.Tensor]] = {
    "default": {},
    "explicit": {"q_positions": torch.tensor([3, 4, 6, 8, 9]), "k_positions": torch.arange(7)},
    "batched": {
        "q_positions": torch.tensor([[3, 4, 6, 8, 9], [10, 11, 12, 13, 14]]),
        "k_positions": torch.tensor([[0, 1, 2, 3, 4, 5, 6], [8, 9, 10, 11, 12, 13, 14]]),
    },
}

# keys' documents; the shared one has a document of a single token (key 2)
SHARED_DOCUMENTS = torch.tensor([0, 0, 1, 2, 2, 2, 2])
BATCHED_DOCUMENTS = torch.tensor([[0, 0, 1, 2, 2, 2, 2], [5, 5, 5, 5, 6, 7, 7]])

MASKS: dict[str, dict[str, object]] = {
    "window 2": {"window": 2},
    "window 1": {"window": 1},
    "window past the sequence": {"window": 100},
    # default positions' widest distance is M - 1: only the pair (last query, key 0) is out
    "window of M - 1": {"window": M - 1},
    "documents": {"document_ids": SHARED_DOCUMENTS},
    "batched documents": {"document_ids": BATCHED_DOCUMENTS},
    "window and documents": {"window": 3, "document_ids": BATCHED_DOCUMENTS},
}


def _make(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cls = generated_class(name)
    sizes = {"heads": HEADS, "head_dim": head_dim_for(name, 8)}
    if "model_dim" in inspect.signature(cls.__init__).parameters:
        sizes["model_dim"] = 32  # DeBERTa's and TUPE's position tables: [rows, model_dim]
    return cls(**sizes).eval()


def _inputs(
    pe: torch.nn.Module, n: int = N, m: int = M, batch: int = BATCH
) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(1)
    d = pe.head_dim
    value_dim = getattr(pe, "value_dim", None) or 8
    q = torch.randn(batch, HEADS, n, d, generator=generator, requires_grad=True)
    k = torch.randn(batch, KV_HEADS, m, d, generator=generator, requires_grad=True)
    v = torch.randn(batch, KV_HEADS, m, value_dim, generator=generator, requires_grad=True)
    return q, k, v


def oracle_mask(
    n: int,
    m: int,
    causal: bool,
    window: int | None = None,
    document_ids: torch.Tensor | None = None,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    batch: int = BATCH,
) -> torch.Tensor:
    """bool [batch, 1, n, m], True where query i may attend key j, pair by pair."""
    allowed = torch.zeros(batch, 1, n, m, dtype=torch.bool)
    for b in range(batch):
        for i in range(n):
            for j in range(m):
                qp = int(_row(q_positions, b)[i]) if q_positions is not None else m - n + i
                kp = int(_row(k_positions, b)[j]) if k_positions is not None else j
                ok = True
                if causal and kp > qp:
                    ok = False
                if window is not None and abs(qp - kp) >= window:
                    ok = False
                if document_ids is not None:
                    docs = _row(document_ids, b)
                    if int(docs[m - n + i]) != int(docs[j]):
                        ok = False
                allowed[b, 0, i, j] = ok
    return allowed


def _row(tensor: torch.Tensor, b: int) -> torch.Tensor:
    return tensor if tensor.dim() == 1 else tensor[b if tensor.shape[0] > 1 else 0]


def _outputs_and_grads(
    pe: torch.nn.Module, inputs: list[torch.Tensor], **kwargs: object
) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
    q, k, v = inputs[:3]
    out = pe(q, k, v, **kwargs)
    grads = torch.autograd.grad(out.square().sum(), inputs, allow_unused=True)
    return out, grads


def _assert_same(got: tuple, want: tuple, what: str) -> None:
    out, grads = got
    want_out, want_grads = want
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5, msg=lambda s: f"{what}: {s}")
    for a, b in zip(grads, want_grads, strict=True):
        if b is None:
            assert a is None or not bool(a.any()), what
            continue
        assert a is not None, what
        # parameter gradients sum many scores' contributions: rtol 1e-4 for the order, and
        # an absolute error relative to the gradient's scale (DeBERTa's table: entries up
        # to 108, the row of distance 0 a sum of such terms that cancel to 8e-3; an AMD
        # EPYC's flex summed it 1.2e-5 off eager, 1e-7 of the scale)
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale, msg=lambda s: f"{what}: {s}")


@pytest.mark.parametrize("routes", ["cpu", "cuda"])
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("name", ENCODINGS)
def test_every_backend_equals_eager_with_the_oracle_mask(
    name: str, mask_name: str, routes: str, monkeypatch
) -> None:
    """Outputs and gradients (inputs and parameters) of every backend equal eager given
    the oracle's boolean attn_mask, at default, explicit and batched positions, causal
    and not, with two key/value heads for four query heads, on the CPU's routes and on
    CUDA's (``cuda_routes``). CoPE's count of gates reads other keys, and documents
    bound it where a mask does not (a packed document counts as it would alone:
    tests/test_cope.py), so with documents its oracle is eager with the same documents."""
    if routes == "cuda":
        cuda_routes(monkeypatch)
    pe = _make(name)
    documents_bound_terms = name == "cope" and "document_ids" in MASKS[mask_name]
    q, k, v = _inputs(pe)
    inputs = [q, k, v, *(p for p in pe.parameters() if p.requires_grad)]
    masks = MASKS[mask_name]
    for position_name, positions in POSITIONS.items():
        for causal in (False, True):
            allowed = oracle_mask(N, M, causal, **masks, **positions)  # type: ignore[arg-type]
            if masks.get("window") != 100:
                assert not bool(allowed.all()), "the oracle masks nothing: a vacuous case"
            want = _outputs_and_grads(pe, inputs, attn_mask=allowed, backend="eager", **positions)
            if documents_bound_terms:
                want = _outputs_and_grads(
                    pe, inputs, causal=causal, backend="eager", **masks, **positions
                )
            for backend in BACKENDS:
                if backend == "flex" and pe.has_value_term:
                    continue
                got = _outputs_and_grads(
                    pe, inputs, causal=causal, backend=backend, **masks, **positions
                )
                _assert_same(got, want, f"{backend}, {position_name}, causal={causal}")


@pytest.mark.parametrize("name", ["nope", "rope", "alibi", "t5"])
def test_a_causal_window_of_one_keeps_only_the_diagonal(name: str) -> None:
    """Default positions, causal, window 1: query i sees only key M - N + i, so the
    output is that key's value (query head h reads value head h // 2)."""
    pe = _make(name)
    q, k, v = (t.detach() for t in _inputs(pe))
    want = v.repeat_interleave(HEADS // KV_HEADS, dim=1)[:, :, M - N :]  # [B, H, N, D]
    for backend in BACKENDS:
        got = pe(q, k, v, causal=True, window=1, backend=backend)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=backend)


@pytest.mark.parametrize("name", ["nope", "alibi", "t5", "deberta"])
def test_a_window_past_every_distance_changes_nothing(name: str) -> None:
    pe = _make(name)
    q, k, v = (t.detach() for t in _inputs(pe))
    for position_name, positions in POSITIONS.items():
        # default positions span fewer than M; the others reach 14
        windows = (M, 100, 2**70) if position_name == "default" else (15, 2**70)
        for causal in (False, True):
            for backend in BACKENDS:
                plain = pe(q, k, v, causal=causal, backend=backend, **positions)
                for window in windows:
                    windowed = pe(
                        q, k, v, causal=causal, window=window, backend=backend, **positions
                    )
                    torch.testing.assert_close(windowed, plain, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["nope", "rope", "alibi", "t5", "deberta", "cope", "shaw"])
def test_a_fully_masked_row_is_zeros_with_finite_gradients(name: str) -> None:
    """Queries at 8 and 9 with keys at 0 .. 6 and a causal window of 2: no key is left
    for them (rows 3 and 4), and every backend gives zeros there, gradients finite
    (Shaw's value term: every backend but flex, which refuses it)."""
    pe = _make(name)
    q, k, v = _inputs(pe)
    positions = POSITIONS["explicit"]
    allowed = oracle_mask(N, M, True, 2, None, **positions)
    assert not bool(allowed[..., 3:, :].any()) and bool(allowed[..., :3, :].any(-1).all())
    backends = [b for b in BACKENDS if not (b == "flex" and pe.has_value_term)]
    for backend in backends:
        out = pe(q, k, v, causal=True, window=2, backend=backend, **positions)
        assert bool((out[:, :, 3:] == 0).all()), backend
        assert bool(out[:, :, :3].abs().sum(-1).gt(0).all()), backend
        grads = torch.autograd.grad(out.square().sum(), [q, k, v])
        assert all(bool(g.isfinite().all()) for g in grads), backend
    # documents: query 4 (token 6, document 3) with keys 0 .. 5 only in later positions
    documents = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    late_keys = {"q_positions": torch.tensor([3, 4, 5, 6, 0]), "k_positions": torch.arange(7)}
    allowed = oracle_mask(N, M, True, None, documents, **late_keys)
    assert not bool(allowed[..., 4, :].any())
    for backend in backends:
        out = pe(q, k, v, causal=True, document_ids=documents, backend=backend, **late_keys)
        assert bool((out[:, :, 4] == 0).all()), backend


@pytest.mark.parametrize("name", ["rope", "alibi", "t5", "kerple_log"])
def test_decode_with_a_window_and_documents_matches_the_full_rows(name: str) -> None:
    """One query against M cached keys (rotated once by ``rotate_keys``): the last row of
    the full causal attention, with a window and with documents, on every backend."""
    pe = _make(name)
    q, k, v = (t.detach() for t in _inputs(pe, n=M, m=M))
    cache = pe.rotate_keys(k)
    documents = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [2, 3, 3, 3, 4, 4, 4]])
    for masks in (
        {"window": 3},
        {"document_ids": documents},
        {"window": 2, "document_ids": documents},
    ):
        full = pe(q, k, v, causal=True, backend="eager", **masks)
        plain = pe(q, k, v, causal=True, backend="eager")
        assert not torch.allclose(full[:, :, -1:], plain[:, :, -1:]), "the mask changes nothing"
        for backend in BACKENDS:
            step = pe(
                q[:, :, -1:], cache, v, causal=True, keys_rotated=True, backend=backend, **masks
            )
            torch.testing.assert_close(step, full[:, :, -1:], rtol=1e-5, atol=1e-5)


def test_sdpa_folds_a_window_into_the_distance_vector_and_documents_fall_back() -> None:
    """ALiBi at default positions: a window keeps SDPA on the per-distance view (no
    [H, N, M] bias); documents need the materialised bias. Both equal the oracle."""
    pe = _make("alibi")
    q, k, v = (t.detach() for t in _inputs(pe))
    calls: list[str] = []
    by_distance = pe._sdpa_by_distance
    sdpa_bias = pe._sdpa_bias

    def spy_distance(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append("distance")
        return by_distance(*args, **kwargs)

    def spy_bias(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append("bias")
        return sdpa_bias(*args, **kwargs)

    pe._sdpa_by_distance, pe._sdpa_bias = spy_distance, spy_bias
    pe(q, k, v, causal=True, window=2, backend="sdpa")
    assert calls == ["distance"]
    calls.clear()
    pe(q, k, v, causal=True, document_ids=SHARED_DOCUMENTS, backend="sdpa")
    assert calls == ["bias"]


def test_flex_block_masks_are_cached_per_window_and_skip_blocks() -> None:
    """Default positions: one block mask per (shape, causal, window, device), reused;
    a window keeps fewer key blocks than causal alone, and documents fewer than none."""
    pe = _make("nope")
    cpu = torch.device("cpu")
    length = 512  # four 128-token blocks per side
    causal = pe._flex_block_mask(None, None, 1, length, length, cpu, True)
    windowed = pe._flex_block_mask(None, None, 1, length, length, cpu, True, 128)
    assert pe._flex_block_mask(None, None, 1, length, length, cpu, True, 128) is windowed
    assert pe._flex_block_mask(None, None, 1, length, length, cpu, True, 64) is not windowed
    assert pe._flex_block_mask(None, None, 1, length, length, cpu, False) is None
    assert kept_blocks(causal) == 1 + 2 + 3 + 4  # query block r keeps key blocks 0 .. r
    assert kept_blocks(windowed) == 1 + 2 + 2 + 2  # r - 1 and r
    documents = torch.arange(length) // 256  # two documents of two blocks each
    packed = pe._flex_block_mask(None, None, 1, length, length, cpu, False, None, documents)
    assert kept_blocks(packed) == 2 * 2 + 2 * 2  # of 16 without a mask


def kept_blocks(block_mask: object) -> int:
    """Key blocks a block mask computes: partial ones plus full ones, over query blocks."""
    partial = block_mask.kv_num_blocks  # type: ignore[attr-defined]
    full = block_mask.full_kv_num_blocks  # type: ignore[attr-defined]
    return int(partial.sum()) + (0 if full is None else int(full.sum()))


def test_compiled_flex_skips_blocks_outside_the_window() -> None:
    """The torch.compile'd kernel (CPU: forward only) with a causal window of 128 at
    N = M = 512 equals eager, using the cached block mask that keeps 7 of the causal
    mask's 10 key blocks."""
    pe = _make("alibi")
    pe.flex_compile = True
    q, k, v = (t.detach() for t in _inputs(pe, n=512, m=512, batch=1))
    with torch.no_grad():
        flex = pe(q, k, v, causal=True, window=128, backend="flex")
        eager = pe(q, k, v, causal=True, window=128, backend="eager")
    torch.testing.assert_close(flex, eager, rtol=1e-4, atol=1e-4)
    used = pe._cache[("flex_mask", 512, 512, True, 128, "cpu")]
    assert kept_blocks(used) == 7
    causal = pe._flex_block_mask(None, None, 1, 512, 512, torch.device("cpu"), True)
    assert kept_blocks(causal) == 10


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"window": 0}, "window"),
        ({"window": -3}, "window"),
        ({"window": True}, "window"),
        ({"window": 2.5}, "window"),
        ({"window": "3"}, "window"),
        ({"document_ids": [0, 0, 1, 1, 1, 2, 2]}, "document_ids"),
        ({"document_ids": SHARED_DOCUMENTS.float()}, "document_ids"),
        ({"document_ids": SHARED_DOCUMENTS.bool()}, "document_ids"),
        ({"document_ids": torch.zeros(8, dtype=torch.int64)}, "document_ids"),
        ({"document_ids": torch.zeros(3, 7, dtype=torch.int64)}, "document_ids"),
        ({"document_ids": torch.zeros(2, 1, 7, dtype=torch.int64)}, "document_ids"),
        ({"document_ids": torch.zeros(7, dtype=torch.int64, device="meta")}, "document_ids"),
    ],
)
def test_bad_masks_raise_value_errors_naming_the_argument(kwargs: dict, match: str) -> None:
    pe = _make("alibi")
    q, k, v = (t.detach() for t in _inputs(pe))
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=match):
            pe(q, k, v, backend=backend, **kwargs)


def test_documents_need_the_queries_among_the_keys() -> None:
    """Queries are the last N keys for their documents, so N > M is refused."""
    pe = _make("rope")
    q, k, v = (t.detach() for t in _inputs(pe, n=M, m=N))
    with pytest.raises(ValueError, match="document_ids"):
        pe(q, k, v, q_positions=torch.arange(M), document_ids=torch.zeros(N, dtype=torch.int64))


@pytest.mark.parametrize("name", ["alibi", "rope", "deberta"])
def test_masks_trace_whole_under_fullgraph_compile(name: str) -> None:
    """torch.compile(fullgraph=True) (dynamo only, as tests/test_compile.py) traces the
    window and document masks on eager and sdpa: no graph break, no host sync."""
    torch._dynamo.reset()
    pe = _make(name)
    q, k, v = (t.detach() for t in _inputs(pe, batch=1))
    compiled = torch.compile(pe, fullgraph=True, backend="eager")
    for backend in ("eager", "sdpa"):
        for masks in ({"window": 2}, {"window": 3, "document_ids": SHARED_DOCUMENTS}):
            want = pe(q, k, v, causal=True, backend=backend, **masks)
            got = compiled(q, k, v, causal=True, backend=backend, **masks)
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["nope", "rope", "alibi", "t5", "deberta"])
@pytest.mark.parametrize("dtype", [torch.bool, torch.float64])
def test_a_mask_of_fewer_than_two_dims_broadcasts_on_every_backend(name: str, dtype) -> None:
    """An attn_mask of shape [M] (one value per key) or a 0-d one broadcasts to
    [B, H, N, M] as PyTorch broadcasting reads it: sdpa and eager give the output of
    the same mask expanded to 4 dims."""
    torch.manual_seed(0)
    pe = generated_class(name)(heads=4, head_dim=8).double()
    q = torch.randn(2, 4, 3, 8, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 5, 8, dtype=torch.float64) for _ in "kv")
    per_key = torch.tensor([True, True, False, True, True])
    for mask in (per_key, torch.tensor(True)):
        mask = mask.to(dtype) if dtype == torch.bool else torch.where(mask, 0.0, -3.0)
        want = pe(q, k, v, attn_mask=mask.expand(2, 4, 3, 5), backend="eager")
        for backend in ("eager", "sdpa"):
            got = pe(q, k, v, attn_mask=mask, backend=backend)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_broadcasts_into_agrees_with_torch_broadcast_shapes() -> None:
    """The runtime's cheap shape test (``broadcasts_into``, for in-place sums and fills)
    says True exactly where torch.broadcast_shapes(shape, target) is target."""
    from generated._masks import broadcasts_into

    sizes = (1, 2, 3)
    shapes = [()] + [(a,) for a in sizes] + [(a, b) for a in sizes for b in sizes]
    shapes += [(1, a, 1, b) for a in sizes for b in sizes] + [(2, 3, 1, 2), (3, 1, 3)]
    for shape in shapes:
        for target in shapes:
            try:
                expected = tuple(torch.broadcast_shapes(shape, target)) == target
            except RuntimeError:  # not broadcastable at all
                expected = False
            assert broadcasts_into(shape, target) == expected, (shape, target)
