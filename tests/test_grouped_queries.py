"""A few grouped-query heads' queries as two batched matmuls (``_grouped_queries``).

The function is checked against softmax(scale q k^T + mask) v in float64 with the
keys and values repeated per query head, outputs and gradients; the decode paths of
the sdpa backend that call it are checked against the eager oracle, with a spy that
the matmuls ran.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from generated import ENCODINGS
from generated import _grouped_queries as grouped
from tests.conftest import runtime_modules, set_runtime, spy_calls

SCALE = 0.3


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """softmax(SCALE q . k^T + mask) v in float64, each key-value head repeated for its
    query heads; a row with every key masked gives zeros."""
    groups = q.shape[1] // k.shape[1]
    keys = k.double().repeat_interleave(groups, dim=1)
    values = v.double().repeat_interleave(groups, dim=1)
    logits = SCALE * q.double() @ keys.transpose(-1, -2)  # [B, H, N, M]
    if mask is not None and mask.dtype == torch.bool:
        logits = logits.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        logits = logits + mask.double()
    weights = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)
    return weights @ values


def inputs(
    batch: int, heads: int, heads_kv: int, n: int, m: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(batch, heads, n, 8, dtype=dtype)
    k = torch.randn(batch, heads_kv, m, 8, dtype=dtype)
    v = torch.randn(batch, heads_kv, m, 6, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("requires_grad", [False, True])
def test_weights_whose_products_with_v_would_be_denormal_become_zero(
    monkeypatch: pytest.MonkeyPatch, requires_grad: bool
) -> None:
    """A steep mask puts weights at e^-70 .. e^-85 (4e-31 .. 1e-37): normal floats whose
    products with v are denormal, which the CPU multiplies slowly. They reach the second
    product as 0, every weight there is 0 or at least tiny / eps, and the output (and
    its gradient) still match the float64 formula."""
    q, k, v = inputs(1, 4, 2, 1, 40)
    q = q.requires_grad_(requires_grad)
    mask = torch.zeros(1, 4, 1, 40)
    mask[..., 20:] = -torch.linspace(70.0, 85.0, 20)  # beside logits within a few units
    seen: list[torch.Tensor] = []
    real = grouped.grouped_values

    def spy(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor | None:
        seen.append(weights.detach().clone())
        return real(weights, values)

    monkeypatch.setattr(grouped, "grouped_values", spy)
    with torch.set_grad_enabled(requires_grad):
        out = grouped.grouped_query_attention(q, k, v, mask, SCALE)
    info = torch.finfo(torch.float32)
    (weights,) = seen
    tiny_weights = (weights > 0) & (weights < info.tiny / info.eps)
    assert not tiny_weights.any() and (weights[..., 20:] == 0).all()
    want = reference(q.detach(), k, v, mask)
    torch.testing.assert_close(out.detach().double(), want, rtol=1e-5, atol=1e-6)
    if requires_grad:
        (grad,) = torch.autograd.grad(out.sum(), q)
        q64 = q.detach().double().requires_grad_()
        (want_grad,) = torch.autograd.grad(reference(q64, k, v, mask).sum(), q64)
        torch.testing.assert_close(grad.double(), want_grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "float per batch"])
@pytest.mark.parametrize(("heads", "heads_kv", "n"), [(4, 2, 1), (8, 2, 3), (6, 1, 2)])
def test_matches_the_formula(mask_kind: str, heads: int, heads_kv: int, n: int) -> None:
    q, k, v = inputs(2, heads, heads_kv, n, 11)
    mask: torch.Tensor | None = None
    if mask_kind == "bool":
        mask = torch.rand(2, 1, n, 11) > 0.3
        mask[0, 0, 0] = False  # a row with every key masked: zeros, as SDPA gives
    elif mask_kind == "float":  # broadcast over the batch: added to the logits
        mask = torch.randn(1, heads, n, 11)
        mask[..., 2] = float("-inf")
    elif mask_kind == "float per batch":  # one row per logit row: inside the product
        mask = torch.randn(2, heads, n, 11)
        mask[..., 2] = float("-inf")
        mask[1, 0, 0] = float("-inf")  # a row with every key masked
    out = grouped.grouped_query_attention(q, k, v, mask, SCALE)
    assert out.shape == (2, heads, n, 6) and out.dtype == v.dtype
    torch.testing.assert_close(out.double(), reference(q, k, v, mask), atol=2e-6, rtol=2e-6)
    if mask_kind == "bool":
        assert torch.equal(out[0, :, 0], torch.zeros_like(out[0, :, 0]))


@pytest.mark.parametrize("mask_batch", [1, 2])
def test_gradients_match_the_formula(mask_batch: int) -> None:
    q, k, v = inputs(2, 4, 2, 2, 9, torch.float64)
    mask = torch.randn(mask_batch, 4, 2, 9, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (q, k, v, mask)]
    grad_out = torch.randn(2, 4, 2, 6, dtype=torch.float64)
    got = torch.autograd.grad(
        grouped.grouped_query_attention(q, k, v, mask, SCALE), leaves, grad_out
    )
    want = torch.autograd.grad(reference(q, k, v, mask), leaves, grad_out)
    for name, a, b in zip("q k v mask".split(), got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=name)


def test_rows_known_to_read_a_key_take_the_plain_softmax() -> None:
    """``every_row_reads``: the caller vouches that no row is fully masked, and the
    output is the formula's (one query with a steep bias, as a decode step)."""
    q, k, v = inputs(1, 4, 4, 1, 12)
    mask = -3.0 * torch.arange(12.0).flip(0).expand(1, 4, 1, 12)
    out = grouped.grouped_query_attention(q, k, v, mask, SCALE, every_row_reads=True)
    torch.testing.assert_close(out.double(), reference(q, k, v, mask), atol=2e-6, rtol=2e-6)


