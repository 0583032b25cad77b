"""torch.func transforms over a generated module: grad, vmap over examples, vmap over a
stack of models' parameters (ensembles), and gradients into substituted parameters.
Under a transform "auto" runs the eager backend's plain ops, rotations go out of place
and biases per distance are gathered, not strided: each must equal the same call
without the transform."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch.func import functional_call, grad, stack_module_state, vmap

from tests.conftest import generated_class, head_dim_for, spec_names

F64 = torch.float64
# encodings whose values kept across calls (parameter snapshots, projected rows) a
# transform must bypass: its parameters are batched tensors with no storage
KEEPING = ["t5", "deberta", "alibi_learned", "fire", "transformer_xl", "tupe_a", "kerple_log"]


def _module(name: str, seed: int = 0) -> torch.nn.Module:
    cls = generated_class(name)
    sizes = {"heads": 4, "head_dim": head_dim_for(name, 16)}
    if "model_dim" in inspect.signature(cls.__init__).parameters:
        sizes["model_dim"] = 32
    torch.manual_seed(seed)
    return cls(**sizes).double().eval()


def _inputs(pe: torch.nn.Module, batch: int = 3) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(1)
    return tuple(
        torch.randn(batch, 4, 7, pe.head_dim, generator=generator, dtype=F64) for _ in range(3)
    )


@pytest.fixture(autouse=True)
def _quiet_batching_fallbacks():
    with warnings.catch_warnings():  # "performance drop ... batching rule for aten::..."
        warnings.filterwarnings("ignore", message="There is a performance drop")
        yield


@pytest.mark.parametrize("name", spec_names())
def test_grad_and_vmap_equal_the_call_without_them(name: str) -> None:
    pe = _module(name)
    q, k, v = _inputs(pe)

    def loss(q: torch.Tensor) -> torch.Tensor:
        return pe(q, k, v, causal=True).square().sum()

    leaf = q.clone().requires_grad_()
    (want,) = torch.autograd.grad(loss(leaf), leaf)
    torch.testing.assert_close(grad(loss)(q), want, rtol=1e-10, atol=1e-12)
    per_example = vmap(lambda q, k, v: pe(q[None], k[None], v[None], causal=True)[0])
    with torch.no_grad():
        torch.testing.assert_close(per_example(q, k, v), pe(q, k, v, causal=True))


@pytest.mark.parametrize("name", KEEPING)
def test_an_ensemble_of_stacked_parameters_and_their_gradients(name: str) -> None:
    """vmap over two models' stacked parameters (``stack_module_state``) equals each
    model's call, also right after a call that kept values of the first model's
    parameters; ``grad`` through ``functional_call`` gives autograd's gradients."""
    models = [_module(name, seed) for seed in (0, 1)]
    q, k, v = _inputs(models[0])
    with torch.no_grad():
        want = torch.stack([model(q, k, v) for model in models])
        models[0](q, k, v)  # values kept of the first model's parameters
        params, buffers = stack_module_state(models)
        got = vmap(lambda p, b: functional_call(models[0], (p, b), (q, k, v)))(params, buffers)
    torch.testing.assert_close(got, want)
    second = dict(models[1].named_parameters())
    substituted = {key: value.detach() for key, value in second.items()}

    def loss(parameters: dict[str, torch.Tensor]) -> torch.Tensor:
        return functional_call(models[0], parameters, (q, k, v)).square().sum()

    got_grads = grad(loss)(substituted)
    want_grads = torch.autograd.grad(models[1](q, k, v).square().sum(), list(second.values()))
    for key, want_grad in zip(second, want_grads, strict=True):
        torch.testing.assert_close(got_grads[key], want_grad, rtol=1e-9, atol=1e-11)
