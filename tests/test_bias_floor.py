"""The floor under a bias given to CPU SDPA (``_distances.floored_bias``): finite entries
raised to ``BIAS_FLOOR`` plus a bound on the row's content-logit spread
(``content_spread``) below the largest entry each query row surely reads, so that no
softmax weight is a slow denormal float; float64 exact, outputs unchanged."""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from generated import ENCODINGS, parameters_frozen
from generated import _distances as distances
from tests.conftest import HostReads, generated_class, runtime_modules, set_runtime, spy_calls

FLOOR = distances.BIAS_FLOOR


def test_floored_bias_raises_finite_entries_only() -> None:
    bias = torch.tensor([[0.0, -10.0, -45.0, float("-inf"), -100.0]], requires_grad=True)
    top, spread = torch.tensor([[-2.0]]), torch.tensor([[1.5]])
    got = distances.floored_bias(bias, top, spread)
    floor = -2.0 - FLOOR - 1.5
    assert got.tolist() == [[0.0, -10.0, floor, float("-inf"), floor]]
    (grad,) = torch.autograd.grad(got[:, [0, 1, 2, 4]].sum(), bias)
    assert grad.tolist() == [[1.0, 1.0, 0.0, 0.0, 0.0]]  # floored entries get none


def test_floored_bias_with_and_without_a_gradient_takes_the_same_values() -> None:
    """Entries on both sides of the floor and close to it (within 1e-3), and -inf: with
    a gradient (``_Floor``) and without, the same values; the gradient is 1 exactly on
    the finite entries at or above the floor, 0 on those lifted."""
    generator = torch.Generator().manual_seed(0)
    top = torch.tensor([[0.0], [3.0]])
    offsets = torch.tensor([-39.9995, -40.0005, -10.0, -80.0, float("-inf"), 0.0])
    bias = top + offsets + 1e-4 * torch.rand(2, 6, generator=generator)
    no_spread = torch.zeros(2, 1)
    with torch.no_grad():
        plain = distances.floored_bias(bias, top, no_spread)
    leaf = bias.clone().requires_grad_()
    got = distances.floored_bias(leaf, top, no_spread)
    assert torch.equal(got, plain)
    (grad,) = torch.autograd.grad(got.sum(), leaf)
    kept = (bias >= top - FLOOR) & bias.isfinite()
    assert torch.equal(grad, kept.float())
    assert kept[:, 0].all() and not kept[:, 1].any()  # either side of the floor


@pytest.mark.parametrize("spread", [float("inf"), float("nan")])
def test_an_unbounded_spread_raises_nothing(spread: float) -> None:
    """Content logits with inf or NaN entries bound nothing: the bias stays as it is."""
    bias = torch.tensor([[0.0, -50.0, -1e30, float("-inf")]])
    got = distances.floored_bias(bias, torch.tensor([[0.0]]), torch.tensor([[spread]]))
    assert torch.equal(got, bias)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_content_spread_bounds_every_row_of_logits(kv_heads: int) -> None:
    """float64 logits scale * q_i . k_j of every batch row and query: their spread over
    the keys never passes the bound of that head and query (grouped keys included)."""
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 5, 8, generator=generator) * torch.rand(3, 4, 5, 1, generator=generator)
    k = torch.randn(3, kv_heads, 7, 8, generator=generator) * 3
    scale = -0.3  # a negative scale bounds the same spread
    bound = distances.content_spread(q, k, scale).double()  # [H, N, 1]
    assert bound.shape == (4, 5, 1)
    keys = k.double().repeat_interleave(4 // kv_heads, dim=1)  # [B, H, M, D]
    logits = scale * q.double() @ keys.transpose(-1, -2)  # [B, H, N, M]
    spread = logits.amax(-1, keepdim=True) - logits.amin(-1, keepdim=True)
    assert (spread <= bound * (1 + 1e-6)).all()


def test_content_spread_is_reached_by_opposite_keys() -> None:
    """A query along a key of the largest norm and that key's opposite: the logits
    differ by exactly 2 |scale| |q| |k|."""
    q, k = torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 3, 4)
    q[..., 0] = 2.0
    k[0, 0, 0, 0], k[0, 0, 1, 0], k[0, 0, 2, 1] = 3.0, -3.0, 1.0
    assert distances.content_spread(q, k, 0.5).item() == 2 * 0.5 * 2.0 * 3.0


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_large_content_logits_keep_their_weights(dtype: torch.dtype, tolerance: float) -> None:
    """ALiBi (head 0's slope 1/2) with two far keys whose content logits are 60 above the
    rest, at distances 100 and 150: exact logits +10 and -15, so the nearer takes almost
    all the weight. A floor 40 under the row's top bias alone lifted both to one value
    (sdpa +0.000 against eager's +0.9999); a floor that leaves room for the content
    spread keeps them apart, in float32 and in bfloat16 (floored too)."""
    pe = ENCODINGS["alibi"](heads=8, head_dim=8)
    q = torch.zeros(1, 8, 1, 8)
    q[..., 0] = 1.0
    k, v = torch.zeros(1, 8, 200, 8), torch.zeros(1, 8, 200, 8)
    k[0, :, [99, 49], 0] = 60.0 / pe.scale
    v[0, :, 99, 0], v[0, :, 49, 0] = 1.0, -1.0
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    with torch.no_grad():
        oracle = pe.double()(q.double(), k.double(), v.double(), causal=True, backend="eager")
        pe.float()
        for queries in (q, q.expand(1, 8, 2, 8)):  # one query (a vector) and two (rows)
            positions = {"q_positions": torch.tensor([199] * queries.shape[2])}
            for call in ({"causal": True}, {**positions, "k_positions": torch.arange(200)}):
                out = pe(queries, k, v, backend="sdpa", **call)
                assert out.dtype == dtype
                torch.testing.assert_close(out[:, :, -1:].double(), oracle, atol=tolerance, rtol=0)
    assert oracle[0, 0, 0, 0] > 0.999