def test_only_full_precision_masks_ride_in_the_product() -> None:
    """A mask with one row per logit row joins the first product (``baddbmm``) in
    float32 and float64; half precision keeps bmm's float32 logits (CUDA's path) and adds
    the mask to them, so the logits are not rounded to the inputs' dtype. A mask shared
    over the batch, or of another dtype, is added too."""
    for dtype, rides in ((torch.float32, True), (torch.float64, True), (torch.bfloat16, False)):
        q = torch.randn(2, 4, 1, 8, dtype=dtype)
        mask = torch.randn(2, 4, 1, 11, dtype=dtype)
        assert (grouped._mask_as_rows(mask, q, 2, 11) is not None) == rides
    q = torch.randn(2, 4, 1, 8)
    assert grouped._mask_as_rows(torch.randn(1, 4, 1, 11), q, 2, 11) is None
    assert grouped._mask_as_rows(torch.randn(2, 4, 1, 11).double(), q, 2, 11) is None


def test_strided_cache_slices_are_read_in_place() -> None:
    """A slice of a preallocated cache (keys 0 .. M - 1 of a longer buffer) merges its
    batch and head axes without a copy."""
    q, _, _ = inputs(3, 4, 2, 1, 1)
    buffer_k, buffer_v = torch.randn(3, 2, 20, 8), torch.randn(3, 2, 20, 6)
    k, v = buffer_k[:, :, :13], buffer_v[:, :, :13]
    assert grouped._heads_merge(k) and grouped._heads_merge(v)
    out = grouped.grouped_query_attention(q, k, v, None, SCALE)
    torch.testing.assert_close(out.double(), reference(q, k, v, None), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("mask_kind", ["none", "bool per batch", "float per batch", "float"])
def test_batch_rows_whose_heads_do_not_merge_go_one_at_a_time(
    mask_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys and values of a [B, M, H_kv, D] cache seen as [B, H_kv, M, D] (the bnhd
    layout) do not merge their batch and head axes without a copy: each batch row runs
    the matmuls alone (its own rows of a per-batch mask), and together they give the
    formula, a fully masked row zeros included."""
    q, k, v = inputs(3, 4, 2, 2, 11)
    k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    mask: torch.Tensor | None = None
    if mask_kind == "bool per batch":
        mask = torch.rand(3, 1, 2, 11) > 0.3
        mask[1, 0, 0] = False
    elif mask_kind == "float per batch":
        mask = torch.randn(3, 4, 2, 11)
        mask[2, 1, 1] = float("-inf")
    elif mask_kind == "float":
        mask = torch.randn(1, 4, 2, 11)
    calls = spy_calls(
        monkeypatch, [grouped], "grouped_query_attention", lambda q, *_, **__: q.shape[0]
    )
    out = grouped.grouped_query_attention(q, k, v, mask, SCALE)
    assert calls == [3, 1, 1, 1]
    torch.testing.assert_close(out.double(), reference(q, k, v, mask), atol=2e-6, rtol=2e-6)


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return grouped.grouped_queries_serve(q, k, v)


def test_where_the_matmuls_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grouped, "GROUPED_QUERY_MIN_KEY_ELEMENTS", 2 * 2 * 64 * 8)
    q, k, v = inputs(2, 8, 2, 1, 64)
    assert serves(q, k, v)
    assert not serves(q, k[:, :, :63], v[:, :, :63])  # too few key elements
    assert not serves(q.repeat(1, 1, 5, 1), k, v)  # 4 heads x 5 queries > 16 rows per kv head
    assert not serves(q, k.repeat(1, 4, 1, 1), v.repeat(1, 4, 1, 1))  # no grouped heads
    assert not serves(q.bfloat16(), k.bfloat16(), v.bfloat16())  # no float32 output on the CPU
    # [B, M, H_kv, D] transposed (the bnhd layout): batch and heads do not merge, so the
    # rows go one at a time where each has enough key elements
    transposed = k.transpose(1, 2).contiguous().transpose(1, 2)
    assert not grouped._heads_merge(transposed) and not serves(q, transposed, v)
    monkeypatch.setattr(grouped, "GROUPED_QUERY_MIN_ROW_KEY_ELEMENTS", 2 * 64 * 8)
    assert serves(q, transposed, v)
    assert not serves(q, transposed[:, :, :63], v[:, :, :63])
    monkeypatch.setattr(grouped, "GROUPED_QUERY_DEVICES", set())
    assert not serves(q, k, v)


# ---------------------------------------------------------------- the sdpa backend


def grouped_calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every key count the matmuls ran with, on any key count (threshold 0)."""
    set_runtime(monkeypatch, "GROUPED_QUERY_MIN_KEY_ELEMENTS", 0)
    return spy_calls(
        monkeypatch, runtime_modules(), "grouped_query_attention", lambda q, k, *_, **__: k.shape[2]
    )


def decode_case(name: str, n: int, **call: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The sdpa backend and the eager oracle on one call of N queries against 24 keys,
    8 query heads reading 2 key-value heads, float64."""
    pe = ENCODINGS[name](heads=8, head_dim=16).double()
    q = torch.randn(2, 8, n, 16, dtype=torch.float64)
    k = torch.randn(2, 2, 24, 16, dtype=torch.float64)
    v = torch.randn(2, 2, 24, 16, dtype=torch.float64)
    if pe.has_rotation:
        k, call = pe.rotate_keys(k), {**call, "keys_rotated": True}
    with torch.no_grad():
        return pe(q, k, v, backend="sdpa", **call), pe(q, k, v, backend="eager", **call)


CASES = {
    "alibi, one query": ("alibi", 1, {}),  # the per-distance vector's row
    "alibi, four causal queries": ("alibi", 4, {"causal": True}),  # query chunks
    "kerple_log, one query": ("kerple_log", 1, {}),
    "t5, explicit positions": (
        "t5",
        2,
        {"q_positions": torch.tensor([30, 31]), "k_positions": torch.arange(8, 32)},
    ),
    "rope, rotated cache": ("rope", 1, {}),  # no mask
    "rope, attn_mask": ("rope", 2, {"attn_mask": torch.arange(24) % 3 > 0}),
    "rope, window": ("rope", 2, {"causal": True, "window": 5}),
}


@pytest.mark.parametrize("name", ["rope", "alibi", "nope"])
def test_a_decode_step_over_a_batch_first_cache_takes_the_matmuls(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """``layout="bnhd"`` with a [B, M, H_kv, D] cache (batch 2): the matmuls run a batch
    row at a time and agree with the eager oracle."""
    calls = grouped_calls(monkeypatch)
    set_runtime(monkeypatch, "GROUPED_QUERY_MIN_ROW_KEY_ELEMENTS", 0)
    pe = ENCODINGS[name](heads=8, head_dim=16).double()
    q = torch.randn(2, 1, 8, 16, dtype=torch.float64)  # [B, N, H, D]
    k, v = (torch.randn(2, 24, 2, 16, dtype=torch.float64) for _ in "kv")  # [B, M, H_kv, D]
    with torch.no_grad():
        out = pe(q, k, v, layout="bnhd", causal=True)
        oracle = pe(q, k, v, layout="bnhd", causal=True, backend="eager")
    assert calls == [24, 24, 24]  # the call, then each batch row
    torch.testing.assert_close(out, oracle, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("case", list(CASES))
def test_decode_steps_take_the_matmuls_and_match_eager(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    name, n, call = CASES[case]
    calls = grouped_calls(monkeypatch)
    out, oracle = decode_case(name, n, **call)
    assert calls, "the grouped matmuls did not run"
    torch.testing.assert_close(out, oracle, atol=1e-10, rtol=1e-10)


STEEP_CASES = {
    "alibi, explicit positions": (
        "alibi",
        {"q_positions": torch.tensor([599]), "k_positions": torch.arange(300) * 2},
    ),
    # head h of H takes (S - 64) H / (8h): with 16 heads the first falls to about -140
    "sandwich": ("sandwich", {}),
    "kerple_power": ("kerple_power", {}),
    "fire": ("fire", {}),
    "tupe_a": ("tupe_a", {}),
}


@pytest.mark.parametrize("case", list(STEEP_CASES))
def test_one_query_per_key_head_takes_the_matmuls_for_a_floor(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Without grouped heads, a decode step whose bias SDPA would floor on the CPU runs
    as the matmuls (which flush denormal weights) and matches the eager oracle: one
    query against 300 keys, 4 heads (Sandwich 16), float32 (float64 takes no floor),
    the parameters scaled so that the biases fall steeply."""
    name, call = STEEP_CASES[case]
    heads = 16 if name == "sandwich" else 4
    calls = grouped_calls(monkeypatch)
    torch.manual_seed(0)
    pe = ENCODINGS[name](heads=heads, head_dim=16)
    with torch.no_grad():
        for parameter in pe.parameters():
            parameter.mul_(4.0)
    q = torch.randn(1, heads, 1, 16)
    k, v = (torch.randn(1, heads, 300, 16) for _ in "kv")
    with torch.no_grad():
        out = pe(q, k, v, backend="sdpa", **call)
        oracle = pe(q, k, v, backend="eager", **call)
    assert calls, "the matmuls did not run"
    torch.testing.assert_close(out, oracle, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("n", [1, 3])
def test_trained_slopes_learn_through_the_matmuls(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """ALiBi with trained slopes, a few causal queries against 200 keys, float32: the
    step runs as the matmuls (its vector is steep), and the gradients into q, k, v and
    the slopes equal the eager oracle's."""
    calls = grouped_calls(monkeypatch)
    torch.manual_seed(0)
    pe = ENCODINGS["alibi_learned"](heads=4, head_dim=16)
    q = torch.randn(1, 4, n, 16, requires_grad=True)
    k, v = (torch.randn(1, 4, 200, 16, requires_grad=True) for _ in "kv")
    grad_out = torch.randn(1, 4, n, 16)
    leaves = [q, k, v, *pe.parameters()]
    got = torch.autograd.grad(pe(q, k, v, causal=True, backend="sdpa"), leaves, grad_out)
    assert calls, "the matmuls did not run"
    want = torch.autograd.grad(pe(q, k, v, causal=True, backend="eager"), leaves, grad_out)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


def test_a_fully_masked_query_gives_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = grouped_calls(monkeypatch)
    mask = torch.ones(2, 1, 2, 24, dtype=torch.bool)
    mask[1, :, 0] = False
    out, oracle = decode_case("alibi", 2, q_positions=torch.tensor([22, 23]), attn_mask=mask)
    assert calls
    assert torch.equal(out[1, :, 0], torch.zeros_like(out[1, :, 0]))
    torch.testing.assert_close(out, oracle, atol=1e-10, rtol=1e-10)


ROWS_READ_CASES = {  # (name, N, call, whether each row surely reads a key)
    "t5, one causal query": ("t5", 1, {"causal": True}, True),  # the distance vector's row
    "kerple_log, one query in a window": ("kerple_log", 1, {"causal": True, "window": 3}, True),
    "t5, three causal queries": ("t5", 3, {"causal": True}, True),  # the bias of a few queries
    "transformer_xl, one causal query": ("transformer_xl", 1, {"causal": True}, True),
    "transformer_xl, documents": (
        "transformer_xl",
        2,
        {"causal": True, "document_ids": (torch.arange(24) >= 23).long()},  # the last alone
        True,
    ),
    "t5, attn_mask": ("t5", 1, {"attn_mask": torch.arange(24) % 3 > 0}, False),
    "transformer_xl, attn_mask": ("transformer_xl", 1, {"attn_mask": torch.arange(24) > 0}, False),
    "t5, a query after keys two apart": (  # its causal mask masks nothing: dropped
        "t5",
        1,
        {"causal": True, "q_positions": torch.tensor([60]), "k_positions": 2 * torch.arange(24)},
        True,
    ),
    "transformer_xl, a query after keys two apart": (
        "transformer_xl",
        1,
        {"causal": True, "q_positions": torch.tensor([50]), "k_positions": 2 * torch.arange(24)},
        True,
    ),
    "t5, keys two apart in a window": (  # a window at explicit positions may hold no key
        "t5",
        1,
        {"window": 3, "q_positions": torch.tensor([60]), "k_positions": 2 * torch.arange(24)},
        False,
    ),
    "transformer_xl, a query before every key": (
        "transformer_xl",
        1,
        {"causal": True, "q_positions": torch.tensor([3]), "k_positions": torch.arange(10, 34)},
        False,
    ),
}


@pytest.mark.parametrize("case", list(ROWS_READ_CASES))
def test_rows_that_surely_read_a_key_take_the_plain_softmax(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """A decode step with a finite bias or finite relative terms and no attn_mask tells
    the matmuls that every query reads a key, at default positions (its own, which no
    causal mask, window or document removes) or where nothing masks any key (at explicit
    positions after every key, where the causal mask is dropped), so their softmax
    skips the care for fully masked rows; with an attn_mask, a window at explicit
    positions, or a query before every key (its row is zeros, as SDPA gives), it keeps
    it. Outputs equal the eager oracle's."""
    name, n, call, reads = ROWS_READ_CASES[case]
    told = spy_calls(
        monkeypatch,
        runtime_modules(),
        "grouped_query_attention",
        lambda *args, **keywords: args[5] if len(args) > 5 else keywords.get("every_row_reads"),
    )
    set_runtime(monkeypatch, "GROUPED_QUERY_MIN_KEY_ELEMENTS", 0)
    out, oracle = decode_case(name, n, **call)
    assert told == [reads]
    torch.testing.assert_close(out, oracle, atol=1e-10, rtol=1e-10)


def test_other_calls_keep_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the device list, or in the bnhd layout (batch and heads do not merge), SDPA
    serves and the output is the same."""
    calls = grouped_calls(monkeypatch)
    set_runtime(monkeypatch, "GROUPED_QUERY_DEVICES", set())
    out, oracle = decode_case("alibi", 1)
    torch.testing.assert_close(out, oracle, atol=1e-10, rtol=1e-10)
    set_runtime(monkeypatch, "GROUPED_QUERY_DEVICES", {"cpu"})
    pe = ENCODINGS["alibi"](heads=8, head_dim=16)
    q, k, v = torch.randn(2, 1, 8, 16), torch.randn(2, 24, 2, 16), torch.randn(2, 24, 2, 16)
    with torch.no_grad():
        out = pe(q, k, v, backend="sdpa", layout="bnhd")
        oracle = pe(q, k, v, backend="eager", layout="bnhd")
    torch.testing.assert_close(out, oracle, atol=1e-5, rtol=1e-5)
    assert calls == []


def test_denormal_weights_become_zero_on_the_cpu() -> None:
    """A key whose weight is denormal (about e^-95) counts for nothing, even where its
    value is large enough that the weight would show: the CPU multiplies denormals
    slowly, so the matmuls flush them."""
    q, k, v = inputs(1, 4, 2, 1, 10)
    mask = torch.zeros(1, 4, 1, 10)
    mask[..., 3] = -95.0 - SCALE * (q @ k.repeat_interleave(2, 1).transpose(-1, -2))[..., 3]
    v[:, :, 3] = 1e38  # weight about e^-97 ~ 7e-43 times 1e38: 7e-5 where it is kept
    out = grouped.grouped_query_attention(q, k, v, mask, SCALE)
    without = mask.clone()
    without[..., 3] = float("-inf")
    torch.testing.assert_close(out.double(), reference(q, k, v, without), atol=1e-6, rtol=1e-6)
    assert (reference(q, k, v, mask) - reference(q, k, v, without)).abs().max() > 1e-5
