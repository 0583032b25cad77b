"""Runtime contract of every generated module beyond the happy path.

Regression tests for defects found in review: caches made under inference mode, cache
growth in decode loops, the rotary cache as a buffer, default query positions, fully
masked rows, sparse Transformer-XL distances, autocast, exception types, and FLOATER's
trajectory in decode loops.
"""

from __future__ import annotations

import copy
import importlib
import io
import pickle
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import generated_class, head_dim_for, runtime_value, spec_names

NAMES = spec_names()
F64 = torch.float64


def make(name: str, **overrides) -> torch.nn.Module:
    overrides.setdefault("heads", 2)
    overrides["head_dim"] = head_dim_for(name, overrides.get("head_dim", 8))
    return generated_class(name)(**overrides).eval()


def qkv(pe, batch=1, n=5, m=5, dtype=torch.float32):
    value_dim = getattr(pe, "value_dim", pe.head_dim)
    q = torch.randn(batch, pe.heads, n, pe.head_dim, dtype=dtype)
    k = torch.randn(batch, pe.heads, m, pe.head_dim, dtype=dtype)
    v = torch.randn(batch, pe.heads, m, value_dim, dtype=dtype)
    return q, k, v


def has_score_bias(pe) -> bool:
    positions = torch.arange(3)
    return pe.score_bias(positions, positions) is not None


# 1. caches made under inference mode ------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_caches_filled_under_inference_mode_do_not_break_training(name: str) -> None:
    pe = make(name)
    q, k, v = qkv(pe)
    with torch.inference_mode():
        for backend in ("eager", "sdpa"):
            pe(q, k, v, causal=True, backend=backend)  # an evaluation pass warms the caches
    for backend in ("eager", "sdpa"):
        qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
        pe(qq, kk, v, causal=True, backend=backend).sum().backward()
        assert qq.grad is not None and torch.isfinite(qq.grad).all()


def test_floater_trajectory_cached_under_inference_mode_is_not_reused_for_training() -> None:
    pe = make("floater", model_dim=16)
    x = torch.randn(1, 6, 16)
    with torch.inference_mode():
        pe.embed(x)
    out = pe.embed(x)
    out.sum().backward()
    assert pe.dynamics_in.weight.grad is not None


# 2. bounded caches ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["alibi", "t5", "t5_decoder", "shaw", "transformer_xl", "tupe_r"])
def test_decode_loop_keeps_a_bounded_cache(name: str) -> None:
    pe = make(name)
    limit = importlib.import_module("generated._caches").CACHE_SIZE
    q = torch.randn(1, pe.heads, 1, pe.head_dim)
    for m in range(1, 40):
        k = torch.randn(1, pe.heads, m, pe.head_dim)
        v = torch.randn(1, pe.heads, m, getattr(pe, "value_dim", pe.head_dim))
        with torch.no_grad():  # as a decoding loop runs (projected rows are kept)
            pe(q, k, v, causal=True, backend="sdpa")
        assert len(pe._cache) <= limit
    assert len(pe._cache) > 0


def test_slope_bias_cache_is_keyed_on_dtype() -> None:
    pe = make("alibi", heads=12)
    positions = torch.tensor([300_000, 0])
    q = torch.zeros(1, 12, 2, 8, dtype=F64)
    first = pe.score_terms(q, q)["position_position"]
    assert first.dtype == F64
    pe.double()  # the module's slopes are now float64: the float32 cache entry must not serve
    exact = pe.score_bias(positions[:1], positions[1:])  # [heads, 1, 1]
    # 12 heads: 8 slopes 2^-(h+1), then the odd ones of the 16-head sequence 2^-((h+1)/2)
    slopes = [2.0 ** -(h + 1) for h in range(8)] + [2.0 ** -((h + 1) / 2) for h in (0, 2, 4, 6)]
    expected = -torch.tensor(slopes, dtype=F64) * 300_000
    assert exact.dtype == F64
    torch.testing.assert_close(exact.flatten(), expected, atol=1e-9, rtol=0)
    second = pe.score_terms(q, q)["position_position"]
    assert second.dtype == F64