def test_a_finite_hard_mask_stays_hard() -> None:
    """Hugging Face's padding mask of finfo.min on key 0, whose content logit is 35 above
    the others: a floor 40 under the row's top bias made it a soft -40 (sdpa 0.395
    against eager's 0.370); with room for the content spread the key keeps no weight."""
    pe = ENCODINGS["alibi"](heads=8, head_dim=8)
    generator = torch.Generator().manual_seed(0)
    q, k = torch.zeros(1, 8, 4, 8), torch.zeros(1, 8, 16, 8)
    q[..., 0] = 1.0
    k[:, :, 0, 0] = 35.0 / pe.scale
    v = torch.randn(1, 8, 16, 8, generator=generator)
    v[:, :, 0] = 10.0
    mask = torch.zeros(1, 1, 4, 16)
    mask[..., 0] = torch.finfo(torch.float32).min
    positions = {"q_positions": torch.arange(12, 16), "k_positions": torch.arange(16)}
    with torch.no_grad():
        out = pe(q, k, v, attn_mask=mask, causal=True, backend="sdpa", **positions)
        pe.double()
        without_key_0 = pe(  # the same attention without key 0 at all, in float64
            q.double(),
            k.double()[:, :, 1:],
            v.double()[:, :, 1:],
            causal=True,
            backend="eager",
            q_positions=positions["q_positions"],
            k_positions=positions["k_positions"][1:],
        )
    torch.testing.assert_close(out.double(), without_key_0, atol=1e-5, rtol=0)


def sdpa_masks(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Every attn_mask F.scaled_dot_product_attention receives during the test."""
    masks: list[torch.Tensor] = []
    original = F.scaled_dot_product_attention

    def spy(*args: Any, **keywords: Any) -> Any:
        masks.append(keywords["attn_mask"])
        return original(*args, **keywords)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return masks


def lowest_finite(mask: torch.Tensor) -> float:
    return float(mask.detach()[torch.isfinite(mask)].min())


def alibi_call(dtype: torch.dtype, **call: Any) -> tuple[torch.Tensor, torch.Tensor, float]:
    """ALiBi's sdpa and eager outputs on 300 keys (head 0's slope 1/4 takes its bias to
    -75 at the far keys; q and k small enough that their content spread is below 10),
    and that spread's bound."""
    pe = ENCODINGS["alibi"](heads=4, head_dim=16).to(dtype)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 300, 16, generator=generator).to(dtype) for _ in range(3))
    q, k = q / 2, k / 2
    spread = float(distances.content_spread(q, k, pe.scale).max())
    assert spread < 10
    with torch.no_grad():
        sdpa, eager = pe(q, k, v, backend="sdpa", **call), pe(q, k, v, backend="eager", **call)
    return sdpa, eager, spread


