"""Pin the references of tests/reference/absolute.py to hand-computed and closed-form values."""

from __future__ import annotations

import torch

from tests.reference import absolute as ref

F64 = torch.float64


def _close(actual: torch.Tensor, expected, atol: float = 1e-12) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=F64), atol=atol, rtol=1e-12)


# ------------------------------------------------------------------------------ plain logits


def test_plain_logits_by_hand() -> None:
    q = torch.tensor([[[[1.0, 2.0], [0.0, -1.0]]]])  # [1, 1, 2, 2]
    k = torch.tensor([[[[3.0, 4.0], [1.0, 0.5], [-2.0, 0.0]]]])  # [1, 1, 3, 2]
    # q0.k = 11, 2, -2; q1.k = -4, -0.5, 0; times scale 0.5
    _close(ref.plain_logits(q, k, 0.5)[0, 0], [[5.5, 1.0, -1.0], [-2.0, -0.25, 0.0]])


# ------------------------------------------------------------------------------ combine input


def test_combine_input_by_hand() -> None:
    x = torch.tensor([[[1.0, 2.0], [3.0, -1.0]]])  # [1, 2, 2]
    table = torch.tensor([[0.5, 0.0], [2.0, 4.0]])
    _close(ref.combine_input(x, table, "add"), [[[1.5, 2.0], [5.0, 3.0]]])
    _close(ref.combine_input(x, table, "multiply"), [[[0.5, 0.0], [6.0, -4.0]]])
    batched = torch.stack([table, -table])
    _close(ref.combine_input(x.expand(2, 2, 2), batched, "multiply")[1], [[-0.5, 0.0],
                                                                           [-6.0, 4.0]])


# ------------------------------------------------------------------------------ depthwise conv


def test_depthwise_conv1d_by_hand() -> None:
    x = torch.tensor([[[1.0], [2.0], [3.0], [4.0]]])  # [1, 4, 1]
    w = torch.tensor([[1.0, 10.0, 100.0]])  # [dim=1, k=3]
    # same: c_i = x_(i-1) + 10 x_i + 100 x_(i+1), zeros outside
    _close(ref.depthwise_conv1d(x, w, None, "same")[0, :, 0], [210.0, 321.0, 432.0, 43.0])
    # causal: c_i = x_(i-2) + 10 x_(i-1) + 100 x_i
    _close(ref.depthwise_conv1d(x, w, torch.tensor([0.5]), "causal")[0, :, 0],
           [100.5, 210.5, 321.5, 432.5])
    # features are independent (depthwise)
    x2 = torch.tensor([[[1.0, 5.0], [0.0, 1.0]]])
    w2 = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    _close(ref.depthwise_conv1d(x2, w2, None, "same")[0], [[1.0, 0.0], [0.0, 10.0]])
