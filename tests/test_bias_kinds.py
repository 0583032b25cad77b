"""The bias kinds beyond ALiBi and T5: KERPLE, FIRE, Sandwich, ALiBi's learned and custom
slopes, and expression biases.

Every value is compared with an independent float64 implementation of the paper's
formula written here (never taken from the generated code); every backend agrees with
the eager oracle on outputs and gradients; gradients reach the trained parameters.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from generated import parameters_frozen
from posgen.cli import main
from posgen.codegen.inmemory import encoding_class, module_from_spec
from tests.conftest import ROOT, generated_class, run_backend, spec_variant, spy_method

runtime_inputs = importlib.import_module("generated._inputs")
EXPR_SPEC = ROOT / "tests" / "specs" / "expr" / "kerple_log_expr.yaml"
NEW_KINDS = ["kerple_log", "kerple_power", "fire", "sandwich", "alibi_learned"]
Q_POS = torch.tensor([3, 4, 9, 10, 12])
K_POS = torch.tensor([0, 1, 2, 4, 7, 9, 11])


def _module(name: str, heads: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    return generated_class(name)(heads=heads, head_dim=8).double()


def _pairs(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """i - j as float64 [N, M], written independently of the runtime."""
    return q_pos.double()[:, None] - k_pos.double()[None, :]


# --------------------------------------------------------------------------- references


def kerple_reference(variant: str, r1: torch.Tensor, r2: torch.Tensor, diff: torch.Tensor):
    """KERPLE (Chi et al. 2022): -r1 log(1 + r2 |m - n|) or -r1 |m - n|^r2, r clamped."""
    p = r1.detach().double().clamp(min=0.01)[:, None, None]
    a = r2.detach().double().clamp(min=0.01)[:, None, None]
    if variant == "power":
        a = a.clamp(max=2.0)
    distance = diff.abs()[None]
    if variant == "log":
        return -p * torch.log(1.0 + a * distance)
    return -p * distance**a


def sandwich_reference(
    dim: int, diff: torch.Tensor, heads: int, per_head: str = "divided"
) -> torch.Tensor:
    """S = sum_{k=1}^{d'/2} cos((i - j) / 10000^(2k / d')): every head alike ("same"),
    or head h = 1 .. H takes (S - d'/2) / (h * 8 / H) ("divided", NVIDIA NeMo's
    SandwichRelativePositionEmbedding)."""
    total = torch.zeros_like(diff)
    for k in range(1, dim // 2 + 1):
        total += torch.cos(diff / 10000.0 ** (2.0 * k / dim))
    if per_head == "same":
        return total[None].expand(heads, -1, -1)
    return torch.stack([(total - dim / 2) / (h * 8 / heads) for h in range(1, heads + 1)])


def _sandwich(per_head: str, heads: int = 4) -> torch.nn.Module:
    """The built-in sandwich (``divided``), or its variant with every head alike."""
    if per_head == "divided":
        return _module("sandwich", heads)
    cls = spec_variant(
        "sandwich", ("per_head: divided", "per_head: same"), name="sandwich_same_heads"
    )
    torch.manual_seed(0)
    return cls(heads=heads, head_dim=8).double()


def fire_reference(pe: torch.nn.Module, q_pos: torch.Tensor, k_pos: torch.Tensor):
    """FIRE (Li et al. 2023): f(psi(i - j) / psi(max(i, L))), psi(x) = log(|c| x + 1)."""
    w1, b1 = pe.fire_mlp[0].weight.detach().double(), pe.fire_mlp[0].bias.detach().double()
    w2, b2 = pe.fire_mlp[2].weight.detach().double(), pe.fire_mlp[2].bias.detach().double()
    c = abs(pe.fire_c.item())
    threshold = abs(pe.fire_threshold_scale.item() * pe.fire_init_threshold.item())
    heads = w2.shape[0]
    out = torch.zeros(heads, len(q_pos), len(k_pos), dtype=torch.float64)
    for a, i in enumerate(q_pos.tolist()):
        normaliser = math.log(c * max(i, threshold) + 1.0) + 1e-6
        for b, j in enumerate(k_pos.tolist()):
            x = math.log(c * max(i - j, 0) + 1.0) / normaliser
            hidden = torch.relu(w1[:, 0] * x + b1)
            out[:, a, b] = w2 @ hidden + b2
    return out


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("variant", ["log", "power"])
def test_kerple_values_match_the_paper(variant: str) -> None:
    pe = _module(f"kerple_{variant}")
    with torch.no_grad():  # include values the clamp acts on
        pe.r1[0] = 0.001
        pe.r2[1] = 0.003
        if variant == "power":
            pe.r2[2] = 2.5
    want = kerple_reference(variant, pe.r1, pe.r2, _pairs(Q_POS, K_POS))
    torch.testing.assert_close(pe.score_bias(Q_POS, K_POS), want, rtol=1e-12, atol=1e-12)
    q = torch.zeros(1, 4, 5, 8, dtype=torch.float64)
    k = torch.zeros(1, 4, 7, 8, dtype=torch.float64)
    default = pe.score_terms(q, k)["position_position"]  # queries 2..6, keys 0..6
    want = kerple_reference(variant, pe.r1, pe.r2, _pairs(torch.arange(2, 7), torch.arange(7)))
    torch.testing.assert_close(default, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("variant", ["log", "power"])
@pytest.mark.parametrize("spread", [1, 50])
def test_kerple_bias_and_gradients_at_near_and_far_positions(variant: str, spread: int) -> None:
    """Explicit positions close together (the kernel once per distance, read per pair)
    and far apart (more distances than the pairs' queries and keys: the kernel per
    pair), batched: the bias and the gradients of r1 and r2 equal autograd through the
    paper's formula in float64."""
    pe = _module(f"kerple_{variant}")
    q_pos = torch.stack([Q_POS, Q_POS + 2]) * spread  # [2, N]
    k_pos = torch.stack([K_POS, K_POS.flip(0)]) * spread  # [2, M]
    generator = torch.Generator().manual_seed(2)
    weights = torch.randn(2, 4, 5, 7, generator=generator, dtype=torch.float64)
    bias = pe.score_bias(q_pos, k_pos)  # [2, H, N, M]
    got = torch.autograd.grad((bias * weights).sum(), [pe.r1, pe.r2])

    r1, r2 = (t.detach().clone().requires_grad_() for t in (pe.r1, pe.r2))
    p, a = r1.clamp(min=0.01)[:, None, None], r2.clamp(min=0.01)[:, None, None]
    if variant == "power":
        a = a.clamp(max=2.0)
    distance = (q_pos.double()[:, None, :, None] - k_pos.double()[:, None, None, :]).abs()
    want = -p * torch.log1p(a * distance) if variant == "log" else -p * distance**a
    want_grads = torch.autograd.grad((want * weights).sum(), [r1, r2])
    torch.testing.assert_close(bias, want, rtol=1e-12, atol=1e-12)
    for grad, want_grad in zip(got, want_grads, strict=True):
        torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)