@pytest.mark.parametrize(
    "call",
    [
        {},
        {"causal": True},
        # every other position: no shift of the defaults (those take the per-distance
        # path), so a bias per pair
        {"q_positions": torch.arange(0, 600, 2), "k_positions": torch.arange(0, 600, 2)},
    ],
    ids=["per distance", "per distance, causal", "explicit positions"],
)
def test_float32_masks_stop_at_the_floor_and_outputs_do_not_move(
    monkeypatch: pytest.MonkeyPatch, call: dict[str, Any]
) -> None:
    masks = sdpa_masks(monkeypatch)
    out, oracle, spread = alibi_call(torch.float32, **call)
    assert masks and all(lowest_finite(mask) >= -FLOOR - spread for mask in masks)
    assert min(lowest_finite(mask) for mask in masks) < -FLOOR  # room for the spread
    torch.testing.assert_close(out, oracle, atol=2e-6, rtol=2e-6)


def test_float64_masks_stay_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    masks = sdpa_masks(monkeypatch)
    out, oracle, _ = alibi_call(torch.float64)
    assert masks and min(lowest_finite(mask) for mask in masks) == pytest.approx(-75.0 + 0.25)
    torch.testing.assert_close(out, oracle, atol=1e-12, rtol=1e-12)


def test_the_floor_follows_each_query_not_the_whole_table() -> None:
    """T5 with every key-after-query bucket at +100 and the others from 0 down to -30:
    the last query row reads none of the first (its keys are all before it), so a floor
    from the table's largest entry (60) would lift that row's every logit to one value
    and flatten its weights."""
    pe = ENCODINGS["t5"](heads=2, head_dim=16)
    with torch.no_grad():
        weight = pe.relative_attention_bias.weight  # [buckets, heads]
        weight[:16] = -2.0 * torch.arange(16.0)[:, None]  # j - i <= 0: bucket |j - i|, ...
        weight[16:] = 100.0  # j - i > 0
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    with torch.no_grad():
        out = pe(q, k, v, backend="sdpa")
        oracle = pe(q, k, v, backend="eager")
    torch.testing.assert_close(out, oracle, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("boolean", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_the_floor_follows_what_the_attn_mask_leaves(boolean: bool, causal: bool) -> None:
    """ALiBi (head 0's slope 1/2) with an attn_mask that keeps only keys at least 100
    away (and key 0): every entry a row reads is 50 or more below the entries it
    removes. A floor from the row's largest entry before the mask lifted every entry
    the row reads to one value (outputs off by 2.5); from what the row reads, the
    outputs equal the eager oracle's."""
    pe = ENCODINGS["alibi"](heads=8, head_dim=8)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 300, 8, generator=generator) for _ in range(3))
    token = torch.arange(300)
    far = (token[:, None] - token[None, :]).abs() >= 100
    far[:, 0] = True  # every row reads a key
    mask = far if boolean else torch.where(far, 0.0, -1e4)
    with torch.no_grad():
        out = pe(q, k, v, attn_mask=mask, causal=causal, backend="sdpa")
        oracle = pe(q, k, v, attn_mask=mask, causal=causal, backend="eager")
    torch.testing.assert_close(out, oracle, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["alibi", "t5"])
def test_no_queries_read_nothing(name: str) -> None:
    """N = 0: the per-distance vector has M - 1 entries and no distance 0 to floor from."""
    pe = ENCODINGS[name](heads=4, head_dim=16)
    q, k, v = torch.randn(1, 4, 0, 16), torch.randn(1, 4, 9, 16), torch.randn(1, 4, 9, 16)
    for causal in (False, True):
        assert pe(q, k, v, backend="sdpa", causal=causal).shape == (1, 4, 0, 16)


def test_no_keys_give_zeros_with_explicit_positions() -> None:
    """M = 0 at explicit positions: the materialised bias has empty rows, no maximum."""
    pe = ENCODINGS["alibi"](heads=4, head_dim=16)
    q, k, v = torch.randn(1, 4, 2, 16), torch.randn(1, 4, 0, 16), torch.randn(1, 4, 0, 16)
    positions = {
        "q_positions": torch.tensor([0, 1]),
        "k_positions": torch.zeros(0, dtype=torch.long),
    }
    out = pe(q, k, v, backend="sdpa", **positions)
    assert torch.equal(out, torch.zeros(1, 4, 2, 16))


