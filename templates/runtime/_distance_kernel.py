"""The Triton kernels of the fused attention (``_fused_distance``), as source.

FlashAttention-2's schedule (Dao 2023, arXiv:2307.08691) with the position terms
computed in registers per tile: a bias of the key minus query position (c_h * |j - i|
from one slope per head, or a per-head vector indexed by the clamped distance) and
relative terms read from their projections over the table rows, each score reading
the row of its diagonal. The kernels are defined on first use (TRITON_INTERPRET is
read at definition) and, on CUDA, wrapped in Triton's autotuner over a few tile shapes.
"""

from __future__ import annotations

from typing import Any

from ._triton import TRITON_CACHE

#: the kernels' @triton.jit helpers, set by ``distance_attention_kernels``: the
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
#: triton.language, bound by ``distance_attention_kernels``: Triton's compiler resolves
#: each parameter's ``tl.constexpr`` annotation (a string, under ``from __future__ import
#: annotations``) among a function's globals and closure cells, and a helper whose body
#: never names ``tl`` (``relative_logits``) has no cell for it; the interpreter looks
#: for it among the globals too
tl: Any = None


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


def distance_attention_kernels() -> dict[str, Any]:
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


def tuned_distance_kernel(name: str) -> Any:
    """The kernel ``name`` wrapped in Triton's autotuner (CUDA), made once per process."""
    key = f"attention_tuned:{name}"
    if key not in TRITON_CACHE:
        import triton

        kernel = distance_attention_kernels()[name]
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
