"""The runtime's eager rotation paths against an independent float64 rotation.

``apply_rotation`` rotates without autograd by ``rotate_into``, with gradients into x
alone by ``_Rotation`` (whose backward rotates the gradient by the negative
angle) and with gradients into cos or sin by the differentiable formula. Each must give
the rotation of every pair (a, b) by its angle: (a cos - b sin, b cos + a sin), and the
gradients of that map.
"""

from __future__ import annotations

import importlib

import pytest
import torch

runtime = importlib.import_module("generated._attention")

CASES = [  # (half_pairing, head_dim, rotary_dim)
    (True, 8, 8),
    (False, 8, 8),
    (True, 12, 8),  # partial: features 8.. pass through
    (False, 12, 4),
]


def _tables(n: int, rotary_dim: int, half_pairing: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [n, rotary_dim] in the pairing's layout, with pair-dependent scales
    (as xPos puts in them), so a mix-up of pairs or of cos and sin shows."""
    generator = torch.Generator().manual_seed(5)
    angles = torch.rand(n, rotary_dim // 2, generator=generator, dtype=torch.float64) * 6
    scale = 0.5 + torch.rand(n, rotary_dim // 2, generator=generator, dtype=torch.float64)
    cos, sin = angles.cos() * scale, angles.sin() * scale
    if half_pairing:
        return torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    return cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)


def _reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: bool) -> torch.Tensor:
    """The rotation pair by pair, with explicit indices."""
    d = cos.shape[-1]
    out = x.clone()
    for k in range(d // 2):
        i, j = (k, k + d // 2) if half else (2 * k, 2 * k + 1)
        c, s = cos[:, i], sin[:, i]
        out[..., i] = x[..., i] * c - x[..., j] * s
        out[..., j] = x[..., j] * c + x[..., i] * s
    return out


@pytest.mark.parametrize(("half_pairing", "head_dim", "rotary_dim"), CASES)
def test_every_eager_path_matches_the_pairwise_rotation(
    half_pairing: bool, head_dim: int, rotary_dim: int
) -> None:
    cos, sin = _tables(5, rotary_dim, half_pairing)
    x = torch.randn(2, 3, 5, head_dim, dtype=torch.float64)
    cotangent = torch.randn_like(x)
    leaf = x.clone().requires_grad_()
    want = _reference(leaf, cos, sin, half_pairing)
    (want_grad,) = torch.autograd.grad(want, leaf, cotangent)

    with torch.no_grad():  # rotate_into
        got = runtime.apply_rotation(x, cos, sin, rotary_dim, half_pairing)
    torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-12)

    leaf = x.clone().requires_grad_()  # _Rotation, by rotate_into
    got = runtime.apply_rotation(leaf, cos, sin, rotary_dim, half_pairing)
    assert type(got.grad_fn).__name__ == "_RotationBackward"
    (got_grad,) = torch.autograd.grad(got, leaf, cotangent)
    torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)

    # the formula, with gradients into the per-pair values behind cos and sin
    leaf = x.clone().requires_grad_()
    pair_cos = cos[:, 0 : rotary_dim // 2] if half_pairing else cos[:, 0::2]
    pair_sin = sin[:, 0 : rotary_dim // 2] if half_pairing else sin[:, 0::2]
    grads = []
    for rotate in ("runtime", "reference"):
        c, s = pair_cos.clone().requires_grad_(), pair_sin.clone().requires_grad_()
        spread = (lambda t: torch.cat((t, t), -1)) if half_pairing else _interleave
        if rotate == "runtime":
            out = runtime.apply_rotation(leaf, spread(c), spread(s), rotary_dim, half_pairing)
            grads.append(torch.autograd.grad(out, (leaf, c, s), cotangent))
        else:
            out = _reference(x, spread(c), spread(s), half_pairing)
            grads.append((want_grad, *torch.autograd.grad(out, (c, s), cotangent)))
    for got_grad, want_grad in zip(*grads, strict=True):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)


def _interleave(t: torch.Tensor) -> torch.Tensor:
    return t.repeat_interleave(2, -1)


@pytest.mark.parametrize(("half_pairing", "head_dim", "rotary_dim"), CASES)
def test_the_backward_by_the_negative_angle_passes_gradcheck_twice(
    half_pairing: bool, head_dim: int, rotary_dim: int
) -> None:
    cos, sin = _tables(4, rotary_dim, half_pairing)
    x = torch.randn(1, 2, 4, head_dim, dtype=torch.float64, requires_grad=True)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        return runtime._Rotation.apply(t, cos, sin, rotary_dim, half_pairing, False)

    assert torch.autograd.gradcheck(rotate, (x,))
    assert torch.autograd.gradgradcheck(rotate, (x,))


@pytest.mark.parametrize("half_pairing", [True, False])
def test_bfloat16_gradients_are_within_bfloat16_error(half_pairing: bool) -> None:
    cos, sin = (t.float() for t in _tables(64, 16, half_pairing))
    x = torch.randn(2, 4, 64, 16).bfloat16()
    cotangent = torch.randn(2, 4, 64, 16).bfloat16()
    leaf = x.clone().requires_grad_()
    out = runtime.apply_rotation(leaf, cos, sin, 16, half_pairing)
    (grad,) = torch.autograd.grad(out, leaf, cotangent)
    assert out.dtype == grad.dtype == torch.bfloat16
    want = _reference(x.double(), cos.double(), sin.double(), half_pairing)
    want_grad = _reference(cotangent.double(), cos.double(), -sin.double(), half_pairing)
    torch.testing.assert_close(out.double(), want, rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(grad.double(), want_grad, rtol=8e-3, atol=8e-3)