def spread_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per ``content_spread`` call the sdpa backend makes during the test."""
    backend = importlib.import_module("generated._sdpa_backend")
    calls: list[int] = []
    original = backend.content_spread

    def spy(*args: Any) -> Any:
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(backend, "content_spread", spy)
    return calls


def test_floor_moves_nothing_within_the_floor_of_the_top() -> None:
    top = torch.tensor([[0.0], [5.0]])
    assert distances.floor_moves_nothing(torch.tensor([[0.0, -FLOOR], [5.0, 5.0 - FLOOR]]), top)
    assert not distances.floor_moves_nothing(torch.tensor([[0.0, -FLOOR - 0.01]]), top[:1])
    assert not distances.floor_moves_nothing(torch.tensor([[0.0, float("nan")]]), top[:1])
    assert not distances.floor_moves_nothing(torch.tensor([[0.0, float("-inf")]]), top[:1])


@pytest.mark.parametrize("steep", [False, True])
def test_a_shallow_vector_skips_the_pass_over_the_keys(
    monkeypatch: pytest.MonkeyPatch, steep: bool
) -> None:
    """A decode step of T5 (one query against 64 keys): with its table within 40 of the
    entry at distance 0 no floor can move an entry, so ``content_spread`` (a pass over
    every cached key) is not called and the mask is the vector as it is; with one bucket
    at -100 (steep) the floor is taken and raises it (with the few-query matmuls off,
    which would take the step instead: ``test_a_decode_step_flushes_instead``).
    Outputs equal eager's either way."""
    set_runtime(monkeypatch, "GROUPED_QUERY_DEVICES", set())
    calls, masks = spread_calls(monkeypatch), sdpa_masks(monkeypatch)
    pe = ENCODINGS["t5"](heads=4, head_dim=8)
    with torch.no_grad():
        table = pe.relative_attention_bias.weight
        table.copy_(torch.linspace(-15.0, 15.0, table.numel()).view_as(table))
        if steep:
            table[15] = -100.0  # the farthest keys' bucket before the query
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 1, 8, generator=generator)
    k, v = (torch.randn(1, 4, 200, 8, generator=generator) for _ in "kv")
    with torch.no_grad():
        out, oracle = pe(q, k, v, backend="sdpa"), pe(q, k, v, backend="eager")
    torch.testing.assert_close(out, oracle)
    assert len(calls) == int(steep)
    vector = pe._distance_bias(1, 200, torch.device("cpu"))  # [H, M]
    assert torch.equal(masks[-1][0, :, 0], vector) != steep


def test_a_wide_spread_puts_the_floor_deep_enough_for_zero_weights() -> None:
    """Past ``BIAS_FLOOR_MOST_SPREAD`` the floor sits ``BIAS_FLOOR_DEEP`` + spread under
    the top: a floored key's logit is then at least 105 under the row's largest, a weight
    of exactly 0 in float32, where 40 + spread under it put such keys among the denormal
    weights (e^-103.3 .. e^-87.3)."""
    most, deep = distances.BIAS_FLOOR_MOST_SPREAD, distances.BIAS_FLOOR_DEEP
    bias = torch.tensor([[0.0, -100.0, -300.0, float("-inf")], [0.0, -100.0, -300.0, -50.0]])
    top, spread = torch.zeros(2, 1), torch.tensor([[most + 10.0], [most]])
    got = distances.floored_bias(bias, top, spread)
    wide, narrow = -deep - (most + 10.0), -FLOOR - most
    assert got.tolist() == [[0.0, -100.0, wide, float("-inf")], [0.0, narrow, narrow, -50.0]]
    assert torch.exp(torch.tensor(wide + most + 10.0)) == 0  # the widest content lift


def _denormal_weights(logits: torch.Tensor) -> int:
    weights = torch.softmax(logits, dim=-1)
    return int(((weights > 0) & (weights < torch.finfo(torch.float32).tiny)).sum())