# 3. the rotary cos/sin cache ----------------------------------------------------------


@pytest.mark.parametrize("name", ["rope", "rope_gptj"])
def test_rotary_cache_is_a_plain_float32_attribute(name: str) -> None:
    q, k = torch.randn(1, 2, 300, 64), torch.randn(1, 2, 300, 64)
    fresh = make(name, head_dim=64)
    expected, _ = fresh.rotate(q, k)
    warm = make(name, head_dim=64)
    warm.rotate(q, k)  # fills the cache
    assert "_cos_cache" not in dict(warm.named_buffers())
    assert "_sin_cache" not in dict(warm.named_buffers())
    assert not any("cache" in key for key in warm.state_dict())
    warm.half()  # must not lower the cache's precision
    assert warm._cos_cache.dtype == torch.float32
    got, _ = warm.rotate(q, k)  # float32 input after .half()
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    warm.to(torch.bfloat16)
    got, _ = warm.rotate(q.bfloat16(), k.bfloat16())
    want, _ = fresh.rotate(q.bfloat16(), k.bfloat16())
    torch.testing.assert_close(got, want, atol=0, rtol=0)


# 4. default query positions -------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_queries_default_to_the_last_key_positions(name: str) -> None:
    pe = make(name)
    q, k, v = qkv(pe, n=3, m=10)
    k_positions = torch.arange(100, 110)
    q_positions = k_positions[-3:]
    for backend in ("eager", "sdpa"):
        for causal in (False, True):
            got = pe(q, k, v, k_positions=k_positions, causal=causal, backend=backend)
            want = pe(
                q,
                k,
                v,
                q_positions=q_positions,
                k_positions=k_positions,
                causal=causal,
                backend=backend,
            )
            torch.testing.assert_close(got, want, atol=0, rtol=0)
            assert got.abs().sum() > 0  # causal must not mask every key
    got = pe.scores(q, k, k_positions=k_positions)
    want = pe.scores(q, k, q_positions=q_positions, k_positions=k_positions)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    got_terms = pe.score_terms(q, k, k_positions=k_positions)
    want_terms = pe.score_terms(q, k, q_positions=q_positions, k_positions=k_positions)
    assert got_terms.keys() == want_terms.keys()
    for key in got_terms:
        torch.testing.assert_close(got_terms[key], want_terms[key], atol=0, rtol=0)
    got_q, got_k = pe.rotate(q, k, k_positions=k_positions)
    want_q, want_k = pe.rotate(q, k, q_positions, k_positions)
    torch.testing.assert_close(got_q, want_q, atol=0, rtol=0)
    torch.testing.assert_close(got_k, want_k, atol=0, rtol=0)


def test_batched_key_positions_give_batched_query_defaults() -> None:
    pe = make("alibi")
    q, k, v = qkv(pe, batch=2, n=2, m=4)
    k_positions = torch.tensor([[0, 1, 2, 3], [10, 11, 12, 13]])
    got = pe(q, k, v, k_positions=k_positions, causal=True)
    want = pe(q, k, v, q_positions=k_positions[:, 2:], k_positions=k_positions, causal=True)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_more_queries_than_keys_need_explicit_positions(name: str) -> None:
    pe = make(name)
    q, k, v = qkv(pe, n=5, m=3)
    calls = [
        lambda: pe(q, k, v),
        lambda: pe(q, k, v, k_positions=torch.arange(3)),
        lambda: pe.scores(q, k),
        lambda: pe.score_terms(q, k),
        lambda: pe.rotate(q, k),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="needs explicit q_positions"):
            call()
    out = pe(q, k, v, q_positions=torch.arange(5), backend="eager")  # explicit: fine
    assert out.shape[2] == 5


