"""CoPE's count under an attn_mask and at keys stored out of position order, on every
path (the eager oracle, the sdpa backend's counted node and its dense terms), against
an independent float64 formula and x-transformers' Attend with its CoPE.

The reference semantics (Golovneva et al. 2024, arXiv:2405.18719: the paper's code adds
the mask's log to the logits before the sigmoid; x-transformers calls its CoPE on the
logits masked with -max): a key the query may not attend to has gate 0, and the count
p_ij sums the gates of the keys between key j and the query in position order, however
the keys are stored (a ring-buffer cache)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.conftest import (
    cope_beside_x_transformers,
    generated_class,
    run_backend,
    runtime_modules,
    set_runtime,
    spy_calls,
)

F64 = torch.float64
BATCH, HEADS, KV_HEADS, DIM = 2, 4, 2, 8


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    scale: float,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    causal: bool = False,
    attn_mask: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """CoPE attention written from the formula, float64, differentiable: s_ij = scale
    q_i . k_j; g_it = sigmoid(s_it) where the query may read key t (the attn_mask: True,
    or an additive entry above half the dtype's lowest; its document) and t is at or
    before it (CoPE is causal), else 0; p_ij = min(sum of g_it over keys t at or after
    key j in position order (equal positions: in storage order), P - 1); the term
    (1 - w) q_i . e[floor p] + w q_i . e[ceil p], w = p - floor p; out = softmax(s +
    term + mask) v, a row with no key it may read 0. No sort and no cumsum: the keys
    "after" j are a [B, M, M] table of comparisons."""
    b, h, n, _ = q.shape
    m = k.shape[2]
    groups = h // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    kp = (torch.arange(m) if k_positions is None else k_positions).expand(b, m)
    qp = kp[:, m - n :] if q_positions is None else q_positions.expand(b, n)
    s = scale * q @ k.transpose(-1, -2)  # [B, H, N, M]
    before = (kp[:, None, :] <= qp[:, :, None])[:, None]  # [B, 1, N, M]: key <= query
    reads = torch.ones(b, 1, n, m, dtype=torch.bool)
    if causal:
        reads = reads & before
    if document_ids is not None:
        docs = document_ids.expand(b, m)
        reads = reads & (docs[:, m - n :, None] == docs[:, None, :])[:, None]
    additive = torch.zeros((), dtype=F64)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            reads = reads & attn_mask
        else:
            hard = attn_mask <= torch.finfo(attn_mask.dtype).min / 2
            reads = reads & ~hard
            additive = attn_mask.masked_fill(hard, 0.0)
    gates = torch.sigmoid(s) * (reads & before)  # [B, H, N, M]
    index = torch.arange(m)
    later = kp[:, None, :] > kp[:, :, None]  # [B, j, t]: t's position after j's
    tied = (kp[:, None, :] == kp[:, :, None]) & (index[None, :] >= index[:, None])[None]
    counts = torch.einsum("bhit,bjt->bhij", gates, (later | tied).to(F64))
    counts = counts.clamp(max=table.shape[0] - 1)
    projected = q @ table.t()  # [B, H, N, P]
    low, high = counts.floor(), counts.ceil()
    w = counts - low
    term = (1 - w) * projected.gather(-1, low.long()) + w * projected.gather(-1, high.long())
    logits = torch.where(reads, s + term + additive, float("-inf"))
    dead = ~reads.any(-1, keepdim=True)  # [B, 1, N, 1]: no key to read
    weights = torch.softmax(logits.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0)
    return weights @ v


def _cope(dtype: torch.dtype = F64) -> torch.nn.Module:
    torch.manual_seed(0)
    pe = generated_class("cope")(heads=HEADS, head_dim=DIM).to(dtype)
    with torch.no_grad():
        pe.cope_positions.normal_(std=0.5)  # a term the size of the content logits
    return pe


def _inputs(n: int, m: int, seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(BATCH, HEADS, n, DIM, generator=generator, dtype=F64),
        "k": torch.randn(BATCH, KV_HEADS, m, DIM, generator=generator, dtype=F64),
        "v": torch.randn(BATCH, KV_HEADS, m, DIM, generator=generator, dtype=F64),
    }


def _reference_and_grads(
    pe: torch.nn.Module, inputs: dict[str, torch.Tensor], **options: Any
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``run_backend``'s output and gradients (q, k, v, the table) for ``_reference``."""
    leaves = {key: value.clone().requires_grad_() for key, value in inputs.items()}
    table = pe.cope_positions.detach().clone().requires_grad_()
    out = _reference(leaves["q"], leaves["k"], leaves["v"], table, pe.scale, **options)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return out.detach(), [*(leaves[key].grad for key in "qkv"), table.grad]


def _ring(m: int, shift: int) -> torch.Tensor:
    """Positions 0 .. m - 1 stored from slot ``shift`` on, as a ring-buffer cache
    holds them (slots [shift .. m - 1, 0 .. shift - 1])."""
    return torch.arange(m).roll(-shift)


N, M = 12, 16
MASK = torch.rand(BATCH, 1, N, M, generator=torch.Generator().manual_seed(4)) > 0.3
ADDITIVE = torch.randn(HEADS, N, M, generator=torch.Generator().manual_seed(5), dtype=F64)
ADDITIVE = ADDITIVE.masked_fill(ADDITIVE < -0.6, float("-inf"))  # per head
HIDDEN = torch.ones(M, dtype=torch.bool)
HIDDEN[5:9] = False  # keys 5 .. 8 hidden from every query: [M]
RING = _ring(M, 6)
SHUFFLED = torch.stack([RING, torch.randperm(M, generator=torch.Generator().manual_seed(6))])
DOCUMENTS = torch.tensor([0] * 7 + [1] * 9)
CASES: dict[str, dict[str, Any]] = {
    "bool mask": {"attn_mask": MASK},
    "bool mask causal": {"attn_mask": MASK, "causal": True},
    "additive mask": {"attn_mask": ADDITIVE},
    "additive mask causal": {"attn_mask": ADDITIVE, "causal": True},
    "hidden keys causal": {"attn_mask": HIDDEN, "causal": True},
    "documents and mask causal": {"attn_mask": MASK, "document_ids": DOCUMENTS, "causal": True},
    "ring positions": {"k_positions": RING},
    "ring positions causal": {"k_positions": RING, "causal": True},
    "shuffled batched positions causal": {
        "k_positions": SHUFFLED,
        "q_positions": torch.stack([torch.arange(4, 16), torch.arange(2, 14)]),
        "causal": True,
    },
    "ring positions and mask causal": {"k_positions": RING, "attn_mask": MASK, "causal": True},
    # positions restarting at each document, stored out of order within the second
    "shuffled documents causal": {
        "k_positions": torch.cat([torch.arange(7), _ring(9, 4)]),
        "document_ids": DOCUMENTS,
        "attn_mask": HIDDEN,
        "causal": True,
    },
}
#: "node": the sdpa backend's counted node (eager mode, CPU, >= COUNTED_MIN_QUERIES
#: queries), in chunks of 4 queries and count blocks of 4 keys; "dense": the sdpa
#: backend's dense terms in chunks of 4 queries (as on CUDA or under torch.compile);
#: "flex": the flex backend, its score_mod reading the dense terms
PATHS = ("eager", "node", "dense", "flex")
BACKEND_OF = {"eager": "eager", "node": "sdpa", "dense": "sdpa", "flex": "flex"}


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in runtime_modules():
        if module.__name__.endswith("_masks"):
            monkeypatch.setitem(module.SDPA_MASK_CHUNK_BYTES, "cpu", 1)
            monkeypatch.setitem(module.SDPA_QUERY_CHUNK, "cpu", 4)
    set_runtime(monkeypatch, "SDPA_MASK_CHUNK_MIN_ROWS", 4)
    set_runtime(monkeypatch, "COUNT_BLOCK", 4)


def _run(
    pe: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    path: str,
    monkeypatch: pytest.MonkeyPatch,
    **options: Any,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The output and gradients on ``path``, checking that the node ran where asked."""
    with monkeypatch.context() as patch:
        if path == "dense":
            set_runtime(patch, "counted_position_attention_serves", lambda *_: False)
        runs = spy_calls(
            patch, runtime_modules(), "counted_position_attention", lambda *a, **_: True
        )
        got = run_backend(pe, inputs, BACKEND_OF[path], **options)
    assert bool(runs) == (path == "node"), path
    return got


def _assert_matches(
    got: tuple[torch.Tensor, list[torch.Tensor]],
    want: tuple[torch.Tensor, list[torch.Tensor]],
    what: str,
) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-10, msg=f"{what}: output")
    assert len(got[1]) == len(want[1]) == 4  # q, k, v, the table
    for name, a, b in zip("qkve", got[1], want[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"{what}: d{name}")


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("path", PATHS)
def test_every_path_matches_the_float64_formula(
    path: str, case: str, small_chunks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Output and gradients into q, k, v and the table: masked keys count 0, and keys
    count in position order (grouped-query heads, 12 queries against 16 keys)."""
    pe, inputs = _cope(), _inputs(N, M)
    want = _reference_and_grads(pe, inputs, **CASES[case])
    _assert_matches(_run(pe, inputs, path, monkeypatch, **CASES[case]), want, f"{path} {case}")


FEW = 4  # queries, the last 4 of the 16 keys' (fewer than COUNTED_MIN_QUERIES)
FEW_CASES: dict[str, dict[str, Any]] = {
    "bool mask causal": {"attn_mask": MASK[..., -FEW:, :], "causal": True},
    "additive mask": {"attn_mask": ADDITIVE[..., -FEW:, :]},
    "ring positions": {"k_positions": RING},
    # queries at the latest positions, 12 .. 15: the keys they count wrap around the ring
    "ring positions causal": {
        "k_positions": RING,
        "q_positions": torch.arange(M - FEW, M),
        "causal": True,
    },
}


@pytest.mark.parametrize("case", sorted(FEW_CASES))
def test_a_decode_step_takes_the_dense_terms(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sdpa backend's dense terms where the node does not serve, fewer queries than
    COUNTED_MIN_QUERIES (the last 4 of 16), as eager: the float64 formula's output and
    gradients."""
    pe, inputs = _cope(), _inputs(FEW, M)
    want = _reference_and_grads(pe, inputs, **FEW_CASES[case])
    for path in ("dense", "eager"):
        got = _run(pe, inputs, path, monkeypatch, **FEW_CASES[case])
        _assert_matches(got, want, f"{path}, {FEW} queries, {case}")


@pytest.mark.parametrize("case", ["additive mask", "additive mask causal"])
def test_a_mask_that_trains_takes_the_dense_terms(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An additive attn_mask that requires grad: the node does not serve (it gives the
    mask no gradient), the sdpa backend's dense terms agree with the float64 formula."""
    pe, inputs = _cope(), _inputs(N, M)
    want = _reference_and_grads(pe, inputs, **CASES[case])
    options = {**CASES[case], "attn_mask": CASES[case]["attn_mask"].clone().requires_grad_()}
    runs = spy_calls(
        monkeypatch, runtime_modules(), "counted_position_attention", lambda *a, **_: True
    )
    got = run_backend(pe, inputs, "sdpa", **options)
    assert runs == []  # the dense terms
    _assert_matches(got, want, f"trained mask, {case}")


def test_a_mask_of_finfo_min_counts_as_a_bool_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hugging Face's additive masks hold finfo.min, not -inf: a key they mask counts 0
    as under the bool mask they stand for (its softmax weight is 0 either way)."""
    pe, inputs = _cope(), _inputs(N, M)
    want = _reference_and_grads(pe, inputs, attn_mask=MASK, causal=True)
    soft = torch.zeros(MASK.shape, dtype=F64).masked_fill(~MASK, torch.finfo(F64).min)
    for path in PATHS:
        got = _run(pe, inputs, path, monkeypatch, attn_mask=soft, causal=True)
        _assert_matches(got, want, path)


@pytest.mark.parametrize("path", PATHS)
def test_the_output_does_not_depend_on_the_keys_storage_order(
    path: str, small_chunks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same keys, values and positions (and attn_mask columns) stored in another
    order (a ring buffer's, then a random one): the same output and gradients (those of
    k and v permuted alike), and ``scores`` with its key columns permuted."""
    pe, inputs = _cope(), _inputs(N, M)
    options = {"attn_mask": MASK, "causal": True, "q_positions": torch.arange(4, 16)}
    want = _run(pe, inputs, path, monkeypatch, **options)
    for order in (RING, torch.randperm(M, generator=torch.Generator().manual_seed(7))):
        stored = {**inputs, "k": inputs["k"][:, :, order], "v": inputs["v"][:, :, order]}
        at = {**options, "k_positions": order, "attn_mask": MASK[..., order]}
        out, grads = _run(pe, stored, path, monkeypatch, **at)
        inverse = order.argsort()
        grads = [grads[0], grads[1][:, :, inverse], grads[2][:, :, inverse], grads[3]]
        _assert_matches((out, grads), want, f"{path}, keys stored as {order.tolist()}")
        with torch.no_grad():
            scores = pe.scores(inputs["q"], inputs["k"], q_positions=torch.arange(4, 16))
            permuted = pe.scores(
                inputs["q"], stored["k"], q_positions=torch.arange(4, 16), k_positions=order
            )
        torch.testing.assert_close(permuted, scores[..., order], rtol=1e-12, atol=1e-12)


def test_masked_keys_count_as_in_x_transformers() -> None:
    """x-transformers' Attend with its CoPE, causal, under a padding-like key mask (each
    batch row's own keys hidden from every query, as left padding and a hidden span
    are): the same output, float32, on every row that reads some key."""
    attend = pytest.importorskip("x_transformers.attend")
    torch.manual_seed(0)
    heads, dim, n = 4, 16, 64
    cope, pe = cope_beside_x_transformers(heads, dim)
    reference = attend.Attend(causal=True, cope=cope)
    q, k, v = (torch.randn(2, heads, n, dim) for _ in range(3))
    keys = torch.ones(2, n, dtype=torch.bool)  # [B, M]: True = attend
    keys[0, :5] = False  # left padding
    keys[:, 30:40] = False  # a span hidden from every query
    want, _ = reference(q, k, v, mask=keys)
    live = (keys[:, None, :] & torch.ones(n, n, dtype=torch.bool).tril()).any(-1)  # [B, N]
    for backend in ("eager", "sdpa", "flex"):
        got = pe(q, k, v, causal=True, attn_mask=keys[:, None, None, :], backend=backend)
        torch.testing.assert_close(got[live[:, None].expand(-1, heads, -1)],
                                   want[live[:, None].expand(-1, heads, -1)],
                                   rtol=1e-5, atol=1e-5, msg=backend)  # fmt: skip
