"""Shapes real models use: grouped-query attention, the [B, N, H, D] layout, and the
range and device of positions, on every encoding and backend."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.conftest import generated_class, head_dim_for, spec_names

NAMES = spec_names()
BACKENDS = ("eager", "sdpa", "auto")
HEADS, HEAD_DIM = 4, 8


def make(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    head_dim = head_dim_for(name, HEAD_DIM)
    return generated_class(name)(heads=HEADS, head_dim=head_dim).double().eval()


def _inputs(
    kv_heads: int, n: int = 5, m: int = 7, head_dim: int = HEAD_DIM
) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, HEADS, n, head_dim, generator=generator, dtype=torch.float64)
    k = torch.randn(2, kv_heads, m, head_dim, generator=generator, dtype=torch.float64)
    v = torch.randn(2, kv_heads, m, HEAD_DIM, generator=generator, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_grouped_query_attention_equals_repeated_heads(name: str, kv_heads: int) -> None:
    """k, v with kv_heads heads give what the same module gives on repeated heads."""
    pe = make(name)
    q, k, v = _inputs(kv_heads, head_dim=pe.head_dim)
    groups = HEADS // kv_heads
    k_full, v_full = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    positions = {"q_positions": torch.tensor([3, 4, 6, 8, 9]), "k_positions": torch.arange(7)}
    for backend in BACKENDS:
        for causal in (False, True):
            for extra in ({}, positions):
                want = pe(q, k_full, v_full, causal=causal, backend=backend, **extra)
                got = pe(q, k, v, causal=causal, backend=backend, **extra)
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    want_terms = pe.score_terms(q, k_full)
    for term, value in pe.score_terms(q, k).items():
        torch.testing.assert_close(value, want_terms[term], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["alibi", "rope", "t5", "shaw", "deberta"])
def test_grouped_query_gradients_equal_repeated_heads(name: str) -> None:
    pe = make(name)
    q, k, v = _inputs(2)
    for backend in ("eager", "sdpa"):
        grads = []
        for repeat in (False, True):
            leaf_k, leaf_v = k.clone().requires_grad_(), v.clone().requires_grad_()
            keys = leaf_k.repeat_interleave(2, 1) if repeat else leaf_k
            values = leaf_v.repeat_interleave(2, 1) if repeat else leaf_v
            pe(q, keys, values, causal=True, backend=backend).square().sum().backward()
            grads.append((leaf_k.grad, leaf_v.grad))
        for got, want in zip(grads[0], grads[1], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_head_counts_that_do_not_divide_are_refused() -> None:
    pe = make("alibi")
    q, _, _ = _inputs(2)
    k = torch.randn(2, 3, 7, HEAD_DIM, dtype=torch.float64)
    with pytest.raises(ValueError, match="multiple of k's 3"):
        pe(q, k, k)
    with pytest.raises(ValueError, match="same heads"):
        pe(q, k[:, :2], k[:, :1])


@pytest.mark.parametrize("name", ["alibi", "rope", "shaw", "transformer_xl", "nope"])
def test_bnhd_layout_is_the_transposed_call(name: str) -> None:
    pe = make(name)
    q, k, v = _inputs(2)
    want = pe(q, k, v, causal=True)
    got = pe(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, layout="bnhd")
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=0, atol=0)
    rq, rk = pe.rotate(q.transpose(1, 2), k.transpose(1, 2), layout="bnhd")
    wq, wk = pe.rotate(q, k)
    torch.testing.assert_close(rq, wq.transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(rk, wk.transpose(1, 2), rtol=0, atol=0)
    terms = pe.score_terms(q.transpose(1, 2), k.transpose(1, 2), layout="bnhd")
    torch.testing.assert_close(sum(terms.values()), pe.scores(q, k), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="layout must be one of"):
        pe(q, k, v, layout="nhd")


@pytest.mark.parametrize(
    "name",
    # per-head position terms (a bias, or relative tables of heads x head_dim): the head
    # count is checked up front, not met later as a bare size mismatch
    ["t5", "alibi", "shaw", "bert_relative_key", "bert_relative_key_query", "transformer_xl"]
    + ["deberta", "deberta_absolute_input"],
)
def test_a_likely_layout_mix_up_is_named(name: str) -> None:
    pe = make(name)
    head_dim = head_dim_for(name, HEAD_DIM)
    q = torch.randn(1, 9, HEADS, head_dim, dtype=torch.float64)  # [batch, seq, heads, dim] as bhnd
    with pytest.raises(ValueError, match="layout='bnhd'"):
        pe(q, q, q)


@pytest.mark.parametrize("name", ["rope", "nope"])  # any head count: none checked
def test_a_layout_mix_up_of_grouped_heads_is_named(name: str) -> None:
    """Grouped-query tensors in the other layout: the head counts do not divide, but
    they would with dims 1 and 2 swapped, which the error says, either way round."""
    pe = make(name)
    q = torch.randn(1, 4, 3, HEAD_DIM)  # [batch, heads, seq, dim]
    k = torch.randn(1, 2, 5, HEAD_DIM)
    with pytest.raises(ValueError, match="multiple of k's 5.*look like the other layout"):
        pe(q, k, k, layout="bnhd")
    with pytest.raises(ValueError, match="multiple of k's 5.*look like the other layout"):
        pe(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2))
    with pytest.raises(ValueError, match=r"multiple of k's 3 \(grouped-query attention: [^;]*\)$"):
        pe(q, torch.randn(1, 3, 7, HEAD_DIM), torch.randn(1, 3, 7, HEAD_DIM))  # no swap helps


def test_no_layout_hint_where_q_has_the_modules_heads() -> None:
    """Equal lengths make any swap divide; a module that knows its heads sees q's dim 1
    hold them, so a wrong kv-head count is not called a layout mix-up."""
    pe = make("t5")  # per-head position terms: the head count is checked
    q = torch.randn(2, HEADS, 12, HEAD_DIM)
    k = torch.randn(2, HEADS - 1, 12, HEAD_DIM)
    with pytest.raises(
        ValueError, match=r"multiple of k's \d+ \(grouped-query attention: [^;]*\)$"
    ):
        pe(q, k, k)
    with pytest.raises(ValueError, match="layout='bnhd'"):  # the real mix-up
        pe(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2))


def test_rotate_keys_names_k() -> None:
    """rotate_keys(k) checks its one tensor as k, not as q."""
    rope = make("rope")
    for bad, message in (
        (torch.randn(2, 5, HEAD_DIM), "k must have shape"),
        (torch.ones(1, 2, 5, HEAD_DIM, dtype=torch.int64), "k must be a float16, bfloat16"),
        (torch.randn(1, 2, 5, HEAD_DIM + 2), f"k must have head_dim {HEAD_DIM}"),
    ):
        with pytest.raises(ValueError, match=message):
            rope.rotate_keys(bad)


@pytest.mark.parametrize("name", ["alibi", "rope", "shaw", "fire", "tupe_r", "rope_logn"])
def test_float8_inputs_are_refused_by_name(name: str) -> None:
    """float8 passes is_floating_point() but CPU ops refuse it deep in a call (alibi and
    rope raised NotImplementedError, fire, tupe_r and rope_logn RuntimeError, and shaw
    returned an output): now a ValueError naming the tensor, and the mask."""
    pe = make(name)
    q, k, v = _inputs(HEADS)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        with pytest.raises(ValueError, match="q must be a float16, bfloat16, float32 or float64"):
            pe(q.to(dtype), k, v)
        with pytest.raises(ValueError, match="v must be a float16, bfloat16, float32 or float64"):
            pe(q, k, v.to(dtype))
    mask = torch.zeros(5, 7).to(torch.float8_e5m2)
    with pytest.raises(ValueError, match="attn_mask must be bool, float16"):
        pe(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("name", ["alibi", "rope", "t5", "learned_absolute"])
def test_positions_past_the_exact_range_are_refused(name: str) -> None:
    pe = make(name)
    q, k, v = _inputs(HEADS, n=2, m=2)
    too_far = torch.tensor([2**53, 2**53 + 1])
    with pytest.raises(ValueError, match=r"k_positions must lie in \[0, 2\^53 - 1\]"):
        pe(q, k, v, q_positions=torch.tensor([0, 1]), k_positions=too_far)
    with pytest.raises(ValueError, match="q_positions must lie"):
        pe(q, k, v, q_positions=torch.tensor([-1, 0]))


@pytest.mark.parametrize(
    ("values", "dtype", "allowed"),
    [
        ([0, 2**53 - 1], torch.int64, True),  # both ends of the exact range
        ([2**53], torch.int64, False),
        ([2**62], torch.int64, False),
        ([-1], torch.int64, False),
        ([-(2**63)], torch.int64, False),
        ([-1], torch.int32, False),
        ([2**31 - 1], torch.int32, True),
        ([255], torch.uint8, True),
    ],
)
def test_the_position_range_check_has_exact_bounds(
    values: list[int], dtype: torch.dtype, allowed: bool
) -> None:
    """check_positions admits exactly [0, 2^53 - 1] (one bit test on int64) for any
    integer dtype, and returns int64."""
    check = importlib.import_module("generated._inputs").check_positions
    positions = torch.tensor(values, dtype=dtype)
    if allowed:
        got = check(positions, len(values), None, "q_positions", positions.device)
        assert got.dtype == torch.int64 and got.tolist() == values
    else:
        with pytest.raises(ValueError, match=r"q_positions must lie in \[0, 2\^53 - 1\]"):
            check(positions, len(values), None, "q_positions", positions.device)


@pytest.mark.parametrize("name", ["alibi", "rope", "deberta"])
def test_positions_on_another_device_are_named(name: str) -> None:
    pe = make(name)
    q, k, v = _inputs(HEADS, n=2, m=2)
    elsewhere = torch.arange(2, device="meta")
    with pytest.raises(ValueError, match="q_positions is on meta"):
        pe(q, k, v, q_positions=elsewhere)
    with pytest.raises(ValueError, match="k_positions is on meta"):
        pe.rotate(q, k, None, elsewhere)
