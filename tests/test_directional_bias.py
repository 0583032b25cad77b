"""A bias of j - i with trained scalars per head (KERPLE's r1 and r2, trained ALiBi
slopes) trains on the CPU through ``directional_bias_attention``: CPU flash attention
with the bias as a constant view, each scalar's gradient from one more flash forward
over vec + log w. Outputs and gradients are checked against softmax(q kᵀ s + b) v with
the bias written out per pair in float64 here, and the modules that take the path
against their eager oracle.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from tests.conftest import (
    assert_sdpa_matches_eager,
    generated_class,
    set_runtime,
    spec_variant,
    spy_query_shapes,
)

directional = importlib.import_module("generated._directional_bias")
distances = importlib.import_module("generated._distances")
masks = importlib.import_module("generated._masks")

HEADS = 3
SCALE = 0.3


def bias_formula(
    distance: torch.Tensor, slope: torch.Tensor, partial: torch.Tensor, shared: torch.Tensor
) -> torch.Tensor:
    """b_h(r) = -slope_h |r| + partial_h log(1 + |r|) (heads past partial's length: 0)
    + shared sin(0.3 r), at key minus query position r: [H, *r.shape]. The shared
    scalar's direction, sin(0.3 r), takes both signs."""
    r = distance.to(slope.dtype)
    partial = torch.cat([partial, partial.new_zeros(HEADS - partial.shape[0])])
    heads = (HEADS,) + (1,) * r.dim()
    return (
        -slope.view(heads) * r.abs()
        + partial.view(heads) * torch.log1p(r.abs())
        + shared * torch.sin(0.3 * r)
    )


def attention_formula(q, k, v, parameters, causal: bool) -> torch.Tensor:
    """softmax(q kᵀ s + b_h(j - i)) v, the queries being the last N of the M keys, every
    score written out: [B, H, N, D]."""
    n, m = q.shape[2], k.shape[2]
    distance = torch.arange(m)[None, :] - (torch.arange(n)[:, None] + m - n)  # key - query
    scores = torch.matmul(q, k.transpose(-1, -2)) * SCALE + bias_formula(distance, *parameters)
    if causal:
        scores = scores.masked_fill(distance > 0, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _leaves(n: int, m: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, HEADS, n, 8, generator=generator, dtype=dtype)
    k, v = (torch.randn(2, HEADS, m, 8, generator=generator, dtype=dtype) for _ in range(2))
    slope = torch.rand(HEADS, generator=generator, dtype=dtype) + 0.1
    partial = torch.rand(HEADS - 1, generator=generator, dtype=dtype)  # heads 0 and 1
    shared = torch.tensor(0.7, dtype=dtype)
    weight = torch.randn(2, HEADS, n, 8, generator=generator, dtype=dtype)  # d loss / d out
    return [t.requires_grad_() for t in (q, k, v, slope, partial, shared)], weight


def _runtime_attention(
    q, k, v, slope, partial, shared, causal: bool, added_mask: bool = False
) -> torch.Tensor:
    """The runtime's attention with the formula's per-distance vector, causal masking
    put in by ``masked_fill`` (the masked entries then have direction 0) or, with
    ``added_mask``, by adding -inf (they keep the formula's direction)."""
    n, m = q.shape[2], k.shape[2]

    def vector() -> torch.Tensor:  # [H, N + M - 1], entry t at key minus query t - (M - 1)
        vec = bias_formula(distances.default_distances(n, m, q.device), slope, partial, shared)
        allowed = masks.distance_allowed(n, m, q.device, causal, None)
        if allowed is None:
            return vec
        if added_mask:
            return vec + torch.zeros_like(vec).masked_fill(~allowed, float("-inf"))
        return vec.masked_fill(~allowed, float("-inf"))

    parameters = (slope, partial, shared)
    return directional.directional_bias_attention(q, k, v, vector, parameters, SCALE, causal)


def _outputs_and_gradients(attend, leaves, weight):
    out = attend(*leaves)
    trained = [t for t in leaves if t.requires_grad]
    return out.detach(), torch.autograd.grad((out * weight).sum(), trained)


def _assert_matches_formula(
    n, m, causal, dtype=torch.float64, tolerance=None, frozen=(), added_mask=False
):
    leaves, weight = _leaves(n, m, dtype)
    for index in frozen:
        leaves[index].requires_grad_(False)
    got, got_grads = _outputs_and_gradients(
        lambda q, k, v, *p: _runtime_attention(q, k, v, *p, causal, added_mask), leaves, weight
    )
    wide = [t.detach().double().requires_grad_(t.requires_grad) for t in leaves]
    want, want_grads = _outputs_and_gradients(
        lambda q, k, v, *p: attention_formula(q, k, v, p, causal), wide, weight.double()
    )
    tolerance = tolerance or {"rtol": 1e-10, "atol": 1e-12}
    torch.testing.assert_close(got.double(), want, **tolerance)
    assert len(got_grads) == len(want_grads) == 6 - len(frozen)
    for index, (g, w) in enumerate(zip(got_grads, want_grads, strict=True)):
        torch.testing.assert_close(
            g.double(), w, **tolerance, msg=lambda text, index=index: f"leaf {index}: {text}"
        )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("n", "m", "query_chunk"), [(37, 37, 8), (20, 45, 8), (33, 33, 256)])
def test_directional_bias_attention_matches_the_formula(
    n, m, query_chunk, causal, monkeypatch
) -> None:
    """Per-head, partial and shared scalars (one with a direction of both signs); with
    small causal chunks several flash calls run per forward. Causal with N = M, the
    first query reads only its own key, where -|r| and log(1 + |r|) have no weight."""
    monkeypatch.setitem(masks.SDPA_QUERY_CHUNK, "cpu", query_chunk)
    _assert_matches_formula(n, m, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_directional_bias_attention_in_float32_stays_within_float32_error(causal) -> None:
    _assert_matches_formula(300, 300, causal, torch.float32, {"rtol": 1e-4, "atol": 2e-5})


def test_masked_distances_count_for_no_row_however_the_mask_went_in() -> None:
    """With -inf added (not filled in), the causally masked distances keep a direction;
    the first query, which reads only its own key (weight 0 there), must still read no
    weight, as those entries are -inf in the forward."""
    _assert_matches_formula(37, 37, True, added_mask=True)


def test_a_frozen_scalar_gets_no_gradient_and_the_others_theirs() -> None:
    _assert_matches_formula(30, 40, True, frozen=(3, 5))  # slope and shared frozen


@pytest.mark.parametrize("reached", [True, False])
def test_a_scalar_the_vector_does_not_move_with_gets_zero(reached) -> None:
    """A shared scalar that multiplies nothing (its direction is 0 everywhere), or that
    the vector never reads, before the others: every row reads no weight, and its
    gradient is exactly 0 (the flash kernel's row of only -inf has log-sum-exp 0, which
    must not count); the others' gradients are still theirs."""
    leaves, weight = _leaves(24, 24, torch.float64)
    q, k, v, slope, partial, shared = leaves
    idle = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)

    def vector() -> torch.Tensor:
        vec = bias_formula(distances.default_distances(24, 24, q.device), slope, partial, shared)
        return vec + 0.0 * idle if reached else vec

    parameters = (idle, slope, partial, shared)
    out = directional.directional_bias_attention(q, k, v, vector, parameters, SCALE, False)
    grads = torch.autograd.grad((out * weight).sum(), parameters)
    assert torch.equal(grads[0], torch.zeros_like(grads[0]))
    wide = [t.detach().requires_grad_() for t in leaves]
    want = attention_formula(*wide[:3], wide[3:], causal=False)
    want_grads = torch.autograd.grad((want * weight).sum(), wide[3:])
    for got, expected in zip(grads[1:], want_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


MODULES = ["kerple_log", "kerple_power", "alibi_learned"]


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("n", "m", "kv_heads"), [(70, 70, 4), (50, 80, 2)])
def test_trained_scalars_per_head_take_the_directional_path(
    name, causal, n, m, kv_heads, monkeypatch
) -> None:
    """KERPLE's r1 and r2 and trained ALiBi slopes (``distance_bias_parameters``), here
    from 64 keys on, with grouped-query heads: outputs and gradients equal the eager
    oracle's."""
    pe = generated_class(name)(heads=4, head_dim=8).double()
    set_runtime(monkeypatch, "DIRECTIONAL_BIAS_MIN_KEYS", {False: 64, True: 64}, pe)
    route = spy_query_shapes(monkeypatch, pe, "directional_bias_attention")
    assert pe.distance_bias_parameters
    assert_sdpa_matches_eager(pe, n, m, kv_heads, causal=causal)
    assert route == [(2, 4, n, 8)]


@pytest.mark.parametrize("variant", ["log", "power"])
def test_a_head_whose_scalar_is_clamped_gets_only_the_gradient_back_in(
    monkeypatch, variant: str
) -> None:
    """KERPLE reads r2 clamped at 0.01 (power: and at 2): a head with r2 outside gets
    the gradient at the bound where a descent step moves it back toward the range and 0
    where it would move it further out (``clamp_toward_range``), which the path's
    directions, taken at the clamped value, cannot say alone (``_directions_and_passes``). Both
    signs of the loss: the path's gradients equal the oracle's, and the outside heads'
    are 0 for one sign and not for the other."""
    pe = generated_class(f"kerple_{variant}")(heads=4, head_dim=8).double()
    with torch.no_grad():
        pe.r2[1] = -0.5
        pe.r2[3] = 2.5 if variant == "power" else pe.r2[3]
    outside = [1, 3] if variant == "power" else [1]
    set_runtime(monkeypatch, "DIRECTIONAL_BIAS_MIN_KEYS", {False: 64, True: 64}, pe)
    route = spy_query_shapes(monkeypatch, pe, "directional_bias_attention")
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 70, 8, generator=generator, dtype=torch.float64) for _ in "qkv")
    stopped = {head: set() for head in outside}
    for sign in (1.0, -1.0):
        grads = {}
        for backend in ("eager", "sdpa"):
            pe.zero_grad()
            (sign * pe(q, k, v, backend=backend)).sin().sum().backward()
            grads[backend] = (pe.r1.grad.clone(), pe.r2.grad.clone())
        for got, want in zip(grads["sdpa"], grads["eager"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
        for head in outside:
            stopped[head].add(float(grads["sdpa"][1][head]) == 0.0)
    assert route
    assert all(flags == {True, False} for flags in stopped.values()), stopped


def test_a_bias_inside_the_scale_is_scaled_on_the_directional_path(monkeypatch) -> None:
    variant = spec_variant(
        "kerple_log", ("placement: after_scale", "placement: before_scale"), name="kerple_inside"
    )
    pe = variant(heads=4, head_dim=8).double()
    set_runtime(monkeypatch, "DIRECTIONAL_BIAS_MIN_KEYS", {False: 64, True: 64}, pe)
    route = spy_query_shapes(monkeypatch, pe, "directional_bias_attention")
    assert pe.position_bias_inside_scale and pe.scale != 1.0
    assert_sdpa_matches_eager(pe, 70, 70, 4)
    assert route


def test_the_path_serves_from_its_key_count_in_float32_floored(monkeypatch) -> None:
    """Below ``DIRECTIONAL_BIAS_MIN_KEYS[causal]`` keys the query chunks train; from it
    on the directional path does, in float32 with the bias floored as SDPA's mask is,
    within float32 error of the float64 oracle (slopes steep enough to reach the
    floor: the floored entries get no gradient)."""
    pe = generated_class("alibi_learned")(heads=4, head_dim=8)
    with torch.no_grad():
        pe.slopes.fill_(0.9)  # the bias falls past -40 within 45 keys
    set_runtime(monkeypatch, "DIRECTIONAL_BIAS_MIN_KEYS", {False: 96, True: 2**62}, pe)
    route = spy_query_shapes(monkeypatch, pe, "directional_bias_attention")
    for m in (95, 96):
        q, k, v = (torch.randn(1, 4, m, 8, requires_grad=True) for _ in range(3))
        out = pe(q, k, v, backend="sdpa")
        grads = torch.autograd.grad(out.square().sum(), (q, pe.slopes))
        wide = copy.deepcopy(pe).double()
        want = wide(q.double(), k.double(), v.double(), backend="eager")
        want_grads = torch.autograd.grad(want.square().sum(), (q, wide.slopes))
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
        for got, expected in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(got.double(), expected.double(), rtol=1e-4, atol=1e-5)
    pe(q, k, v, backend="sdpa", causal=True).sum().backward()  # causal: from 2**62 keys
    assert route == [(1, 4, 96, 8)]


@pytest.mark.parametrize(
    "case", ["no_grad", "frozen", "window", "bfloat16", "one_query", "device", "clipped"]
)
def test_the_path_serves_only_training_steps_it_can_take(case, monkeypatch) -> None:
    """No gradient into the scalars, a window, half precision, one query, a device not
    in ``DIRECTIONAL_BIAS_DEVICES`` or a module without such scalars (T5): the step
    goes elsewhere, and still trains where gradients flow."""
    name = "t5" if case == "clipped" else "kerple_log"
    pe = generated_class(name)(heads=4, head_dim=8)
    set_runtime(monkeypatch, "DIRECTIONAL_BIAS_MIN_KEYS", {False: 1, True: 1}, pe)
    if case == "device":
        set_runtime(monkeypatch, "DIRECTIONAL_BIAS_DEVICES", set(), pe)
    route = spy_query_shapes(monkeypatch, pe, "directional_bias_attention")
    if case == "frozen":
        pe.requires_grad_(False)
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    n = 1 if case == "one_query" else 40
    q = torch.randn(1, 4, n, 8, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, 4, 40, 8, dtype=dtype) for _ in range(2))
    window = 8 if case == "window" else None
    with torch.set_grad_enabled(case != "no_grad"):
        out = pe(q, k, v, backend="sdpa", window=window)
    if case != "no_grad":
        out.float().sum().backward()
        assert q.grad is not None
    assert route == []


def test_the_catalogue_declares_trained_scalars_per_head_exactly_where_they_are() -> None:
    """``distance_bias_parameters`` names trained parameters, one scalar per head each
    (KERPLE's r1 and r2, trained slopes), and nothing for fixed slopes or tables."""
    from generated import ENCODINGS

    declared = {name: cls.distance_bias_parameters for name, cls in ENCODINGS.items()}
    assert {name: names for name, names in declared.items() if names} == {
        "kerple_log": ("r1", "r2"),
        "kerple_power": ("r1", "r2"),
        "alibi_learned": ("slopes",),
    }
    for name in ("kerple_log", "kerple_power", "alibi_learned"):
        pe = ENCODINGS[name](heads=4, head_dim=8)
        trained = dict(pe.named_parameters())
        for attribute in pe.distance_bias_parameters:
            assert trained[attribute].shape == (4,)