@pytest.mark.parametrize("content_scale", [1.0, 1.5])
def test_the_floor_adds_no_denormal_weights_whatever_the_spread(content_scale: float) -> None:
    """ALiBi's per-distance vector floored as the sdpa backend floors it (under distance
    0, each head's largest spread), 512 keys, randn q and k times 1 (spread bounds about
    22) or 1.5 (about 50, past BIAS_FLOOR_MOST_SPREAD): the softmax weights in float32
    have no denormal where the spread is narrow, and never more than the bias as it is
    gives (40 + spread under the top, whatever the spread, put 6.8% of them there at 1.5,
    against 2.0% as it is)."""
    pe = ENCODINGS["alibi"](heads=8, head_dim=64)
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 8, 512, 64, generator=generator) * content_scale for _ in "qk")
    spread = distances.content_spread(q, k, pe.scale)  # [H, N, 1]
    with torch.no_grad():
        bias = pe.score_bias(torch.arange(512), torch.arange(512))  # [H, N, M]
        floored = distances.floored_bias(
            bias, torch.zeros(8, 1, 1), spread.amax(dim=1, keepdim=True)
        )
        content = q[0] @ k[0].transpose(-1, -2) * pe.scale  # [H, N, M]
    plain, shipped = _denormal_weights(content + bias), _denormal_weights(content + floored)
    assert plain > 0
    assert shipped == 0 if content_scale == 1.0 else shipped <= plain


FLUSH_CASES = [
    ("alibi", 4, 1, False),
    ("t5", 4, 1, False),
    ("alibi", 2, 1, False),
    ("alibi", 4, 4, True),
    ("alibi", 2, 3, False),
    ("t5", 4, 4, True),
]


def matmul_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A record of each call of the few-query matmuls (``grouped_query_attention``)."""
    return spy_calls(monkeypatch, runtime_modules(), "grouped_query_attention", lambda *_, **__: 1)


def decode_case(
    name: str, kv_heads: int, n: int, seed: int
) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The encoding with 4 heads of 8, and n random queries against 300 keys and values
    of kv_heads heads."""
    pe = ENCODINGS[name](heads=4, head_dim=8)
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, n, 8, generator=generator)
    k, v = (torch.randn(1, kv_heads, 300, 8, generator=generator) for _ in "kv")
    return pe, q, k, v


@pytest.mark.parametrize(("name", "kv_heads", "n", "causal"), FLUSH_CASES)
def test_a_decode_step_flushes_instead(
    monkeypatch: pytest.MonkeyPatch, name: str, kv_heads: int, n: int, causal: bool
) -> None:
    """A few queries against 300 keys on the CPU, float32: ALiBi's vector falls more
    than the floor's depth below distance 0, so SDPA would need the floor and its pass
    over the keys (``content_spread``), and T5's would need a read to tell that it
    needs none. One query runs as the few-query matmuls, which flush denormal weights:
    no floor and no bound, with or without grouped heads. More queries read
    whether the floor is due and take the matmuls where it is (ALiBi), SDPA where it is
    not (T5). T5's vector is made per call here, as outside a ``parameters_frozen``
    block on a GPU (kept, its row is known shallow: the next tests). Outputs equal
    eager's."""
    set_runtime(monkeypatch, "KEPT_WITHOUT_SYNC_DEVICES", set())
    spreads, matmuls = spread_calls(monkeypatch), matmul_calls(monkeypatch)
    pe, q, k, v = decode_case(name, kv_heads, n, seed=0)
    with torch.no_grad(), HostReads() as reads:
        out = pe(q, k, v, backend="sdpa", causal=causal)
    with torch.no_grad():
        oracle = pe(q, k, v, backend="eager", causal=causal)
    torch.testing.assert_close(out, oracle)
    assert spreads == []
    assert len(matmuls) == int(n == 1 or name == "alibi")
    # one query: ALiBi's kept vector is read once for its depth (``kept_row_is_shallow``)
    assert reads.count == int(n > 1 or name == "alibi")


@pytest.mark.parametrize(
    ("name", "kv_heads", "n", "given"),
    [
        ("alibi", 4, 1, False),
        ("t5", 4, 1, False),
        ("alibi", 4, 3, False),
        ("alibi", 4, 1, True),
        ("alibi", 2, 1, False),
    ],
)
def test_without_a_floor_on_the_device_a_decode_step_keeps_sdpa(
    monkeypatch: pytest.MonkeyPatch, name: str, kv_heads: int, n: int, given: bool
) -> None:
    """The few-query matmuls stand in for the floor, so a device that floors no bias
    (``BIAS_FLOOR_DEVICES`` without it: a CPU whose denormal arithmetic runs at full
    speed) runs a decode step with a bias as SDPA with the bias as it is, at default
    positions and at given ones; grouped heads keep the matmuls, which serve them for
    speed (here at any key count). Outputs equal eager's."""
    set_runtime(monkeypatch, "BIAS_FLOOR_DEVICES", set())
    set_runtime(monkeypatch, "GROUPED_QUERY_MIN_KEY_ELEMENTS", 0)
    spreads, matmuls = spread_calls(monkeypatch), matmul_calls(monkeypatch)
    pe, q, k, v = decode_case(name, kv_heads, n, seed=1)
    positions = {}
    if given:  # two apart: not the defaults
        keys = torch.arange(300) * 2
        positions = {"q_positions": keys[300 - n :], "k_positions": keys}
    with torch.no_grad():
        out = pe(q, k, v, backend="sdpa", causal=True, **positions)
        oracle = pe(q, k, v, backend="eager", causal=True, **positions)
    torch.testing.assert_close(out, oracle)
    assert spreads == []
    assert len(matmuls) == int(kv_heads < 4)