# (r1, r2)'s upper bounds at initialisation, per variant, as the authors' code draws
# them (chijames/KERPLE): ParallelKerpleLog's factor bias_p ~ U(0, 2) and bias_a ~ U(0, 1);
# ParallelKerplePower's factor bias_a ~ U(0, 1) and exponent bias_p ~ U(0, 2)
KERPLE_INIT_BOUNDS = {"log": (2.0, 1.0), "power": (1.0, 2.0)}


@pytest.mark.parametrize("variant", ["log", "power"])
def test_kerple_initialisation_follows_the_authors_code(variant: str) -> None:
    pe = generated_class(f"kerple_{variant}")(heads=64, head_dim=8)
    assert pe.r1.shape == pe.r2.shape == (64,)
    for value, bound in zip((pe.r1, pe.r2), KERPLE_INIT_BOUNDS[variant], strict=True):
        assert 0 <= float(value.detach().min()) and float(value.detach().max()) < bound
        assert float(value.detach().max()) > bound / 2  # uniform up to the bound, not half


def test_kerple_power_takes_the_authors_weights_by_its_documented_mapping() -> None:
    """ParallelKerplePower's bias = -bias_a * |m - n|^bias_p (chijames/KERPLE), its
    parameters copied into r1 and r2 as the module's "Weights:" section says."""
    cls = generated_class("kerple_power")
    module_doc = importlib.import_module("generated.kerple_power").__doc__ or ""
    assert "``bias_a`` and ``bias_p`` of the authors' ParallelKerplePower" in module_doc
    generator = torch.Generator().manual_seed(4)
    bias_a = torch.rand(4, 1, 1, generator=generator, dtype=torch.float64)
    bias_p = torch.rand(4, 1, 1, generator=generator, dtype=torch.float64) * 2
    pe = cls(heads=4, head_dim=8).double()
    with torch.no_grad():
        pe.r1.copy_(bias_a.squeeze())
        pe.r2.copy_(bias_p.squeeze())
    diff = _pairs(torch.arange(6), torch.arange(6)).clamp(min=0)  # causal |m - n|
    authors = -bias_a.clamp(min=0.01) * diff.pow(bias_p.clamp(min=0.01, max=2))
    got = pe.score_bias(torch.arange(6), torch.arange(6))
    torch.testing.assert_close(got.tril(), authors, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("per_head", ["divided", "same"])
@pytest.mark.parametrize("spread", [1, 40], ids=["near", "far"])
def test_sandwich_values_match_the_formula(spread: int, per_head: str) -> None:
    """Positions close together (the bias once per distance, read per pair) and far
    apart (per pair), and the defaults, for both ways of giving the heads the sum."""
    pe = _sandwich(per_head, heads=6)
    q_pos, k_pos = Q_POS * spread, K_POS * spread
    want = sandwich_reference(128, _pairs(q_pos, k_pos), 6, per_head)
    torch.testing.assert_close(pe.score_bias(q_pos, k_pos), want, rtol=1e-12, atol=1e-10)
    q = torch.zeros(1, 6, 5, 8, dtype=torch.float64)
    default = pe.score_terms(q, q)["position_position"]
    want = sandwich_reference(128, _pairs(torch.arange(5), torch.arange(5)), 6, per_head)
    torch.testing.assert_close(default, want, rtol=1e-12, atol=1e-10)
    assert list(pe.state_dict()) == []  # nothing trained or saved


@pytest.mark.parametrize("per_head", ["divided", "same"])
def test_sandwich_attention_matches_the_formula_on_every_backend(per_head: str) -> None:
    """softmax(q.k / sqrt(d) + bias) v in float64 from the reference bias, causal, on
    the default positions and on explicit ones, for eager and sdpa."""
    pe = _sandwich(per_head, heads=4)
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=generator, dtype=torch.float64) for _ in "qkv")
    positions = torch.tensor([0, 3, 4, 9, 10, 30])
    bias = sandwich_reference(128, _pairs(positions, positions), 4, per_head)
    scores = q @ k.transpose(-2, -1) / 8**0.5 + bias
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    want = scores.softmax(-1) @ v
    for backend in ("eager", "sdpa"):
        got = pe(
            q, k, v, causal=True, q_positions=positions, k_positions=positions, backend=backend
        )
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    default_bias = sandwich_reference(128, _pairs(torch.arange(6), torch.arange(6)), 4, per_head)
    scores = q @ k.transpose(-2, -1) / 8**0.5 + default_bias
    want = scores.softmax(-1) @ v
    for backend in ("eager", "sdpa"):
        torch.testing.assert_close(pe(q, k, v, backend=backend), want, rtol=1e-10, atol=1e-10)