# 5. fully masked rows -------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_fully_masked_rows_are_zero_on_every_backend(name: str) -> None:
    pe = make(name)
    q, k, v = qkv(pe, n=2, m=3)
    # query position 0 precedes keys 5, 6, 7: under causal it sees no key
    positions = dict(q_positions=torch.tensor([0, 7]), k_positions=torch.tensor([5, 6, 7]))
    mask = torch.tensor([[False, False, False], [True, True, True]])
    for kwargs in (dict(positions, causal=True), dict(attn_mask=mask)):
        outs = []
        for backend in ("eager", "sdpa", "auto"):
            qq = q.clone().requires_grad_()
            out = pe(qq, k, v, backend=backend, **kwargs)
            out.sum().backward()
            assert torch.isfinite(qq.grad).all()
            assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0])), backend
            assert out[:, :, 1].abs().sum() > 0
            outs.append(out.detach())
        torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(outs[2], outs[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_no_queries_or_no_keys_give_zeros_on_every_backend(name: str) -> None:
    """N = 0 or M = 0: an output of [batch, heads, N, value_dim] zeros (with no keys each
    row is fully masked) on every backend, and a backward that gives zero gradients.
    Keys, but no queries, with default positions; no keys with explicit query positions.
    (flex refuses a value-side term whatever the shape: ``test_flex``.)"""
    pe = make(name)
    explicit = {} if pe.position_axes > 1 else {"q_positions": torch.arange(3)}
    backends = ["eager", "sdpa", "auto"] + ([] if pe.has_value_term else ["flex"])
    for n, m, positions in ((0, 4, {}), (0, 0, {}), (3, 0, explicit)):
        if n > m and not positions:
            continue  # M-RoPE: explicit positions are [axes, batch, seq]
        for backend in backends:
            q, k, v = (t.requires_grad_() for t in qkv(pe, batch=2, n=n, m=m))
            out = pe(q, k, v, backend=backend, causal=True, **positions)
            assert out.shape == (2, pe.heads, n, v.shape[-1]), (backend, n, m)
            assert out.dtype == v.dtype and not out.any(), (backend, n, m)
            out.sum().backward()
            for tensor in (q, k, v):
                assert tensor.grad is not None and not tensor.grad.any(), (backend, n, m)


@pytest.mark.parametrize("name", NAMES)
def test_an_empty_batch_gives_an_empty_output_on_every_backend(name: str) -> None:
    """Batch 0: an empty [0, heads, N, value_dim] output on every backend (CoPE's flex
    score_mod once read entry 0 of its empty captured terms), and a backward."""
    pe = make(name)
    backends = ["eager", "sdpa", "auto"] + ([] if pe.has_value_term else ["flex"])
    for backend in backends:
        q, k, v = (t.requires_grad_() for t in qkv(pe, batch=0, n=3, m=5))
        out = pe(q, k, v, backend=backend, causal=True)
        assert out.shape == (0, pe.heads, 3, v.shape[-1]), backend
        out.sum().backward()
        assert q.grad is not None and q.grad.shape == q.shape, backend


# 6. sparse Transformer-XL distances -----------------------------------------------------


def test_distance_rows_are_only_the_distances_present() -> None:
    pe = make("transformer_xl", model_dim=512)
    q, k, v = qkv(pe, n=2, m=2)
    positions = torch.tensor([0, 10**6])
    index, rows = pe._relative_layout(positions, positions, 2, 2, "cpu", "query_minus_key")
    assert sorted(rows.tolist()) == [-(10**6), 0, 10**6]
    far = pe(q, k, v, q_positions=positions, k_positions=positions, backend="eager")
    assert torch.isfinite(far).all()
    # the gather over distinct distances agrees with the relative shift at default positions
    q, k, v = qkv(pe, n=4, m=7)
    default = pe.scores(q, k)
    explicit = pe.scores(q, k, q_positions=torch.arange(3, 7), k_positions=torch.arange(7))
    torch.testing.assert_close(explicit, default, atol=1e-5, rtol=1e-5)
    # the far-apart terms by hand, in float64: (q_i + v_h) . (W_R R_(i - j))_h, R split
    terms = pe.score_terms(q[:, :, :2], k[:, :, :2], q_positions=positions, k_positions=positions)
    got = (terms["content_position"] + terms["position_position"]) / pe.scale  # [1, H, 2, 2]
    width = pe.model_dim
    inv_freq = 10000.0 ** (-torch.arange(0, width, 2, dtype=F64) / width)
    w_r = pe.r_net.weight.detach().double()
    for i in range(2):
        for j in range(2):
            angles = float(positions[i] - positions[j]) * inv_freq
            r = (w_r @ torch.cat((angles.sin(), angles.cos()))).view(pe.heads, pe.head_dim)
            query = q[0, :, i].double() + pe.r_r_bias.detach().double()  # [H, D]
            want = (query * r).sum(-1)  # [H]
            torch.testing.assert_close(got[0, :, i, j].double(), want, atol=1e-4, rtol=1e-4)


# 7. eager under autocast; float64 modules -------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_eager_stays_exact_under_autocast(name: str) -> None:
    pe = make(name)
    q, k, v = qkv(pe, n=4, m=6)
    want_scores = pe.scores(q, k)
    want_out = pe(q, k, v, causal=True, backend="eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores = pe.scores(q, k)
        terms = pe.score_terms(q, k)
        out = pe(q, k, v, causal=True, backend="eager")
    assert scores.dtype == torch.float32
    assert all(term.dtype == torch.float32 for term in terms.values())
    torch.testing.assert_close(scores, want_scores, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out, want_out, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ["tupe_a", "tupe_r"])
def test_untied_term_of_a_float64_module_is_float64(name: str) -> None:
    pe = make(name, model_dim=16).double()
    q_positions, k_positions = torch.tensor([1, 4, 9]), torch.tensor([2, 3, 9, 20])
    full = pe.score_bias(q_positions, k_positions)
    assert full.dtype == F64
    # the untied term by hand, in float64: scale * (LN(p_i) U_q)_h . (LN(p_j) U_k)_h
    offset = 1 if pe.position_embeddings.weight.shape[0] > pe.max_positions else 0
    table = pe.position_embeddings.weight
    rows_q, rows_k = table[q_positions + offset], table[k_positions + offset]
    if hasattr(pe, "position_norm"):
        norm = pe.position_norm
        rows_q = torch.nn.functional.layer_norm(rows_q, (16,), norm.weight, norm.bias, norm.eps)
        rows_k = torch.nn.functional.layer_norm(rows_k, (16,), norm.weight, norm.bias, norm.eps)
    uq = pe.position_query(rows_q).view(3, pe.heads, pe.head_dim)
    uk = pe.position_key(rows_k).view(4, pe.heads, pe.head_dim)
    untied = torch.einsum("ihd,jhd->hij", uq, uk) * pe.scale
    relative = full - untied
    if not hasattr(pe, "relative_attention_bias"):
        torch.testing.assert_close(full, untied, atol=1e-12, rtol=1e-12)
    else:  # the rest is the bucketed bias: constant along equal i - j (away from the reset)
        assert relative.dtype == F64


# 8. exception types ------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_bad_score_bias_positions_raise_value_error(name: str) -> None:
    """Every encoding checks the positions, those without a position-only bias too
    (they returned None for any argument)."""
    pe = make(name)
    with pytest.raises(ValueError):
        pe.score_bias(None, None)
    with pytest.raises(ValueError):
        pe.score_bias(torch.arange(3), None)
    with pytest.raises(ValueError, match="batch"):
        pe.score_bias(torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="q_positions"):
        pe.score_bias(torch.tensor([-1, 0]), torch.arange(2))
    with pytest.raises(ValueError, match="k_positions"):
        pe.score_bias(torch.arange(2), torch.arange(2.0))
    if not has_score_bias(pe):
        assert pe.score_bias(torch.arange(2), torch.arange(3)) is None


@pytest.mark.parametrize("name", ["t5", "fire", "tupe_a", "transformer_xl", "deberta"])
def test_a_module_built_on_meta_names_what_has_no_values(name: str) -> None:
    """Built under torch.device("meta") (to load weights later), then called with CPU
    inputs: a ValueError naming the parameter or buffer, not torch's RuntimeError."""
    with torch.device("meta"):
        pe = make(name)
    q, k, v = qkv(pe)
    with pytest.raises(ValueError, match=r"the module's \S+ is on the meta device.*q on cpu"):
        pe(q, k, v)
    with pytest.raises(ValueError, match="on the meta device"):
        pe.scores(q, k)
    # the way the message names: to_empty, reset_parameters, then the weights
    reference = make(name)
    pe.to_empty(device="cpu")
    pe.reset_parameters()
    pe.load_state_dict(reference.state_dict())
    torch.testing.assert_close(pe(q, k, v), reference(q, k, v))
    # and a module saved whole still pickles (the hook that forgets devices is named)
    buffer = io.BytesIO()
    torch.save(pe, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded(q, k, v), reference(q, k, v))


@pytest.mark.parametrize("name", ["rope", "shaw", "learned_absolute"])
def test_meta_inputs_that_need_values_are_named(name: str) -> None:
    pe = make(name)
    if name == "learned_absolute":
        x = torch.randn(2, 6, pe.model_dim, device="meta")
        with pytest.raises(ValueError, match="x is on the meta device"):
            pe.embed(x)
        return
    q, k, v = (t.to("meta") for t in qkv(pe))
    with pytest.raises(ValueError, match="q is on the meta device"):
        pe(q, k, v)


def test_meta_inputs_that_need_no_values_give_meta_outputs() -> None:
    pe = make("alibi")
    q, k, v = (t.to("meta") for t in qkv(pe, n=3, m=7))
    for backend in ("auto", "eager", "sdpa"):
        out = pe(q, k, v, backend=backend)
        assert out.device.type == "meta" and out.shape == (1, pe.heads, 3, pe.head_dim)
    assert pe.scores(q, k).device.type == "meta"


def test_a_tensor_moved_after_a_call_is_named_in_any_argument_order() -> None:
    """The devices are read at every call: a submodule moved alone, or a parameter
    replaced after a call, is named (CPU x meta matmuls gave CPU garbage silently),
    whatever order the arguments come in."""
    pe = make("transformer_xl")
    q, k, v = qkv(pe)
    pe(q, k, v)
    pe.r_net.to_empty(device="meta")  # the submodule alone
    for call in (
        lambda: pe(q, k, v),
        lambda: pe(causal=True, q=q, k=k, v=v),
        lambda: pe.scores(layout="bhnd", q=q, k=k),
        lambda: pe.score_bias(torch.arange(5), torch.arange(5)),
    ):
        with pytest.raises(ValueError, match=r"the module's r_net\.weight is on the meta"):
            call()
    pe = make("cope")
    pe(q, k, v)
    pe.cope_positions = torch.nn.Parameter(torch.empty_like(pe.cope_positions, device="meta"))
    with pytest.raises(ValueError, match="the module's cope_positions is on the meta"):
        pe(q, k, v)


def test_other_failures_keep_their_own_error(monkeypatch) -> None:
    pe = make("t5")

    def fails(*args, **keywords):
        raise RuntimeError("not about devices")

    monkeypatch.setattr(pe, "_attend", fails)
    q, k, v = qkv(pe)
    with pytest.raises(RuntimeError, match="not about devices"):
        pe(q, k, v)


@pytest.mark.parametrize("name", ["alibi", "rope", "t5"])
def test_positions_of_any_integer_type_int64_holds_give_the_same_output(name: str) -> None:
    pe = make(name)
    q, k, v = qkv(pe, n=3, m=4)
    q_positions, k_positions = torch.tensor([7, 9, 12]), torch.tensor([3, 7, 8, 12])
    expected = pe(q, k, v, q_positions=q_positions, k_positions=k_positions)
    for dtype in (torch.uint8, torch.int16, torch.int32, torch.uint32):
        got = pe(q, k, v, q_positions=q_positions.to(dtype), k_positions=k_positions.to(dtype))
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
    # uint64 past 2^63 would wrap to negative int64 positions: refused by its dtype
    huge = torch.tensor([2**63, 2**63 + 1, 2**63 + 2], dtype=torch.uint64)
    with pytest.raises(ValueError, match=r"q_positions .*int64 holds.*uint64"):
        pe(q, k, v, q_positions=huge, k_positions=k_positions)


@pytest.mark.parametrize("name", ["tupe_a", "tupe_r"])
def test_untied_positions_never_go_negative(name: str) -> None:
    pe = make(name)
    q, k, v = qkv(pe, n=3, m=0)
    with pytest.raises(ValueError):
        pe(q, k, v)  # once gave negative query positions and an IndexError
    with pytest.raises(ValueError):
        pe.score_bias(torch.tensor([-1]), torch.tensor([0]))


# 9. FLOATER in a decode loop -------------------------------------------------------------


def _count_dynamics(pe) -> list[int]:
    calls = [0]
    original = pe._dynamics

    def counted(*args):
        calls[0] += 1
        return original(*args)

    pe._dynamics = counted
    return calls


def test_floater_decode_step_integrates_one_position_without_autograd() -> None:
    pe = make("floater", model_dim=16)
    x = torch.randn(1, 64, 16)
    fresh = pe.trajectory(65).detach()
    calls = _count_dynamics(pe)
    with torch.no_grad():
        prompt = pe.embed(x)
        after_prompt = calls[0]
        step = pe.embed(x[:, :1], positions=torch.tensor([[64]]))
        assert calls[0] - after_prompt <= 4  # one RK4 step, not 64 positions again
        again = pe.embed(x[:, :1], positions=torch.tensor([[10]]))
        assert calls[0] - after_prompt <= 4  # already integrated: read from the cache
    torch.testing.assert_close(prompt, x + fresh[:64], atol=0, rtol=0)
    torch.testing.assert_close(step, x[:, :1] + fresh[64], atol=0, rtol=0)
    torch.testing.assert_close(again, x[:, :1] + fresh[10], atol=0, rtol=0)
    # an in-place parameter update (an optimizer step) invalidates the cached trajectory
    with torch.no_grad():
        pe.dynamics_out.bias.add_(0.5)
        moved = pe.embed(x[:, :1], positions=torch.tensor([[30]]))
    torch.testing.assert_close(moved, x[:, :1] + pe.trajectory(31).detach()[30], atol=0, rtol=0)
    # so does load_state_dict (it copies in place)
    other = make("floater", model_dim=16)
    pe.load_state_dict(other.state_dict())
    with torch.no_grad():
        loaded = pe.embed(x[:, :1], positions=torch.tensor([[30]]))
        torch.testing.assert_close(loaded, other.embed(x[:, :1], positions=torch.tensor([[30]])))
    # and so does a new tensor assigned to .data (its version counter does not move)
    with torch.no_grad():
        pe.dynamics_out.bias.data = pe.dynamics_out.bias.data + 0.5
        assigned = pe.embed(x[:, :1], positions=torch.tensor([[30]]))
    want = x[:, :1] + pe.trajectory(31).detach()[30]
    torch.testing.assert_close(assigned, want, atol=0, rtol=0)
    # with autograd on the trajectory is integrated afresh and differentiable
    pe.embed(x[:, :4]).sum().backward()
    assert pe.dynamics_out.bias.grad is not None


def test_floater_sees_an_edit_through_data() -> None:
    """An EMA-style edit through ``.data`` leaves every version counter as it was: the
    kept trajectory must still not serve the edited parameters."""
    pe = make("floater", model_dim=8)
    x = torch.randn(1, 5, 8)
    with torch.no_grad():
        before = pe.embed(x)  # a trajectory kept
        for parameter in pe.parameters():
            parameter.data.mul_(0.5)
        after = pe.embed(x)
    fresh = make("floater", model_dim=8)
    fresh.load_state_dict(pe.state_dict())
    torch.testing.assert_close(after, fresh.embed(x).detach(), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(before, after)


def test_floater_cache_stays_bounded() -> None:
    pe = make("floater", model_dim=8)
    limit = importlib.import_module("generated._caches").CACHE_SIZE
    with torch.no_grad():
        for _ in range(limit + 3):
            pe.dynamics_out.bias.add_(0.1)  # a new version each time
            pe.embed(torch.randn(1, 3, 8))
    assert len(pe._cache) <= limit
    assert len(pe._cache) == 1  # one trajectory per dtype and device: old versions dropped


@pytest.mark.parametrize(
    ("name", "expected"),
    [("alibi", "sdpa"), ("t5", "sdpa"), ("deberta", "sdpa"), ("rope", "sdpa"), ("shaw", "sdpa")],
)
def test_auto_on_the_cpu_is_sdpa(name: str, expected: str) -> None:
    """FlexAttention is not fused on the CPU, so "auto" keeps sdpa there; a value term
    too, whose sdpa path forms the weights once and chunks causal queries."""
    pe = generated_class(name)(heads=4, head_dim=64)
    assert pe._auto_backend(torch.randn(1, 4, 16, 64)) == expected


@pytest.mark.parametrize(("name", "queries"), [("t5", 16), ("deberta", 1), ("alibi", 3)])
def test_auto_runs_sdpa_for_a_decode_step_on_any_device(name: str, queries: int) -> None:
    """A few queries take sdpa on CUDA too: flex would compile a kernel for every key
    count of a decoding loop. (A stand-in for a CUDA tensor: only its shape and device
    are read.)"""
    pe = generated_class(name)(heads=4, head_dim=64)
    limit = runtime_value("AUTO_SDPA_MAX_QUERIES")
    assert queries <= limit
    on_cuda = SimpleNamespace(is_cuda=True, shape=(1, 4, queries, 64))
    assert pe._auto_backend(on_cuda) == "sdpa"
    more = SimpleNamespace(is_cuda=True, shape=(1, 4, limit + 1, 64))
    assert pe._auto_backend(more) == "flex"


@pytest.mark.parametrize("name", NAMES)
def test_a_copy_carries_no_table_a_call_grew(name: str) -> None:
    """deepcopy, pickle and torch.save of a module after a call at a far position carry
    its parameters and buffers and nothing the calls grew: a rotation's cos/sin tables
    had made a parameter-free RoPE's file 64 MiB after one call at position 65535. The
    copy still computes what the original does."""
    pe = make(name)
    q, k, v = qkv(pe, n=2, m=2)
    table = getattr(pe, "max_positions", None)  # learned tables end there
    far = torch.tensor([40000, 65535]) if table is None else torch.tensor([0, 1])
    axes = getattr(pe, "position_axes", 1)
    positions = far if axes == 1 else far.expand(axes, 1, 2)
    options = {"q_positions": positions, "k_positions": positions, "causal": True}
    want = pe(q, k, v, **options)
    owned = sum(t.numel() * t.element_size() for t in [*pe.parameters(), *pe.buffers()])
    buffer = io.BytesIO()
    torch.save(pe, buffer)
    assert buffer.tell() < owned + 200_000
    buffer.seek(0)
    for copied in (
        copy.deepcopy(pe),
        pickle.loads(pickle.dumps(pe)),
        torch.load(buffer, weights_only=False),
    ):
        kept = [v for v in vars(copied).values() if isinstance(v, torch.Tensor) and v.numel()]
        assert not kept, [t.shape for t in kept]
        got = copied(q, k, v, **options)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_no_queries_or_no_keys_give_empty_terms_biases_and_rotations(name: str) -> None:
    """score_terms, scores, score_bias, rotate and rotate_keys accept N = 0 or M = 0 as
    forward does, with the names, leading shape and dtype of a call with some (T5 and
    TUPE's bias had raised from a reshape, KERPLE's and Transformer-XL's terms from an
    empty range, M-RoPE's from its axis positions, xPos from min() of no keys, and
    Transformer-XL's content_position term of no queries was [1, H, 0, 3])."""
    pe = make(name)
    axes = getattr(pe, "position_axes", 1)

    def tokens(count: int, start: int = 0) -> torch.Tensor:
        return torch.arange(start, start + count)

    def positions(count: int, start: int = 0) -> torch.Tensor:
        rows = tokens(count, start)
        return rows if axes == 1 else rows.expand(axes, 1, count)

    some_q, some_k, _ = qkv(pe, n=3, m=5)
    want = pe.score_terms(some_q, some_k, q_positions=positions(3, 2), k_positions=positions(5))
    want_bias = pe.score_bias(tokens(3, 2), tokens(5))
    for n, m, explicit in [(0, 5, False), (0, 0, False), (0, 5, True), (3, 0, True), (0, 0, True)]:
        q, k, _ = qkv(pe, n=n, m=m)
        given = {"q_positions": positions(n), "k_positions": positions(m)} if explicit else {}
        terms = pe.score_terms(q, k, **given)
        assert terms.keys() == want.keys()
        for term, value in terms.items():
            assert value.shape == (*want[term].shape[:-2], n, m), term
            assert value.dtype == want[term].dtype, term
        assert pe.scores(q, k, **given).shape == (1, pe.heads, n, m)
        if explicit:
            bias = pe.score_bias(tokens(n), tokens(m))
            assert (bias is None) == (want_bias is None)
            assert bias is None or bias.shape == (*want_bias.shape[:-2], n, m)
            rotated_q, rotated_k = pe.rotate(q, k, positions(n), positions(m))
            assert rotated_q.shape == q.shape and rotated_k.shape == k.shape
            assert pe.rotate_keys(k, positions(m)).shape == k.shape


def test_sparse_and_mkldnn_arguments_are_named() -> None:
    """Each tensor argument in a layout other than torch.strided is a ValueError naming
    it (they had raised NotImplementedError or RuntimeError from inside aten)."""
    pe = make("t5")
    q, k, v = qkv(pe, n=4, m=4)
    positions = torch.arange(4)
    calls = {
        "q": lambda: pe(q.to_sparse(), k, v),
        "k_positions": lambda: pe(q, k, v, k_positions=positions.to_sparse()),
        "attn_mask": lambda: pe(q, k, v, attn_mask=torch.ones(4, 4, dtype=torch.bool).to_sparse()),
        "document_ids": lambda: pe(
            q, k, v, document_ids=torch.zeros(4, dtype=torch.long).to_sparse()
        ),
        "q_positions": lambda: pe.score_bias(positions.to_sparse(), positions),
    }
    if torch.backends.mkldnn.is_available():
        calls["v"] = lambda: pe(q, k, v.to_mkldnn())
    for name, call in calls.items():
        with pytest.raises(ValueError, match=f"{name} must be a dense tensor"):
            call()
    rope, absolute = make("rope"), make("learned_absolute")
    with pytest.raises(ValueError, match="^positions must be a dense tensor"):
        rope.rotate_keys(k, positions.to_sparse())
    with pytest.raises(ValueError, match="x must be a dense tensor"):
        absolute.embed(torch.randn(1, 4, absolute.model_dim).to_sparse())


@pytest.mark.parametrize("name", NAMES)
def test_a_float64_modules_score_bias_is_its_float64_position_term(name: str) -> None:
    """score_bias of a float64 module is float64 and equals score_terms' position-only
    term (Transformer-XL's was float32, 4e-9 off it)."""
    pe = make(name).double()
    positions = torch.arange(4)
    bias = pe.score_bias(positions, positions)
    if bias is None:
        return
    assert bias.dtype == F64
    q, k, _ = qkv(pe, n=4, m=4, dtype=F64)
    term = pe.score_terms(q, k, q_positions=positions, k_positions=positions).get(
        "position_position"
    )
    if term is not None and not pe.position_bias_inside_scale:
        torch.testing.assert_close(bias, term, rtol=1e-12, atol=1e-12)
