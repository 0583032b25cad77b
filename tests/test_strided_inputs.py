"""q, k and v whose features are not adjacent in memory (a stride other than 1 along the
last dimension, as a transposed view has) on the sdpa backend.

The CPU paths that call the flash kernel directly for its log-sum-exp (the chunked
relative terms, chunked training steps, trained biases, recomputed masks) read each
row as contiguous features; F.scaled_dot_product_attention copies such inputs first,
and so must they. Every case is checked against the eager oracle on the same values,
outputs and gradients into q, k, v and the parameters. Runtime settings route the
small calls here to the paths that otherwise need hundreds of keys.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import generated_class, run_backend, runtime_value, set_runtime

CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    # (encoding, forward options, runtime settings that route the call to the path)
    ("bert_relative_key", {}, {}),
    ("deberta", {"causal": True}, {}),
    ("transformer_xl", {}, {}),
    ("nope", {"window": 3}, {"SDPA_QUERY_CHUNK": {"cpu": 5}}),
    ("rope", {"window": 3, "causal": True}, {"SDPA_QUERY_CHUNK": {"cpu": 5}}),
    ("alibi_learned", {}, {"DIRECTIONAL_BIAS_MIN_KEYS": {False: 8, True: 8}}),
    ("kerple_log", {"causal": True}, {"DIRECTIONAL_BIAS_MIN_KEYS": {False: 8, True: 8}}),
    ("t5", {}, {"CLIPPED_BIAS_MIN_KEYS_PER_CLIP": 0}),
    ("fire", {}, {"RECOMPUTED_MASK_MIN_KEYS": 8, "SDPA_QUERY_CHUNK": {"cpu": 5}}),
    ("tupe_a", {}, {"RECOMPUTED_MASK_MIN_KEYS": 8, "SDPA_QUERY_CHUNK": {"cpu": 5}}),
]


def strided_rows(t: torch.Tensor) -> torch.Tensor:
    """t's values with its features a row apart in memory: [..., S, D] strides (D*S, 1, S)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def small_module(name: str) -> torch.nn.Module:
    cls = generated_class(name)
    options = {"heads": 4, "head_dim": 8}
    if "model_dim" in inspect.signature(cls.__init__).parameters:
        options["model_dim"] = 16
    torch.manual_seed(4)
    pe = cls(**options).double()
    with torch.no_grad():  # tables that start at zero would hide their terms
        for parameter in pe.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    return pe


@pytest.mark.parametrize(("name", "options", "settings"), CASES, ids=[c[0] for c in CASES])
def test_strided_inputs_match_eager(
    name: str, options: dict[str, Any], settings: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    pe = small_module(name)
    for setting, value in settings.items():
        set_runtime(monkeypatch, setting, value, pe)
    generator = torch.Generator().manual_seed(5)
    inputs = {
        key: torch.randn(2, 4, 20, 8, generator=generator, dtype=torch.float64) for key in "qkv"
    }
    strided = {key: strided_rows(value) for key, value in inputs.items()}
    assert all(value.stride(-1) != 1 for value in strided.values())
    want, want_grads = run_backend(pe, inputs, "eager", **options)
    got, got_grads = run_backend(pe, strided, "sdpa", **options)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert len(got_grads) == len(want_grads)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-9, atol=1e-11)


def test_the_flash_wrappers_take_strided_rows() -> None:
    """cpu_flash_forward and cpu_flash_backward against F.scaled_dot_product_attention
    and its autograd, q, k, v (and the output's gradient) all strided."""
    forward = runtime_value("cpu_flash_forward")
    backward = runtime_value("cpu_flash_backward")
    generator = torch.Generator().manual_seed(6)
    q, k, v, grad_out = (
        strided_rows(torch.randn(1, 2, 12, 16, generator=generator, dtype=torch.float64))
        for _ in range(4)
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=0.3)
    want_grads = torch.autograd.grad(want, leaves, grad_out)
    out, lse = forward(q, k, v, None, 0.3, causal=True)
    torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)
    grads = backward(grad_out, q, k, v, out, lse, None, 0.3, causal=True)
    for got_grad, want_grad in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)