def test_sandwich_at_large_positions_keeps_float64_precision() -> None:
    """Positions near 2^40 (explicit, 3 apart, per batch row): the bias is the formula
    of their differences to float64 precision, as near 0 (the angles are taken from the
    least position; from 0, cos(i w) cos(j w) + sin(i w) sin(j w) lost 1e-4 there)."""
    pe = _module("sandwich")
    base = torch.tensor([[2**40], [2**40 + 7]])  # [batch, 1]
    q_pos, k_pos = base + 3 * torch.arange(5), base + 3 * torch.arange(7) - 4  # [2, 5], [2, 7]
    diff = (q_pos[:, :, None] - k_pos[:, None, :]).double()  # exact below 2^53
    want = torch.stack([sandwich_reference(128, row, 4) for row in diff])  # divided
    torch.testing.assert_close(pe.score_bias(q_pos, k_pos), want, rtol=1e-12, atol=1e-10)


def test_fire_values_match_the_paper() -> None:
    pe = _module("fire")
    with torch.no_grad():  # a threshold the positions cross, and a non-default c
        pe.fire_threshold_scale.fill_(8.0 / 512.0)
        pe.fire_c.fill_(-0.3)
    want = fire_reference(pe, Q_POS, K_POS)
    torch.testing.assert_close(pe.score_bias(Q_POS, K_POS), want, rtol=1e-10, atol=1e-12)
    batched = pe.score_bias(torch.stack([Q_POS, Q_POS + 20]), torch.stack([K_POS, K_POS + 20]))
    assert batched.shape == (2, 4, 5, 7)
    torch.testing.assert_close(batched[1], fire_reference(pe, Q_POS + 20, K_POS + 20))


