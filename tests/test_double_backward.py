"""Second-order gradients (``create_graph=True``): the sdpa paths that are one autograd
node with a hand-written backward raise a clear RuntimeError where before the double
backward silently left out the attention's second derivative
(``once_differentiable``'s error node hangs off detached copies, so a gradient with
respect to q never reaches it); ``backend="eager"`` differentiates twice, checked
against finite differences by ``gradgradcheck``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.conftest import generated_class

SORTED = torch.arange(0, 2200, 2)  # explicit positions, sorted: the banded route

# (name, keys, causal, options): each reaches one node (``first_order_only``)
NODES = [
    ("alibi", 1100, True, {}),  # _ChunkedFlash
    ("t5", 1100, False, {}),  # _ClippedBiasAttention
    ("kerple_log", 1100, False, {}),  # _DirectionalBias
    ("fire", 1100, False, {}),  # _RecomputedMask
    ("bert_relative_key", 1100, False, {}),  # _SkewedAttention
    ("deberta", 1100, False, {}),  # _ChunkedAttention (clipped relative terms)
    ("shaw", 1100, True, {}),  # _ChunkedAttention with the value term
    ("bert_relative_key", 1100, False, {"q_positions": SORTED, "k_positions": SORTED}),
    ("cope", 64, False, {}),  # _CountedPositionAttention
]


@pytest.mark.parametrize(
    ("name", "m", "causal", "options"),
    NODES,
    ids=[f"{c[0]}-{c[1]}" + ("-causal" if c[2] else "") + "".join(c[3])[:1] for c in NODES],
)
def test_single_node_paths_refuse_a_double_backward(
    name: str, m: int, causal: bool, options: dict[str, Any]
) -> None:
    torch.manual_seed(0)
    pe = generated_class(name)(heads=2, head_dim=16)
    q, k, v = (torch.randn(1, 2, m, 16, requires_grad=True) for _ in range(3))
    out = pe(q, k, v, causal=causal, backend="sdpa", **options)
    (first,) = torch.autograd.grad(out.square().sum(), q, retain_graph=True)  # still fine
    assert torch.isfinite(first).all()
    with pytest.raises(RuntimeError, match='no double backward.*backend="eager"'):
        torch.autograd.grad(out.square().sum(), q, create_graph=True)


@pytest.mark.parametrize("name", ["t5", "shaw", "rope"])
def test_eager_differentiates_twice(name: str) -> None:
    """The oracle's second derivatives against finite differences (float64)."""
    torch.manual_seed(0)
    pe = generated_class(name)(heads=2, head_dim=4).double()
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return pe(q, k, v, causal=True, backend="eager")

    assert torch.autograd.gradgradcheck(attention, (q, k, v))
