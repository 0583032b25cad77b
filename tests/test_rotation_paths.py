"""The runtime's eager rotation paths against an independent float64 rotation.

``apply_rotation`` rotates without autograd by ``rotate_into``, with gradients into x
alone by ``_Rotation`` (whose backward rotates the gradient by the negative
angle) and with gradients into cos or sin by the differentiable formula. Each must give
the rotation of every pair (a, b) by its angle: (a cos - b sin, b cos + a sin), and the
gradients of that map. ``rotate_into`` takes a few rows by their partners, a roll of
the half pairing (``ROLLED_ROTATION_MAX_ELEMENTS``) or each interleaved pair flipped
(``FLIPPED_ROTATION_MAX_ELEMENTS``), and others by halves or complex products: tests of
it run both ways.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.conftest import generated_class, runtime_value, spy_calls

runtime = importlib.import_module("generated._rotation")

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
        c, s = cos[..., i], sin[..., i]  # [N] or [B, 1, N]
        out[..., i] = x[..., i] * c - x[..., j] * s
        out[..., j] = x[..., j] * c + x[..., i] * s
    return out


@pytest.mark.parametrize("rolled", [True, False])
@pytest.mark.parametrize(("half_pairing", "head_dim", "rotary_dim"), CASES)
def test_every_eager_path_matches_the_pairwise_rotation(
    half_pairing: bool,
    head_dim: int,
    rotary_dim: int,
    rolled: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rolls = roll_small_inputs(monkeypatch, rolled)
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
    # the partners serve whole rows: without autograd, _Rotation's forward and its
    # backward (by the negative angles)
    assert rolls == ([False, False, True] if rolled and rotary_dim == head_dim else [])


def roll_small_inputs(monkeypatch: pytest.MonkeyPatch, rolled: bool) -> list[object]:
    """Set whether ``rotate_into`` takes small inputs by their partners (a roll, or
    flipped pairs); the returned list records each such rotation's ``inverse``."""
    limit = {"cpu": 1 << 16} if rolled else {}
    monkeypatch.setattr(runtime, "ROLLED_ROTATION_MAX_ELEMENTS", limit)
    monkeypatch.setattr(runtime, "FLIPPED_ROTATION_MAX_ELEMENTS", limit)
    return spy_calls(monkeypatch, [runtime], "_rotate_by_partners", lambda *args: args[-1])


def _interleave(t: torch.Tensor) -> torch.Tensor:
    return t.repeat_interleave(2, -1)


