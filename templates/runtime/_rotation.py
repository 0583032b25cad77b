"""Rotary position embedding: rotating q and k by position-dependent angles.

RoPE (Su et al. 2021, RoFormer) rotates each pair of features (a, b) of a query or key
at position p by the angle p * theta_f:

    a' = a cos(p theta_f) - b sin(p theta_f),    b' = b cos(p theta_f) + a sin(p theta_f)

so that (R_i q) . (R_j k) depends on j - i alone. Pairs are the two halves of the
rotated features (GPT-NeoX, Llama: ``half_pairing``) or neighbours (GPT-J). Angles are
computed in float64 and cos and sin rounded to float32 once. ``apply_rotation`` picks
the path: the fused Triton kernel on CUDA, chunked eager ops without up-cast copies on
the CPU, and under torch.compile a traced form inductor fuses.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._inputs import position_reach, under_function_transform
from ._numerics import autocast_off
from ._opaque import opaque_copy
from ._rotation_kernel import FUSED_ROTATION_DTYPES, fused_rotation_enabled, launch_rotation


def apply_rotation(
    x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int, half_pairing: bool
) -> Tensor:
    """Each pair (a, b) of x's first rotary_dim features becomes (a cos - b sin,
    b cos + a sin); the features past rotary_dim pass through. Computed in cos's dtype
    and returned in x's.

    x: [..., N, D]; cos, sin: [N, rotary_dim] or [B, 1, N, rotary_dim], laid out for the
    pairing (half: feature k pairs with k + rotary_dim / 2, and cos repeats its first
    half; interleaved: 2k with 2k + 1, each angle repeated). An attention factor, xPos
    scales and M-RoPE sections are values inside cos and sin, in the same layout.

    On CUDA with Triton (float16, bfloat16 or float32, eager mode) one fused kernel
    each way (``fused_rotation``); under torch.compile ``rotate_by_halves``, which
    inductor fuses, or for interleaved pairs on the CPU ``rotate_into`` as the opaque
    op ``posgen::rotate`` (``EAGER_ROTATION_UNDER_COMPILE``); else ``rotate_into``,
    with a backward by the negative angle (``_Rotation``) when gradients reach x alone;
    ``rotate_by_formula`` when they reach cos or sin, or under a torch.func transform.
    """
    if fused_rotation_enabled(x, cos, sin) and not under_function_transform():
        return fused_rotation(x, cos, sin, rotary_dim, half_pairing)
    with autocast_off(x.device.type):
        if torch.compiler.is_compiling():
            if compiled_rotation_stays_eager(x, cos, sin, half_pairing):
                return _ROTATE(x, cos, sin, rotary_dim, half_pairing)
            return rotate_by_halves(x, cos, sin, rotary_dim, half_pairing).to(x.dtype)
        if under_function_transform():  # torch.func (vmap, grad): plain ops out of place
            return rotate_by_formula(x, cos, sin, rotary_dim, half_pairing).to(x.dtype)
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad)
        if not needs_grad:
            return rotate_into(x, cos, sin, rotary_dim, half_pairing)
        if not (cos.requires_grad or sin.requires_grad):
            return _Rotation.apply(x, cos, sin, rotary_dim, half_pairing, False)
        return rotate_by_formula(x, cos, sin, rotary_dim, half_pairing).to(x.dtype)


# Under torch.compile, the rotation's cos and sin pass through ops that inductor cannot
# see into (``posgen::cos_sin``, ``posgen::materialize``) only from these sizes. Each such
# op's call cost 15-25 us in a compiled step (2-core x86 CPU), more than the trigonometry
# it saves on small tensors: a compiled decode step of ``rope`` (q [2, 8, 1, 64], 512
# rotated keys, float32) took 134 us through both ops and 84 us without; with 16 heads of
# 128 the ops won from about 48K elements of q (32K: 585 us through them, 562 without;
# 64K: 795 through them, 820 without; 131K: 1209 through the cos_sin op alone, 1398
# without either). The cos_sin op
# needs angles of at least OPAQUE_COS_SIN_MIN_ANGLES elements (positions times pairs), a
# materialised table an x of at least OPAQUE_TABLE_MIN_ELEMENTS.
OPAQUE_COS_SIN_MIN_ANGLES = 1 << 12
OPAQUE_TABLE_MIN_ELEMENTS = 1 << 16

# (device type, half pairing) where torch.compile calls ``rotate_into`` as one opaque
# op (``posgen::rotate``) instead of letting inductor fuse ``rotate_by_halves``, for an
# x of at least ``OPAQUE_TABLE_MIN_ELEMENTS`` elements. On a 2-core x86 CPU (float32,
# separate processes) inductor's code for interleaved pairs took 1.3-1.4x a copy of q
# and k at [2, 16, 2048, 128] and [4, 32, 512, 128], the op (one complex product)
# 1.1-1.2x; for the half pairing inductor's 1.1-1.2x beats the op's 1.6x. In a compiled
# decode step of ``rope_gptj`` (one query, 512 keys) the op's call cost more than it
# saved: 130 against 82 us for q [2, 8, 1, 64], 643 against 540 for [4, 32, 1, 128],
# about even at 131K elements (1263 against 1234 us), and it paid from about 200K
# (524K: 3789 against 4854 us).
EAGER_ROTATION_UNDER_COMPILE = {("cpu", False)}


def compiled_rotation_stays_eager(x: Tensor, cos: Tensor, sin: Tensor, half_pairing: bool) -> bool:
    """Whether a traced rotation of x goes through ``posgen::rotate``: where
    ``EAGER_ROTATION_UNDER_COMPILE`` lists x's device and pairing, x has at least
    ``OPAQUE_TABLE_MIN_ELEMENTS`` elements, and no gradient reaches cos or sin."""
    if cos.requires_grad or sin.requires_grad or x.numel() < OPAQUE_TABLE_MIN_ELEMENTS:
        return False
    return (x.device.type, half_pairing) in EAGER_ROTATION_UNDER_COMPILE


def _rotation_op() -> Any:
    """The custom op ``posgen::rotate``: ``rotate_into`` as one call that torch.compile
    does not trace into, differentiable in x (the gradient rotated by the negative
    angle, through the same op, so a double backward works too). Registered once per
    process, like ``posgen::materialize``. Eager autograd keeps ``_Rotation``, which
    computes the same: through this op a rotate of q and k with its backward at
    [1, 8, 1024, 64] took 1.7-1.8 ms instead of 1.4-1.5 ms (the op's dispatch)."""
    if hasattr(torch.ops.posgen, "rotate"):
        return torch.ops.posgen.rotate

    def rotate(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int, half_pairing: bool) -> Tensor:
        return rotate_into(x, cos, sin, rotary_dim, half_pairing)

    def rotated_like(
        x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int, half_pairing: bool
    ) -> Tensor:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)  # rotate_into's output

    schema = "(Tensor x, Tensor cos, Tensor sin, int rotary_dim, bool half_pairing) -> Tensor"
    op = torch.library.custom_op("posgen::rotate", mutates_args=(), schema=schema)(rotate)
    op.register_fake(rotated_like)

    def remember(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, cos, sin, ctx.rotary_dim, ctx.half_pairing = inputs
        ctx.save_for_backward(cos, sin)

    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        return op(grad, cos, -sin, ctx.rotary_dim, ctx.half_pairing), None, None, None, None

    op.register_autograd(backward, setup_context=remember)
    return op


def rotate_by_formula(
    x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int, half_pairing: bool
) -> Tensor:
    """x * cos + partner(x) * sin over the rotated features, in cos's dtype: plain
    differentiable ops, for gradients into cos and sin or a double backward."""
    rotated = x[..., :rotary_dim].to(cos.dtype)
    out = rotated * cos + rotation_partners(rotated, half_pairing) * sin
    if rotary_dim < x.shape[-1]:
        out = torch.cat((out, x[..., rotary_dim:].to(cos.dtype)), dim=-1)
    return out


class _Rotation(torch.autograd.Function):
    """RoPE (Su et al. 2021) differentiable in x, by one rotation routine each way: the
    fused Triton kernel (``fused``) or ``rotate_into``. The gradient of a rotation is
    the gradient rotated by the negative angle (each pair's [[cos, -sin], [sin, cos]]
    transposed), so nothing of x is kept, only cos and sin; a double backward goes
    through ``rotate_by_formula``. On a 2-core CPU (float32, [2, 16, 2048, 128]) autograd
    through the formula took 3.95x a copy forward and backward for the half pairing,
    6.1x interleaved.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        rotary_dim: int,
        half_pairing: bool,
        fused: bool,
    ) -> Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.rotary_dim, ctx.half_pairing, ctx.fused = rotary_dim, half_pairing, fused
        return _rotate_once(x, cos, sin, rotary_dim, half_pairing, fused, inverse=False)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        d, half_pairing = ctx.rotary_dim, ctx.half_pairing
        if grad.requires_grad:  # a double backward: stay differentiable
            grad_x = rotate_by_formula(grad, cos, -sin, d, half_pairing).to(grad.dtype)
        else:
            grad_x = _rotate_once(grad, cos, sin, d, half_pairing, ctx.fused, inverse=True)
        return grad_x, None, None, None, None, None


def _rotate_once(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    rotary_dim: int,
    half_pairing: bool,
    fused: bool,
    inverse: bool,
) -> Tensor:
    """x rotated by its angles (by their negatives when ``inverse``), in x's dtype."""
    if fused:
        return launch_rotation(x, cos, sin, rotary_dim, half_pairing, inverse=inverse)
    return rotate_into(x, cos, sin, rotary_dim, half_pairing, inverse)


def rotate_by_halves(
    x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int, half_pairing: bool
) -> Tensor:
    """The rotation for torch.compile, in cos's dtype: the pairs' two halves
    (a cos - b sin, b cos + a sin) as half-width products, joined once.

    Inductor turns this form into one pass over x: 1.05x a copy of q and k on a 2-core
    CPU (float32, [2, 16, 2048, 128]), against 2.3x for x * cos + partner(x) * sin,
    whose partner is a per-element choice. cos and sin go through ``materialized``:
    traced from positions, inductor would otherwise fuse their float64 cos and sin into
    that pass, once per element of x instead of once per position and pair (1.6x);
    not for an x of fewer than ``OPAQUE_TABLE_MIN_ELEMENTS`` elements (a decode step's).
    """
    d = rotary_dim
    rotated = x[..., :d].to(cos.dtype)
    passed = [x[..., d:].to(cos.dtype)] if d < x.shape[-1] else []  # features past d
    if half_pairing:  # feature k pairs with k + d / 2
        a, b = rotated[..., : d // 2], rotated[..., d // 2 :]
        c, s = materialized(cos[..., : d // 2], x), materialized(sin[..., : d // 2], x)
        return torch.cat([a * c - b * s, b * c + a * s, *passed], dim=-1)  # one join
    a, b = rotated[..., 0::2], rotated[..., 1::2]  # feature 2k pairs with 2k + 1
    c, s = materialized(cos[..., 0::2], x), materialized(sin[..., 0::2], x)
    out = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    return torch.cat([out, *passed], dim=-1) if passed else out


def materialized(t: Tensor, x: Tensor) -> Tensor:
    """``t`` as its own buffer when torch.compile traces (``opaque_copy``) and the
    tensor x it will rotate has at least ``OPAQUE_TABLE_MIN_ELEMENTS`` elements, else
    ``t`` itself."""
    if torch.compiler.is_compiling() and x.numel() >= OPAQUE_TABLE_MIN_ELEMENTS:
        return opaque_copy(t)
    return t


def spread_over_features(per_pair: Tensor, half_pairing: bool) -> Tensor:
    """A value per pair [..., d / 2] at both features of its pair, [..., d]: features k
    and k + d / 2 (half pairing) or 2k and 2k + 1 (interleaved). Rotary tables are
    computed per pair and spread in their final dtype (half the cos and sin of a table
    per feature)."""
    if half_pairing:
        return torch.cat((per_pair, per_pair), dim=-1)
    return torch.stack((per_pair, per_pair), dim=-1).flatten(-2)


def _cos_sin_op() -> Any:
    """The custom op ``posgen::cos_sin``: cos and sin of a tensor by torch's own
    kernels, one call that torch.compile does not trace into. With inductor's own
    float64 cos and sin in the traced table, a compiled ``rope_gptj`` rotated q and k
    in 1.7x a copy at [2, 16, 2048, 128] and 2.8 ms at [1, 8, 1024, 64]; through this
    op in 1.3-1.4x and 2.0-2.1 ms (2-core x86 CPU, separate processes). Differentiable,
    so angles that need a gradient get one; registered once per process, like
    ``posgen::materialize``."""
    if hasattr(torch.ops.posgen, "cos_sin"):
        return torch.ops.posgen.cos_sin

    def cos_sin(angles: Tensor) -> tuple[Tensor, Tensor]:
        return angles.cos(), angles.sin()

    def cos_sin_like(angles: Tensor) -> tuple[Tensor, Tensor]:
        return torch.empty_like(angles), torch.empty_like(angles)

    schema = "(Tensor angles) -> (Tensor, Tensor)"
    op = torch.library.custom_op("posgen::cos_sin", mutates_args=(), schema=schema)(cos_sin)
    op.register_fake(cos_sin_like)

    def remember(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        ctx.save_for_backward(*output)

    def backward(ctx: Any, grad_cos: Tensor | None, grad_sin: Tensor | None) -> Tensor:
        cos, sin = ctx.saved_tensors  # d cos = -sin d angle, d sin = cos d angle
        grad = torch.zeros_like(cos)
        if grad_cos is not None:
            grad = grad - grad_cos * sin
        if grad_sin is not None:
            grad = grad + grad_sin * cos
        return grad

    op.register_autograd(backward, setup_context=remember)
    return op


_COS_SIN = _cos_sin_op()


def cos_and_sin(angles: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin of ``angles``: through ``posgen::cos_sin`` while torch.compile
    traces angles of at least ``OPAQUE_COS_SIN_MIN_ANGLES`` elements, else plain ops."""
    if torch.compiler.is_compiling() and angles.numel() >= OPAQUE_COS_SIN_MIN_ANGLES:
        return _COS_SIN(angles)
    return angles.cos(), angles.sin()


def rotation_partners(x: Tensor, half_pairing: bool) -> Tensor:
    """The partner of each feature, signed so that x * cos + partner * sin rotates."""
    if half_pairing:
        first, second = x.chunk(2, dim=-1)
        return torch.cat((-second, first), dim=-1)
    pairs = x.unflatten(-1, (-1, 2))  # [..., rotary_dim / 2, 2]
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


# Rows (positions) of x that ``rotate_into`` rotates at a time where it takes several
# passes, as a budget of rotated features' bytes per device. On a 2-core x86 CPU at
# [2, 16, 2048, 128], the chunk stays in cache between the passes: the half pairing in
# float32 went from 1.6x to 1.5x a copy of q and k; bfloat16, widened a chunk at a
# time, from 24x to 6x. None or absent: all rows at once.
ROTATION_CHUNK_BYTES: dict[str, int | None] = {"cpu": 1 << 20}

# The most elements of x, per device, that ``rotate_into`` rotates by the half pairing
# as x * cos + roll(x) * signed sin (``_rotate_by_partners``: four ops on whole rows,
# x widened to cos's dtype first and the result rounded once) rather than x * cos and
# a multiply-add into each half (three ops on ten slices, through a scratch buffer for
# another dtype). On a 2-core x86 CPU a decode step's query [1, 8, 1, 64] took 6.9 us
# against 19 us in float32 and 12 us against 28 us in bfloat16, [4, 32, 1, 128] 12 us
# against 23 us and 20 us against 34 us; the halves win on long inputs, whose passes
# are half as wide. Absent: never (on CUDA each op is a kernel launch).
ROLLED_ROTATION_MAX_ELEMENTS: dict[str, int] = {"cpu": 1 << 16}

# The same for interleaved pairs: x * cos + flip(pairs of x) * signed sin
# (``_rotate_by_partners``: four ops, the flip giving each pair as (b, a)) rather than
# one complex product (about fifteen calls around it: two complex views, strided cos
# and sin, a complex turn). On a 2-core x86 CPU, float32: [1, 8, 1, 64] 24 us against
# 9.5 us, [2, 32, 1, 128] 30 us against 20 us, but [4, 32, 1, 128] 26 us against 29 us
# (the flip's copy is slow). Absent: never.
FLIPPED_ROTATION_MAX_ELEMENTS: dict[str, int] = {"cpu": 1 << 13}


# Device types where a rotation at explicit positions reads its cos and sin rows from
# the module's float32 table of default positions (grown to cover them) rather than
# forming their angles (a dozen small ops: the frequencies, the float64 angles, cos,
# sin, two casts, two spreads): one host read of the positions' range, which costs no
# sync there. A Hugging Face decode step gives every layer explicit positions.
EXPLICIT_TABLE_DEVICES = {"cpu"}

# The most positions such a table grows to hold for explicit positions (cos and sin in
# float32: 64 MiB at rotary_dim 128); positions past it are computed.
EXPLICIT_TABLE_MAX_POSITIONS = 1 << 16


def table_reach(positions: Tensor, dtype: torch.dtype) -> int | None:
    """The table length (the largest position + 1) from which the float32 cos and sin at
    explicit ``positions`` are read, or None where they are computed: another dtype, a
    device not in ``EXPLICIT_TABLE_DEVICES``, while compiling, no positions, or one
    outside [0, ``EXPLICIT_TABLE_MAX_POSITIONS``). The range is read once per unchanged
    tensor (``position_reach``), so a model's layers read it once."""
    if dtype != torch.float32 or positions.device.type not in EXPLICIT_TABLE_DEVICES:
        return None
    if torch.compiler.is_compiling() or not positions.numel():
        return None
    return position_reach(positions, EXPLICIT_TABLE_MAX_POSITIONS) or None


def rotate_into(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    rotary_dim: int,
    half_pairing: bool,
    inverse: bool = False,
) -> Tensor:
    """The rotation written into one new tensor of x's dtype (no autograd), computed in
    cos's dtype in as few passes over x as eager ops allow; by the negative angles where
    ``inverse`` (the gradient of a rotation).

    x: [..., N, D]; cos, sin: [N, rotary_dim] or [B, 1, N, rotary_dim]. Rows go
    ``rotation_chunk_rows`` at a time, so that the passes over a chunk find it in cache;
    where x's dtype is not cos's, each chunk is computed in a scratch buffer of cos's
    dtype and rounded into the output once.
    """
    if rotary_dim == x.shape[-1] and _partners_serve(x, half_pairing):
        if x.dtype == cos.dtype:  # no .to(): each costs a call even where it is x
            return _rotate_by_partners(x, cos, sin, half_pairing, inverse)
        widened = x.to(cos.dtype)
        return _rotate_by_partners(widened, cos, sin, half_pairing, inverse).to(x.dtype)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [..., N, D]
    n, d = x.shape[-2], rotary_dim
    one_pass = not half_pairing and x.dtype == cos.dtype and d == x.shape[-1]  # complex product
    rows = n if one_pass else rotation_chunk_rows(x, d, cos.dtype)
    scratch = None  # x's rows in cos's dtype, then their rotation, where the dtypes differ
    if x.dtype != cos.dtype:
        scratch = torch.empty((2, *x.shape[:-2], min(rows, n), d), dtype=cos.dtype, device=x.device)
    if rows >= n:  # one chunk (a decode step's few rows): no slicing
        _rotate_chunk(x, cos, sin, out, d, half_pairing, scratch, inverse)
        return out
    if half_pairing and scratch is None:
        _rotate_halves_by_rows(x, cos, sin, out, d, rows, inverse)
        return out
    chunks = (t.split(rows, dim=-2) for t in (x, cos, sin, out))  # views of `rows` rows
    for x_rows, cos_rows, sin_rows, out_rows in zip(*chunks, strict=True):
        chunk_scratch = None if scratch is None else scratch[:, ..., : x_rows.shape[-2], :]
        _rotate_chunk(x_rows, cos_rows, sin_rows, out_rows, d, half_pairing, chunk_scratch, inverse)
    return out


def _partners_serve(x: Tensor, half_pairing: bool) -> bool:
    """Whether ``rotate_into`` rotates every feature of x by ``_rotate_by_partners``:
    at most ``ROLLED_ROTATION_MAX_ELEMENTS`` (half pairing) or
    ``FLIPPED_ROTATION_MAX_ELEMENTS`` (interleaved) elements on x's device."""
    limits = ROLLED_ROTATION_MAX_ELEMENTS if half_pairing else FLIPPED_ROTATION_MAX_ELEMENTS
    return x.numel() <= limits.get(x.device.type, -1)


def _rotate_by_partners(
    x: Tensor, cos: Tensor, sin: Tensor, half_pairing: bool, inverse: bool
) -> Tensor:
    """Every feature of x [..., N, D] (in cos's dtype) rotated, as a new tensor: each
    pair (a, b)'s partners (b, a) are roll(x, D / 2) for the half pairing, each pair
    flipped for interleaved pairs; times the signs (-1, 1) (by the negative angles,
    (1, -1)) and sin they give (-b sin, a sin), and x * cos is added to them."""
    dim = x.shape[-1]
    signs = _partner_signs(dim, x.dtype, x.device, half_pairing, inverse)  # [D]
    if half_pairing:
        partners = x.roll(dim // 2, -1)  # [..., N, D]: (b, a) per pair, a new tensor
    else:
        partners = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # likewise, pair by pair
    return partners.mul_(signs).mul_(sin).addcmul_(x, cos)  # (-b sin, a sin) + x cos


def _partner_signs(
    dim: int, dtype: torch.dtype, device: torch.device, half_pairing: bool, inverse: bool
) -> Tensor:
    """[dim]: -1 at each pair's first feature and 1 at its second (the first half and
    the second, or even and odd features; the reverse where ``inverse``), made once per
    (dim, dtype, device) outside inference mode, so that every mode can read it."""
    key = (dim, dtype, device, half_pairing, inverse)
    signs = _PARTNER_SIGNS.get(key)
    if signs is None:
        with torch.inference_mode(False):
            signs = torch.ones(dim, dtype=dtype, device=device)
            if half_pairing:
                signs[: dim // 2] = -1
            else:
                signs[0::2] = -1
            if inverse:
                signs = -signs
        _PARTNER_SIGNS[key] = signs
    return signs


_PARTNER_SIGNS: dict[tuple[int, torch.dtype, torch.device, bool, bool], Tensor] = {}


def _rotate_chunk(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    out: Tensor,
    rotary_dim: int,
    half_pairing: bool,
    scratch: Tensor | None,
    inverse: bool,
) -> None:
    """Writes the rotation of x's rows [..., n, D] into out's; through scratch
    [2, ..., n, rotary_dim] of cos's dtype (x widened, then rotated) where given."""
    whole = rotary_dim == x.shape[-1]
    if not whole:
        # features past rotary_dim pass through: one copy of whole rows, whose rotated
        # features are then overwritten, beats a strided copy of the rest (1.6x -> 1.45x
        # a copy of q and k for rope_partial on a 2-core CPU)
        out.copy_(x)
    x_rotated = x if whole else x[..., :rotary_dim]
    out_rotated = out if whole else out[..., :rotary_dim]
    if scratch is None:
        _rotate_rows(x_rotated, cos, sin, out_rotated, half_pairing, inverse)
    else:
        widened, rotated = scratch.unbind(0)
        widened.copy_(x_rotated)
        _rotate_rows(widened, cos, sin, rotated, half_pairing, inverse)
        out_rotated.copy_(rotated)  # rounded once


def _rotate_halves_by_rows(
    x: Tensor, cos: Tensor, sin: Tensor, out: Tensor, rotary_dim: int, rows: int, inverse: bool
) -> None:
    """The half pairing of x [..., N, D] in its own dtype (cos's) written into out,
    ``rows`` rows at a time (``_rotate_rows`` gives it one chunk of every row), with every
    operand (x, out, their rotated features and halves, cos, sin's first half) cut into
    row chunks by one split each up front: per chunk only the three passes remain
    (and the copy of whole rows where rotary_dim < D). Against slicing each chunk in
    turn, 2-core x86, float32, time over a copy of q and k: 1.35x -> 1.31x at
    [2, 16, 2048, 128], 1.40x -> 1.33x at [4, 32, 1024, 128]
    (benchmarks/results/rotary_cpu_float32_row_chunks.md)."""
    sign = -1 if inverse else 1
    half = rotary_dim // 2
    whole = rotary_dim == x.shape[-1]
    x_rotated = x if whole else x[..., :rotary_dim]
    out_rotated = out if whole else out[..., :rotary_dim]
    a, b = x_rotated[..., :half], x_rotated[..., half:]
    out_a, out_b = out_rotated[..., :half], out_rotated[..., half:]
    operands = (x, out, x_rotated, out_rotated, cos, a, b, out_a, out_b, sin[..., :half])
    chunks: list[tuple[Tensor, ...]] = [operands]  # one chunk: a decode step's few rows
    if rows < x.shape[-2]:
        chunks = list(zip(*(t.split(rows, dim=-2) for t in operands), strict=True))
    for x_rows, out_rows, x_rot, out_rot, cos_rows, a_rows, b_rows, oa, ob, s in chunks:
        if not whole:  # whole rows first, then the rotated features over them
            out_rows.copy_(x_rows)
        torch.mul(x_rot, cos_rows, out=out_rot)  # a cos, b cos
        oa.addcmul_(b_rows, s, value=-sign)  # a cos - b sin
        ob.addcmul_(a_rows, s, value=sign)  # b cos + a sin


def rotation_chunk_rows(x: Tensor, rotary_dim: int, compute_dtype: torch.dtype) -> int:
    """How many rows of x [..., N, D] ``rotate_into`` takes at a time on x's device:
    ``ROTATION_CHUNK_BYTES`` of x's rotated features in ``compute_dtype``, at least one
    row, at most N."""
    n = x.shape[-2]
    budget = ROTATION_CHUNK_BYTES.get(x.device.type)
    if budget is None or n == 0:
        return max(n, 1)
    row_bytes = x.numel() // (n * x.shape[-1]) * rotary_dim * compute_dtype.itemsize
    return min(n, max(1, budget // max(row_bytes, 1)))


def _rotate_rows(
    x: Tensor, cos: Tensor, sin: Tensor, out: Tensor, half_pairing: bool, inverse: bool
) -> None:
    """Writes the rotation of x [..., n, d] (the rotated features only) into out, in
    out's dtype, which is cos's; by the negative angles where ``inverse`` (a backward),
    with no negated copy of sin.

    Half pairing: out = x * cos (a cos, b cos), then out_a -= b sin and out_b += a sin.
    Interleaved: pairs (2k, 2k + 1) are complex numbers and the rotation is one product
    with e^(i theta_k) where x is in cos's dtype (float32/float64) with even strides;
    elsewhere four strided passes.
    """
    if half_pairing:  # every row in one chunk
        _rotate_halves_by_rows(x, cos, sin, out, x.shape[-1], max(x.shape[-2], 1), inverse)
        return
    sign = -1 if inverse else 1
    pairs = complex_pairs(x) if x.dtype == cos.dtype else None
    out_pairs = complex_pairs(out)
    if pairs is not None and out_pairs is not None:
        c, s = cos[..., 0::2], sin[..., 0::2]
        turn = torch.complex(c, -s if inverse else s)  # e^(+-i theta) [..., d / 2]
        torch.mul(pairs, turn, out=out_pairs)  # (a + ib)(cos +- i sin)
        return
    c, s = cos[..., 0::2], sin[..., 0::2]  # each angle is repeated for its pair
    a, b = x[..., 0::2], x[..., 1::2]
    out_a, out_b = out[..., 0::2], out[..., 1::2]
    torch.mul(a, c, out=out_a)
    out_a.addcmul_(b, s, value=-sign)  # a cos - b sin
    torch.mul(b, c, out=out_b)
    out_b.addcmul_(a, s, value=sign)  # b cos + a sin


def complex_pairs(t: Tensor) -> Tensor | None:
    """t [..., 2k] float32/float64 as complex [..., k], pair (2j, 2j + 1) as real and
    imaginary part: a view, or None where dtype, strides or offset do not allow one."""
    if t.dtype not in (torch.float32, torch.float64) or t.stride(-1) != 1:
        return None
    if t.storage_offset() % 2 or any(stride % 2 for stride in t.stride()[:-1]):
        return None
    return torch.view_as_complex(t.unflatten(-1, (-1, 2)))


_ROTATE = _rotation_op()


def fused_rotation(
    x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int, half_pairing: bool
) -> Tensor:
    """Rotary position embedding (Su et al. 2021) of x's leading rotary_dim features, fused.

    Each pair (a, b) turns by its angle: a cos - b sin and b cos + a sin, computed in
    float32 and rounded once to x's dtype; features past rotary_dim pass through. The
    pairing is half (feature k with k + rotary_dim / 2; cos and sin repeat their first
    half) or interleaved (2k with 2k + 1; each angle repeated twice); the angle is read
    at each pair's first feature, so any values laid out that way work (attention
    factors, xPos scales, M-RoPE sections, p-RoPE's zero frequencies).

    x: [B, H, N, D] float16/bfloat16/float32, any strides (a transposed [B, N, H, D]
    view included); cos, sin: [N, rotary_dim] or [B or 1, 1, N, rotary_dim] on x's
    device -> [B, H, N, D] in x's dtype. Differentiable in x (one kernel backward).
    Needs Triton (on CPU tensors only under TRITON_INTERPRET=1).
    """
    if x.dim() != 4:
        raise ValueError(f"x must be [batch, heads, seq, dim], got shape {list(x.shape)}")
    if x.dtype not in FUSED_ROTATION_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > x.shape[-1]:
        raise ValueError(
            f"rotary_dim must be even, at least 2 and at most head_dim {x.shape[-1]}; "
            f"got {rotary_dim}"
        )
    if cos.shape != sin.shape or cos.device != x.device or sin.device != x.device:
        raise ValueError(
            f"cos and sin must share a shape and x's device {x.device}; got "
            f"{list(cos.shape)} on {cos.device} and {list(sin.shape)} on {sin.device}"
        )
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rotation.apply(x, cos, sin, rotary_dim, half_pairing, True)
    return launch_rotation(x, cos, sin, rotary_dim, half_pairing, inverse=False)
