"""Fused attention with a bias of the key minus query position, or relative terms read
from their projections (optional Triton).

softmax(scale * q k^T + b_h(j - i) + masks) v on FlashAttention-2's schedule (Dao 2023):
the bias is computed in registers per tile, either c_h * |j - i| from one slope per head
(ALiBi, Press et al. 2022) or read from a per-head vector indexed by the clamped
distance (T5's clipped table, KERPLE), so no [B, H, N, M] tensor exists. Relative-table
terms (BERT, DeBERTa, Transformer-XL) are added the same way from their projections
over the table rows, [B, H, N or M, K], each score reading the row of its diagonal
(``fused_relative_attention``). Causal masks and windows are a band of tiles the loops
skip. The backward recomputes the scores
per tile; a bias that trains gets its gradient summed in the dQ kernel (one entry per
tile past the clip, per-diagonal sums elsewhere), or, on the flex backend's other
route, from a band and two triangles (see ``_trained_bias``). On CUDA each kernel is
autotuned over a few tile shapes; the CPU suite runs them under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._first_order import first_order_only
from ._inputs import check_flag
from ._masks import check_window
from ._triton import TRITON_CACHE, triton_available

#: device types where ``fused_distance_attention`` runs: Triton compiles it for CUDA;
#: tests add "cpu" to run the kernels under TRITON_INTERPRET=1.
FUSED_DISTANCE_DEVICES: set[str] = {"cuda"}
FUSED_DISTANCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: tiles (BLOCK_M queries, BLOCK_N keys) where the kernels are not autotuned (the
#: interpreter); on CUDA each kernel picks from ``_distance_attention_configs``
FUSED_DISTANCE_BLOCKS = (16, 16)
#: entries of O (and of dO) per program of the backward's δ = dO · O kernel on CUDA:
#: rows of value_dim per program, at least 16 (memory-bound, untuned)
DISTANCE_ROW_DOTS_ELEMENTS = 4096
#: how the kernels read the bias: "none", "slope" (c_h |j - i|, one value per head) or
#: "vector" (a row per head indexed by the clamped key minus query position)
DISTANCE_BIAS_KINDS = ("none", "slope", "vector")
#: a vector shorter than the N + M - 1 distances (clipped, as T5's): each tile first
#: tests whether it lies wholly past an end and then adds one loaded value instead of a
#: gather per score; False gathers in every tile (tests and benchmarks compare the two)
FUSED_DISTANCE_CONSTANT_TILES = True
#: the kernels' @triton.jit helpers, set by ``_distance_attention_kernels``: the
#: interpreter resolves a kernel's callees among the module's globals, not its closure.
#: The kernels call no @triton.jit function of triton.language (zeros, max, sum): made
#: when triton was imported without TRITON_INTERPRET, those refuse to run in the
#: interpreter, so the kernels use tl.full and tl.reduce with these helpers.
_distance_tile_logits: Any = None
_distance_larger: Any = None
_distance_plus: Any = None
_distance_diagonal_sums_into: Any = None
_distance_relative_tile: Any = None
_distance_tile_row: Any = None
_distance_relative_logits: Any = None
_distance_relative_grad_into: Any = None
#: triton.language, bound by ``_distance_attention_kernels``: Triton's compiler resolves
#: each parameter's ``tl.constexpr`` annotation (a string, under ``from __future__ import
#: annotations``) among a function's globals and closure cells, and a helper whose body
#: never names ``tl`` (``relative_logits``) has no cell for it; the interpreter looks
#: for it among the globals too
tl: Any = None


def fused_distance_attention_serves(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether ``fused_distance_attention`` can take q [B, H, N, D], k and v: a device
    in FUSED_DISTANCE_DEVICES, float16/bfloat16/float32 alike, N <= M (default
    positions), head_dim and value_dim powers of two from 16 to 256 (the tile widths of
    Triton's dot), eager mode (compiled modules take FlexAttention, which inductor
    traces) and Triton installed."""
    widths = (q.shape[-1], v.shape[-1])
    return (
        q.device.type in FUSED_DISTANCE_DEVICES
        and q.dtype in FUSED_DISTANCE_DTYPES
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and q.shape[2] <= k.shape[2]
        and all(16 <= w <= 256 and w & (w - 1) == 0 for w in widths)
        and not torch.compiler.is_compiling()
        and triton_available()
    )


def _distance_attention_configs(name: str) -> list[Any]:
    """Autotuning candidates of kernel ``name`` on CUDA, as (BLOCK_M queries, BLOCK_N
    keys, warps, stages): wide query tiles for the forward and dQ, wide key tiles for dK
    and dV (as in the Triton fused-attention tutorial and FlashAttention-2). Untimed
    here, so the autotuner chooses per (N, M, widths, bias, band); a tile that needs
    more shared memory than the device has is skipped."""
    import triton

    shapes = {
        "forward": [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2)],
        "key_grad": [(32, 128, 4, 3), (64, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3)],
        "query_grad": [(128, 32, 4, 3), (128, 64, 8, 2), (64, 64, 4, 3), (64, 32, 4, 3)],
    }[name]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=stages)
        for bm, bn, w, stages in shapes
    ]