@pytest.mark.parametrize("half_pairing", [True, False])
def test_strided_pairs_rotate_both_ways(half_pairing: bool) -> None:
    """x with odd strides (head_dim 9) and the gradient of out.sum() (an expanded
    tensor, all strides 0) cannot be complex views: the rotation and its backward by
    the negative angle take the strided passes."""
    cos, sin = _tables(5, 4, half_pairing)
    x = torch.randn(2, 3, 5, 9, dtype=torch.float64)
    assert runtime.complex_pairs(x[..., :4]) is None
    leaf = x.clone().requires_grad_()
    got = runtime.apply_rotation(leaf, cos, sin, 4, half_pairing)
    (got_grad,) = torch.autograd.grad(got.sum(), leaf)
    want = _reference(x, cos, sin, half_pairing)
    want_grad = _reference(torch.ones_like(x), cos, -sin, half_pairing)
    torch.testing.assert_close(got.detach(), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rolled", [True, False])
@pytest.mark.parametrize(("half_pairing", "head_dim", "rotary_dim"), CASES)
def test_the_backward_by_the_negative_angle_passes_gradcheck_twice(
    half_pairing: bool,
    head_dim: int,
    rotary_dim: int,
    rolled: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    roll_small_inputs(monkeypatch, rolled)
    cos, sin = _tables(4, rotary_dim, half_pairing)
    x = torch.randn(1, 2, 4, head_dim, dtype=torch.float64, requires_grad=True)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        return runtime._Rotation.apply(t, cos, sin, rotary_dim, half_pairing, False)

    assert torch.autograd.gradcheck(rotate, (x,))
    assert torch.autograd.gradgradcheck(rotate, (x,))
    # gradgradcheck checks the double backward against the backward with a graph, not
    # that backward itself: it is the rotation by the negative angle too (a gradient
    # that requires grad takes that path, as one from a loss of q does)
    grad_out = torch.randn_like(x, requires_grad=True)
    (with_graph,) = torch.autograd.grad(rotate(x), x, grad_out, create_graph=True)
    assert with_graph.requires_grad
    want = _reference(grad_out.detach(), cos, -sin, half_pairing)
    torch.testing.assert_close(with_graph, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rolled", [True, False])
@pytest.mark.parametrize("half_pairing", [True, False])
def test_bfloat16_gradients_are_within_bfloat16_error(
    half_pairing: bool, rolled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    rolls = roll_small_inputs(monkeypatch, rolled)
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
    assert rolls == ([False, True] if rolled else [])  # widened, rounded once


@pytest.mark.parametrize(("half_pairing", "head_dim", "rotary_dim"), CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rows_in_chunks_give_the_rotation_of_every_row(
    monkeypatch: pytest.MonkeyPatch,
    half_pairing: bool,
    head_dim: int,
    rotary_dim: int,
    dtype: torch.dtype,
) -> None:
    """rotate_into over chunks of two rows (five rows: a short last chunk), x a
    transposed [B, N, H, D] view, batched cos and sin [B, 1, N, d]; x of another dtype
    than cos goes through the scratch buffer (interleaved pairs in cos's dtype are one
    complex product, not chunked)."""
    cos, sin = _tables(10, rotary_dim, half_pairing)
    cos, sin = cos.view(2, 1, 5, rotary_dim), sin.view(2, 1, 5, rotary_dim)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    x = torch.randn(2, 5, 3, head_dim, dtype=torch.float64).to(dtype).transpose(1, 2)
    row_bytes = 2 * 3 * rotary_dim * compute.itemsize  # one position's rotated features
    assert not roll_small_inputs(monkeypatch, False)
    monkeypatch.setitem(runtime.ROTATION_CHUNK_BYTES, "cpu", 2 * row_bytes + 1)
    assert runtime.rotation_chunk_rows(x, rotary_dim, compute) == 2

    got = runtime.rotate_into(x, cos.to(compute), sin.to(compute), rotary_dim, half_pairing)

    assert got.dtype == dtype and got.shape == x.shape
    want = _reference(x.double(), cos, sin, half_pairing)
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)
    # by the negative angles (a backward's), in the same chunks
    back = runtime.rotate_into(x, cos.to(compute), sin.to(compute), rotary_dim, half_pairing, True)
    want_back = _reference(x.double(), cos, -sin, half_pairing)
    torch.testing.assert_close(back.double(), want_back, rtol=tolerance, atol=tolerance)
    monkeypatch.setitem(runtime.ROTATION_CHUNK_BYTES, "cpu", None)  # one chunk
    whole = runtime.rotate_into(x, cos.to(compute), sin.to(compute), rotary_dim, half_pairing)
    assert torch.equal(got, whole)


def test_the_cos_sin_op_passes_opcheck_and_gradcheck() -> None:
    """``posgen::cos_sin``, through which a traced rotary table takes torch's own cos and
    sin kernels: schema, fake function and autograd registration are consistent, its
    values are torch.cos and torch.sin, and its gradient is -sin and cos."""
    angles = (torch.rand(3, 4, dtype=torch.float64) * 20 - 10).requires_grad_()
    op = torch.ops.posgen.cos_sin
    torch.library.opcheck(op, (angles,))
    cos, sin = op(angles)
    assert torch.equal(cos, angles.detach().cos()) and torch.equal(sin, angles.detach().sin())
    assert torch.autograd.gradcheck(lambda a: op(a), (angles,))
    (only_sin,) = torch.autograd.grad(op(angles)[1].sum(), angles)  # no gradient into cos
    torch.testing.assert_close(only_sin, angles.detach().cos(), rtol=0, atol=0)


@pytest.mark.parametrize("large", [False, True])
def test_a_traced_rotary_table_takes_torchs_cos_and_sin_from_a_size(large: bool) -> None:
    """Under torch.compile the cos and sin of a rotary table of at least
    OPAQUE_COS_SIN_MIN_ANGLES angles are one ``posgen::cos_sin`` call (with inductor's
    own float64 cos and sin a compiled rope_gptj ran 1.7x a copy on the CPU, through
    the op 1.3-1.4x), and no cos or sin is left for inductor to generate; a smaller
    table's (a decode step's, where the op's call costs more than it saves) are
    plain cos and sin."""
    pe = generated_class("rope")(heads=2, head_dim=8)  # 4 angles per position
    threshold = runtime_value("OPAQUE_COS_SIN_MIN_ANGLES", pe)
    rows = threshold // 4 if large else threshold // 4 - 1
    q, k = torch.randn(1, 2, rows, 8), torch.randn(1, 2, rows, 8)
    targets: list[object] = []

    def record(graph: torch.fx.GraphModule, inputs: object) -> object:
        targets.extend(node.target for node in graph.graph.nodes)
        return graph.forward

    torch._dynamo.reset()
    positions = torch.arange(3, 3 + rows)
    got = torch.compile(pe.rotate, fullgraph=True, backend=record)(q, k, positions, positions)
    assert (torch.ops.posgen.cos_sin.default in targets) is large
    names = [t if isinstance(t, str) else getattr(t, "__name__", "") for t in targets]
    assert ("cos" in names and "sin" in names) is not large
    for tensor, want in zip(got, pe.rotate(q, k, positions, positions), strict=True):
        torch.testing.assert_close(tensor, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("half_pairing", "head_dim", "rotary_dim"), CASES)
def test_the_rotate_op_passes_opcheck_and_gradcheck_twice(
    half_pairing: bool, head_dim: int, rotary_dim: int
) -> None:
    """``posgen::rotate``, the opaque op torch.compile calls on the CPU for interleaved
    pairs: its fake function, schema and autograd registration are consistent
    (torch.library.opcheck), it rotates every pair, and its backward (the same op at
    the negative angle) is differentiable again."""
    cos, sin = _tables(4, rotary_dim, half_pairing)
    x = torch.randn(1, 2, 4, head_dim, dtype=torch.float64, requires_grad=True)
    op = torch.ops.posgen.rotate
    torch.library.opcheck(op, (x, cos, sin, rotary_dim, half_pairing))
    want = _reference(x.detach(), cos, sin, half_pairing)
    got = op(x, cos, sin, rotary_dim, half_pairing)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        return op(t, cos, sin, rotary_dim, half_pairing)

    assert torch.autograd.gradcheck(rotate, (x,))
    assert torch.autograd.gradgradcheck(rotate, (x,))
