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