def _distance_attention_kernels() -> dict[str, Any]:
    """The Triton kernels of ``fused_distance_attention``, defined on first use
    (TRITON_INTERPRET is read at definition): "forward", "key_grad", "query_grad" and
    "row_dots" (the backward's δ_i = dO_i · O_i, read once in the input dtype).

    FlashAttention-2's schedule (Dao 2023, arXiv:2307.08691): the forward walks one tile
    of queries over the key tiles its band allows with an online softmax in base 2; the
    backward recomputes P = exp(S - lse) per tile, once per key tile for dK and dV
    (summing the query heads a key head serves, so no atomics) and once per query tile
    for dQ, which also sums the gradient of a bias that trains (``diagonal_sums_into``).
    The bias of each tile comes from ``tile_logits``.
    """
    global _distance_tile_logits, _distance_larger, _distance_plus, _distance_diagonal_sums_into
    global _distance_relative_tile, _distance_relative_logits, _distance_relative_grad_into
    global _distance_tile_row, tl
    if "attention" in TRITON_CACHE:
        return dict(TRITON_CACHE["attention"])
    import triton
    import triton.language as tl

    @triton.jit
    def tile_logits(
        s,  # float32 q . k times scale * log2(e): [BLOCK_M, BLOCK_N], or transposed
        start_m,  # the tile's first query
        start_n,  # its first key
        n,
        m,
        bias_row,  # this head's slope, or its vector row
        bias_stride,
        bias_length,
        bias_base,
        r_lo,
        r_hi,
        BIAS: tl.constexpr,  # 0 none, 1 slope, 2 clipped vector, 3 vector gathered per score
        BAND: tl.constexpr,  # keys outside r_lo <= r <= r_hi are masked
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        KEYS_FIRST: tl.constexpr,  # s is [BLOCK_N, BLOCK_M] (the key-tile backward)
    ):
        """s plus the bias (in base-2 units), -inf where masked."""
        log2e: tl.constexpr = 1.4426950408889634
        shift = m - n  # query i sits at position i + M - N
        rows = start_m + tl.arange(0, BLOCK_M)
        cols = start_n + tl.arange(0, BLOCK_N)
        if KEYS_FIRST:
            r = cols[:, None] - rows[None, :] - shift  # key minus query position
            inside = (cols[:, None] < m) & (rows[None, :] < n)
        else:
            r = cols[None, :] - rows[:, None] - shift
            inside = (rows[:, None] < n) & (cols[None, :] < m)
        edge = (start_m + BLOCK_M > n) | (start_n + BLOCK_N > m)  # the tile crosses an end
        r_min = start_n - (start_m + BLOCK_M - 1) - shift  # the tile's smallest r
        r_max = start_n + BLOCK_N - 1 - start_m - shift  # and largest
        if BIAS == 1:  # c_h |r|
            slope = tl.load(bias_row).to(tl.float32) * log2e
            s += slope * tl.abs(r).to(tl.float32)
        elif BIAS == 2:  # row[clamp(r + base, 0, length - 1)]; one value where it is clamped
            if r_max + bias_base <= 0:
                s += tl.load(bias_row).to(tl.float32) * log2e
            elif r_min + bias_base >= bias_length - 1:
                last = tl.load(bias_row + (bias_length - 1) * bias_stride)
                s += last.to(tl.float32) * log2e
            else:
                index = tl.minimum(tl.maximum(r + bias_base, 0), bias_length - 1)
                s += tl.load(bias_row + index * bias_stride).to(tl.float32) * log2e
        elif BIAS == 3:  # the same, gathered per score in every tile
            index = tl.minimum(tl.maximum(r + bias_base, 0), bias_length - 1)
            s += tl.load(bias_row + index * bias_stride).to(tl.float32) * log2e
        masked = edge
        if BAND:
            masked = masked | (r_min < r_lo) | (r_max > r_hi)
        if masked:  # only tiles on an edge or across the band's ends pay for the mask
            keep = inside
            if BAND:
                keep = keep & (r >= r_lo) & (r <= r_hi)
            s = tl.where(keep, s, float("-inf"))
        return s

    @triton.jit
    def diagonal_sums_into(
        grad_s,  # [BLOCK_M, BLOCK_N] float32: dL/d(logit) of one tile
        grad_row,  # this head's row of the vector's gradient (float32)
        stride,
        length,
        first,  # the vector index of the tile's main diagonal (unclamped)
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Adds each diagonal's sum of grad_s into grad_row[clamp(first + j - i)].

        Row i is rotated left by i (a gather), so column c holds the scores with
        j - i = c - w * BLOCK_N, w = (c + i) // BLOCK_N: summing the columns of each w
        gives BLOCK_N diagonals at once, added with one vector atomic per w (diagonals
        past an end of the vector share its clamped entry)."""
        rows = tl.arange(0, BLOCK_M)[:, None]
        cols = tl.arange(0, BLOCK_N)
        turned = cols[None, :] + rows  # [BLOCK_M, BLOCK_N]
        skewed = tl.gather(grad_s, turned % BLOCK_N, 1)  # skewed[i, c] = grad_s[i, (c + i) % BN]
        for w in tl.static_range((BLOCK_M + BLOCK_N - 2) // BLOCK_N + 1):
            part = tl.where(turned // BLOCK_N == w, skewed, 0.0)
            sums = tl.reduce(part, 0, _distance_plus)  # [BLOCK_N]: j - i = c - w BLOCK_N
            index = tl.minimum(tl.maximum(first + cols - w * BLOCK_N, 0), length - 1)
            tl.atomic_add(grad_row + index * stride, sums)

    @triton.jit
    def relative_tile(
        s,  # [BLOCK_M, BLOCK_N] float32 logits in base-2 units, or transposed
        row_at,  # this (batch, head)'s projection: entry (x, k) at x * stride_x + k * stride_k
        stride_x,
        stride_k,
        diagonal,  # int32 [N + M - 1]: the row k of each j - i + N - 1 (where DIAGONAL)
        below,  # diagonal[d] == diagonal[0] for every d <= below
        above,  # diagonal[d] == diagonal[N + M - 2] for every d >= above
        start_m,
        start_n,
        n,
        m,
        DIAGONAL: tl.constexpr,  # False: every score reads row 0 (one value per x)
        KEY_SIDE: tl.constexpr,  # x is the key index j (else the query index i)
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        KEYS_FIRST: tl.constexpr,  # s is [BLOCK_N, BLOCK_M] (the key-tile backward)
    ):
        """s plus one relative term of the tile (the projection of query i, or key j, onto
        the table row of j - i), in base-2 units; nothing outside the N x M scores. A tile
        whose diagonals all lie past one of the diagonal's constant ends (beyond a clip)
        reads one value per query or key instead of a gather per score."""
        log2e: tl.constexpr = 1.4426950408889634
        if KEYS_FIRST:
            queries = (start_m + tl.arange(0, BLOCK_M))[None, :]
            keys = (start_n + tl.arange(0, BLOCK_N))[:, None]
        else:
            queries = (start_m + tl.arange(0, BLOCK_M))[:, None]
            keys = (start_n + tl.arange(0, BLOCK_N))[None, :]
        if KEY_SIDE:
            x = keys.to(tl.int64)
            x_inside = keys < m
        else:
            x = queries.to(tl.int64)
            x_inside = queries < n
        if not DIAGONAL:
            term = tl.load(row_at + x * stride_x, mask=x_inside, other=0.0)
            s = s + log2e * term.to(tl.float32)
        else:
            one_row, row = _distance_tile_row(
                diagonal, below, above, start_m, start_n, n, m, BLOCK_M, BLOCK_N
            )
            if one_row:
                term = tl.load(row_at + x * stride_x + row * stride_k, mask=x_inside, other=0.0)
                s = s + log2e * term.to(tl.float32)
            else:
                inside = (queries < n) & (keys < m)
                index = tl.load(diagonal + (keys - queries + n - 1), mask=inside, other=0)
                at = row_at + x * stride_x + index.to(tl.int64) * stride_k  # the tile's shape
                s = s + log2e * tl.load(at, mask=inside, other=0.0).to(tl.float32)
        return s

    @triton.jit
    def tile_row(
        diagonal, below, above, start_m, start_n, n, m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
    ):
        """(whether every score of the tile reads one row, that row as int64): true where
        the tile's diagonals all lie at or before ``below`` (the diagonal's first row) or
        at or after ``above`` (its last), beyond a clip."""
        first = start_n - (start_m + BLOCK_M - 1) + n - 1  # the tile's least j - i + N - 1
        last = start_n + BLOCK_N - 1 - start_m + n - 1  # and its greatest
        past_above = first >= above
        end = tl.where(past_above, n + m - 2, 0)  # the diagonal's entry at that end
        return (last <= below) | past_above, tl.load(diagonal + end).to(tl.int64)

    @triton.jit
    def relative_logits(
        s,
        query_at,
        query_stride_x,
        query_stride_k,
        query_diagonal,
        query_below,
        query_above,
        key_at,
        key_stride_x,
        key_stride_k,
        key_diagonal,
        key_below,
        key_above,
        start_m,
        start_n,
        n,
        m,
        QUERY_ROWS: tl.constexpr,  # 0 none, 1 the row of each diagonal, 2 row 0 (per query)
        KEY_ROWS: tl.constexpr,  # the same for the key-side term (2: one value per key)
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        KEYS_FIRST: tl.constexpr,
    ):
        """s plus the tile's query-side and key-side relative terms (``relative_tile``)."""
        if QUERY_ROWS > 0:
            s = _distance_relative_tile(
                s,
                query_at,
                query_stride_x,
                query_stride_k,
                query_diagonal,
                query_below,
                query_above,
                start_m,
                start_n,
                n,
                m,
                QUERY_ROWS == 1,
                False,
                BLOCK_M,
                BLOCK_N,
                KEYS_FIRST,
            )
        if KEY_ROWS > 0:
            s = _distance_relative_tile(
                s,
                key_at,
                key_stride_x,
                key_stride_k,
                key_diagonal,
                key_below,
                key_above,
                start_m,
                start_n,
                n,
                m,
                KEY_ROWS == 1,
                True,
                BLOCK_M,
                BLOCK_N,
                KEYS_FIRST,
            )
        return s

    @triton.jit
    def relative_grad_into(
        grad_s,  # float32 dL/d(logit), 0 where masked: [BLOCK_M, BLOCK_N] for a query-side
        # term, [BLOCK_N, BLOCK_M] (keys first) for a key-side one: its x along axis 0
        grad_at,  # this (batch, head)'s gradient of the projection (float32)
        stride_x,
        stride_k,
        diagonal,
        below,
        above,
        start_m,
        start_n,
        n,
        m,
        DIAGONAL: tl.constexpr,
        KEY_SIDE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Adds each score's gradient into the entry of the projection that
        ``relative_tile`` read for it (float32 atomics). A tile that reads one row per x
        (no diagonal, or wholly past one of its ends) adds one sum per x."""
        if KEY_SIDE:
            queries = (start_m + tl.arange(0, BLOCK_M))[None, :]
            keys = (start_n + tl.arange(0, BLOCK_N))[:, None]
            x_line = start_n + tl.arange(0, BLOCK_N)  # the x of each row of grad_s
            x_limit = m
        else:
            queries = (start_m + tl.arange(0, BLOCK_M))[:, None]
            keys = (start_n + tl.arange(0, BLOCK_N))[None, :]
            x_line = start_m + tl.arange(0, BLOCK_M)
            x_limit = n
        line_at = grad_at + x_line.to(tl.int64) * stride_x
        line_inside = x_line < x_limit
        if not DIAGONAL:
            tl.atomic_add(line_at, tl.reduce(grad_s, 1, _distance_plus), mask=line_inside)
        else:
            one_row, row = _distance_tile_row(
                diagonal, below, above, start_m, start_n, n, m, BLOCK_M, BLOCK_N
            )
            if one_row:
                sums = tl.reduce(grad_s, 1, _distance_plus)
                tl.atomic_add(line_at + row * stride_k, sums, mask=line_inside)
            else:
                inside = (queries < n) & (keys < m)
                index = tl.load(diagonal + (keys - queries + n - 1), mask=inside, other=0)
                x = x_line.to(tl.int64)[:, None]
                at = grad_at + x * stride_x + index.to(tl.int64) * stride_k
                tl.atomic_add(at, grad_s, mask=inside)

    @triton.jit
    def larger(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def plus(a, b):
        return a + b

    _distance_tile_logits, _distance_larger, _distance_plus = tile_logits, larger, plus
    _distance_diagonal_sums_into = diagonal_sums_into
    _distance_relative_tile = relative_tile
    _distance_tile_row = tile_row
    _distance_relative_logits = relative_logits
    _distance_relative_grad_into = relative_grad_into

    @triton.jit
    def forward(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        lse_ptr,
        bias_ptr,
        n,
        m,
        heads,
        groups,
        stride_qb,
        stride_qh,
        stride_qn,
        stride_qd,
        stride_kb,
        stride_kh,
        stride_kn,
        stride_kd,
        stride_vb,
        stride_vh,
        stride_vn,
        stride_vd,
        stride_ob,
        stride_oh,
        stride_on,
        stride_od,
        bias_stride_h,
        bias_stride,
        bias_length,
        bias_base,
        r_lo,
        r_hi,
        qk_scale,  # the logit scale times log2(e)
        query_rows_ptr,  # relative term of query i: [B, H, N, K] (any strides)
        query_rows_stride_b,
        query_rows_stride_h,
        query_rows_stride_x,
        query_rows_stride_k,
        query_diagonal_ptr,
        query_below,
        query_above,
        key_rows_ptr,  # relative term of key j: [B, H, M, K]
        key_rows_stride_b,
        key_rows_stride_h,
        key_rows_stride_x,
        key_rows_stride_k,
        key_diagonal_ptr,
        key_below,
        key_above,
        HEAD_DIM: tl.constexpr,
        VALUE_DIM: tl.constexpr,
        BIAS: tl.constexpr,
        BAND: tl.constexpr,
        IEEE: tl.constexpr,  # float32 inputs: exact products, not TF32
        QUERY_ROWS: tl.constexpr,  # 0 none, 1 the row of each diagonal, 2 row 0 (per query)
        KEY_ROWS: tl.constexpr,  # the same for the key-side term (2: one value per key)
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        start_m = tl.program_id(0) * BLOCK_M
        batch_head = tl.program_id(1)
        batch = (batch_head // heads).to(tl.int64)
        head = (batch_head % heads).to(tl.int64)
        kv_head = head // groups
        shift = m - n  # query i sits at position i + M - N
        rows = start_m + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        dims = tl.arange(0, HEAD_DIM)
        value_dims = tl.arange(0, VALUE_DIM)
        q_at = q_ptr + batch * stride_qb + head * stride_qh
        q = tl.load(
            q_at + rows[:, None] * stride_qn + dims[None, :] * stride_qd,
            mask=rows[:, None] < n,
            other=0.0,
        )  # [BLOCK_M, HEAD_DIM]
        k_at = k_ptr + batch * stride_kb + kv_head * stride_kh
        v_at = v_ptr + batch * stride_vb + kv_head * stride_vh
        bias_row = bias_ptr + head * bias_stride_h
        query_rows_at = query_rows_ptr + batch * query_rows_stride_b + head * query_rows_stride_h
        key_rows_at = key_rows_ptr + batch * key_rows_stride_b + head * key_rows_stride_h
        row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        row_sum = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, VALUE_DIM], 0.0, tl.float32)
        # the keys some query of the tile may read: r_lo <= j - i - shift <= r_hi
        lo = tl.maximum(start_m + shift + r_lo, 0) // BLOCK_N * BLOCK_N
        hi = tl.minimum(start_m + BLOCK_M + shift + r_hi, m)
        for start_n in range(lo, hi, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N]
            k_t = tl.load(
                k_at + cols[None, :] * stride_kn + dims[:, None] * stride_kd,
                mask=cols[None, :] < m,
                other=0.0,
            )  # [HEAD_DIM, BLOCK_N]
            if IEEE:
                s = tl.dot(q, k_t, input_precision="ieee")
            else:
                s = tl.dot(q, k_t)
            s = s * qk_scale
            s = _distance_relative_logits(
                s,
                query_rows_at,
                query_rows_stride_x,
                query_rows_stride_k,
                query_diagonal_ptr,
                query_below,
                query_above,
                key_rows_at,
                key_rows_stride_x,
                key_rows_stride_k,
                key_diagonal_ptr,
                key_below,
                key_above,
                start_m,
                start_n,
                n,
                m,
                QUERY_ROWS,
                KEY_ROWS,
                BLOCK_M,
                BLOCK_N,
                False,
            )
            s = _distance_tile_logits(
                s,
                start_m,
                start_n,
                n,
                m,
                bias_row,
                bias_stride,
                bias_length,
                bias_base,
                r_lo,
                r_hi,
                BIAS,
                BAND,
                BLOCK_M,
                BLOCK_N,
                False,
            )  # [BLOCK_M, BLOCK_N]
            new_max = tl.maximum(row_max, tl.reduce(s, 1, _distance_larger))
            shift_by = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows masked so far
            rescale = tl.math.exp2(row_max - shift_by)
            p = tl.math.exp2(s - shift_by[:, None])
            row_sum = row_sum * rescale + tl.reduce(p, 1, _distance_plus)
            v = tl.load(
                v_at + cols[:, None] * stride_vn + value_dims[None, :] * stride_vd,
                mask=cols[:, None] < m,
                other=0.0,
            )  # [BLOCK_N, VALUE_DIM]
            if IEEE:
                acc = acc * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
            row_max = new_max
        total = tl.where(row_sum > 0, row_sum, 1.0)  # a row with no key: zeros, lse -inf
        out_at = out_ptr + batch * stride_ob + head * stride_oh
        tl.store(
            out_at + rows[:, None] * stride_on + value_dims[None, :] * stride_od,
            (acc / total[:, None]).to(out_ptr.dtype.element_ty),
            mask=rows[:, None] < n,
        )
        lse = (row_max + tl.math.log2(total)) * 0.6931471805599453  # natural log
        tl.store(lse_ptr + batch_head.to(tl.int64) * n + rows, lse, mask=rows < n)

    @triton.jit
    def key_grad(
        q_ptr,
        k_ptr,
        v_ptr,
        grad_out_ptr,
        lse_ptr,
        delta_ptr,
        grad_k_ptr,
        grad_v_ptr,
        bias_ptr,
        n,
        m,
        heads,
        kv_heads,
        groups,
        stride_dkb,
        stride_dkh,
        stride_dkn,
        stride_dkd,
        stride_dvb,
        stride_dvh,
        stride_dvn,
        stride_dvd,
        stride_qb,
        stride_qh,
        stride_qn,
        stride_qd,
        stride_kb,
        stride_kh,
        stride_kn,
        stride_kd,
        stride_vb,
        stride_vh,
        stride_vn,
        stride_vd,
        stride_gb,
        stride_gh,
        stride_gn,
        stride_gd,
        bias_stride_h,
        bias_stride,
        bias_length,
        bias_base,
        r_lo,
        r_hi,
        qk_scale,
        scale,
        query_rows_ptr,  # relative terms, as in the forward
        query_rows_stride_b,
        query_rows_stride_h,
        query_rows_stride_x,
        query_rows_stride_k,
        query_diagonal_ptr,
        query_below,
        query_above,
        key_rows_ptr,
        key_rows_stride_b,
        key_rows_stride_h,
        key_rows_stride_x,
        key_rows_stride_k,
        key_diagonal_ptr,
        key_below,
        key_above,
        grad_rows_ptr,  # float32 gradient of this kernel's term: the key-side term's [B, H, M, K]
        grad_rows_stride_b,
        grad_rows_stride_h,
        grad_rows_stride_x,
        grad_rows_stride_k,
        HEAD_DIM: tl.constexpr,
        VALUE_DIM: tl.constexpr,
        BIAS: tl.constexpr,
        BAND: tl.constexpr,
        IEEE: tl.constexpr,
        QUERY_ROWS: tl.constexpr,
        KEY_ROWS: tl.constexpr,
        ROWS_GRAD: tl.constexpr,  # add dL/d(key-side term) into grad_rows_ptr
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        log2e: tl.constexpr = 1.4426950408889634
        start_n = tl.program_id(0) * BLOCK_N
        batch_kv_head = tl.program_id(1)
        batch = batch_kv_head // kv_heads
        kv_head = (batch_kv_head % kv_heads).to(tl.int64)
        shift = m - n
        cols = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] keys
        dims = tl.arange(0, HEAD_DIM)
        value_dims = tl.arange(0, VALUE_DIM)
        key_rows = cols[:, None] < m
        k_at = k_ptr + batch.to(tl.int64) * stride_kb + kv_head * stride_kh
        v_at = v_ptr + batch.to(tl.int64) * stride_vb + kv_head * stride_vh
        k = tl.load(
            k_at + cols[:, None] * stride_kn + dims[None, :] * stride_kd, mask=key_rows, other=0.0
        )  # [BLOCK_N, HEAD_DIM]
        v = tl.load(
            v_at + cols[:, None] * stride_vn + value_dims[None, :] * stride_vd,
            mask=key_rows,
            other=0.0,
        )  # [BLOCK_N, VALUE_DIM]
        grad_k = tl.full([BLOCK_N, HEAD_DIM], 0.0, tl.float32)
        grad_v = tl.full([BLOCK_N, VALUE_DIM], 0.0, tl.float32)
        # the queries that may read some key of the tile: r_lo <= j - i - shift <= r_hi
        lo = tl.maximum(start_n - shift - r_hi, 0) // BLOCK_M * BLOCK_M
        hi = tl.minimum(start_n + BLOCK_N - shift - r_lo, n)
        for group in range(0, groups):  # the query heads this key head serves
            head = kv_head * groups + group
            batch_head = batch.to(tl.int64) * heads + head
            q_at = q_ptr + batch.to(tl.int64) * stride_qb + head * stride_qh
            g_at = grad_out_ptr + batch.to(tl.int64) * stride_gb + head * stride_gh
            bias_row = bias_ptr + head * bias_stride_h
            wide_batch = batch.to(tl.int64)
            query_rows_at = (
                query_rows_ptr + wide_batch * query_rows_stride_b + head * query_rows_stride_h
            )
            key_rows_at = key_rows_ptr + wide_batch * key_rows_stride_b + head * key_rows_stride_h
            grad_rows_at = (
                grad_rows_ptr + wide_batch * grad_rows_stride_b + head * grad_rows_stride_h
            )
            for start_m in range(lo, hi, BLOCK_M):
                rows = start_m + tl.arange(0, BLOCK_M)  # [BLOCK_M] queries
                q_t = tl.load(
                    q_at + rows[None, :] * stride_qn + dims[:, None] * stride_qd,
                    mask=rows[None, :] < n,
                    other=0.0,
                )  # [HEAD_DIM, BLOCK_M]
                if IEEE:
                    s_t = tl.dot(k, q_t, input_precision="ieee")
                else:
                    s_t = tl.dot(k, q_t)
                s_t = s_t * qk_scale
                s_t = _distance_relative_logits(
                    s_t,
                    query_rows_at,
                    query_rows_stride_x,
                    query_rows_stride_k,
                    query_diagonal_ptr,
                    query_below,
                    query_above,
                    key_rows_at,
                    key_rows_stride_x,
                    key_rows_stride_k,
                    key_diagonal_ptr,
                    key_below,
                    key_above,
                    start_m,
                    start_n,
                    n,
                    m,
                    QUERY_ROWS,
                    KEY_ROWS,
                    BLOCK_M,
                    BLOCK_N,
                    True,
                )
                s_t = _distance_tile_logits(
                    s_t,
                    start_m,
                    start_n,
                    n,
                    m,
                    bias_row,
                    bias_stride,
                    bias_length,
                    bias_base,
                    r_lo,
                    r_hi,
                    BIAS,
                    BAND,
                    BLOCK_M,
                    BLOCK_N,
                    True,
                )  # [BLOCK_N, BLOCK_M]
                lse = tl.load(lse_ptr + batch_head * n + rows, mask=rows < n, other=0.0)
                p_t = tl.math.exp2(s_t - lse[None, :] * log2e)  # P transposed
                grad_out = tl.load(
                    g_at + rows[:, None] * stride_gn + value_dims[None, :] * stride_gd,
                    mask=rows[:, None] < n,
                    other=0.0,
                )  # [BLOCK_M, VALUE_DIM]
                delta = tl.load(delta_ptr + batch_head * n + rows, mask=rows < n, other=0.0)
                if IEEE:
                    grad_v += tl.dot(p_t, grad_out, input_precision="ieee")
                    grad_p_t = tl.dot(v, tl.trans(grad_out), input_precision="ieee")
                    grad_s_t = p_t * (grad_p_t - delta[None, :])  # [BLOCK_N, BLOCK_M]
                    grad_k += tl.dot(grad_s_t, tl.trans(q_t), input_precision="ieee")
                else:
                    grad_v += tl.dot(p_t.to(grad_out.dtype), grad_out)
                    grad_p_t = tl.dot(v, tl.trans(grad_out))
                    grad_s_t = p_t * (grad_p_t - delta[None, :])
                    grad_k += tl.dot(grad_s_t.to(q_t.dtype), tl.trans(q_t))
                if ROWS_GRAD:
                    _distance_relative_grad_into(
                        grad_s_t,
                        grad_rows_at,
                        grad_rows_stride_x,
                        grad_rows_stride_k,
                        key_diagonal_ptr,
                        key_below,
                        key_above,
                        start_m,
                        start_n,
                        n,
                        m,
                        KEY_ROWS == 1,
                        True,
                        BLOCK_M,
                        BLOCK_N,
                    )
        out_k = grad_k_ptr + batch.to(tl.int64) * stride_dkb + kv_head * stride_dkh
        out_v = grad_v_ptr + batch.to(tl.int64) * stride_dvb + kv_head * stride_dvh
        tl.store(
            out_k + cols[:, None] * stride_dkn + dims[None, :] * stride_dkd,
            (grad_k * scale).to(grad_k_ptr.dtype.element_ty),
            mask=key_rows,
        )
        tl.store(
            out_v + cols[:, None] * stride_dvn + value_dims[None, :] * stride_dvd,
            grad_v.to(grad_v_ptr.dtype.element_ty),
            mask=key_rows,
        )

    @triton.jit
    def query_grad(
        q_ptr,
        k_ptr,
        v_ptr,
        grad_out_ptr,
        lse_ptr,
        delta_ptr,
        grad_q_ptr,
        bias_ptr,
        grad_bias_ptr,
        n,
        m,
        heads,
        groups,
        stride_dqb,
        stride_dqh,
        stride_dqn,
        stride_dqd,
        stride_qb,
        stride_qh,
        stride_qn,
        stride_qd,
        stride_kb,
        stride_kh,
        stride_kn,
        stride_kd,
        stride_vb,
        stride_vh,
        stride_vn,
        stride_vd,
        stride_gb,
        stride_gh,
        stride_gn,
        stride_gd,
        bias_stride_h,
        bias_stride,
        bias_length,
        bias_base,
        r_lo,
        r_hi,
        qk_scale,
        scale,
        query_rows_ptr,  # relative terms, as in the forward
        query_rows_stride_b,
        query_rows_stride_h,
        query_rows_stride_x,
        query_rows_stride_k,
        query_diagonal_ptr,
        query_below,
        query_above,
        key_rows_ptr,
        key_rows_stride_b,
        key_rows_stride_h,
        key_rows_stride_x,
        key_rows_stride_k,
        key_diagonal_ptr,
        key_below,
        key_above,
        grad_rows_ptr,  # float32 gradient of this kernel's term: the query-side term's [B, H, N, K]
        grad_rows_stride_b,
        grad_rows_stride_h,
        grad_rows_stride_x,
        grad_rows_stride_k,
        HEAD_DIM: tl.constexpr,
        VALUE_DIM: tl.constexpr,
        BIAS: tl.constexpr,
        BAND: tl.constexpr,
        BIAS_GRAD: tl.constexpr,  # add dL/d(bias) into grad_bias_ptr (float32, as bias)
        IEEE: tl.constexpr,
        QUERY_ROWS: tl.constexpr,
        KEY_ROWS: tl.constexpr,
        ROWS_GRAD: tl.constexpr,  # add dL/d(query-side term) into grad_rows_ptr
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        log2e: tl.constexpr = 1.4426950408889634
        start_m = tl.program_id(0) * BLOCK_M
        batch_head = tl.program_id(1).to(tl.int64)
        batch = batch_head // heads
        head = batch_head % heads
        kv_head = head // groups
        shift = m - n
        rows = start_m + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        dims = tl.arange(0, HEAD_DIM)
        value_dims = tl.arange(0, VALUE_DIM)
        query_rows = rows[:, None] < n
        q_at = q_ptr + batch * stride_qb + head * stride_qh
        q = tl.load(
            q_at + rows[:, None] * stride_qn + dims[None, :] * stride_qd, mask=query_rows, other=0.0
        )  # [BLOCK_M, HEAD_DIM]
        g_at = grad_out_ptr + batch * stride_gb + head * stride_gh
        grad_out = tl.load(
            g_at + rows[:, None] * stride_gn + value_dims[None, :] * stride_gd,
            mask=query_rows,
            other=0.0,
        )  # [BLOCK_M, VALUE_DIM]
        lse = tl.load(lse_ptr + batch_head * n + rows, mask=rows < n, other=0.0) * log2e
        delta = tl.load(delta_ptr + batch_head * n + rows, mask=rows < n, other=0.0)
        k_at = k_ptr + batch * stride_kb + kv_head * stride_kh
        v_at = v_ptr + batch * stride_vb + kv_head * stride_vh
        bias_row = bias_ptr + head * bias_stride_h
        grad_bias_row = grad_bias_ptr + head * bias_stride_h
        query_rows_at = query_rows_ptr + batch * query_rows_stride_b + head * query_rows_stride_h
        key_rows_at = key_rows_ptr + batch * key_rows_stride_b + head * key_rows_stride_h
        grad_rows_at = grad_rows_ptr + batch * grad_rows_stride_b + head * grad_rows_stride_h
        grad_q = tl.full([BLOCK_M, HEAD_DIM], 0.0, tl.float32)
        # dL/d(bias) of the scores whose distance is clamped to the vector's first and
        # last entry (or, for a slope, sum dS |r|), added once at the end
        grad_first = tl.full([BLOCK_M], 0.0, tl.float32)  # per query row
        grad_last = tl.full([BLOCK_M], 0.0, tl.float32)
        lo = tl.maximum(start_m + shift + r_lo, 0) // BLOCK_N * BLOCK_N
        hi = tl.minimum(start_m + BLOCK_M + shift + r_hi, m)
        for start_n in range(lo, hi, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            k_t = tl.load(
                k_at + cols[None, :] * stride_kn + dims[:, None] * stride_kd,
                mask=cols[None, :] < m,
                other=0.0,
            )  # [HEAD_DIM, BLOCK_N]
            v_t = tl.load(
                v_at + cols[None, :] * stride_vn + value_dims[:, None] * stride_vd,
                mask=cols[None, :] < m,
                other=0.0,
            )  # [VALUE_DIM, BLOCK_N]
            if IEEE:
                s = tl.dot(q, k_t, input_precision="ieee")
            else:
                s = tl.dot(q, k_t)
            s = s * qk_scale
            s = _distance_relative_logits(
                s,
                query_rows_at,
                query_rows_stride_x,
                query_rows_stride_k,
                query_diagonal_ptr,
                query_below,
                query_above,
                key_rows_at,
                key_rows_stride_x,
                key_rows_stride_k,
                key_diagonal_ptr,
                key_below,
                key_above,
                start_m,
                start_n,
                n,
                m,
                QUERY_ROWS,
                KEY_ROWS,
                BLOCK_M,
                BLOCK_N,
                False,
            )
            s = _distance_tile_logits(
                s,
                start_m,
                start_n,
                n,
                m,
                bias_row,
                bias_stride,
                bias_length,
                bias_base,
                r_lo,
                r_hi,
                BIAS,
                BAND,
                BLOCK_M,
                BLOCK_N,
                False,
            )  # [BLOCK_M, BLOCK_N]
            p = tl.math.exp2(s - lse[:, None])
            if IEEE:
                grad_p = tl.dot(grad_out, v_t, input_precision="ieee")
                grad_s = p * (grad_p - delta[:, None])
                grad_q += tl.dot(grad_s, tl.trans(k_t), input_precision="ieee")
            else:
                grad_p = tl.dot(grad_out, v_t)
                grad_s = p * (grad_p - delta[:, None])
                grad_q += tl.dot(grad_s.to(k_t.dtype), tl.trans(k_t))
            if ROWS_GRAD:
                _distance_relative_grad_into(
                    grad_s,
                    grad_rows_at,
                    grad_rows_stride_x,
                    grad_rows_stride_k,
                    query_diagonal_ptr,
                    query_below,
                    query_above,
                    start_m,
                    start_n,
                    n,
                    m,
                    QUERY_ROWS == 1,
                    False,
                    BLOCK_M,
                    BLOCK_N,
                )
            if BIAS_GRAD:  # grad_s is dL/d(logit), 0 wherever the tile is masked
                r_first = start_n - start_m - shift  # r on the tile's main diagonal
                if BIAS == 1:  # d(c_h |r|) / d c_h = |r|
                    r = r_first + tl.arange(0, BLOCK_N)[None, :] - tl.arange(0, BLOCK_M)[:, None]
                    weighted = grad_s * tl.abs(r).to(tl.float32)
                    grad_first += tl.reduce(weighted, 1, _distance_plus)
                elif r_first + BLOCK_N - 1 + bias_base <= 0:  # every score reads entry 0
                    grad_first += tl.reduce(grad_s, 1, _distance_plus)
                elif r_first - (BLOCK_M - 1) + bias_base >= bias_length - 1:  # the last entry
                    grad_last += tl.reduce(grad_s, 1, _distance_plus)
                else:
                    _distance_diagonal_sums_into(
                        grad_s,
                        grad_bias_row,
                        bias_stride,
                        bias_length,
                        r_first + bias_base,
                        BLOCK_M,
                        BLOCK_N,
                    )
        out_q = grad_q_ptr + batch * stride_dqb + head * stride_dqh
        tl.store(
            out_q + rows[:, None] * stride_dqn + dims[None, :] * stride_dqd,
            (grad_q * scale).to(grad_q_ptr.dtype.element_ty),
            mask=query_rows,
        )
        if BIAS_GRAD:
            tl.atomic_add(grad_bias_row, tl.reduce(grad_first, 0, _distance_plus))
            if BIAS != 1:
                last = grad_bias_row + (bias_length - 1) * bias_stride
                tl.atomic_add(last, tl.reduce(grad_last, 0, _distance_plus))

    @triton.jit
    def row_dots(
        out_ptr,
        grad_out_ptr,
        delta_ptr,
        n,
        heads,
        stride_ob,
        stride_oh,
        stride_on,
        stride_od,
        stride_gb,
        stride_gh,
        stride_gn,
        stride_gd,
        VALUE_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        # δ_i = dO_i · O_i in float32, for one tile of rows of one batch and head
        start_m = tl.program_id(0) * BLOCK_M
        batch_head = tl.program_id(1).to(tl.int64)
        batch = batch_head // heads
        head = batch_head % heads
        rows = start_m + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        value_dims = tl.arange(0, VALUE_DIM)
        inside = rows[:, None] < n
        out = tl.load(
            out_ptr
            + batch * stride_ob
            + head * stride_oh
            + rows[:, None] * stride_on
            + value_dims[None, :] * stride_od,
            mask=inside,
            other=0.0,
        ).to(tl.float32)  # [BLOCK_M, VALUE_DIM]
        grad_out = tl.load(
            grad_out_ptr
            + batch * stride_gb
            + head * stride_gh
            + rows[:, None] * stride_gn
            + value_dims[None, :] * stride_gd,
            mask=inside,
            other=0.0,
        ).to(tl.float32)  # [BLOCK_M, VALUE_DIM]
        delta = tl.reduce(out * grad_out, 1, _distance_plus)  # [BLOCK_M]
        tl.store(delta_ptr + batch_head * n + rows, delta, mask=rows < n)

    kernels = {
        "forward": forward,
        "key_grad": key_grad,
        "query_grad": query_grad,
        "row_dots": row_dots,
    }
    TRITON_CACHE["attention"] = kernels
    return dict(kernels)


def _tuned_distance_kernel(name: str) -> Any:
    """The kernel ``name`` wrapped in Triton's autotuner (CUDA), made once per process."""
    key = f"attention_tuned:{name}"
    if key not in TRITON_CACHE:
        import triton

        kernel = _distance_attention_kernels()[name]
        tuning_key = ["n", "m", "HEAD_DIM", "VALUE_DIM", "BIAS", "BAND", "IEEE"]
        tuning_key += ["QUERY_ROWS", "KEY_ROWS"]
        reset: list[str] = []
        if name == "query_grad":  # it adds the bias's gradient: zeroed before each trial
            tuning_key.append("BIAS_GRAD")
            reset.append("grad_bias_ptr")
        if name in ("query_grad", "key_grad"):  # and each adds a relative term's
            tuning_key.append("ROWS_GRAD")
            reset.append("grad_rows_ptr")
        configs = _distance_attention_configs(name)
        tune = triton.autotune(configs, key=tuning_key, reset_to_zero=reset or None)
        TRITON_CACHE[key] = tune(kernel)
    return TRITON_CACHE[key]


def _launch_distance_kernel(
    name: str, tiled: int, block: str, programs: int, device: torch.device, *args: Any, **meta: Any
) -> None:
    """Launch kernel ``name`` over ``tiled`` rows in tiles of ``block`` ("BLOCK_M" or
    "BLOCK_N") times ``programs``: autotuned on CUDA, FUSED_DISTANCE_BLOCKS elsewhere."""
    if device.type == "cuda":
        kernel = _tuned_distance_kernel(name)
        kernel[lambda tile: ((tiled + tile[block] - 1) // tile[block], programs)](*args, **meta)
        return
    block_m, block_n = FUSED_DISTANCE_BLOCKS
    size = block_m if block == "BLOCK_M" else block_n
    grid = ((tiled + size - 1) // size, programs)
    _distance_attention_kernels()[name][grid](*args, BLOCK_M=block_m, BLOCK_N=block_n, **meta)


def _distance_bias_arguments(
    q: Tensor,
    bias: Tensor | None,
    kind: str,
    base: int,
    n: int,
    m: int,
    causal: bool,
    window: int | None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The kernels' bias and band arguments: (bias tensor, its head and entry strides,
    length, base, r_lo, r_hi) and the constexprs BIAS (0 none, 1 slope, 2 a clipped
    vector with one value per tile wholly past its clip, 3 a vector gathered per score;
    FUSED_DISTANCE_CONSTANT_TILES) and BAND. Keys pass where
    r_lo <= j - i - (M - N) <= r_hi: a causal mask caps r at 0, a window keeps |r| <
    window; without either the band spans every pair."""
    r_lo, r_hi = -m, n
    if window is not None:
        r_lo, r_hi = -(window - 1), window - 1
    if causal:
        r_hi = 0
    code = DISTANCE_BIAS_KINDS.index(kind)
    if bias is None:
        values = (q, 0, 0, 1, 0)  # never read (BIAS = 0)
    else:
        stride_h = bias.stride(0) if bias.dim() == 2 else bias.stride(-1)
        length = bias.shape[-1] if bias.dim() == 2 else 1
        values = (bias, stride_h, bias.stride(-1), length, base)
        clipped = length < n + m - 1  # some tile may lie wholly past an end
        if kind == "vector" and not (clipped and FUSED_DISTANCE_CONSTANT_TILES):
            code = 3  # a gather per score in every tile, without the tile's tests
    meta = {"BIAS": code, "BAND": causal or window is not None}
    return (*values, r_lo, r_hi), meta


class RelativeRows(NamedTuple):
    """A relative term as the kernels read it: ``scores`` [B, H, X, K] float32 (any
    strides, broadcast dimensions as stride 0), X the queries (N) for a query-side term
    or the keys (M) for a key-side one; the score of query i and key j reads row
    ``diagonal[j - i + N - 1]`` (int32 [N + M - 1]) of its x, or row 0 where
    ``diagonal`` is None (one value per query or per key).

    ``below`` and ``above`` (None: N + M - 2) are indices of the diagonal up to which,
    and from which on, it holds its first and last row (a clip): a tile wholly past
    them reads one value per query or key. They must hold; the defaults always do."""

    scores: Tensor
    diagonal: Tensor | None
    below: int = 0
    above: int | None = None


def _relative_rows_arguments(q: Tensor, rows: RelativeRows | None) -> tuple[tuple[Any, ...], int]:
    """The forward kernel's arguments of one relative term (pointer, strides of batch,
    head, x and row, diagonal, its constant ends) and its QUERY_ROWS / KEY_ROWS code: 0
    none (the pointers are never read), 1 a row per diagonal, 2 row 0."""
    if rows is None:
        return (q, 0, 0, 0, 0, q, 0, 0), 0
    scores, diagonal, below, above = rows
    if diagonal is None:
        return (scores, *scores.stride(), scores, 0, 0), 2
    ends = (below, diagonal.shape[0] - 1 if above is None else above)
    return (scores, *scores.stride(), diagonal, *ends), 1


def distance_attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    kind: str,
    base: int,
    scale: float,
    causal: bool,
    window: int | None,
    query_rows: RelativeRows | None = None,
    key_rows: RelativeRows | None = None,
) -> tuple[Tensor, Tensor]:
    """One forward launch: out [B, H, N, value_dim] in q's dtype, lse [B, H, N] float32;
    ``query_rows`` and ``key_rows`` add relative terms to the logits."""
    batch, heads, n, head_dim = q.shape
    m, value_dim = k.shape[2], v.shape[-1]
    out = q.new_empty((batch, heads, n, value_dim))
    lse = torch.empty((batch, heads, n), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse.fill_(float("-inf"))
    bias_args, meta = _distance_bias_arguments(q, bias, kind, base, n, m, causal, window)
    query_args, query_code = _relative_rows_arguments(q, query_rows)
    key_args, key_code = _relative_rows_arguments(q, key_rows)
    _launch_distance_kernel(
        "forward",
        n,
        "BLOCK_M",
        batch * heads,
        q.device,
        q,
        k,
        v,
        out,
        lse,
        *bias_args[:1],
        n,
        m,
        heads,
        heads // k.shape[1],
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *out.stride(),
        *bias_args[1:],
        scale * math.log2(math.e),
        *query_args,
        *key_args,
        HEAD_DIM=head_dim,
        VALUE_DIM=value_dim,
        IEEE=q.dtype == torch.float32,
        QUERY_ROWS=query_code,
        KEY_ROWS=key_code,
        **meta,
    )
    return out, lse


def _distance_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    kind: str,
    base: int,
    scale: float,
    causal: bool,
    window: int | None,
    bias_grad: bool = False,
    query_rows: RelativeRows | None = None,
    key_rows: RelativeRows | None = None,
    rows_grad: tuple[bool, bool] = (False, False),
) -> tuple[Tensor | None, ...]:
    """The gradients into q, k and v (in their dtypes) from two launches, given the
    forward's out and lse and the gradient into out; with ``bias_grad`` also the
    gradient into the bias (float32, bias's shape; contiguous bias), which the dQ kernel
    adds up tile by tile (atomically, so in no fixed order), else None; then the
    gradients into the relative terms' scores where ``rows_grad`` asks (float32
    [B, H, N or M, K]: the query-side term's from the dQ kernel, the key-side term's
    from the dK one, atomically), else None."""
    batch, heads, n, head_dim = q.shape
    kv_heads, m, value_dim = k.shape[1], k.shape[2], v.shape[-1]
    grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    grad_bias = None
    if bias_grad:
        assert bias is not None and bias.is_contiguous() and kind != "none"
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
    terms = (query_rows, key_rows)
    grad_rows = [
        None
        if rows is None or not wanted
        else torch.zeros_like(rows.scores, memory_format=torch.contiguous_format)
        for rows, wanted in zip(terms, rows_grad, strict=True)
    ]
    if q.numel() == 0 or k.numel() == 0:
        return grad_q.zero_(), grad_k.zero_(), grad_v.zero_(), grad_bias, *grad_rows
    # [B, H, N]: δ_i = dO_i . O_i, without float32 copies of dO and O
    delta = torch.empty((batch, heads, n), dtype=torch.float32, device=q.device)
    rows = FUSED_DISTANCE_BLOCKS[0]
    if q.device.type == "cuda":
        rows = max(16, DISTANCE_ROW_DOTS_ELEMENTS // value_dim)  # a power of two
    _distance_attention_kernels()["row_dots"][((n + rows - 1) // rows, batch * heads)](
        out,
        grad_out,
        delta,
        n,
        heads,
        *out.stride(),
        *grad_out.stride(),
        VALUE_DIM=value_dim,
        BLOCK_M=rows,
    )
    bias_args, meta = _distance_bias_arguments(q, bias, kind, base, n, m, causal, window)
    meta.update(HEAD_DIM=head_dim, VALUE_DIM=value_dim, IEEE=q.dtype == torch.float32)
    strides = (*q.stride(), *k.stride(), *v.stride(), *grad_out.stride())
    query_args, query_code = _relative_rows_arguments(q, query_rows)
    key_args, key_code = _relative_rows_arguments(q, key_rows)
    meta.update(QUERY_ROWS=query_code, KEY_ROWS=key_code)
    tail = (*bias_args[1:], scale * math.log2(math.e), scale, *query_args, *key_args)

    def grad_rows_arguments(grad: Tensor | None) -> tuple[Any, ...]:
        # never written without ROWS_GRAD, but zeroed by the autotuner's trials on CUDA
        # (reset_to_zero): a scratch float, never an input
        if grad is None:
            return (torch.empty(1, device=q.device), 0, 0, 0, 0)
        return (grad, *grad.stride())

    _launch_distance_kernel(
        "key_grad",
        m,
        "BLOCK_N",
        batch * kv_heads,
        q.device,
        q,
        k,
        v,
        grad_out,
        lse,
        delta,
        grad_k,
        grad_v,
        bias_args[0],
        n,
        m,
        heads,
        kv_heads,
        heads // kv_heads,
        *grad_k.stride(),
        *grad_v.stride(),
        *strides,
        *tail,
        *grad_rows_arguments(grad_rows[1]),
        ROWS_GRAD=grad_rows[1] is not None,
        **meta,
    )
    _launch_distance_kernel(
        "query_grad",
        n,
        "BLOCK_M",
        batch * heads,
        q.device,
        q,
        k,
        v,
        grad_out,
        lse,
        delta,
        grad_q,
        bias_args[0],
        # never written without BIAS_GRAD, but zeroed by the autotuner's trials on CUDA
        # (reset_to_zero): a scratch float, never an input
        torch.empty(1, device=q.device) if grad_bias is None else grad_bias,
        n,
        m,
        heads,
        heads // kv_heads,
        *grad_q.stride(),
        *strides,
        *tail,
        *grad_rows_arguments(grad_rows[0]),
        BIAS_GRAD=grad_bias is not None,
        ROWS_GRAD=grad_rows[0] is not None,
        **meta,
    )
    return grad_q, grad_k, grad_v, grad_bias, *grad_rows


class _FusedDistanceAttention(torch.autograd.Function):
    """``fused_distance_attention`` and ``fused_relative_attention`` with gradients into
    q, k, v, the bias and the relative terms' scores. Like SDPA's flash kernels it has
    no double backward."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        bias: Tensor | None,
        query_scores: Tensor | None,
        query_diagonal: Tensor | None,
        key_scores: Tensor | None,
        key_diagonal: Tensor | None,
        kind: str,
        base: int,
        scale: float,
        causal: bool,
        window: int | None,
        ends: tuple[int, int | None, int, int | None],
    ) -> tuple[Tensor, Tensor]:
        rows = _relative_terms(query_scores, query_diagonal, key_scores, key_diagonal, ends)
        out, lse = distance_attention_forward(
            q, k, v, bias, kind, base, scale, causal, window, *rows
        )
        saved = (q, k, v, bias, query_scores, query_diagonal, key_scores, key_diagonal)
        ctx.save_for_backward(*saved, out, lse)
        ctx.settings = (kind, base, scale, causal, window, ends)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_out: Tensor, _grad_lse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, bias, query_scores, query_diagonal, key_scores, key_diagonal, out, lse = (
            ctx.saved_tensors
        )
        kind, base, scale, causal, window, ends = ctx.settings
        needs = ctx.needs_input_grad
        rows = _relative_terms(query_scores, query_diagonal, key_scores, key_diagonal, ends)
        grad_q, grad_k, grad_v, grad_bias, grad_query, grad_key = _distance_backward(
            q,
            k,
            v,
            bias,
            out,
            lse,
            grad_out,
            kind,
            base,
            scale,
            causal,
            window,
            bool(needs[3]),
            *rows,
            (bool(needs[4]), bool(needs[6])),
        )
        return (grad_q, grad_k, grad_v, grad_bias, grad_query, None, grad_key, None, *[None] * 6)


def _relative_terms(
    query_scores: Tensor | None,
    query_diagonal: Tensor | None,
    key_scores: Tensor | None,
    key_diagonal: Tensor | None,
    ends: tuple[int, int | None, int, int | None],
) -> tuple[RelativeRows | None, RelativeRows | None]:
    """The query-side and key-side ``RelativeRows`` from their parts (None where a term
    has no scores)."""
    query = None if query_scores is None else RelativeRows(query_scores, query_diagonal, *ends[:2])
    key = None if key_scores is None else RelativeRows(key_scores, key_diagonal, *ends[2:])
    return query, key


def attend_fused(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    kind: str,
    base: int,
    scale: float,
    causal: bool,
    window: int | None,
    query_rows: RelativeRows | None = None,
    key_rows: RelativeRows | None = None,
) -> tuple[Tensor, Tensor]:
    """The fused kernels' out and lse for arguments already checked (the public
    functions' checks, some of which sync with the device, are the caller's): through
    ``_FusedDistanceAttention`` where a gradient is needed (into q, k, v, the bias or a
    relative term's scores), else one forward launch."""
    scores = [rows.scores if rows is not None else None for rows in (query_rows, key_rows)]
    inputs = (q, k, v, bias, *scores)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)):
        return distance_attention_forward(
            q, k, v, bias, kind, base, scale, causal, window, query_rows, key_rows
        )
    parts: list[Any] = []
    ends: list[int | None] = []
    for rows in (query_rows, key_rows):
        parts += [None, None] if rows is None else [rows.scores, rows.diagonal]
        ends += [0, None] if rows is None else [rows.below, rows.above]
    settings = (kind, base, scale, causal, window, tuple(ends))
    return _FusedDistanceAttention.apply(q, k, v, bias, *parts, *settings)