@pytest.mark.parametrize("seed", range(6))
def test_a_kept_row_is_shallow_where_the_floor_would_move_nothing(seed: int) -> None:
    """For every one-query row sliced from a kept vector [H, L] (its last entry at
    distance 0), ``kept_row_is_shallow`` says what ``floor_moves_nothing`` finds by
    reading the row: vectors of random depth, rows of every length up to the
    distance-0 column."""
    generator = torch.Generator().manual_seed(seed)
    heads, length = 3, 90
    depth = (10.0, 60.0, 200.0)[seed % 3]
    steps = torch.rand(heads, length, generator=generator) * depth / length
    vector = steps.cumsum(-1) - torch.rand(heads, 1, generator=generator) * depth
    zero = int(torch.randint(20, length, (1,), generator=generator))
    for m in range(1, zero + 2):
        row = vector[:, zero + 1 - m : zero + 1]
        want = distances.floor_moves_nothing(row, row[:, -1:])
        assert distances.kept_row_is_shallow(row, m) == want, (m, zero)


def test_a_row_not_sliced_from_a_kept_vector_is_not_known_shallow() -> None:
    """A row made on its own, or from a vector holding NaN or -inf, is never called
    shallow; a vector made after another is judged afresh."""
    vector = torch.zeros(2, 50)
    assert distances.kept_row_is_shallow(vector[:, 10:30], 20)
    assert not distances.kept_row_is_shallow(vector[:, 10:30].clone(), 20)
    for odd in (float("nan"), float("-inf")):
        other = torch.zeros(2, 50)
        other[1, 12] = odd
        assert not distances.kept_row_is_shallow(other[:, 10:30], 20)
        assert distances.kept_row_is_shallow(other[:, 13:30], 17)  # past the odd entry
    one_row = torch.zeros(1, 50)
    assert distances.kept_row_is_shallow(one_row[:, 10:30].expand(4, -1), 20)  # every head
    rows = torch.zeros(3, 50)
    rows[0, 15] = -FLOOR - 1.0  # in a row the slice leaves out: judged with the rest
    assert not distances.kept_row_is_shallow(rows[1:, 10:30], 20)
    assert distances.kept_row_is_shallow(rows[1:, 16:30], 14)
    del vector
    steep = torch.zeros(2, 50)
    steep[0, 10] = -FLOOR - 1.0
    assert not distances.kept_row_is_shallow(steep[:, 10:30], 20)


@pytest.mark.parametrize("frozen", [True, False])
@pytest.mark.parametrize(
    ("name", "keys", "shallow"),
    [
        ("t5", 300, True),
        ("alibi", 60, True),
        ("alibi", 300, False),
        ("t5_steep", 300, False),
    ],
)
def test_a_decode_step_on_a_kept_shallow_vector_runs_sdpa_as_it_is(
    monkeypatch: pytest.MonkeyPatch, name: str, keys: int, shallow: bool, frozen: bool
) -> None:
    """One query on the CPU, float32, inside a ``parameters_frozen`` block or outside
    one (where the CPU keeps the vector too, comparing T5's table at every call):
    where the kept vector lies within the floor of its distance-0 entry (T5's table,
    ALiBi's first 60 keys at slopes up to 1/4), SDPA takes the row as it is, with no
    matmuls, no floor and no read after the first step's; a vector that falls deeper
    (ALiBi over 300 keys, T5 with a bucket at -100) keeps the matmuls, which flush.
    Outputs equal eager's."""
    spreads, matmuls, masks = (
        spread_calls(monkeypatch),
        matmul_calls(monkeypatch),
        sdpa_masks(monkeypatch),
    )
    pe, q, k, v = decode_case(name.removesuffix("_steep"), 4, 1, seed=2)
    k, v = k[:, :, :keys], v[:, :, :keys]
    if name == "t5_steep":
        with torch.no_grad():
            pe.relative_attention_bias.weight[15] = -100.0  # the farthest keys' bucket
    block = parameters_frozen(pe) if frozen else contextlib.nullcontext()
    with torch.no_grad(), block:
        pe(q, k[:, :, :-1], v[:, :, :-1], backend="sdpa", causal=True)  # keeps the vector
        matmuls.clear()
        masks.clear()
        with HostReads() as reads:
            out = pe(q, k, v, backend="sdpa", causal=True)
        sdpa_calls = list(masks)
        oracle = pe(q, k, v, backend="eager", causal=True)
    torch.testing.assert_close(out, oracle)
    assert spreads == []
    assert len(matmuls) == int(not shallow)
    assert reads.count == 0
    if shallow:
        vector = pe._distance_bias(1, keys, torch.device("cpu"))  # [H, M]
        assert len(sdpa_calls) == 1
        torch.testing.assert_close(sdpa_calls[0][0, :, 0], vector, rtol=0, atol=0)