@pytest.mark.parametrize("offset", [2**24, 2**30, 2**40])
def test_fire_distances_stay_exact_past_float32_positions(offset: int) -> None:
    """A float32 FIRE forms i - j in int64: positions rounded to float32 first had
    made the distances 0 or multiples of 2, 4 .. past 2^24 (at 2^30 all eight keys got
    one bias). The bias against the paper's formula by hand, and the output of every
    backend against the float64 module's."""
    torch.manual_seed(0)
    pe = generated_class("fire")(heads=4, head_dim=16)
    q_pos, k_pos = torch.tensor([7]) + offset, torch.arange(8) + offset
    want = fire_reference(pe, q_pos, k_pos)
    torch.testing.assert_close(pe.score_bias(q_pos, k_pos).double(), want, rtol=0, atol=1e-5)
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 4, 8, 16), torch.randn(1, 4, 8, 16)
    positions = {"q_positions": q_pos, "k_positions": k_pos}
    reference = pe.double()(q.double(), k.double(), v.double(), backend="eager", **positions)
    pe.float()
    for backend in ("eager", "sdpa", "flex"):
        out = pe(q, k, v, backend=backend, **positions)
        torch.testing.assert_close(out.double(), reference, rtol=0, atol=1e-5)


def _fire_bias_by_autograd(pe: torch.nn.Module, q_pos: torch.Tensor, k_pos: torch.Tensor):
    """FIRE's bias [H, N, M] through the literal MLP, relu(w1 x + b1) then w2, in
    float64 with autograd, from copies of pe's parameters (returned by name)."""
    params = {name: p.detach().clone().requires_grad_() for name, p in pe.named_parameters()}
    w1, b1 = params["fire_mlp.0.weight"][:, 0], params["fire_mlp.0.bias"]
    w2, b2 = params["fire_mlp.2.weight"], params["fire_mlp.2.bias"]
    c = params["fire_c"].abs()
    threshold = (params["fire_threshold_scale"] * float(pe.fire_init_threshold)).abs()
    i, j = q_pos.double()[:, None], k_pos.double()[None, :]
    normaliser = torch.log1p(c * torch.maximum(i, threshold)) + 1e-6  # [N, 1]
    x = torch.log1p(c * (i - j).clamp(min=0)) / normaliser  # [N, M]
    hidden = torch.relu(x[..., None] * w1 + b1)  # [N, M, hidden]
    return (hidden @ w2.t() + b2).permute(2, 0, 1), params


