"""Parameters read clamped (KERPLE's r1 and r2, an expression parameter's ``bounds``)
keep a gradient outside their range.

The authors' KERPLE code (chijames/KERPLE) writes the clamp back into each parameter at
every forward, so the gradient, taken at the bound, always reaches it. posgen does not
write back; a value outside its range gets that same gradient where a descent step
moves it back toward the range, and none where the step would take it further out.
Expected values come from the formula in float64 with the clamped value as the leaf.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from posgen.codegen.inmemory import encoding_class, module_from_spec
from tests.conftest import (
    expr_bias_spec,
    generated_class,
    runtime_modules,
    set_runtime,
    spy_calls,
)

HEADS, N, D = 4, 9, 8


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor):
    """softmax(q kᵀ / sqrt(D) + bias, causal) v, float64, written here."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(D) + bias  # [B, H, N, N]
    future = torch.ones(N, N, dtype=torch.bool).triu(1)
    return scores.masked_fill(future, -math.inf).softmax(-1) @ v


def _kerple(variant: str, r1: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    """KERPLE's bias [H, N, N] from already-clamped r1, r2 (Chi et al. 2022)."""
    distance = (torch.arange(N)[:, None] - torch.arange(N)[None, :]).abs().double()
    if variant == "log":
        return -r1[:, None, None] * torch.log1p(r2[:, None, None] * distance)
    return -r1[:, None, None] * distance ** r2[:, None, None]


def _expected(gradient: torch.Tensor, raw: torch.Tensor, low: float, high: float):
    """The gradient at the bound where a descent step moves ``raw`` toward [low, high]
    (or raw lies in it), else 0."""
    outward = ((raw < low) & (gradient > 0)) | ((raw > high) & (gradient < 0))
    return gradient.masked_fill(outward, 0.0)


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    q, k, v, weights = (
        torch.randn(2, HEADS, N, D, generator=generator, dtype=torch.float64) for _ in range(4)
    )
    return q, k, v, weights


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("variant", ["log", "power"])
def test_kerple_parameters_outside_their_range_get_the_gradient_back_in(
    variant: str, backend: str
) -> None:
    torch.manual_seed(0)
    pe = generated_class(f"kerple_{variant}")(heads=HEADS, head_dim=D).double()
    with torch.no_grad():
        pe.r1.copy_(torch.tensor([0.004, 0.7, 1.2, 0.3]))  # head 0 below 0.01
        pe.r2.copy_(torch.tensor([0.5, 0.005, 0.8, 2.5 if variant == "power" else 0.9]))
    high2 = 2.0 if variant == "power" else math.inf  # power's exponent lies in (0, 2]
    q, k, v, weights = _inputs()
    outside = [(0, "r1"), (1, "r2")] + ([(3, "r2")] if variant == "power" else [])
    seen = {entry: set() for entry in outside}
    for sign in (1.0, -1.0):  # one of the two pushes each outside value back in
        pe.zero_grad()
        (sign * pe(q, k, v, causal=True, backend=backend) * weights).sum().backward()
        r1 = pe.r1.detach().clamp(min=0.01).requires_grad_()
        r2 = pe.r2.detach().clamp(0.01, high2).requires_grad_()
        want = (sign * _attention(q, k, v, _kerple(variant, r1, r2)) * weights).sum()
        g1, g2 = torch.autograd.grad(want, [r1, r2])
        expected = {
            "r1": _expected(g1, pe.r1.detach(), 0.01, math.inf),
            "r2": _expected(g2, pe.r2.detach(), 0.01, high2),
        }
        torch.testing.assert_close(pe.r1.grad, expected["r1"], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(pe.r2.grad, expected["r2"], rtol=1e-9, atol=1e-12)
        for head, name in outside:
            seen[(head, name)].add(float(getattr(pe, name).grad[head]) != 0.0)
    assert all(flags == {True, False} for flags in seen.values()), seen


def test_an_expression_parameter_outside_its_bounds_gets_the_gradient_back_in(
    tmp_path: Path,
) -> None:
    params = "{r: {shape: [heads], init: 0.5, bounds: [0.1, 2.0]}}"
    spec = expr_bias_spec(tmp_path, "bounded", "-r[h] * abs(i - j)", heads=HEADS, params=params)
    pe = encoding_class(module_from_spec(spec))(heads=HEADS, head_dim=D).double()
    with torch.no_grad():
        pe.expr_r.copy_(torch.tensor([0.05, 0.5, 3.0, 1.0]))  # heads 0 and 2 outside
    q, k, v, weights = _inputs()
    distance = (torch.arange(N)[:, None] - torch.arange(N)[None, :]).abs().double()
    seen: dict[int, set[bool]] = {0: set(), 2: set()}
    for sign in (1.0, -1.0):
        pe.zero_grad()
        (sign * pe(q, k, v, causal=True, backend="eager") * weights).sum().backward()
        r = pe.expr_r.detach().clamp(0.1, 2.0).requires_grad_()
        bias = -r[:, None, None] * distance
        (g,) = torch.autograd.grad((sign * _attention(q, k, v, bias) * weights).sum(), [r])
        expected = _expected(g, pe.expr_r.detach(), 0.1, 2.0)
        torch.testing.assert_close(pe.expr_r.grad, expected, rtol=1e-9, atol=1e-12)
        for head in seen:
            seen[head].add(float(pe.expr_r.grad[head]) != 0.0)
    assert all(flags == {True, False} for flags in seen.values()), seen


BOUNDED_EXPRESSIONS = {
    # of j - i, and of i and j apart (a positive parameter beside the bounded one)
    "distance": ("-r[h] * abs(i - j)", "{r: {shape: [heads], init: 0.5, bounds: [0.1, 2.0]}}"),
    "positions": (
        "-r[h] * abs(i - j) + s * i / 64",
        "{r: {shape: [heads], init: 0.5, bounds: [0.1, 2.0]}, s: {shape: [], init: 0.3, "
        "positive: true}}",
    ),
}


def _bounded_module(name: str, folder: Path) -> torch.nn.Module:
    """KERPLE (``kerple_log``, ``kerple_power``) or an expression of BOUNDED_EXPRESSIONS,
    4 heads, float64, with values outside their range in heads 0 and 1."""
    if name.startswith("kerple"):
        pe = generated_class(name)(heads=HEADS, head_dim=D).double()
        with torch.no_grad():
            pe.r1.copy_(torch.tensor([-0.1, 0.7, 1.2, 0.3]))
            pe.r2.copy_(torch.tensor([0.5, -0.4, 0.8, 0.9]))
        return pe
    expr, params = BOUNDED_EXPRESSIONS[name]
    spec = expr_bias_spec(folder, f"bounded_{name}", expr, heads=HEADS, params=params)
    pe = encoding_class(module_from_spec(spec))(heads=HEADS, head_dim=D).double()
    with torch.no_grad():
        pe.expr_r.copy_(torch.tensor([0.05, 3.0, 0.5, 1.0]))
    return pe


@pytest.mark.parametrize("route", ["loop", "recomputed"])
@pytest.mark.parametrize("name", ["kerple_log", "kerple_power", "distance", "positions"])
def test_a_call_built_in_chunks_judges_the_whole_gradient_of_a_clamped_value(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, route: str
) -> None:
    """sdpa builds the bias of explicit positions one query at a time here (the chunk
    loop, or the node that rebuilds each chunk's mask in its backward): the clamped
    values are read once for the call, so a value outside its range gets the whole
    gradient where it points back in, as on eager, not the sum of the chunks' parts
    that do (KERPLE-log, r1 = -0.1: -1.053 against eager's -0.972)."""
    pe = _bounded_module(name, tmp_path)
    set_runtime(monkeypatch, "SDPA_QUERY_CHUNK", {"cpu": 1}, pe)
    set_runtime(
        monkeypatch, "RECOMPUTED_MASK_MIN_KEYS", 1 if route == "recomputed" else 1 << 30, pe
    )
    nodes = spy_calls(monkeypatch, runtime_modules(pe), "recomputed_mask_attention", lambda *a: 1)
    q, k, v, weights = _inputs()
    positions = 5 * torch.arange(N)  # keys spread out: a bias read per pair
    options = {"causal": True, "q_positions": positions, "k_positions": positions}
    for sign in (1.0, -1.0):
        grads = []
        for backend in ("eager", "sdpa"):
            pe.zero_grad()
            (sign * pe(q, k, v, backend=backend, **options) * weights).sum().backward()
            grads.append([p.grad.clone() for p in pe.parameters()])
        for eager, sdpa in zip(*grads, strict=True):
            torch.testing.assert_close(sdpa, eager, rtol=1e-9, atol=1e-12)
    assert (len(nodes) > 0) == (route == "recomputed")