def test_a_half_precision_decode_step_reads_no_kept_shallow_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One bfloat16 query (the matmuls take full precision only) against T5's kept
    vector inside a ``parameters_frozen`` block: SDPA takes the row without the read
    that ``floor_moves_nothing`` makes, and with no floor; outputs within bfloat16's
    rounding of eager's."""
    spreads, masks = spread_calls(monkeypatch), sdpa_masks(monkeypatch)
    pe, q, k, v = decode_case("t5", 4, 1, seed=3)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    with torch.no_grad(), parameters_frozen(pe):
        pe(q, k[:, :, :-1], v[:, :, :-1], backend="sdpa")  # keeps the vector
        masks.clear()
        with HostReads() as reads:
            out = pe(q, k, v, backend="sdpa")
        sdpa_calls = list(masks)
        oracle = pe(q.double(), k.double(), v.double(), backend="eager")
    torch.testing.assert_close(out.double(), oracle, atol=2e-2, rtol=2e-2)
    assert spreads == [] and reads.count == 0
    vector = pe._distance_bias(1, 300, torch.device("cpu")).detach()  # [H, M]
    shifted = (vector - vector.amax(-1, keepdim=True)).to(torch.bfloat16)  # half_precision_bias
    assert len(sdpa_calls) == 1 and torch.equal(sdpa_calls[0][0, :, 0], shifted)


def test_each_kept_vector_keeps_its_reach_while_it_lives() -> None:
    """A model's layers each keep a vector of their own: twelve live vectors are each
    read once (their reach kept beside no eviction), then told with no read; a vector
    that dies takes its entry with it."""
    # rising to distance 0 by 0, 1.5 or 3 a key: 19 keys back, 0, 28.5 or 57 below it
    vectors = [torch.arange(40.0).expand(2, 40) * (1.5 * (i % 3)) for i in range(12)]
    with HostReads() as first:
        verdicts = [distances.kept_row_is_shallow(v[:, 10:30], 20) for v in vectors]
    with HostReads() as again:
        assert [distances.kept_row_is_shallow(v[:, 10:30], 20) for v in vectors] == verdicts
    assert first.count == 12 and again.count == 0
    assert verdicts == [i % 3 < 2 for i in range(12)]  # the first two stay within 40
    entries = len(distances._SHALLOW_REACH)
    del vectors[0]
    assert len(distances._SHALLOW_REACH) == entries - 1


def test_rows_clear_floor_judges_each_row_under_its_own_largest() -> None:
    spread = torch.tensor([[1.0], [1.0]])
    at_the_floor = torch.tensor([[0.0, -FLOOR - 1.0], [7.0, 7.0 - FLOOR - 1.0]])
    assert distances.rows_clear_floor(at_the_floor, spread)
    assert not distances.rows_clear_floor(torch.tensor([[0.0, -FLOOR - 1.01]]), spread[:1])
    # the first and last keys within the floor's depth of each other, a middle one not
    assert not distances.rows_clear_floor(torch.tensor([[0.0, -FLOOR - 2.0, 0.0]]), spread[:1])
    deep = torch.tensor([[FLOOR + 1.0]])  # past BIAS_FLOOR_MOST_SPREAD: the deeper floor
    assert distances.rows_clear_floor(
        torch.tensor([[0.0, -distances.BIAS_FLOOR_DEEP - FLOOR]]), deep
    )
    for bad in (float("nan"), float("inf"), float("-inf")):
        assert not distances.rows_clear_floor(torch.tensor([[0.0, bad]]), spread[:1])


