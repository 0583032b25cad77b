"""The fused rotary kernel (optional Triton): q or k rotated in one pass.

Each program reads a block of positions' cos and sin once, into registers, and rotates
every head of those positions, reading x in its own dtype through any strides and
rounding once. The backward is the same kernel at the negated angle. Tests run it on
the CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._triton import TRITON_CACHE, power_of_two_at_least, sm_count, triton_available

# Devices and dtypes the fused rotation serves; float64 stays on the eager formula. Tests
# add "cpu" to the devices to run the kernel under TRITON_INTERPRET=1.
FUSED_ROTATION_DEVICES = ["cuda"]
FUSED_ROTATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Launch shape (tunable): positions per program, heads per tile, and the heads one
# program walks through with the same cos/sin in registers (None: all of them, split in
# halves while that leaves fewer than FUSED_ROTATION_PROGRAMS_PER_SM programs per SM).
FUSED_ROTATION_BLOCK_N = 16
FUSED_ROTATION_BLOCK_H = 2
FUSED_ROTATION_HEADS_PER_PROGRAM: int | None = None
FUSED_ROTATION_PROGRAMS_PER_SM = 4
FUSED_ROTATION_NUM_WARPS = 4


def fused_rotation_enabled(x: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether ``fused_rotation`` serves this call: x [B, H, N, D] float16/bfloat16/float32
    on a served device (CUDA), cos and sin without gradients, eager mode (under
    torch.compile the eager formula is traced and fused by inductor), Triton installed."""
    return (
        x.device.type in FUSED_ROTATION_DEVICES
        and x.dtype in FUSED_ROTATION_DTYPES
        and x.dim() == 4
        and cos.dim() in (2, 4)
        and not torch.compiler.is_compiling()
        and not (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))
        and triton_available()
    )


def _rotation_kernel() -> Any:
    """The Triton kernel, defined on first use (TRITON_INTERPRET is read at definition).

    One program takes BLOCK_N positions of one batch row and a range of heads. It loads
    the angle of each pair once (cos and sin at the pair's first feature, as float32) and
    walks its heads BLOCK_H at a time: a tile [BLOCK_H, BLOCK_N, BLOCK_PAIRS] of first
    features a and partners b is read in x's dtype, rotated in float32 (a cos - b sin,
    b cos + a sin; sin negated for the inverse rotation) and rounded once to the
    output's dtype; features past rotary_dim are copied. Interleaved pairs (2k, 2k + 1)
    are read as one contiguous span and split in registers (two stride-2 gathers ran at
    11.8x a copy on an H100), then joined back for one contiguous store.
    """
    if "kernel" in TRITON_CACHE:
        return TRITON_CACHE["kernel"]
    import triton
    import triton.language as tl

    @triton.jit
    def rotate_kernel(
        x_ptr,
        out_ptr,
        cos_ptr,
        sin_ptr,
        heads,
        length,
        x_stride_b,
        x_stride_h,
        x_stride_n,
        x_stride_d,
        out_stride_b,
        out_stride_h,
        out_stride_n,
        out_stride_d,
        cos_stride_b,
        cos_stride_n,
        cos_stride_d,
        sin_stride_b,
        sin_stride_n,
        sin_stride_d,
        HEADS_PER_PROGRAM: tl.constexpr,
        PAIRS: tl.constexpr,
        PASS_THROUGH: tl.constexpr,
        HALF_PAIRING: tl.constexpr,
        INVERSE: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_PAIRS: tl.constexpr,
        BLOCK_PASS: tl.constexpr,
    ):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)  # [BLOCK_N]
        batch = tl.program_id(1).to(tl.int64)
        head_start = tl.program_id(2) * HEADS_PER_PROGRAM
        head_end = tl.minimum(head_start + HEADS_PER_PROGRAM, heads)
        pair = tl.arange(0, BLOCK_PAIRS)  # [BLOCK_PAIRS]
        if HALF_PAIRING:  # feature k pairs with k + rotary_dim / 2
            first = pair
            partner = pair + PAIRS
        else:  # feature 2k pairs with 2k + 1
            first = 2 * pair
            partner = 2 * pair + 1
        pair_mask = (n[:, None] < length) & (pair[None, :] < PAIRS)  # [BLOCK_N, BLOCK_PAIRS]
        cos_at = batch * cos_stride_b + n[:, None] * cos_stride_n + first * cos_stride_d
        sin_at = batch * sin_stride_b + n[:, None] * sin_stride_n + first * sin_stride_d
        cos = tl.load(cos_ptr + cos_at, mask=pair_mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + sin_at, mask=pair_mask, other=0.0).to(tl.float32)
        if INVERSE:  # the transpose: rotation by the negative angle
            sin = -sin
        cos = cos[None, :, :]  # [1, BLOCK_N, BLOCK_PAIRS]
        sin = sin[None, :, :]
        n_x = n[None, :, None] * x_stride_n  # [1, BLOCK_N, 1]
        n_out = n[None, :, None] * out_stride_n
        for head_offset in range(0, HEADS_PER_PROGRAM, BLOCK_H):
            head = head_start + head_offset + tl.arange(0, BLOCK_H).to(tl.int64)  # [BLOCK_H]
            mask = (head[:, None, None] < head_end) & pair_mask[None, :, :]
            x_row = x_ptr + batch * x_stride_b + head[:, None, None] * x_stride_h + n_x
            out_row = out_ptr + batch * out_stride_b + head[:, None, None] * out_stride_h
            out_row += n_out
            dtype = out_ptr.dtype.element_ty
            if HALF_PAIRING:  # a and b are two contiguous halves
                a = tl.load(x_row + first * x_stride_d, mask=mask).to(tl.float32)
                b = tl.load(x_row + partner * x_stride_d, mask=mask).to(tl.float32)
                out_a = a * cos - b * sin  # [BLOCK_H, BLOCK_N, BLOCK_PAIRS]
                out_b = b * cos + a * sin
                tl.store(out_row + first * out_stride_d, out_a.to(dtype), mask=mask)
                tl.store(out_row + partner * out_stride_d, out_b.to(dtype), mask=mask)
            else:  # interleaved: one contiguous span of pairs, split and joined in registers
                feature = tl.arange(0, 2 * BLOCK_PAIRS)[None, None, :]  # [1, 1, 2 BLOCK_PAIRS]
                span_mask = (head[:, None, None] < head_end) & (n[None, :, None] < length)
                span_mask = span_mask & (feature < 2 * PAIRS)
                span = tl.load(x_row + feature * x_stride_d, mask=span_mask).to(tl.float32)
                a, b = tl.split(tl.reshape(span, (BLOCK_H, BLOCK_N, BLOCK_PAIRS, 2)))
                out_a = a * cos - b * sin  # [BLOCK_H, BLOCK_N, BLOCK_PAIRS]
                out_b = b * cos + a * sin
                joined = tl.reshape(tl.join(out_a, out_b), (BLOCK_H, BLOCK_N, 2 * BLOCK_PAIRS))
                tl.store(out_row + feature * out_stride_d, joined.to(dtype), mask=span_mask)
            if PASS_THROUGH > 0:  # features rotary_dim .. D - 1 are copied
                feature = 2 * PAIRS + tl.arange(0, BLOCK_PASS)
                copy_mask = (head[:, None, None] < head_end) & (n[None, :, None] < length)
                copy_mask = copy_mask & (feature < 2 * PAIRS + PASS_THROUGH)
                kept = tl.load(x_row + feature * x_stride_d, mask=copy_mask)
                tl.store(out_row + feature * out_stride_d, kept.to(dtype), mask=copy_mask)

    TRITON_CACHE["kernel"] = rotate_kernel
    return rotate_kernel


