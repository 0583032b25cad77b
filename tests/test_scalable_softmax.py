"""Scalable-Softmax (``query_scale: {kind: ssmax}``, spec ``rope_ssmax``): each query of
head h times s_h ln(i + 1), s trained per head.

Against an independent float64 reference of the paper's formula (softmax of the logits
times s ln n, n counted from the causal mask: tests/reference/formulas.py), outputs and
the gradient into s; every backend against the eager oracle with gradients into q, k, v
and s; a decode step over keys rotated once; ``scale_queries``' factors and errors.
"""

from __future__ import annotations

import math

import pytest
import torch
from click.testing import CliRunner

from posgen.cli import main
from tests.conftest import assert_backends_agree_on_a_grouped_call, generated_class
from tests.reference.formulas import rope_apply, scalable_softmax_attention

F64 = torch.float64
RATES = [0.43, 0.1, 1.0, 2.5]  # one s per head, distinct so a head mix-up shows


def _module(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    pe = generated_class("rope_ssmax")(heads=4, head_dim=8).to(dtype)
    with torch.no_grad():
        pe.query_scale_per_head.copy_(torch.tensor(RATES, dtype=dtype))
    return pe


def test_the_output_and_the_gradient_into_s_follow_the_papers_formula() -> None:
    """Causal, 11 queries from position 0: the module's output equals float64 SSMax over
    the rotated logits (n = i + 1 keys per row), and so do the gradients into s and q."""
    pe = _module(F64)
    q, k, v = (torch.randn(2, 4, 11, 8, dtype=F64) for _ in range(3))
    q.requires_grad_()
    weight = torch.randn(2, 4, 11, 8, dtype=F64)
    (pe(q, k, v, causal=True) * weight).sum().backward()
    positions = torch.arange(11)
    s = torch.tensor(RATES, dtype=F64, requires_grad=True)
    q_ref = q.detach().clone().requires_grad_()
    rq, rk = (rope_apply(x, positions, 10000.0, "half") for x in (q_ref, k))
    logits = rq @ rk.transpose(-1, -2) / math.sqrt(8)
    allowed = positions[None, :] <= positions[:, None]
    expected = scalable_softmax_attention(logits, v, s, allowed)
    (expected * weight).sum().backward()
    torch.testing.assert_close(pe(q, k, v, causal=True), expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(pe.query_scale_per_head.grad, s.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(q.grad, q_ref.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("explicit", [False, True])
def test_every_backend_agrees_with_eager_with_gradients_into_s(
    causal: bool, explicit: bool
) -> None:
    """sdpa, flex (its unfused reference on the CPU) and auto against eager, float32,
    grouped-query heads (4 over 2): outputs and gradients into q, k, v and s."""
    eager_grads = assert_backends_agree_on_a_grouped_call(_module(), causal, explicit)
    assert len(eager_grads) == 4  # q, k, v and s


def test_decode_over_keys_rotated_once_matches_the_full_call() -> None:
    """One query at a time at the default position (the last of the keys), over keys
    rotated once, equals the rows of one causal call: the factor s_h ln(t + 1)."""
    pe = _module()
    q, k, v = torch.randn(1, 4, 20, 8), torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    with torch.no_grad():
        full = pe(q, k, v, causal=True)
        rotated = pe.rotate_keys(k)
        for t in (0, 1, 7, 19):
            step = pe(
                q[:, :, t : t + 1], rotated[:, :, : t + 1], v[:, :, : t + 1], keys_rotated=True
            )
            torch.testing.assert_close(step, full[:, :, t : t + 1], rtol=1e-5, atol=1e-6)


def test_scale_queries_multiplies_each_head_by_its_own_rate() -> None:
    """tau_h(i) = s_h ln(i + 1): 0 at position 0; a q whose head count is not the
    module's is refused by name."""
    pe = _module(F64)
    q = torch.randn(2, 4, 6, 8, dtype=F64)
    tau = torch.tensor(RATES, dtype=F64)[:, None] * torch.log(torch.arange(1, 7, dtype=F64))
    with torch.no_grad():
        torch.testing.assert_close(pe.scale_queries(q), q * tau[:, :, None], rtol=1e-15, atol=0)
    with pytest.raises(ValueError, match=r"q must have 4 heads \(dim 1\), got 2"):
        pe.scale_queries(q[:, :2])
    with pytest.raises(ValueError, match="expected 4 heads"):
        pe(q[:, :2], q[:, :2], q[:, :2])


def test_explain_states_the_trained_factor() -> None:
    result = CliRunner().invoke(main, ["explain", "rope_ssmax"])
    assert result.exit_code == 0, result.output
    assert "tau_h(i) = s_h ln(i + 1) (s [heads] trained from 0.43; 0 at position 0)" in (
        result.output
    )