@pytest.mark.parametrize("heads", [4, 20])
@pytest.mark.parametrize("units", ["initial", "breakpoints among the inputs"])
def test_fire_gradients_match_the_literal_mlp(
    units: str, heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bias, f taken piece by piece between its hidden units' breakpoints (4 heads)
    or layer by layer (20 heads, more than half the hidden units): its values and
    gradients into f's weights, c and the threshold are those of the literal MLP
    (autograd in float64), at the initial weights with a unit of w1 = 0, and with every
    breakpoint inside x's range (0 .. 1), alternate signs of w1, and pairs with x below
    the first breakpoint (x = 0 at distance 0)."""
    pe = _module("fire", heads=heads)
    pieces = spy_method(monkeypatch, type(pe), "_fire_pieces", lambda kept: True)
    first = pe.fire_mlp[0]
    with torch.no_grad():
        pe.fire_threshold_scale.fill_(8.0 / 512.0)  # queries past the threshold too
        if units == "initial":
            first.weight[3] = 0.0  # a constant unit
        else:
            crossings = torch.linspace(0.05, 0.95, first.bias.numel(), dtype=torch.float64)
            signs = torch.tensor([-1.0, 1.0], dtype=torch.float64).repeat(len(crossings) // 2)
            first.weight[:, 0] = first.weight[:, 0].abs().clamp(min=0.1) * signs
            first.bias.copy_(-first.weight[:, 0] * crossings)
    weights = torch.randn(heads, len(Q_POS), len(K_POS), dtype=torch.float64)
    (pe.score_bias(Q_POS, K_POS) * weights).sum().backward()
    assert bool(pieces) == (heads == 4)
    want, params = _fire_bias_by_autograd(pe, Q_POS, K_POS)
    torch.testing.assert_close(pe.score_bias(Q_POS, K_POS), want.detach(), rtol=1e-12, atol=1e-12)
    (want * weights).sum().backward()
    for name, parameter in pe.named_parameters():
        assert params[name].grad is not None, name
        torch.testing.assert_close(parameter.grad, params[name].grad, rtol=1e-10, atol=1e-12)


def test_fire_future_keys_share_distance_zero() -> None:
    pe = _module("fire")
    bias = pe.score_bias(torch.tensor([5]), torch.tensor([5, 6, 9]))
    torch.testing.assert_close(bias[:, :, 1], bias[:, :, 0])
    torch.testing.assert_close(bias[:, :, 2], bias[:, :, 0])


def test_learned_slopes_start_at_the_geometric_recipe() -> None:
    pe = _module("alibi_learned", heads=8)
    assert isinstance(pe.slopes, torch.nn.Parameter)
    want = torch.tensor([2.0 ** (-(h + 1)) for h in range(8)], dtype=torch.float64)
    torch.testing.assert_close(pe.slopes.detach(), want, rtol=1e-7, atol=0)
    with torch.no_grad():
        pe.slopes[3] = 0.7
    bias = pe.score_bias(Q_POS, K_POS)
    torch.testing.assert_close(bias[3], -0.7 * _pairs(Q_POS, K_POS).abs())
    assert "slopes" in pe.state_dict()


def test_custom_slopes_and_their_head_count() -> None:
    cls = spec_variant(
        "alibi",
        ("slopes: alibi_geometric", "slopes: custom\n      values: [0.5, 0.25, 0.0, 2.0]"),
        ("heads: 8", "heads: 4"),
        name="alibi_custom",
    )
    pe = cls().double()
    bias = pe.score_bias(Q_POS, K_POS)
    distance = _pairs(Q_POS, K_POS).abs()
    for h, slope in enumerate([0.5, 0.25, 0.0, 2.0]):
        torch.testing.assert_close(bias[h], -slope * distance)
    with pytest.raises(ValueError, match="4 custom slopes: heads must be 4, got 8"):
        cls(heads=8)


def test_heads_with_bias_leaves_the_other_heads_unbiased() -> None:
    cls = spec_variant(
        "alibi", ("distance: absolute", "distance: absolute\n      heads_with_bias: 4")
    )
    pe = cls().double()  # 8 heads, the first 4 with ALiBi's slopes for 4 heads
    bias = pe.score_bias(Q_POS, K_POS)
    distance = _pairs(Q_POS, K_POS).abs()
    for h in range(4):
        torch.testing.assert_close(bias[h], -(2.0 ** (-2 * (h + 1))) * distance)
    assert bool((bias[4:] == 0).all())
    with pytest.raises(ValueError, match="at least 4"):
        cls(heads=3)
    learned = spec_variant(
        "alibi_learned", ("distance: absolute", "distance: absolute\n      heads_with_bias: 2")
    )().double()
    assert learned.slopes.shape == (2,)
    assert bool((learned.score_bias(Q_POS, K_POS)[2:] == 0).all())


# --------------------------------------------------------------------------- gradients


def _parameters_of(name: str, pe: torch.nn.Module) -> list[str]:
    return [key for key, _ in pe.named_parameters()]


@pytest.mark.parametrize("name", ["kerple_log", "kerple_power", "fire", "alibi_learned"])
def test_gradients_reach_the_trained_parameters(name: str) -> None:
    pe = _module(name)
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    for backend in ("eager", "sdpa"):
        pe.zero_grad()
        pe(q, q, q, causal=True, backend=backend).square().sum().backward()
        for key, parameter in pe.named_parameters():
            assert parameter.grad is not None, (backend, key)
            assert bool(torch.isfinite(parameter.grad).all()), (backend, key)
            if key != "fire_threshold_scale":  # below the threshold it has no effect
                assert float(parameter.grad.abs().max()) > 0, (backend, key)
    expected = {
        "kerple_log": {"r1", "r2"},
        "kerple_power": {"r1", "r2"},
        "alibi_learned": {"slopes"},
        "fire": {"fire_c", "fire_threshold_scale"},
    }[name]
    assert expected <= set(_parameters_of(name, pe))


def test_fire_threshold_gets_gradients_past_it() -> None:
    pe = _module("fire")
    with torch.no_grad():
        pe.fire_threshold_scale.fill_(8.0 / 512.0)  # above queries 3 and 4
    pe.score_bias(Q_POS, K_POS).sum().backward()
    assert float(pe.fire_threshold_scale.grad.abs()) > 0
    assert float(pe.fire_mlp[0].weight.grad.abs().max()) > 0


# --------------------------------------------------------------------------- backends


@pytest.mark.parametrize("name", [*NEW_KINDS, "expr"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("explicit", [False, True])
def test_every_backend_matches_eager(name: str, causal: bool, explicit: bool) -> None:
    torch.manual_seed(0)
    if name == "expr":
        pe = encoding_class(module_from_spec(EXPR_SPEC))(heads=4, head_dim=8)
    else:
        pe = generated_class(name)(heads=4, head_dim=8)
    generator = torch.Generator().manual_seed(3)
    n, m = (5, 7) if explicit else (4, 9)
    shapes = {"q": (2, 4, n, 8), "k": (2, 2, m, 8), "v": (2, 2, m, 8)}  # GQA: 2 kv heads
    inputs = {key: torch.randn(*shape, generator=generator) for key, shape in shapes.items()}
    kwargs = {"causal": causal}
    if explicit:
        kwargs.update(q_positions=Q_POS + 1, k_positions=K_POS)
    eager, eager_grads = run_backend(pe, inputs, "eager", **kwargs)
    for backend in runtime_inputs.BACKENDS:
        got, grads = run_backend(pe, inputs, backend, **kwargs)
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
        assert len(grads) == len(eager_grads)
        for a, b in zip(grads, eager_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["kerple_log", "kerple_power", "sandwich", "alibi_learned"])
def test_distance_biases_take_the_per_distance_path(name: str) -> None:
    cls = generated_class(name)
    assert cls.bias_by_distance and cls.has_position_bias
    assert not generated_class("fire").bias_by_distance


# --------------------------------------------------------------------------- expressions


def test_kerple_log_expression_equals_the_built_in_kind() -> None:
    torch.manual_seed(0)
    expr = encoding_class(module_from_spec(EXPR_SPEC))(heads=4, head_dim=8).double()
    built_in = _module("kerple_log")
    with torch.no_grad():  # equal parameters: softplus(raw) = the built-in r1, r2
        for raw, value in ((expr.expr_r1, built_in.r1), (expr.expr_r2, built_in.r2)):
            value.clamp_(min=0.05)
            raw.copy_(value + torch.log(-torch.expm1(-value)))
    torch.testing.assert_close(
        expr.score_bias(Q_POS, K_POS), built_in.score_bias(Q_POS, K_POS), rtol=1e-12, atol=1e-12
    )
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64)
    torch.testing.assert_close(expr(q, q, q, causal=True), built_in(q, q, q, causal=True))
    expr(q, q, q).sum().backward()
    assert expr.expr_r1.grad is not None and expr.expr_r2.grad is not None


def test_expression_without_h_broadcasts_over_heads(tmp_path: Path) -> None:
    text = EXPR_SPEC.read_text().replace("kerple_log_expr", "expr_plain")
    text = text.replace(
        '"-r1[h] * log1p(r2[h] * abs(i - j))"', '"where(i >= j, -0.5 * (i - j), s * 0)"'
    )
    text = text.replace(
        "params: {r1: {shape: [heads], init: 1.0, positive: true}, r2: {shape: [heads], "
        "init: 0.5, positive: true, bounds: [0.01, 10]}}",
        "params: {s: {shape: [], init: 2.0}}",
    )
    (tmp_path / "expr_plain.yaml").write_text(text)
    pe = encoding_class(module_from_spec(tmp_path / "expr_plain.yaml"))(heads=3).double()
    bias = pe.score_bias(Q_POS, K_POS)
    diff = _pairs(Q_POS, K_POS)
    want = torch.where(diff >= 0, -0.5 * diff, torch.zeros_like(diff))[None].expand(3, -1, -1)
    torch.testing.assert_close(bias, want)


BAD_EXPRESSIONS = [
    ('"r1[h].real"', 1, "attribute access is not allowed"),
    ('"(lambda: 1)()"', 2, "only the listed functions may be called"),
    ("\"abs('i')\"", 5, "a string literal is not allowed"),
    ('"[x for x in i]"', 1, "a comprehension is not allowed"),
    ('"r1[h] * k"', 9, "unknown name 'k'"),
    ('"__import__(1) + i"', 1, "unknown function '__import__'"),
    ('"abs(x=i) + r1[h]"', 7, "abs() takes positional arguments only"),
    ('"abs(*i) + r1[h]"', 5, "a starred argument is not allowed"),
    ('"clamp(i, 1) * r1[h]"', 1, "clamp() takes 3 arguments, got 2"),
    ('"r1 * i"', 1, "parameter 'r1' has shape [heads]: read it as r1[h]"),
    ('"r1[i] * i"', 4, "a [heads] parameter is indexed by h only"),
    ('"i + j + r1[h] if i else j"', 1, "a conditional expression (use where)"),
    ('"r1[h] * ' + "i + " * 150 + 'j"', 501, "past the limit of 500"),
    ('"r1[h] * (' + "i + " * 40 + 'j)"', 1, "syntax nodes, past the limit of 64"),
    ('"exp(1) + r1[h]"', 1, "exp() of constants: write the number instead"),
    # numbers and comments as the rest of a spec spells them: Python would read these
    ('"r1[h] * 0x10 * i"', 9, "number 0x10: write numbers in plain decimal"),
    ('"r1[h] * 1_000 * i"', 9, "number 1_000: write numbers in plain decimal"),
    ('"r1[h] * i # and j"', 11, "'#' would start a comment"),
]


@pytest.mark.parametrize(("expression", "column", "message"), BAD_EXPRESSIONS)
def test_refused_expressions_point_at_the_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, expression: str, column: int, message: str
) -> None:
    text = EXPR_SPEC.read_text().replace("kerple_log_expr", "bad_expr")
    text = text.replace(
        "params: {r1: {shape: [heads], init: 1.0, positive: true}, r2: {shape: [heads], "
        "init: 0.5, positive: true, bounds: [0.01, 10]}}",
        "params: {r1: {shape: [heads], init: 1.0}}",
    )
    original = '"-r1[h] * log1p(r2[h] * abs(i - j))"'
    line_text = next(line for line in text.splitlines() if original in line)
    line = text.splitlines().index(line_text) + 1
    start = line_text.index(original) + 2  # 1-based column of the first character inside
    text = text.replace(original, expression)
    (tmp_path / "bad_expr.yaml").write_text(text)
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["generate", "bad_expr.yaml", "--out", str(out)])
    assert result.exit_code == 2
    first = result.output.splitlines()[0]
    prefix = f"bad_expr.yaml:{line}:{start + column - 1}: terms.position_position.bias.expr: "
    assert first.startswith(prefix), first
    assert message in first
    assert "Traceback" not in result.output
    assert not out.exists() or not any(out.iterdir())  # nothing written


def test_plain_scalar_expression_columns(tmp_path: Path) -> None:
    text = EXPR_SPEC.read_text().replace("kerple_log_expr", "plain_expr")
    start = text.index("    bias: {")
    text = text[:start] + (
        "    bias:\n"
        "      kind: expr\n"
        "      expr: -r1[h] * log1p(q * abs(i - j))\n"
        "      params: {r1: {shape: [heads], init: 1.0}}\n"
        "      placement: after_scale\n"
        "claims: {relative: true}\n"
    )
    (tmp_path / "plain_expr.yaml").write_text(text)
    result = CliRunner().invoke(main, ["validate", str(tmp_path / "plain_expr.yaml")])
    assert result.exit_code == 2
    line = text.splitlines().index("      expr: -r1[h] * log1p(q * abs(i - j))") + 1
    column = len("      expr: -r1[h] * log1p(") + 1
    assert f":{line}:{column}: terms.position_position.bias.expr: unknown name 'q'" in (
        result.output
    )


def test_generated_expression_code_holds_no_spec_text() -> None:
    from posgen.codegen.render import render_module
    from posgen.codegen.writing import plan_for
    from posgen.spec.loader import load_spec

    plan = plan_for(load_spec(EXPR_SPEC))
    source = render_module(plan)
    code = source.split('"""', 2)[2]  # past the module docstring
    assert "log1p(r2[h]" not in code
    assert "torch.log1p(t" in code


@pytest.mark.parametrize("name", NEW_KINDS)
def test_catalogue_spec_claims_hold(name: str) -> None:
    result = CliRunner().invoke(main, ["check", str(ROOT / "specs" / f"{name}.yaml")])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(("n", "m", "threshold"), [(1, 30, 512.0), (3, 30, 512.0), (1, 30, 8.0)])
def test_fire_decode_steps_in_a_frozen_block_read_a_kept_row(
    monkeypatch: pytest.MonkeyPatch, n: int, m: int, threshold: float
) -> None:
    """Inside ``parameters_frozen``, N queries at default positions at or below the
    threshold L (every normaliser psi(L)) read their bias from a vector per distance
    kept across steps: f runs once for the vector, not at each step, and the bias
    equals the paper's formula at every step, future keys (causal) at distance 0. Past
    L the bias is made per pair at each step, as outside a block."""
    pe = _module("fire")
    with torch.no_grad():
        pe.fire_threshold_scale.fill_(threshold / 512.0)
        pe.fire_c.fill_(-0.3)
    runs = spy_method(
        monkeypatch, type(pe), "_fire_heads", lambda normalised, kept: normalised.shape
    )
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, n, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(1, 4, m, 8, generator=generator, dtype=torch.float64) for _ in "kv")
    with torch.no_grad(), parameters_frozen(pe):
        for length in range(m - 3, m + 1):
            bias = pe._position_bias(None, None, n, length, q.device)  # [H, N, M]
            want = fire_reference(pe, torch.arange(length - n, length), torch.arange(length))
            torch.testing.assert_close(bias, want, rtol=1e-12, atol=1e-12)
            got = pe(q, k[:, :, :length], v[:, :, :length], causal=True, backend="sdpa")
            oracle = pe(q, k[:, :, :length], v[:, :, :length], causal=True, backend="eager")
            torch.testing.assert_close(got, oracle, rtol=1e-12, atol=1e-12)
    if threshold >= m:
        assert len(runs) == 1  # the kept vector, made once for every step and backend
    else:  # per pair at every call ([N, M] each)
        assert len(runs) >= 12 and all(shape[-2] == n for shape in runs)