def _angle_rows(angles: Tensor, x: Tensor, rotary_dim: int, name: str) -> Tensor:
    """cos or sin [N, rotary_dim] (shared) or [B or 1, 1, N, rotary_dim] (batched) ->
    a [B, N, rotary_dim] view (batch stride 0 where shared). ValueError for other shapes."""
    batch, _, length, _ = x.shape
    if angles.dim() == 2 and angles.shape == (length, rotary_dim):
        return angles.unsqueeze(0).expand(batch, length, rotary_dim)
    if angles.dim() == 4 and angles.shape[1:] == (1, length, rotary_dim):
        if angles.shape[0] in (1, batch):
            return angles[:, 0].expand(batch, length, rotary_dim)
    raise ValueError(
        f"{name} must be [N, rotary_dim] or [batch, 1, N, rotary_dim] = [{batch}, 1, "
        f"{length}, {rotary_dim}] for x of shape {list(x.shape)}; got {list(angles.shape)}"
    )


def launch_rotation(
    x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int, half_pairing: bool, inverse: bool
) -> Tensor:
    """One kernel launch: x [B, H, N, D] (any strides) -> a new tensor in x's dtype."""
    cos_rows = _angle_rows(cos, x, rotary_dim, "cos")  # [B, N, rotary_dim]
    sin_rows = _angle_rows(sin, x, rotary_dim, "sin")
    out = torch.empty_like(x)  # x's strides where x is dense, else contiguous
    batch, heads, length, head_dim = x.shape
    if out.numel() == 0:
        return out
    pairs = rotary_dim // 2
    pass_through = head_dim - rotary_dim
    block_n = FUSED_ROTATION_BLOCK_N
    row_blocks = (length + block_n - 1) // block_n
    per_program = _heads_per_program(x.device, batch * row_blocks, heads)
    block_h = min(FUSED_ROTATION_BLOCK_H, per_program)
    grid = (row_blocks, batch, (heads + per_program - 1) // per_program)
    _rotation_kernel()[grid](
        x,
        out,
        cos_rows,
        sin_rows,
        heads,
        length,
        *x.stride(),
        *out.stride(),
        *cos_rows.stride(),
        *sin_rows.stride(),
        HEADS_PER_PROGRAM=per_program,
        PAIRS=pairs,
        PASS_THROUGH=pass_through,
        HALF_PAIRING=half_pairing,
        INVERSE=inverse,
        BLOCK_H=power_of_two_at_least(block_h),
        BLOCK_N=power_of_two_at_least(block_n),
        BLOCK_PAIRS=power_of_two_at_least(pairs),
        BLOCK_PASS=power_of_two_at_least(pass_through),
        num_warps=FUSED_ROTATION_NUM_WARPS,
    )
    return out


def _heads_per_program(device: torch.device, row_programs: int, heads: int) -> int:
    """Heads one program walks: FUSED_ROTATION_HEADS_PER_PROGRAM, else all of them,
    halved while the grid would give a CUDA device's SMs too few programs."""
    if FUSED_ROTATION_HEADS_PER_PROGRAM is not None:
        return max(1, min(FUSED_ROTATION_HEADS_PER_PROGRAM, heads))
    if device.type != "cuda":
        return heads
    wanted = FUSED_ROTATION_PROGRAMS_PER_SM * sm_count(device)
    per_program = heads
    while per_program > 1 and row_programs * ((heads + per_program - 1) // per_program) < wanted:
        per_program = (per_program + 1) // 2
    return per_program