def _check_fused_inputs(q: Tensor, k: Tensor, v: Tensor, caller: str) -> None:
    """ValueError naming the argument unless q [B, H, N, D], k [B, H_kv, M, D] and v
    [B, H_kv, M, value_dim] fit the kernels (``fused_distance_attention_serves``)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "q, k and v must be [batch, heads, seq, dim]; got shapes "
            f"{list(q.shape)}, {list(k.shape)} and {list(v.shape)}"
        )
    batch, heads, n, head_dim = q.shape
    if k.shape[0] != batch or k.shape[-1] != head_dim or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"k must be [{batch}, kv_heads, M, {head_dim}] and v [{batch}, kv_heads, M, "
            f"value_dim]; got {list(k.shape)} and {list(v.shape)}"
        )
    if k.shape[1] == 0 or heads % k.shape[1] or n > k.shape[2]:
        raise ValueError(
            f"k's heads must divide q's {heads} and q's length {n} must not exceed k's "
            f"{k.shape[2]} (default positions); got k of shape {list(k.shape)}"
        )
    if not fused_distance_attention_serves(q, k, v):
        raise ValueError(
            f"{caller} needs q, k and v alike in float16, bfloat16 or "
            f"float32 on a device in FUSED_DISTANCE_DEVICES {sorted(FUSED_DISTANCE_DEVICES)}, "
            "head and value widths powers of two from 16 to 256, eager mode and Triton; "
            f"got {q.dtype}, {k.dtype}, {v.dtype} on {q.device} with widths {head_dim} "
            f"and {v.shape[-1]}"
        )


def fused_distance_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    bias: Tensor | None = None,
    bias_kind: str = "none",
    bias_base: int = 0,
    causal: bool = False,
    window: int | None = None,
) -> tuple[Tensor, Tensor]:
    """softmax(q kᵀ · scale + b(r) + mask) v for default positions, fused in Triton, with
    the row log-sum-exp of the biased, scaled scores.

    Query i sits at position i + M - N (the last N of M keys, as with a KV cache) and r =
    j - i - (M - N) is the key minus query position. The bias b(r), read in float32:
    - "none": 0;
    - "slope": ``bias`` [H] holds c_h and b = c_h |r| (ALiBi, Press et al. 2022: c_h =
      -slope_h);
    - "vector": ``bias`` [H, L] and b = bias[h, clamp(r + bias_base, 0, L - 1)]: the
      per-distance vector [H, N + M - 1] with base M - 1, or a vector clipped at K
      (T5's [H, 2K + 1] with base K; tiles wholly past the clip add one value).
    ``causal`` masks r > 0, ``window`` masks |r| >= window.

    q: [B, H, N, D]; k: [B, H_kv, M, D] with H_kv dividing H (grouped-query attention:
    query head h reads key head h // (H / H_kv)); v: [B, H_kv, M, value_dim]; same dtype
    (float16, bfloat16 or float32; scores and softmax in float32), any strides, N <= M.
    Returns out [B, H, N, value_dim] in q's dtype and lse [B, H, N] float32 (natural
    log). Differentiable in q, k, v and the bias: the dQ kernel adds dL/db tile by tile,
    a tile's sum where every score reads one entry (past a clip) and per-diagonal sums
    elsewhere (float32 atomics, so not bit-reproducible run to run). Needs Triton (on
    CPU tensors only under TRITON_INTERPRET=1).
    """
    if bias_kind not in DISTANCE_BIAS_KINDS:
        raise ValueError(f"bias_kind must be one of {DISTANCE_BIAS_KINDS}, got {bias_kind!r}")
    _check_fused_inputs(q, k, v, "fused_distance_attention")
    check_flag(causal, "causal")
    heads = q.shape[1]
    if (bias is None) != (bias_kind == "none"):
        raise ValueError(f'bias must be given exactly when bias_kind is not "none" ({bias_kind!r})')
    if bias is not None:
        expected = (heads,) if bias_kind == "slope" else (heads, bias.shape[-1])
        if tuple(bias.shape) != expected or bias.shape[-1] == 0 or bias.device != q.device:
            raise ValueError(
                f"bias must be {'[heads]' if bias_kind == 'slope' else '[heads, L]'} with "
                f"heads = {heads} on {q.device}; got {list(bias.shape)} on {bias.device}"
            )
        bias = bias.float().contiguous()
    if window is not None:
        window = check_window(window)
    return attend_fused(q, k, v, bias, bias_kind, bias_base, scale, causal, window)


def _check_relative_rows(
    name: str, rows: RelativeRows, leading: tuple[int, int, int], diagonals: int, device: Any
) -> None:
    """ValueError naming ``name`` unless its scores are float32 [*leading, K] on
    ``device`` and its diagonal (where given) int32 [diagonals] with rows in [0, K),
    constant up to ``below`` and from ``above`` on (host syncs: eager callers only)."""
    scores, diagonal, below, above = rows
    if scores.dim() != 4 or tuple(scores.shape[:3]) != leading:
        raise ValueError(
            f"{name}.scores must be [{', '.join(map(str, leading))}, K]; got {list(scores.shape)}"
        )
    if scores.dtype != torch.float32 or scores.device != device:
        raise ValueError(
            f"{name}.scores must be float32 on {device}; got {scores.dtype} on {scores.device}"
        )
    if diagonal is None:
        return
    if diagonal.dtype != torch.int32 or tuple(diagonal.shape) != (diagonals,):
        raise ValueError(
            f"{name}.diagonal must be int32 [{diagonals}] on {device}; got "
            f"{diagonal.dtype} {list(diagonal.shape)} on {diagonal.device}"
        )
    if diagonal.device != device:
        raise ValueError(f"{name}.diagonal must be on {device}; got {diagonal.device}")
    if not bool(((diagonal >= 0) & (diagonal < scores.shape[3])).all()):
        raise ValueError(f"{name}.diagonal must hold rows in [0, {scores.shape[3]})")
    above = diagonals - 1 if above is None else above
    if not (
        0 <= below < diagonals
        and 0 <= above < diagonals
        and bool((diagonal[: below + 1] == diagonal[0]).all())
        and bool((diagonal[above:] == diagonal[-1]).all())
    ):
        raise ValueError(
            f"{name}.below and .above must be indices of the diagonal up to which and from "
            f"which on it holds its first and last row; got {below} and {above}"
        )


def fused_relative_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    query_rows: RelativeRows | None = None,
    key_rows: RelativeRows | None = None,
    causal: bool = False,
    window: int | None = None,
) -> tuple[Tensor, Tensor]:
    """softmax(q kᵀ · scale + a(i, j) + c(i, j) + mask) v for default positions, fused
    in Triton with the relative terms read from their projections: a(i, j) =
    query_rows.scores[b, h, i, row] and c(i, j) = key_rows.scores[b, h, j, row'], each
    row from its diagonal at j - i + N - 1 (row 0 without one). These are the
    projections over a relative table (Shaw et al. 2018; BERT's relative_key_query,
    Huang et al. 2020; DeBERTa's c2p and p2c, He et al. 2021; Transformer-XL's
    (q_i + v) · R and u · k_j, Dai et al. 2019), so no [B, H, N, M] tensor is formed and
    each score costs two loads per term.

    q, k, v, ``causal`` and ``window``: as ``fused_distance_attention`` (query i at
    position i + M - N). query_rows.scores: [B, H, N, K]; key_rows.scores: [B, H, M, K],
    any strides (expanded dimensions included), read in float32; diagonals: int32
    [N + M - 1] with entries in [0, K), and the ends past which each is constant
    (``RelativeRows``; checked here with host syncs). Returns out [B, H, N, value_dim] in
    q's dtype and lse [B, H, N] float32. Differentiable in q, k, v and both scores: the
    backward recomputes each tile's logits with the terms, and adds each score's dL/dS
    into the entry its term read (the query-side term's in the dQ kernel, the key-side
    term's in the dK one; float32 atomics, one sum per row where a tile reads one row),
    so the projections' own backward takes the gradient on to q, k and the table.
    """
    _check_fused_inputs(q, k, v, "fused_relative_attention")
    check_flag(causal, "causal")
    batch, heads, n = q.shape[:3]
    m = k.shape[2]
    for name, rows, length in (("query_rows", query_rows, n), ("key_rows", key_rows, m)):
        if rows is not None:
            _check_relative_rows(name, rows, (batch, heads, length), n + m - 1, q.device)
    if window is not None:
        window = check_window(window)
    return attend_fused(q, k, v, None, "none", 0, scale, causal, window, query_rows, key_rows)
