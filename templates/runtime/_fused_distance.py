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
route, from a band and two triangles (see ``_trained_bias``). This module is the host
side (settings, argument checks, launches, the autograd Function); the kernels are in
``_distance_kernel``. On CUDA each kernel is autotuned over a few tile shapes; the CPU
suite runs them under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._distance_kernel import distance_attention_kernels, tuned_distance_kernel
from ._first_order import first_order_only
from ._inputs import check_flag
from ._masks import check_window
from ._triton import triton_available

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


def _launch_distance_kernel(
    name: str, tiled: int, block: str, programs: int, device: torch.device, *args: Any, **meta: Any
) -> None:
    """Launch kernel ``name`` over ``tiled`` rows in tiles of ``block`` ("BLOCK_M" or
    "BLOCK_N") times ``programs``: autotuned on CUDA, FUSED_DISTANCE_BLOCKS elsewhere."""
    if device.type == "cuda":
        kernel = tuned_distance_kernel(name)
        kernel[lambda tile: ((tiled + tile[block] - 1) // tile[block], programs)](*args, **meta)
        return
    block_m, block_n = FUSED_DISTANCE_BLOCKS
    size = block_m if block == "BLOCK_M" else block_n
    grid = ((tiled + size - 1) // size, programs)
    distance_attention_kernels()[name][grid](*args, BLOCK_M=block_m, BLOCK_N=block_n, **meta)


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
    distance_attention_kernels()["row_dots"][((n + rows - 1) // rows, batch * heads)](
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
