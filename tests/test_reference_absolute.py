"""Pin the references of tests/reference/absolute.py to hand-computed and closed-form values."""

from __future__ import annotations

import pytest
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
    _close(ref.combine_input(x.expand(2, 2, 2), batched, "multiply")[1], [[-0.5, 0.0], [-6.0, 4.0]])


# ------------------------------------------------------------------------------ depthwise conv


def test_depthwise_conv1d_by_hand() -> None:
    x = torch.tensor([[[1.0], [2.0], [3.0], [4.0]]])  # [1, 4, 1]
    w = torch.tensor([[1.0, 10.0, 100.0]])  # [dim=1, k=3]
    # same: c_i = x_(i-1) + 10 x_i + 100 x_(i+1), zeros outside
    _close(ref.depthwise_conv1d(x, w, None, "same")[0, :, 0], [210.0, 321.0, 432.0, 43.0])
    # causal: c_i = x_(i-2) + 10 x_(i-1) + 100 x_i
    _close(
        ref.depthwise_conv1d(x, w, torch.tensor([0.5]), "causal")[0, :, 0],
        [100.5, 210.5, 321.5, 432.5],
    )
    # features are independent (depthwise)
    x2 = torch.tensor([[[1.0, 5.0], [0.0, 1.0]]])
    w2 = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    _close(ref.depthwise_conv1d(x2, w2, None, "same")[0], [[1.0, 0.0], [0.0, 10.0]])


# ------------------------------------------------------------------------------ ODE integrator


def _linear_system():
    a = torch.tensor([[0.0, 1.0, 0.0], [-1.0, -0.1, 0.3], [0.2, 0.0, -0.5]], dtype=F64)
    p0 = torch.tensor([1.0, 0.0, -0.5], dtype=F64)
    return (lambda p, t: a @ p), a, p0


@pytest.mark.parametrize("method,order", [("euler", 1), ("rk4", 4)])
def test_ode_trajectory_order_of_accuracy_on_a_linear_system(method: str, order: int) -> None:
    """dp/dt = A p has p(t) = expm(t A) p0: halving the step divides the error by 2^order."""
    h, a, p0 = _linear_system()
    exact = torch.stack([torch.linalg.matrix_exp(a * (i * 0.5)) @ p0 for i in range(5)])
    errors = []
    for steps in (4, 8, 16):
        path = ref.ode_trajectory(h, p0, 5, 0.5, steps, method)
        _close(path[0], p0)
        errors.append((path - exact).abs().max().item())
    for coarse, fine in zip(errors, errors[1:], strict=False):
        assert coarse / fine == pytest.approx(2**order, rel=0.15)
    assert errors[-1] < (1e-5 if method == "rk4" else 3e-2)


def test_ode_trajectory_time_dependence_by_hand() -> None:
    # dp/dt = t: Euler with one step of 1 from 0 gives 0, then 1; RK4 integrates t exactly
    h = lambda p, t: torch.full_like(p, t)  # noqa: E731
    p0 = torch.zeros(1, dtype=F64)
    _close(ref.ode_trajectory(h, p0, 3, 1.0, 1, "euler")[:, 0], [0.0, 0.0, 1.0])
    _close(ref.ode_trajectory(h, p0, 3, 1.0, 1, "rk4")[:, 0], [0.0, 0.5, 2.0])


def test_floater_dynamics_by_hand() -> None:
    # d = 1, H = 2: a = [2p + t + 1, -p + 0t - 3]; relu -> out = 1*h0 + 3*h1 + 2t + 0.5
    w_in = torch.tensor([[2.0, 1.0], [-1.0, 0.0]])
    b_in = torch.tensor([1.0, -3.0])
    w_out = torch.tensor([[1.0, 3.0, 2.0]])
    b_out = torch.tensor([0.5])
    h = ref.floater_dynamics(w_in, b_in, w_out, b_out, "relu")
    # p = 1, t = 0.5: a = [3.5, -4] -> h = [3.5, 0] -> 3.5 + 0 + 1 + 0.5 = 5
    _close(h(torch.tensor([1.0], dtype=F64), 0.5), [5.0])
    # p = -5, t = 0: a = [-9, 2] -> h = [0, 2] -> 6 + 0.5
    _close(h(torch.tensor([-5.0], dtype=F64), 0.0), [6.5])
    tanh = ref.floater_dynamics(w_in, b_in, w_out, b_out, "tanh")
    import math

    _close(tanh(torch.tensor([1.0], dtype=F64), 0.5), [math.tanh(3.5) + 3 * math.tanh(-4.0) + 1.5])


def test_depthwise_conv2d_grid_by_hand() -> None:
    # 2 x 3 grid, one feature, tokens 1..6 row-major; kernel picks (up) + 10 (centre) + 100 (right)
    x = torch.arange(1.0, 7.0).reshape(1, 6, 1)
    w = torch.zeros(1, 3, 3)
    w[0, 0, 1], w[0, 1, 1], w[0, 1, 2] = 1.0, 10.0, 100.0
    out = ref.depthwise_conv2d_grid(x, w, torch.tensor([0.25]), 2, 3)[0, :, 0]
    # row 0: no row above; right neighbour zero at the last column
    # row 1: up = token above
    _close(
        out,
        [
            10 + 200 + 0.25,
            20 + 300 + 0.25,
            30 + 0.25,
            1 + 40 + 500 + 0.25,
            2 + 50 + 600 + 0.25,
            3 + 60 + 0.25,
        ],
    )