def floor_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per ``floored_rows`` call (the floor of a bias made per pair)."""
    return spy_calls(monkeypatch, runtime_modules(), "floored_rows", lambda *_, **__: 1)


@pytest.mark.parametrize("trained", [False, True])
@pytest.mark.parametrize("keys", [40, 300])
def test_a_causal_bias_per_pair_is_floored_only_where_its_rows_are_steep(
    monkeypatch: pytest.MonkeyPatch, keys: int, trained: bool
) -> None:
    """ALiBi at every other position (a bias per pair), causal: over 40 keys (head 0's
    bias down to -19.5) no row needs a floor, so the masked bias goes to SDPA with no
    floor pass, although the causal mask's -inf entries are not above any floor; over
    300 keys (down to -150) the rows are floored, to at most FLOOR plus the spread below
    what each row reads. Outputs (and, trained, the slopes' and inputs' gradients) equal
    the eager oracle's either way."""
    calls, masks = floor_calls(monkeypatch), sdpa_masks(monkeypatch)
    pe = ENCODINGS["alibi_learned" if trained else "alibi"](heads=4, head_dim=16)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, keys, 16, generator=generator) / 2 for _ in range(3))
    positions = torch.arange(0, 2 * keys, 2)
    call = {"causal": True, "q_positions": positions, "k_positions": positions}
    results = []
    for backend in ("sdpa", "eager"):
        inputs = [t.clone().requires_grad_(trained) for t in (q, k, v)]
        with torch.set_grad_enabled(trained):
            out = pe(*inputs, backend=backend, **call)
        grads = torch.autograd.grad(out.sum(), [*inputs, *pe.parameters()]) if trained else ()
        results.append((out, grads))
    (out, grads), (oracle, oracle_grads) = results
    torch.testing.assert_close(out, oracle, atol=2e-6, rtol=2e-6)
    for grad, oracle_grad in zip(grads, oracle_grads, strict=True):
        torch.testing.assert_close(grad, oracle_grad, atol=2e-5, rtol=2e-5)
    steep = keys == 300
    assert masks and bool(calls) == steep
    spread = float(distances.content_spread(q, k, pe.scale).max())
    lowest = min(lowest_finite(mask) for mask in masks)
    assert (lowest >= -FLOOR - spread) if steep else lowest == pytest.approx(-0.25 * 2 * (keys - 1))


@pytest.mark.parametrize("trains", [False, True])
def test_a_row_far_from_zero_keeps_its_keys_apart_under_the_floor(trains: bool) -> None:
    """KERPLE-power at r1 = 1, r2 = 2 with queries 2^15 positions after their keys: each
    row's bias lies near -2^30, where a float32's spacing (128) outgrew the floor's
    depth, so top - depth rounded back to the top and raised every key to it (sdpa 3.4
    off, the r1 gradient 1.5e8 off). The float32 sdpa output and gradients equal the
    float64 eager ones (the bias's magnitude drowns the content logits in float32, so
    each row is its nearest key's value)."""
    pe = generated_class("kerple_power")(heads=4, head_dim=16)
    with torch.no_grad():
        pe.r1.fill_(1.0)
        pe.r2.fill_(2.0)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 40, 16, generator=generator) for _ in range(3))
    positions = dict(q_positions=torch.arange(40) + 2**15, k_positions=torch.arange(40))

    def run(module: torch.nn.Module, dtype: torch.dtype, backend: str) -> list[torch.Tensor]:
        inputs = [t.to(dtype).requires_grad_(trains) for t in (q, k, v)]
        with torch.set_grad_enabled(trains):
            out = module.to(dtype)(*inputs, backend=backend, **positions)
        if not trains:
            return [out.detach()]
        weights = torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)
        grads = torch.autograd.grad((out * weights).sum(), [*inputs, module.r1, module.r2])
        return [out.detach(), *grads]

    want = run(pe, torch.float64, "eager")
    got = run(pe, torch.float32, "sdpa")
    for got_one, want_one in zip(got, want, strict=True):
        torch.testing.assert_close(got_one.double(), want_one, rtol=1e-5, atol=1e-5)
