"""The attention runtime shared by every posgen encoding module.

``posgen generate`` copies this file, byte for byte after its header, into
``generated/_attention.py``; each generated encoding subclasses ``PositionalAttention``
and adds only what is its own (parameters, position terms, rotation). ``posgen generate
--standalone`` inlines it into a single file.

The logits of query i and key j are the sum of the terms an encoding keeps:

    a_ij = scale * (R_i q_i) . (R_j k_j)          content (rotated where the encoding rotates)
         + b_h(i, j)                              position-only bias (scaled when inside)
         + relative terms x . P(R)[index(i, j)]   content-dependent relative terms

and the output is softmax(a + masks) @ v (plus a value-side term where the encoding has
one). Positions are int64 [seq] or [batch, seq] on the device of q, in [0, 2^53); keys
default to 0 .. M - 1 and queries to the last N key positions, as with a KV cache.
Keys and values may have fewer heads than queries (grouped-query and multi-query
attention): query head h reads key/value head h // (heads / kv_heads).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

BACKENDS = ("auto", "eager", "sdpa", "flex")
LAYOUTS = ("bhnd", "bnhd")  # [batch, heads, seq, dim] (default) or [batch, seq, heads, dim]
CACHE_SIZE = 8  # shape-keyed caches keep this many most recent entries
# Positions are exact in float64 (angles, distances) below 2^53; larger ones are refused.
MAX_POSITION = 2**53 - 1
# What a backend receives already rotated: nothing, the keys (a cache of rotated keys), or
# both q and k (rotated at M-RoPE axis positions before the backend).
Rotated = Literal["none", "keys", "both"]


def compute_dtype(x: Tensor) -> torch.dtype:
    """float64 inputs are computed in float64; everything else in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def autocast_off(device_type: str) -> Any:
    """A context turning autocast off for ``device_type`` where it is on, else a no-op
    (entering ``torch.autocast`` costs about 8 us: a fifth of a CPU decode step's host
    time)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def flush_denormals() -> bool:
    """Flush float32/float64 denormals to zero on the CPU threads torch computes on;
    True if every thread now does.

    Softmax weights below 2^-126 (a steep bias: ALiBi at long range, KERPLE, Sandwich)
    are denormal, and CPU arithmetic on denormals is slow: on 2 threads a training step
    of ALiBi through CPU SDPA took 3.3x the bias-free step with them, 1.05x without
    (N = 2048, float32; benchmarks/results/attention_backends_cpu_float32_bias*.md).

    ``torch.set_flush_denormal`` sets the calling thread's mode only; torch's intra-op
    threads copy it when they are created, at the first parallel operation. So call
    this before any tensor operation; called later it returns False (a probe multiplies
    denormals on every thread), and a warning says so. The change is process-wide:
    values below 2^-126 become 0.
    """
    if not torch.set_flush_denormal(True):
        return False
    # the largest float32 denormal, from its bits (a conversion would already flush it),
    # enough of them to be split across every thread
    probe = torch.full((2**17 * torch.get_num_threads(),), 0x007FFFFF, dtype=torch.int32)
    flushed = bool(((probe.view(torch.float32) * 1.5) == 0).all())
    if not flushed:
        warnings.warn(
            "flush_denormals: torch's worker threads existed before this call and keep "
            "denormals; call it before the first tensor operation",
            stacklevel=2,
        )
    return flushed


def positive_int(value: int, name: str) -> int:
    """``value`` if it is a positive int (not a bool), else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_attention_inputs(
    q: Tensor, k: Tensor, v: Tensor | None, heads: int | None, head_dim: int
) -> None:
    """Raise ValueError unless q, k (and v) are [batch, heads, seq, dim] float tensors.

    k and v share a head count that divides q's (grouped-query attention). ``heads``,
    when given, is the head count q must have.
    """
    named = (("q", q), ("k", k)) if v is None else (("q", q), ("k", k), ("v", v))
    for name, tensor in named:
        if not isinstance(tensor, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(
                f"{name} must have shape [batch, heads, seq, head_dim], got {list(tensor.shape)}"
            )
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
        if tensor.dtype != q.dtype or tensor.device != q.device:
            raise ValueError(
                f"q, k and v must share dtype and device: q is {q.dtype} on {q.device}, "
                f"{name} is {tensor.dtype} on {tensor.device}"
            )
        if tensor.shape[0] != q.shape[0]:
            raise ValueError(
                f"batch sizes differ: q has {q.shape[0]}, {name} has {tensor.shape[0]}"
            )
    if v is not None and v.shape[1] != k.shape[1]:
        raise ValueError(f"k and v must have the same heads, got {k.shape[1]} and {v.shape[1]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"q's {q.shape[1]} heads must be a multiple of k's {k.shape[1]} "
            "(grouped-query attention: each key/value head serves heads / kv_heads queries)"
        )
    if heads is not None and q.shape[1] != heads:
        hint = ""
        if q.shape[2] == heads:
            hint = (
                "; q looks like [batch, seq, heads, head_dim]: pass layout='bnhd' or "
                "transpose(1, 2)"
            )
        raise ValueError(f"expected {heads} heads (dim 1), got {q.shape[1]}{hint}")
    for name, tensor in (("q", q), ("k", k)):
        if tensor.shape[-1] != head_dim:
            raise ValueError(
                f"{name} must have head_dim {head_dim} (last dim), got {tensor.shape[-1]}"
            )
    if v is not None and v.shape[2] != k.shape[2]:
        raise ValueError(f"k and v must have the same length, got {k.shape[2]} and {v.shape[2]}")


def check_positions(
    positions: Tensor | None, length: int, batch: int | None, name: str, device: torch.device
) -> Tensor | None:
    """Validate explicit positions: integers >= 0, shape [length] or [batch, length]."""
    if positions is None:
        return None
    if not isinstance(positions, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(positions).__name__}")
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer positions (int64), got {positions.dtype}")
    if positions.dim() not in (1, 2) or positions.shape[-1] != length:
        raise ValueError(
            f"{name} must have shape [{length}] or [batch, {length}], got {list(positions.shape)}"
        )
    if positions.dim() == 2 and batch is not None and positions.shape[0] not in (1, batch):
        raise ValueError(f"{name} has batch {positions.shape[0]}, inputs have batch {batch}")
    if positions.device != torch.device(device):
        raise ValueError(
            f"{name} is on {positions.device}, the inputs on {device}: create positions on "
            "the inputs' device"
        )
    positions = positions.to(dtype=torch.int64)
    # a value check reads the tensor (a host sync): eager mode only, never while compiling.
    # One op: an int64 lies in [0, 2^53 - 1] exactly when no bit above bit 52 is set
    # (a negative one has its sign bit set).
    if (
        positions.numel()
        and not torch.compiler.is_compiling()
        and bool((positions & ~MAX_POSITION).any())
    ):
        low, high = int(positions.min()), int(positions.max())
        raise ValueError(
            f"{name} must lie in [0, 2^53 - 1] (exact in float64), got {low} .. {high}"
        )
    return positions


def check_axis_positions(
    positions: Tensor | None,
    axes: int,
    length: int,
    batch: int | None,
    name: str,
    device: torch.device,
) -> Tensor | None:
    """Axis positions as [axes, batch, length], validated; None for token positions.

    A rotation over several position axes (Qwen2-VL's temporal, height and width; an
    image's column and row) reads one position per axis, given as [axes, batch, length]
    (Hugging Face's layout) or as coordinates [batch, length, axes] (read as the first
    when both fit); [length] and [batch, length] stay token positions, the same on every
    axis.
    """
    if axes == 1 or not isinstance(positions, Tensor) or positions.dim() != 3:
        return None
    axes_first = positions.shape[0] == axes and positions.shape[-1] == length
    if not axes_first and positions.shape[-1] == axes and positions.shape[1] == length:
        positions = positions.movedim(-1, 0)  # coordinates [batch, length, axes]
    elif not axes_first:
        raise ValueError(
            f"{name} must have shape [{axes}, batch, {length}] (one row per position axis) "
            f"or [batch, {length}, {axes}] (coordinates), got {list(positions.shape)}"
        )
    flat = check_positions(positions.reshape(-1, length), length, None, name, device)
    assert flat is not None
    if batch is not None and positions.shape[1] not in (1, batch):
        raise ValueError(f"{name} has batch {positions.shape[1]}, inputs have batch {batch}")
    return flat.reshape(positions.shape)


def check_position_pair(
    q_positions: Tensor | None,
    k_positions: Tensor | None,
    n: int,
    m: int,
    batch: int | None,
    device: torch.device,
) -> tuple[Tensor | None, Tensor | None]:
    """Validate both position tensors and resolve the queries' default.

    Without q_positions the queries are the last N keys: k_positions[..., M - N:] when
    key positions are given, M - N, ..., M - 1 otherwise (both None stays None, the
    cacheable default). N > M then has no default and raises ValueError.
    """
    q_positions = check_positions(q_positions, n, batch, "q_positions", device)
    k_positions = check_positions(k_positions, m, batch, "k_positions", device)
    if q_positions is None and n > m:
        raise ValueError(
            f"{n} queries but {m} keys: the default query positions are the last N key "
            "positions, so N > M needs explicit q_positions"
        )
    if q_positions is None and k_positions is not None:
        q_positions = k_positions[..., m - n :]  # the queries are the newest keys
    if (
        q_positions is not None
        and k_positions is not None
        and q_positions.dim() == 2
        and k_positions.dim() == 2
        and q_positions.shape[0] != k_positions.shape[0]
        and 1 not in (q_positions.shape[0], k_positions.shape[0])
    ):
        raise ValueError(
            f"q_positions has batch {q_positions.shape[0]}, k_positions has batch "
            f"{k_positions.shape[0]}"
        )
    return q_positions, k_positions


def score_bias_positions(
    q_positions: Tensor, k_positions: Tensor, device: torch.device
) -> tuple[Tensor, Tensor]:
    """The explicit positions score_bias needs, validated: int64 [N] / [batch, N], [M] / ..."""
    for name, positions in (("q_positions", q_positions), ("k_positions", k_positions)):
        if not isinstance(positions, Tensor) or positions.dim() not in (1, 2):
            got = list(positions.shape) if isinstance(positions, Tensor) else positions
            raise ValueError(f"score_bias needs {name} of shape [seq] or [batch, seq], got {got!r}")
    n, m = q_positions.shape[-1], k_positions.shape[-1]
    checked_q, checked_k = check_position_pair(q_positions, k_positions, n, m, None, device)
    assert checked_q is not None and checked_k is not None  # both were given
    return checked_q, checked_k


def cache_get(cache: dict[tuple[Any, ...], Any], key: tuple[Any, ...]) -> Any:
    """The cached value for key (a tensor or a tuple of them), or None.

    An entry made under torch.inference_mode() is dropped when autograd is active now:
    inference tensors cannot be saved for backward. A hit becomes the most recent entry.
    While torch.compile traces, caches are bypassed (the values are computed in the graph).
    """
    if torch.compiler.is_compiling():
        return None
    value = cache.pop(key, None)
    if value is None:
        return None
    tensors = value if isinstance(value, tuple) else (value,)
    if not torch.is_inference_mode_enabled() and any(
        isinstance(t, Tensor) and t.is_inference() for t in tensors
    ):
        return None
    cache[key] = value  # dict order is recency order
    return value


def cache_put(cache: dict[tuple[Any, ...], Any], key: tuple[Any, ...], value: Any) -> Any:
    """Store value as the most recent entry, keeping the CACHE_SIZE most recent ones."""
    if torch.compiler.is_compiling():
        return value
    cache.pop(key, None)
    cache[key] = value
    while len(cache) > CACHE_SIZE:
        del cache[next(iter(cache))]  # least recently used first
    return value


def default_distances(n: int, m: int, device: torch.device) -> Tensor:
    """Key minus query position, one per diagonal, for default positions: int64 [n + m - 1].

    Queries M - N .. M - 1 against keys 0 .. M - 1 give r = j - i - (M - N) from
    -(M - 1) to N - 1; entry t holds r = t - (M - 1).
    """
    return torch.arange(-(m - 1), n, device=device)


class _QueryReversedDiagonals(torch.autograd.Function):
    """A per-distance vector [H, N + M - 1] as an [H, N, M] view with queries reversed.

    out[h, i', j] = vec[h, i' + j], where row i' = N - 1 - i is query i: for default
    positions the bias of query i and key j depends only on j - i, so reversing the
    queries turns every diagonal into an anti-diagonal, which one overlapping strided
    view expresses with no copy. The backward sums each anti-diagonal of the gradient
    with a skew (pad each row by N, reshape to rows of N + M - 1, sum the rows): no
    scatter and no atomics, so its cost is one pass over the gradient.
    """

    @staticmethod
    def forward(ctx: Any, vec: Tensor, n: int, m: int) -> Tensor:
        ctx.n, ctx.m = n, m
        if vec.stride(-1) != 1:
            vec = vec.contiguous()
        # rows of a wider vector's slice keep that vector's row stride
        return vec.as_strided((vec.shape[0], n, m), (vec.stride(0), 1, 1))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return anti_diagonal_sums(grad), None, None  # [H, N + M - 1]


def anti_diagonal_sums(grad: Tensor) -> Tensor:
    """[..., n, m] -> [..., n + m - 1]: entry t sums grad[..., a, b] over a + b = t.

    A skew, no scatter: pad each row by n, reshape to rows of n + m - 1 (row a then
    starts a columns later), sum the rows; one pass over ``grad``.
    """
    n, m = grad.shape[-2], grad.shape[-1]
    padded = F.pad(grad, (0, n))  # [..., n, m + n]
    skewed = padded.flatten(-2)[..., : n * (n + m - 1)].unflatten(-1, (n, n + m - 1))
    return skewed.sum(-2)


def query_reversed_bias(vec: Tensor, n: int, m: int) -> Tensor:
    """[H, N + M - 1] per-distance values -> [H, N, M] view, queries in reverse order."""
    return _QueryReversedDiagonals.apply(vec, n, m)  # type: ignore[no-any-return]


def distance_chunk_view(vec: Tensor, n: int, i0: int, i1: int, lo: int, hi: int) -> Tensor:
    """The bias of queries i0 .. i1 - 1 (of n, in reverse order) against keys lo .. hi - 1,
    as a view of a slice of the per-distance vector ``vec`` [H, n + m - 1] (entry t at
    key minus query position t - (m - 1), ``default_distances``): [1, H, rows, keys]."""
    # the chunk's first reversed row (query i1 - 1) starts at key lo: entry lo - i1 + n
    start = lo - i1 + n
    part = vec[:, start : start + (i1 - i0) + (hi - lo) - 1]
    return query_reversed_bias(part, i1 - i0, hi - lo).unsqueeze(0)


def expand_distance_bias(vec: Tensor, n: int, m: int) -> Tensor:
    """[H, N + M - 1] per-distance values -> [H, N, M] bias for default positions (a copy)."""
    return query_reversed_bias(vec, n, m).flip(-2)


def half_precision_bias(bias: Tensor, dtype: torch.dtype) -> Tensor:
    """An additive bias cast to SDPA's ``dtype``; in float16 or bfloat16 its largest
    finite value along the last axis is subtracted first (detached).

    Softmax ignores a constant per query row (and per head, for a per-distance vector),
    so the result is the same function; the shift puts the entries that dominate the
    weights near 0, where half precision is finest. Sandwich's bias reaches 64, where
    bf16's spacing is 0.5: unshifted, outputs moved by 7e-2.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        return bias.to(dtype)
    shift = bias.detach().amax(dim=-1, keepdim=True)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    return (bias - shift).to(dtype)


def repeat_kv(x: Tensor, groups: int) -> Tensor:
    """[B, H_kv, L, D] -> [B, H_kv * groups, L, D]: head h reads kv head h // groups."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def to_bhnd(layout: str, *tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors as [batch, heads, seq, dim] views, from ``layout``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "bnhd":
        return tuple(t.transpose(1, 2) if isinstance(t, Tensor) else t for t in tensors)
    return tensors


def masked_softmax(logits: Tensor) -> Tensor:
    """softmax over the last dim; a row whose every key is masked gives zeros (as SDPA).

    A fully masked row has max logit -inf; it is zeroed before and after the softmax so
    neither the output nor the gradient carries NaN.
    """
    if logits.shape[-1] == 0:
        return torch.softmax(logits, dim=-1)
    dead = logits.amax(dim=-1, keepdim=True) == float("-inf")  # [..., N, 1]
    weights = torch.softmax(logits.masked_fill(dead, 0.0), dim=-1)
    return weights.masked_fill(dead, 0.0)


def positions_or_default(
    positions: Tensor | None, start: int, length: int, device: torch.device
) -> Tensor:
    """Explicit positions, or start, start + 1, ..., start + length - 1."""
    if positions is not None:
        return positions
    return torch.arange(start, start + length, device=device)


def causal_allowed(
    q_positions: Tensor | None, k_positions: Tensor | None, n: int, m: int, device: torch.device
) -> Tensor:
    """True where key position <= query position: [n, m], or [batch, 1, n, m]."""
    q_pos = positions_or_default(q_positions, m - n, n, device)
    k_pos = positions_or_default(k_positions, 0, m, device)
    allowed = k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)  # [..., n, m]
    return allowed.unsqueeze(1) if allowed.dim() == 3 else allowed


def check_window(window: int | None) -> int | None:
    """A sliding window: None, or a positive int (ValueError naming ``window``).

    Windows past every distance positions can have (2^53) are clipped to 2^53, which
    keeps them comparable with int64 distances and changes nothing.
    """
    if window is None:
        return None
    return min(positive_int(window, "window"), MAX_POSITION + 1)


def check_document_ids(
    document_ids: Tensor | None, n: int, m: int, batch: int, device: torch.device
) -> Tensor | None:
    """Validate the keys' document ids: integers [M] or [batch or 1, M] on ``device``.

    Packed sequences: key j belongs to document document_ids[..., j], and query i to
    document_ids[..., M - N + i] (the queries are the last N keys, as with a KV cache),
    so N > M raises ValueError. Returns int64 [M] or [batch or 1, M].
    """
    if document_ids is None:
        return None
    name = "document_ids"
    if not isinstance(document_ids, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(document_ids).__name__}")
    if (
        document_ids.is_floating_point()
        or document_ids.is_complex()
        or document_ids.dtype == torch.bool
    ):
        raise ValueError(f"{name} must hold integer document ids (int64), got {document_ids.dtype}")
    if document_ids.dim() not in (1, 2) or document_ids.shape[-1] != m:
        raise ValueError(
            f"{name} must have shape [{m}] or [batch, {m}] (one id per key), got "
            f"{list(document_ids.shape)}"
        )
    if document_ids.dim() == 2 and document_ids.shape[0] not in (1, batch):
        raise ValueError(f"{name} has batch {document_ids.shape[0]}, inputs have batch {batch}")
    if document_ids.device != torch.device(device):
        raise ValueError(
            f"{name} is on {document_ids.device}, the inputs on {device}: create it on the "
            "inputs' device"
        )
    if n > m:
        raise ValueError(
            f"{name} gives the keys' documents and the queries are the last N keys, so "
            f"{n} queries need at least as many keys, got {m}"
        )
    return document_ids.to(dtype=torch.int64)


def attention_allowed(
    q_positions: Tensor | None,
    k_positions: Tensor | None,
    n: int,
    m: int,
    device: torch.device,
    causal: bool,
    window: int | None = None,
    document_ids: Tensor | None = None,
) -> Tensor | None:
    """True where query i may attend key j: [n, m] or [batch, 1, n, m]; None when nothing
    masks.

    With d = query position - key position (positions as ``causal_allowed`` reads them):
    ``causal`` needs d >= 0, ``window`` needs |d| < window (with causal:
    0 <= d < window), and ``document_ids`` (keys' documents, [M] or [batch, M]) needs
    document_ids[..., M - N + i] == document_ids[..., j].
    """
    if not causal and window is None and document_ids is None:
        return None
    allowed: Tensor | None = None
    if causal or window is not None:
        q_pos = positions_or_default(q_positions, m - n, n, device)
        k_pos = positions_or_default(k_positions, 0, m, device)
        distance = q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)  # [..., n, m] query - key
        if causal:
            allowed = distance >= 0  # the key at or before the query
        if window is not None:
            near = distance < window if causal else distance.abs() < window
            allowed = near if allowed is None else allowed & near
    if document_ids is not None:
        same = document_ids[..., m - n :].unsqueeze(-1) == document_ids.unsqueeze(-2)
        allowed = same if allowed is None else allowed & same  # [..., n, m]
    assert allowed is not None
    return allowed.unsqueeze(1) if allowed.dim() == 3 else allowed


def distance_allowed(
    n: int, m: int, device: torch.device, causal: bool, window: int | None
) -> Tensor | None:
    """``attention_allowed`` per diagonal for default positions: bool [n + m - 1] (entry t
    at key minus query position r = t - (M - 1), see ``default_distances``), or None."""
    if not causal and window is None:
        return None
    r = default_distances(n, m, device)  # key - query
    allowed = r <= 0 if causal else None
    if window is not None:
        near = r > -window if causal else r.abs() < window
        allowed = near if allowed is None else allowed & near
    return allowed


def key_span(i0: int, i1: int, n: int, m: int, causal: bool, window: int | None) -> tuple[int, int]:
    """Keys [lo, hi) that queries i0 .. i1 - 1 of n may read at default positions (the
    queries are the last n of m keys), under ``causal`` and ``window``."""
    first, last = m - n + i0, m - n + i1 - 1  # the positions of the first and last query
    hi = last + 1 if causal else m
    lo = 0
    if window is not None:
        lo = max(0, first - window + 1)
        hi = min(hi, last + window)
    return lo, hi


def query_chunks(
    n: int, m: int, device_type: str, causal: bool, window: int | None
) -> list[tuple[int, int, int, int]]:
    """(i0, i1, lo, hi) per SDPA call: queries i0 .. i1 - 1 and the keys [lo, hi) they may
    read (``key_span``), ``SDPA_QUERY_CHUNK`` queries at a time on ``device_type``; one
    call over every key where it sets no chunk or n fits in one."""
    chunk = SDPA_QUERY_CHUNK.get(device_type)
    if chunk is None or n <= chunk:
        return [(0, n, 0, m)]
    return [
        (i0, min(i0 + chunk, n), *key_span(i0, min(i0 + chunk, n), n, m, causal, window))
        for i0 in range(0, n, chunk)
    ]


def flex_mask_mod(
    q_positions: Tensor | None,
    k_positions: Tensor | None,
    n: int,
    m: int,
    causal: bool,
    window: int | None,
    documents: Tensor | None,
) -> Any:
    """A FlexAttention mask_mod(b, h, qi, ki) -> bool: ``attention_allowed`` per element.

    Positions as ``flex_positions`` reads them; documents [M] or [B, M]: the keys'
    document ids, query qi reading entry qi + M - N.
    """
    positions = flex_positions(q_positions, k_positions, n, m)
    offset = m - n
    doc_rows = None if documents is None else documents.view(-1, m)  # [1 or B, M]

    def mask_mod(b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        allowed: Tensor | None = None
        if causal or window is not None:
            i, j = positions(b, qi, ki)
            distance = i - j  # query minus key position
            if causal:
                allowed = distance >= 0
            if window is not None:
                near = distance < window
                near = near if causal else near & (distance > -window)
                allowed = near if allowed is None else allowed & near
        if doc_rows is not None:
            row = b % doc_rows.shape[0]
            same = doc_rows[row, qi + offset] == doc_rows[row, ki]
            allowed = same if allowed is None else allowed & same
        assert allowed is not None  # the caller passes something to mask
        return allowed

    return mask_mod


def relative_positions(
    q_positions: Tensor | None, k_positions: Tensor | None, n: int, m: int, device: torch.device
) -> Tensor:
    """Key position minus query position: [n, m], or [batch, n, m] for batched positions."""
    q_pos = positions_or_default(q_positions, m - n, n, device)
    k_pos = positions_or_default(k_positions, 0, m, device)
    return k_pos.unsqueeze(-2) - q_pos.unsqueeze(-1)


def check_attn_mask(attn_mask: Tensor | None, q: Tensor, m: int) -> Tensor | None:
    """attn_mask: bool (True = attend) or additive float, broadcastable to [B, H, N, M]."""
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, Tensor):
        raise ValueError(f"attn_mask must be a torch.Tensor, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise ValueError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
    target = (q.shape[0], q.shape[1], q.shape[2], m)
    try:
        torch.broadcast_shapes(attn_mask.shape, target)
    except RuntimeError:
        raise ValueError(
            f"attn_mask of shape {list(attn_mask.shape)} does not broadcast to {list(target)}"
        ) from None
    if attn_mask.dim() > 4:
        raise ValueError(f"attn_mask must have at most 4 dims, got {attn_mask.dim()}")
    return attn_mask.to(q.device)


def apply_masks(logits: Tensor, allowed: Tensor | None, attn_mask: Tensor | None) -> Tensor:
    """Add masks to float logits: -inf where not allowed, plus an additive attn_mask."""
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            logits = logits.masked_fill(~attn_mask, float("-inf"))
        else:
            logits = logits + attn_mask.to(logits.dtype)
    return logits


def sum_into_new(parts: list[Tensor]) -> Tensor:
    """The sum of broadcastable tensors as one freshly allocated tensor (summed in place).

    The largest part comes first so that every later one broadcasts into it.
    """
    largest = 0
    for index, part in enumerate(parts):  # a loop, not sorted(key=...): torch.compile traces it
        if part.dim() > parts[largest].dim():
            largest = index
    rest = parts[:largest] + parts[largest + 1 :]
    total = parts[largest] + rest[0] if rest else parts[largest].clone()
    for part in rest[1:]:
        total.add_(part)
    return total


def block_fresh(scores: Tensor, allowed: Tensor) -> Tensor:
    """-inf where not allowed, in place when the freshly made ``scores`` has the full shape."""
    if torch.broadcast_shapes(scores.shape, allowed.shape) == scores.shape:
        return scores.masked_fill_(~allowed, float("-inf"))
    return scores.masked_fill(~allowed, float("-inf"))


def flex_score_mod(
    vec: Tensor | None,
    added: Tensor | None,
    n: int,
    bias_fn: Any = None,
    bias_scale: float = 1.0,
    relative_fn: Any = None,
) -> Any:
    """A FlexAttention score_mod adding a per-distance vector, a captured tensor and/or a
    bias computed per index.

    vec: [H, N + M - 1], entry kv - q + N - 1 (default positions, ``default_distances``);
    added: [B or 1, H or 1, N, M] (a bias or mask as the sdpa backend would add it);
    bias_fn(b, h, q, kv): a bias per element (an expression), times ``bias_scale``;
    relative_fn(b, h, q, kv): relative terms per element, as they enter the logits.
    None when there is nothing to add.
    """
    if vec is None and added is None and bias_fn is None and relative_fn is None:
        return None
    per_batch = per_head = False  # bound either way: dynamo reads every closure cell
    if added is not None:
        added = (
            added if added.dim() == 4 else added.view(1, *([1] * (3 - added.dim())), *added.shape)
        )
        per_batch, per_head = added.shape[0] > 1, added.shape[1] > 1

    def score_mod(score: Tensor, b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        if vec is not None:
            score = score + vec[h, ki - qi + (n - 1)]
        if added is not None:
            score = score + added[b if per_batch else 0, h if per_head else 0, qi, ki]
        if bias_fn is not None:
            score = score + bias_fn(b, h, qi, ki) * bias_scale
        if relative_fn is not None:
            score = score + relative_fn(b, h, qi, ki)
        return score

    return score_mod


def flex_positions(q_positions: Tensor | None, k_positions: Tensor | None, n: int, m: int) -> Any:
    """positions(b, qi, ki) -> (query position, key position) for a score_mod's indices.

    Default positions: query qi is at qi + M - N, key ki at ki. Explicit ones are read
    from their [N] or [batch, N] rows (a shared row answers every batch index).
    """
    offset = m - n
    q_rows = None if q_positions is None else q_positions.view(-1, n)  # [1 or B, N]
    k_rows = None if k_positions is None else k_positions.view(-1, m)  # [1 or B, M]

    def positions(b: Tensor, qi: Tensor, ki: Tensor) -> tuple[Tensor, Tensor]:
        i = qi + offset if q_rows is None else q_rows[b % q_rows.shape[0], qi]
        j = ki if k_rows is None else k_rows[b % k_rows.shape[0], ki]
        return i, j

    return positions


def flex_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    score_mod: Any,
    block_mask: Any,
    scale: float,
    return_lse: bool = False,
) -> Any:
    """What flex_attention computes, unfused and differentiable on any device: the
    output, and with ``return_lse`` also the log-sum-exp of each row's scores [B, H, N]
    (-inf for a fully masked row).

    The score_mod and the block mask's mask_mod are called once on broadcast index
    tensors b [B, 1, 1, 1], h [1, H, 1, 1], q [1, 1, N, 1], kv [1, 1, 1, M]; fully masked
    rows give zeros, as flex_attention does.
    """
    groups = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    batch, heads, n, m = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # [B, H, N, M]
    device = q.device
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    qi = torch.arange(n, device=device).view(1, 1, -1, 1)
    ki = torch.arange(m, device=device).view(1, 1, 1, -1)
    if score_mod is not None:
        scores = score_mod(scores, b, h, qi, ki)
    if block_mask is not None:
        allowed = block_mask.mask_mod(b, h, qi, ki)
        scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.matmul(masked_softmax(scores), v)
    return (out, torch.logsumexp(scores, dim=-1)) if return_lse else out


#: queries per SDPA call (``query_chunks``), per device type, None: one call; used at
#: default positions for a bias of j - i alone that is masked (causal, window) or
#: trained, for other biases and relative terms under causal or window masking (built
#: per chunk at its positions), and for a window or causal last-N-of-M queries without
#: a bias. Each call
#: reads only the keys its queries may see (``key_span``): SDPA's kernels skip no
#: masked block once a mask is given, and a mask that requires grad takes the CPU's
#: unfused math kernel, whose [B, H, rows, M] scores then stay in cache. CPU, float32,
#: N = 2048, B=2, H=16, D=64, 2 threads, against plain SDPA: causal ALiBi forward
#: 1.72x -> 1.20x, T5 training 6.65x -> 2.63x causal and 3.87x -> 3.56x not
#: (benchmarks/results/attention_backends_cpu_float32_bias_flushed.md, chunk none
#: against chunk 256); a causal window of 256 (..._window256.md): rope forward
#: 1.26x -> 0.49x SDPA with the window's mask
SDPA_QUERY_CHUNK: dict[str, int | None] = {"cpu": 256}

_COMPILED_FLEX: dict[str, Any] = {}

#: recompilations TorchDynamo may make of flex_attention while posgen calls it: each
#: (score_mod, shape, dtype, mask) is one, and past dynamo's default limit (8) it falls
#: back, with a warning, to the unfused kernel that materialises the scores
FLEX_RECOMPILE_LIMIT = 256


def flex_kernel_options(q: Tensor, has_score_mod: bool) -> dict[str, Any] | None:
    """Triton options for the compiled flex kernel (None: FlexAttention's defaults).

    On CUDA a score_mod (they read captured vectors and tables) gets BLOCK_M = BLOCK_N =
    64 and one pipeline stage: the default tiles ran out of shared memory on an H100
    (torch 2.11) and, for T5 at N = 8192, ran a causal forward 2.8x slower
    (benchmarks/results/attention_backends_cuda_bfloat16_options.md).
    """
    if q.device.type == "cuda" and has_score_mod:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1}
    return None


def _recompile_room() -> Any:
    """A context raising dynamo's per-function recompile limit to FLEX_RECOMPILE_LIMIT
    for the call (the setting is ``recompile_limit``, ``cache_size_limit`` before 2.7)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: max(getattr(config, name), FLEX_RECOMPILE_LIMIT)})


def run_flex(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    score_mod: Any,
    block_mask: Any,
    scale: float,
    gqa: bool,
    compiled: bool,
    trains_terms: bool = False,
    return_lse: bool = False,
) -> Any:
    """flex_attention, compiled once per process with static shapes (a kernel per shape,
    dtype and score_mod; the dynamic-shape recompile of torch 2.13's CPU code generator
    failed to compile C++ for a second score_mod in one process), with room for
    FLEX_RECOMPILE_LIMIT kernels and the options of ``flex_kernel_options``: the output
    [B, H, N, value_dim], and with ``return_lse`` also each row's log-sum-exp of its
    scores [B, H, N] (float32, float64 for float64 inputs).

    ``trains_terms``: gradients flow into what the score_mod captures (the module's
    parameters). On the CPU that, or q, k or v requiring grad, takes ``flex_reference``:
    FlexAttention has no CPU backward (and refuses such inputs even under no_grad).
    """
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type == "cpu" and (trains_terms or any(t.requires_grad for t in (q, k, v))):
        return flex_reference(q, k, v, score_mod, block_mask, scale, return_lse)
    options = flex_kernel_options(q, score_mod is not None)
    keywords: dict[str, Any] = {"score_mod": score_mod, "block_mask": block_mask}
    keywords.update(scale=scale, enable_gqa=gqa, **(_lse_request() if return_lse else {}))
    if torch.compiler.is_compiling():  # inside the caller's torch.compile: inlined
        result = flex_attention(q, k, v, kernel_options=options, **keywords)
    elif not compiled:  # the unfused implementation (exact, materialises the scores)
        result = flex_attention(q, k, v, **keywords)
    else:
        function = _COMPILED_FLEX.get("flex")
        if function is None:
            compiled_flex = torch.compile(flex_attention, dynamic=False)
            function = _COMPILED_FLEX.setdefault("flex", compiled_flex)
        with _recompile_room():
            result = function(q, k, v, kernel_options=options, **keywords)
    if return_lse and "return_aux" in keywords:
        out, aux = result
        return out, aux.lse
    return result


def _lse_request() -> dict[str, Any]:
    """flex_attention's keyword asking for the log-sum-exp: ``return_aux`` where torch
    has it (``return_lse`` is deprecated there), else ``return_lse``."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # torch before AuxRequest
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


# ---- rotation (RoPE, Su et al. 2021) ----


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
    ``rotate_by_formula`` when they reach cos or sin.
    """
    if fused_rotation_enabled(x, cos, sin):
        return fused_rotation(x, cos, sin, rotary_dim, half_pairing)
    with autocast_off(x.device.type):
        if torch.compiler.is_compiling():
            if compiled_rotation_stays_eager(x, cos, sin, half_pairing):
                return _ROTATE(x, cos, sin, rotary_dim, half_pairing)  # type: ignore[no-any-return]
            return rotate_by_halves(x, cos, sin, rotary_dim, half_pairing).to(x.dtype)
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad)
        if not needs_grad:
            return rotate_into(x, cos, sin, rotary_dim, half_pairing)
        if not (cos.requires_grad or sin.requires_grad):
            return _Rotation.apply(x, cos, sin, rotary_dim, half_pairing, False)  # type: ignore[no-any-return]
        return rotate_by_formula(x, cos, sin, rotary_dim, half_pairing).to(x.dtype)


# (device type, half pairing) where torch.compile calls ``rotate_into`` as one opaque
# op (``posgen::rotate``) instead of letting inductor fuse ``rotate_by_halves``. On a
# 2-core x86 CPU (float32, separate processes) inductor's code for interleaved pairs
# took 1.3-1.4x a copy of q and k at [2, 16, 2048, 128] and [4, 32, 512, 128], the op
# (one complex product) 1.1-1.2x; for the half pairing inductor's 1.1-1.2x beats the
# op's 1.6x.
EAGER_ROTATION_UNDER_COMPILE = {("cpu", False)}


def compiled_rotation_stays_eager(x: Tensor, cos: Tensor, sin: Tensor, half_pairing: bool) -> bool:
    """Whether a traced rotation of x goes through ``posgen::rotate``: where
    ``EAGER_ROTATION_UNDER_COMPILE`` lists x's device and pairing, and no gradient
    reaches cos or sin."""
    if cos.requires_grad or sin.requires_grad:
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
        return _launch_rotation(x, cos, sin, rotary_dim, half_pairing, inverse=inverse)
    return rotate_into(x, cos, -sin if inverse else sin, rotary_dim, half_pairing)


def rotate_by_halves(
    x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int, half_pairing: bool
) -> Tensor:
    """The rotation for torch.compile, in cos's dtype: the pairs' two halves
    (a cos - b sin, b cos + a sin) as half-width products, joined once.

    Inductor turns this form into one pass over x: 1.05x a copy of q and k on a 2-core
    CPU (float32, [2, 16, 2048, 128]), against 2.3x for x * cos + partner(x) * sin,
    whose partner is a per-element choice. cos and sin go through ``materialized``:
    traced from positions, inductor would otherwise fuse their float64 cos and sin into
    that pass, once per element of x instead of once per position and pair (1.6x).
    """
    d = rotary_dim
    rotated = x[..., :d].to(cos.dtype)
    passed = [x[..., d:].to(cos.dtype)] if d < x.shape[-1] else []  # features past d
    if half_pairing:  # feature k pairs with k + d / 2
        a, b = rotated[..., : d // 2], rotated[..., d // 2 :]
        c, s = materialized(cos[..., : d // 2]), materialized(sin[..., : d // 2])
        return torch.cat([a * c - b * s, b * c + a * s, *passed], dim=-1)  # one join
    a, b = rotated[..., 0::2], rotated[..., 1::2]  # feature 2k pairs with 2k + 1
    c, s = materialized(cos[..., 0::2]), materialized(sin[..., 0::2])
    out = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    return torch.cat([out, *passed], dim=-1) if passed else out


def _materialize_op() -> Any:
    """The custom op ``posgen::materialize``: a copy that torch.compile cannot see
    into, so inductor computes its input once, as its own buffer, and fuses nothing
    across it. Registered once per process (a standalone module's inlined runtime finds
    the one already there)."""
    if hasattr(torch.ops.posgen, "materialize"):
        return torch.ops.posgen.materialize
    op = torch.library.custom_op(
        "posgen::materialize", mutates_args=(), schema="(Tensor x) -> Tensor"
    )(lambda x: x.clone())
    op.register_fake(lambda x: torch.empty_like(x))
    op.register_autograd(lambda ctx, grad: grad)
    return op


_MATERIALIZE = _materialize_op()


def materialized(t: Tensor) -> Tensor:
    """``t`` as its own buffer when torch.compile traces (``_materialize_op``), else
    ``t`` itself."""
    return _MATERIALIZE(t) if torch.compiler.is_compiling() else t


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
    traces, else plain ops."""
    if torch.compiler.is_compiling():
        return _COS_SIN(angles)  # type: ignore[no-any-return]
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


def rotate_into(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int, half_pairing: bool) -> Tensor:
    """The rotation written into one new tensor of x's dtype (no autograd), computed in
    cos's dtype in as few passes over x as eager ops allow.

    x: [..., N, D]; cos, sin: [N, rotary_dim] or [B, 1, N, rotary_dim]. Rows go
    ``rotation_chunk_rows`` at a time, so that the passes over a chunk find it in cache;
    where x's dtype is not cos's, each chunk is computed in a scratch buffer of cos's
    dtype and rounded into the output once.
    """
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [..., N, D]
    n, d = x.shape[-2], rotary_dim
    one_pass = not half_pairing and x.dtype == cos.dtype and d == x.shape[-1]  # complex product
    rows = n if one_pass else rotation_chunk_rows(x, d, cos.dtype)
    scratch = None  # x's rows in cos's dtype, then their rotation, where the dtypes differ
    if x.dtype != cos.dtype:
        scratch = torch.empty((2, *x.shape[:-2], min(rows, n), d), dtype=cos.dtype, device=x.device)
    if rows >= n:  # one chunk (a decode step's few rows): no slicing
        _rotate_chunk(x, cos, sin, out, d, half_pairing, scratch)
        return out
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        _rotate_chunk(
            x[..., start:stop, :],
            cos[..., start:stop, :],
            sin[..., start:stop, :],
            out[..., start:stop, :],
            d,
            half_pairing,
            None if scratch is None else scratch[:, ..., : stop - start, :],
        )
    return out


def _rotate_chunk(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    out: Tensor,
    rotary_dim: int,
    half_pairing: bool,
    scratch: Tensor | None,
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
        _rotate_rows(x_rotated, cos, sin, out_rotated, half_pairing)
    else:
        widened, rotated = scratch.unbind(0)
        widened.copy_(x_rotated)
        _rotate_rows(widened, cos, sin, rotated, half_pairing)
        out_rotated.copy_(rotated)  # rounded once


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


def _rotate_rows(x: Tensor, cos: Tensor, sin: Tensor, out: Tensor, half_pairing: bool) -> None:
    """Writes the rotation of x [..., n, d] (the rotated features only) into out, in
    out's dtype, which is cos's.

    Half pairing: out = x * cos (a cos, b cos), then out_a -= b sin and out_b += a sin.
    Interleaved: pairs (2k, 2k + 1) are complex numbers and the rotation is one product
    with e^(i theta_k) where x is in cos's dtype (float32/float64) with even strides;
    elsewhere four strided passes.
    """
    d = x.shape[-1]
    if half_pairing:
        half = d // 2
        s = sin[..., :half]
        torch.mul(x, cos, out=out)  # a cos, b cos
        out[..., :half].addcmul_(x[..., half:], s, value=-1)  # a cos - b sin
        out[..., half:].addcmul_(x[..., :half], s)  # b cos + a sin
        return
    pairs = complex_pairs(x) if x.dtype == cos.dtype else None
    out_pairs = complex_pairs(out)
    if pairs is not None and out_pairs is not None:
        turn = torch.complex(cos[..., 0::2], sin[..., 0::2])  # e^(i theta) [..., d / 2]
        torch.mul(pairs, turn, out=out_pairs)  # (a + ib)(cos + i sin)
        return
    c, s = cos[..., 0::2], sin[..., 0::2]  # each angle is repeated for its pair
    a, b = x[..., 0::2], x[..., 1::2]
    out_a, out_b = out[..., 0::2], out[..., 1::2]
    torch.mul(a, c, out=out_a)
    out_a.addcmul_(b, s, value=-1)  # a cos - b sin
    torch.mul(b, c, out=out_b)
    out_b.addcmul_(a, s)  # b cos + a sin


def complex_pairs(t: Tensor) -> Tensor | None:
    """t [..., 2k] float32/float64 as complex [..., k], pair (2j, 2j + 1) as real and
    imaginary part: a view, or None where dtype, strides or offset do not allow one."""
    if t.dtype not in (torch.float32, torch.float64) or t.stride(-1) != 1:
        return None
    if t.storage_offset() % 2 or any(stride % 2 for stride in t.stride()[:-1]):
        return None
    return torch.view_as_complex(t.unflatten(-1, (-1, 2)))


_ROTATE = _rotation_op()


# ---- attention with a mask that needs a gradient (CPU) ----


def trained_mask_attention_serves(q: Tensor, mask: Tensor | None) -> bool:
    """Whether ``trained_mask_attention`` replaces SDPA for one query chunk: a float
    mask that needs a gradient (a trained bias: SDPA then runs its unfused math kernel
    anyway), float32 or float64 q, on the CPU."""
    return (
        mask is not None
        and mask.requires_grad
        and mask.is_floating_point()
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64)
    )


def trained_mask_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """softmax(q kᵀ · scale + mask) v as three differentiable ops, for a chunk whose
    every query row has a key it may read (the chunked paths guarantee it: causal and
    window masks keep each query's own position).

    SDPA's math kernel, which CPU SDPA runs for a mask that needs a gradient, adds a
    safe softmax (checks for fully masked rows) and zero fills around it. Attention
    over 256-query chunks with a trained per-distance bias, forward and backward
    (N = 2048, batch 2, 16 heads, float32, 2-core CPU): 2.16 s through SDPA, 1.68 s
    through these ops, 0.52 s for SDPA without a bias; T5's whole training step went
    from 3.2-3.3x to 3.0x the bias-free one (non-causal).

    q: [B, H, n, D]; k, v: [B, KVH, m, D] (KVH divides H: query head h reads key head
    h // (H / KVH)); mask: [1 or B, H, n, m] -> [B, H, n, value_dim].
    """
    batch, heads, n, _ = q.shape
    kv_heads, m = k.shape[1], k.shape[2]
    group = heads // kv_heads
    grouped = (q * scale).view(batch, kv_heads, group, n, q.shape[-1])  # [B, KVH, G, n, D]
    scores = torch.matmul(grouped, k.unsqueeze(2).transpose(-1, -2))  # [B, KVH, G, n, m]
    weights = torch.softmax(scores.view(batch, heads, n, m) + mask, dim=-1)  # [B, H, n, m]
    out = torch.matmul(weights.view(batch, kv_heads, group, n, m), v.unsqueeze(2))
    return out.view(batch, heads, n, v.shape[-1])


# ---- a trained bias that is constant past a distance (CPU training) ----

#: the clipped-bias path serves at least this many keys per unit of the clip distance:
#: with fewer, the band pass spans (nearly) every key and recomputes more than it saves
#: (T5, clip 128, training step, 2-core CPU, float32, against the chunked path in one
#: run: N = 512 1.91x plain SDPA against 1.41x; N = 1024 1.52x against 2.09x)
CLIPPED_BIAS_MIN_KEYS_PER_CLIP = 8


def band_gradient_pays(m: int, clip: int) -> bool:
    """Whether a bias clipped at ``clip`` trains through the band-and-triangle gradient
    at ``m`` keys (every route that offers it: CPU sdpa, flex, the fused kernel): at
    least ``CLIPPED_BIAS_MIN_KEYS_PER_CLIP`` keys per unit of the clip distance."""
    return m >= CLIPPED_BIAS_MIN_KEYS_PER_CLIP * clip


#: queries per step of the band pass: its scores are [B, H, rows, rows + 2 clip - 2]
CLIPPED_BIAS_BAND_ROWS = 256


#: device types whose flex backend trains a clipped bias from a constant per-score read
#: plus ``attach_clipped_bias_gradient`` (else: the [H, N + M - 1] vector, whose
#: backward adds each score's gradient into it). Empty until timed on a GPU; the CPU's
#: flex runs unfused, where it only serves the tests.
CLIPPED_BIAS_FLEX_DEVICES: set[str] = set()


def clipped_bias_attention_serves(q: Tensor, m: int, clip: int, window: int | None) -> bool:
    """Whether ``clipped_bias_attention`` runs a training step with a bias clipped at
    ``clip``: the CPU (its flash kernel returns the log-sum-exp the gradient needs),
    float32 or float64, no autocast, more than one query, no window, and at least
    ``CLIPPED_BIAS_MIN_KEYS_PER_CLIP`` keys per unit of ``clip``."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64)
        and not torch.is_autocast_enabled("cpu")
        and q.shape[2] > 1
        and window is None
        and band_gradient_pays(m, clip)
    )


def clipped_distance_vector(clipped: Tensor, n: int, m: int, causal: bool) -> Tensor:
    """[H, 2 clip + 1] bias at key minus query position -clip .. clip -> the per-distance
    vector of default positions [H, n + m - 1] (``default_distances``), -inf on the
    distances a causal mask excludes."""
    clip = (clipped.shape[1] - 1) // 2
    r = default_distances(n, m, clipped.device)  # key - query
    vec = clipped[:, r.clamp(-clip, clip) + clip]
    allowed = distance_allowed(n, m, clipped.device, causal, None)
    return vec if allowed is None else vec.masked_fill(~allowed, float("-inf"))


def _flash_spans(n: int, m: int, causal: bool) -> list[tuple[int, int, int, int]]:
    """The CPU flash calls of ``clipped_bias_attention``: causal queries in chunks that
    skip the keys they may not read (the reversed-query view cannot use is_causal), all
    queries in one call otherwise (chunks there only add work)."""
    return query_chunks(n, m, "cpu", causal, None) if causal else [(0, n, 0, m)]


class _ClippedBiasAttention(torch.autograd.Function):
    """softmax(q kᵀ · scale + c[clamp(j - i, -K, K)]) v with c [H, 2K + 1] trained: CPU
    FlashAttention forward and backward, and the gradient of c from a band and a
    triangle.

    The bias is constant past distance K on each side (T5's buckets past max_distance).
    With dS = P ⊙ (dP - δ), δ_i = dO_i · O_i, the gradient of c[d] for |d| < K sums dS
    over one diagonal, and the band pass (``clipped_bias_gradient``) recomputes P and dP
    only on the band |j - i| < K. The two far entries sum dS over triangles, and need no
    per-pair work:

    - every row of dS sums to 0 (softmax), so the far side d <= -K is minus the rest;
    - the near side d >= K, for query i, is m_i (dO_i · Ō_i - δ_i), where Ō_i is the
      attention output over those keys alone and m_i = exp(lse_i^far + c[K] - lse_i)
      their share of the softmax mass: one causal flash forward over the triangle.

    The bias enters the flash kernels as a strided view of the per-distance vector
    (queries reversed, ``query_reversed_bias``) that needs no gradient, so SDPA's math
    kernel (every score, probability and gradient as an [B, H, N, M] tensor) never
    runs. q: [B, H, N, D]; k, v: [B, H, M, D] (heads repeated for GQA by the caller).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, clipped: Tensor, scale: float, causal: bool
    ) -> Tensor:
        n, m = q.shape[2], k.shape[2]
        vec = clipped_distance_vector(clipped, n, m, causal)  # [H, N + M - 1]
        out = q.new_empty(q.shape[:-1] + v.shape[-1:])  # [B, H, N, value_dim]
        lse = q.new_empty(q.shape[:-1])  # [B, H, N]
        for i0, i1, lo, hi in _flash_spans(n, m, causal):
            chunk_out, chunk_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[:, :, i0:i1].flip(2),
                k[:, :, lo:hi],
                v[:, :, lo:hi],
                0.0,
                False,
                attn_mask=distance_chunk_view(vec, n, i0, i1, lo, hi),
                scale=scale,
            )
            out[:, :, i0:i1] = chunk_out.flip(2)
            lse[:, :, i0:i1] = chunk_lse.flip(-1)
        ctx.save_for_backward(q, k, v, clipped, vec, out, lse)
        ctx.scale, ctx.causal = scale, causal
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, clipped, vec, out, lse = ctx.saved_tensors
        scale, causal = ctx.scale, ctx.causal
        n, m = q.shape[2], k.shape[2]
        grad_out = grad_out.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for i0, i1, lo, hi in _flash_spans(n, m, causal):
            grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out[:, :, i0:i1].flip(2),
                q[:, :, i0:i1].flip(2),
                k[:, :, lo:hi],
                v[:, :, lo:hi],
                out[:, :, i0:i1].flip(2),
                lse[:, :, i0:i1].flip(-1),
                0.0,
                False,
                attn_mask=distance_chunk_view(vec, n, i0, i1, lo, hi),
                scale=scale,
            )
            dq[:, :, i0:i1] = grads[0].flip(2)
            dk[:, :, lo:hi] += grads[1]
            dv[:, :, lo:hi] += grads[2]
        grad_clipped = None
        if ctx.needs_input_grad[3]:
            grad_clipped = clipped_bias_gradient(
                q, k, v, clipped, vec, out, lse, grad_out, scale, causal, cpu_flash_triangle
            )
        return dq, dk, dv, grad_clipped, None, None


def cpu_flash_triangle(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Top-left causal attention of r queries over r keys (query u reads keys <= u) with
    its log-sum-exp, by the CPU FlashAttention kernel: [B, H, r, value_dim], [B, H, r]."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, True, scale=scale
    )
    return out, lse


def clipped_bias_gradient(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    clipped: Tensor,
    vec: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    scale: float,
    causal: bool,
    triangle: Any,
) -> Tensor:
    """The gradient of the clipped bias c [H, 2K + 1] (see ``_ClippedBiasAttention``)
    for attention at default positions whose output was ``out`` [B, H, N, value_dim]
    and row log-sum-exp ``lse`` [B, H, N], given ``grad_out``. q: [B, H, N, D]; k, v:
    [B, H, M, D]; vec: the per-distance vector of ``clipped_distance_vector``;
    ``triangle(q, k, v, scale)``: top-left causal attention and its log-sum-exp.

    Band: ``CLIPPED_BIAS_BAND_ROWS`` queries at a time against the keys within K - 1 of
    them, P = exp(S - lse) and dS = P ⊙ (dO vᵀ - δ) in reversed query order (the view of
    ``vec`` the forward used), summed over the batch and along each diagonal
    (``anti_diagonal_sums``), in float32 (float64 for float64 inputs). Far entries: the
    triangle and the zero row sums.
    """
    n, m = q.shape[2], k.shape[2]
    clip = (clipped.shape[1] - 1) // 2
    dtype = compute_dtype(q)
    grad_out, out, lse = grad_out.to(dtype), out.to(dtype), lse.to(dtype)
    vec = vec.to(dtype)
    delta = (grad_out * out).sum(-1)  # [B, H, N]: δ_i = dO_i . O_i
    per_distance = torch.zeros_like(vec)  # [H, N + M - 1]: dS summed per diagonal
    for i0 in range(0, n, CLIPPED_BIAS_BAND_ROWS):
        i1 = min(n, i0 + CLIPPED_BIAS_BAND_ROWS)
        first, last = m - n + i0, m - n + i1 - 1  # the chunk's query positions
        lo, hi = max(0, first - clip + 1), min(m, (last + 1) if causal else (last + clip))
        rows = q[:, :, i0:i1].flip(2).to(dtype)  # [B, H, rows, D], reversed
        keys, values = k[:, :, lo:hi].to(dtype), v[:, :, lo:hi].to(dtype)
        scores = torch.matmul(rows, keys.transpose(-1, -2)).mul_(scale)
        scores += distance_chunk_view(vec, n, i0, i1, lo, hi)  # [B, H, rows, keys]
        weights = scores.sub_(lse[:, :, i0:i1].flip(-1).unsqueeze(-1)).exp_()  # P
        grad_weights = torch.matmul(grad_out[:, :, i0:i1].flip(2), values.transpose(-1, -2))
        grad_weights -= delta[:, :, i0:i1].flip(-1).unsqueeze(-1)  # dP - δ
        grad_scores = weights.mul_(grad_weights).sum(0)  # [H, rows, keys]: dS, batch summed
        start = lo - i1 + n  # the vector entry of the chunk's first anti-diagonal
        per_distance[:, start : start + (i1 - i0) + (hi - lo) - 1] += anti_diagonal_sums(
            grad_scores
        )
    grad = clipped.new_zeros(clipped.shape, dtype=dtype)  # [H, 2K + 1], entry d + K
    # the band |d| < K: entries t = d + M - 1 of the per-distance sums (complete there:
    # every pair within K - 1 of its query is in its chunk's keys)
    t0, t1 = max(0, m - clip), min(n + m - 1, m + clip - 1)
    grad[:, t0 - (m - 1) + clip : t1 - (m - 1) + clip] = per_distance[:, t0:t1]
    band = grad.sum(1)  # [H]
    near = torch.zeros_like(band)  # d >= K: keys at least K after the query
    rows_with_near = n - clip  # queries 0 .. n - clip - 1 have such keys
    if not causal and rows_with_near > 0:
        r = rows_with_near
        # query i (reversed: u = r - 1 - i) reads keys j >= i + (m - n) + K, i.e. the
        # reversed keys u' = m - 1 - j <= u: top-left causal over r queries and r keys
        far_out, far_lse = triangle(
            q[:, :, :r].flip(2), k[:, :, m - r :].flip(2), v[:, :, m - r :].flip(2), scale
        )  # [B, H, r, value_dim], [B, H, r]: reversed query order
        far_lse = far_lse.to(dtype) + clipped[:, 2 * clip, None].to(dtype)
        mass = torch.exp(far_lse - lse[:, :, :r].flip(-1))  # the triangle's softmax share
        far_dot = (grad_out[:, :, :r].flip(2) * far_out.to(dtype)).sum(-1)  # dO_i . Ō_i
        near = (mass * (far_dot - delta[:, :, :r].flip(-1))).sum((0, 2))
        grad[:, 2 * clip] += near
    if m - 1 >= clip:  # some query has keys at d <= -K: the rest of its zero row sum
        grad[:, 0] -= band + near
    return grad.to(clipped.dtype)


class _ClippedBiasGradient(torch.autograd.Function):
    """out, unchanged, whose backward also gives the gradient of the clipped bias c that
    went into it as a constant (``clipped_bias_gradient``): attention computed with a
    detached bias (flex's per-score read, no atomic adds in its backward) still trains
    c. The gradient into out passes through to that attention's own backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        out: Tensor,
        clipped: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        lse: Tensor,
        scale: float,
        causal: bool,
        triangle: Any,
    ) -> Tensor:
        ctx.save_for_backward(out, clipped, q, k, v, lse)
        ctx.scale, ctx.causal, ctx.triangle = scale, causal, triangle
        return out.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        out, clipped, q, k, v, lse = ctx.saved_tensors
        n, m = q.shape[2], k.shape[2]
        vec = clipped_distance_vector(clipped, n, m, ctx.causal)
        grad_clipped = clipped_bias_gradient(
            q, k, v, clipped, vec, out, lse, grad_out, ctx.scale, ctx.causal, ctx.triangle
        )
        return (grad_out, grad_clipped) + (None,) * 7


def attach_clipped_bias_gradient(
    out: Tensor,
    clipped: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    scale: float,
    causal: bool,
    triangle: Any,
) -> Tensor:
    """``out`` [B, H, N, value_dim] of attention at default positions with the bias
    c[clamp(j - i, -K, K)] taken as a constant, row log-sum-exp ``lse`` [B, H, N]; the
    result is out, through which c [H, 2K + 1] also gets its gradient. q: [B, H, N, D];
    k, v: [B, H, M, D] (heads repeated for GQA), as the attention saw them."""
    args = (out, clipped, q.detach(), k.detach(), v.detach(), lse.detach())
    return _ClippedBiasGradient.apply(*args, scale, causal, triangle)  # type: ignore[no-any-return]


def clipped_bias_attention(
    q: Tensor, k: Tensor, v: Tensor, clipped: Tensor, scale: float, causal: bool
) -> Tensor:
    """Attention with the bias c[clamp(j - i, -K, K)] for default positions (the queries
    are the last N of M keys), c = ``clipped`` [H, 2K + 1] (already scaled where the bias
    sits inside the scale), causal or not: [B, H, N, value_dim]. q: [B, H, N, D]; k, v:
    [B, H, M, D]. See ``_ClippedBiasAttention``."""
    return _ClippedBiasAttention.apply(q, k, v, clipped, scale, causal)  # type: ignore[no-any-return]


# ---- fused rotary kernel (optional Triton) ----

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
_TRITON: dict[str, Any] = {}  # "kernel": the @triton.jit rotation, defined on first use


def triton_available() -> bool:
    """Whether Triton imports here (it is optional: checked once per process)."""
    if "available" not in _TRITON:
        try:
            import triton  # noqa: F401
        except ImportError:
            _TRITON["available"] = False
        else:
            _TRITON["available"] = True
    return bool(_TRITON["available"])


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
    if "kernel" in _TRITON:
        return _TRITON["kernel"]
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

    _TRITON["kernel"] = rotate_kernel
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


def _launch_rotation(
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
        BLOCK_H=_power_of_two_at_least(block_h),
        BLOCK_N=_power_of_two_at_least(block_n),
        BLOCK_PAIRS=_power_of_two_at_least(pairs),
        BLOCK_PASS=_power_of_two_at_least(pass_through),
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
    wanted = FUSED_ROTATION_PROGRAMS_PER_SM * _sm_count(device)
    per_program = heads
    while per_program > 1 and row_programs * ((heads + per_program - 1) // per_program) < wanted:
        per_program = (per_program + 1) // 2
    return per_program


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (asked once per device)."""
    key = f"sms:{device}"
    if key not in _TRITON:
        _TRITON[key] = torch.cuda.get_device_properties(device).multi_processor_count
    return int(_TRITON[key])


def _power_of_two_at_least(value: int) -> int:
    """The smallest power of two >= value (and >= 1): Triton tiles are powers of two."""
    return 1 << max(value - 1, 0).bit_length()


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
        return _Rotation.apply(x, cos, sin, rotary_dim, half_pairing, True)  # type: ignore[no-any-return]
    return _launch_rotation(x, cos, sin, rotary_dim, half_pairing, inverse=False)


# ---- fused attention with a bias of j - i (optional Triton) ----

#: device types where ``fused_distance_attention`` runs: Triton compiles it for CUDA;
#: tests add "cpu" to run the kernels under TRITON_INTERPRET=1.
FUSED_DISTANCE_DEVICES: set[str] = {"cuda"}
#: per bias form, the device types where the flex backend runs a bias of the key minus
#: query position alone (default positions) through ``fused_distance_attention``
#: instead of FlexAttention. Timed on an H200 (bf16, batch 2, 16 heads, head_dim 64,
#: benchmarks/results/attention_backends_cuda_bfloat16_fused.md): ALiBi's slope, computed
#: per score, beat flex's score_mod at N = 8192 (forward 1.64-1.70x FlashAttention
#: against 1.79-2.02x, training 1.63-1.70x against 2.08-2.14x) and at N = 2048 (forward
#: 2.50-2.94x against 3.03-3.22x); a vector read per score (T5, KERPLE) lost to flex
#: when causal (T5 forward 3.34-4.21x against 2.74-3.69x) and when T5's table trains at
#: N = 2048, so it stays on flex.
FUSED_DISTANCE_ROUTES: dict[str, set[str]] = {"slope": {"cuda"}, "vector": set()}
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
    for dQ. The bias of each tile comes from ``tile_logits``.
    """
    global _distance_tile_logits, _distance_larger, _distance_plus
    if "attention" in _TRITON:
        return dict(_TRITON["attention"])
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
    def larger(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def plus(a, b):
        return a + b

    _distance_tile_logits, _distance_larger, _distance_plus = tile_logits, larger, plus

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
        HEAD_DIM: tl.constexpr,
        VALUE_DIM: tl.constexpr,
        BIAS: tl.constexpr,
        BAND: tl.constexpr,
        IEEE: tl.constexpr,  # float32 inputs: exact products, not TF32
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
            s = _distance_tile_logits(
                s * qk_scale,
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
        HEAD_DIM: tl.constexpr,
        VALUE_DIM: tl.constexpr,
        BIAS: tl.constexpr,
        BAND: tl.constexpr,
        IEEE: tl.constexpr,
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
                s_t = _distance_tile_logits(
                    s_t * qk_scale,
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
        HEAD_DIM: tl.constexpr,
        VALUE_DIM: tl.constexpr,
        BIAS: tl.constexpr,
        BAND: tl.constexpr,
        IEEE: tl.constexpr,
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
        grad_q = tl.full([BLOCK_M, HEAD_DIM], 0.0, tl.float32)
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
            s = _distance_tile_logits(
                s * qk_scale,
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
        out_q = grad_q_ptr + batch * stride_dqb + head * stride_dqh
        tl.store(
            out_q + rows[:, None] * stride_dqn + dims[None, :] * stride_dqd,
            (grad_q * scale).to(grad_q_ptr.dtype.element_ty),
            mask=query_rows,
        )

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
    _TRITON["attention"] = kernels
    return dict(kernels)


def _tuned_distance_kernel(name: str) -> Any:
    """The kernel ``name`` wrapped in Triton's autotuner (CUDA), made once per process."""
    key = f"attention_tuned:{name}"
    if key not in _TRITON:
        import triton

        kernel = _distance_attention_kernels()[name]
        tuning_key = ["n", "m", "HEAD_DIM", "VALUE_DIM", "BIAS", "BAND", "IEEE"]
        configs = _distance_attention_configs(name)
        _TRITON[key] = triton.autotune(configs, key=tuning_key)(kernel)
    return _TRITON[key]


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


def _distance_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    kind: str,
    base: int,
    scale: float,
    causal: bool,
    window: int | None,
) -> tuple[Tensor, Tensor]:
    """One forward launch: out [B, H, N, value_dim] in q's dtype, lse [B, H, N] float32."""
    batch, heads, n, head_dim = q.shape
    m, value_dim = k.shape[2], v.shape[-1]
    out = q.new_empty((batch, heads, n, value_dim))
    lse = torch.empty((batch, heads, n), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse.fill_(float("-inf"))
    bias_args, meta = _distance_bias_arguments(q, bias, kind, base, n, m, causal, window)
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
        HEAD_DIM=head_dim,
        VALUE_DIM=value_dim,
        IEEE=q.dtype == torch.float32,
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
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients into q, k and v (in their dtypes) from two launches, given the
    forward's out and lse and the gradient into out."""
    batch, heads, n, head_dim = q.shape
    kv_heads, m, value_dim = k.shape[1], k.shape[2], v.shape[-1]
    grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0 or k.numel() == 0:
        return grad_q.zero_(), grad_k.zero_(), grad_v.zero_()
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
    tail = (*bias_args[1:], scale * math.log2(math.e), scale)
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
        n,
        m,
        heads,
        heads // kv_heads,
        *grad_q.stride(),
        *strides,
        *tail,
        **meta,
    )
    return grad_q, grad_k, grad_v


class _FusedDistanceAttention(torch.autograd.Function):
    """``fused_distance_attention`` with gradients into q, k and v (the bias is a
    constant here). Like SDPA's flash kernels it has no double backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        bias: Tensor | None,
        kind: str,
        base: int,
        scale: float,
        causal: bool,
        window: int | None,
    ) -> tuple[Tensor, Tensor]:
        out, lse = _distance_forward(q, k, v, bias, kind, base, scale, causal, window)
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.settings = (kind, base, scale, causal, window)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: Tensor, _grad_lse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, bias, out, lse = ctx.saved_tensors
        grads = _distance_backward(q, k, v, bias, out, lse, grad_out, *ctx.settings)
        return (*grads, None, None, None, None, None, None)


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
    log). Differentiable in q, k and v; the bias is a constant (ValueError where it needs
    a gradient). Needs Triton (on CPU tensors only under TRITON_INTERPRET=1).
    """
    if bias_kind not in DISTANCE_BIAS_KINDS:
        raise ValueError(f"bias_kind must be one of {DISTANCE_BIAS_KINDS}, got {bias_kind!r}")
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
            "fused_distance_attention needs q, k and v alike in float16, bfloat16 or "
            f"float32 on a device in FUSED_DISTANCE_DEVICES {sorted(FUSED_DISTANCE_DEVICES)}, "
            "head and value widths powers of two from 16 to 256, eager mode and Triton; "
            f"got {q.dtype}, {k.dtype}, {v.dtype} on {q.device} with widths {head_dim} "
            f"and {v.shape[-1]}"
        )
    if (bias is None) != (bias_kind == "none"):
        raise ValueError(f'bias must be given exactly when bias_kind is not "none" ({bias_kind!r})')
    if bias is not None:
        expected = (heads,) if bias_kind == "slope" else (heads, bias.shape[-1])
        if tuple(bias.shape) != expected or bias.shape[-1] == 0 or bias.device != q.device:
            raise ValueError(
                f"bias must be {'[heads]' if bias_kind == 'slope' else '[heads, L]'} with "
                f"heads = {heads} on {q.device}; got {list(bias.shape)} on {bias.device}"
            )
        if bias.requires_grad and torch.is_grad_enabled():
            raise ValueError("bias gets no gradient here: pass it detached")
        bias = bias.float()
    if window is not None:
        window = check_window(window)
    args = (q, k, v, bias, bias_kind, bias_base, scale, causal, window)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _FusedDistanceAttention.apply(*args)  # type: ignore[no-any-return]
    return _distance_forward(*args)


class PositionalAttention(nn.Module):
    """Attention whose logits are the sum of an encoding's terms; subclassed per encoding.

    A generated encoding sets the composition flags below (decided by posgen's plan) and
    overrides the hooks it needs: ``embed`` (input-level positions), ``_rotate``
    (rotary part), ``_position_bias`` and ``score_bias`` (position-only bias),
    ``_relative_terms`` (content-dependent relative terms) and ``_value_term``.

    Args:
        heads: number of attention heads.
        head_dim: features per head.
        scale_factor: the logits are scaled by 1 / sqrt(scale_factor * head_dim); None
            leaves them unscaled.
    """

    #: the position terms are per head, so q must have ``heads`` heads
    checks_heads: bool = False
    #: a position-only bias [heads, N, M] enters the logits
    has_position_bias: bool = False
    #: that bias is added inside the scale: (q . k + b) * scale, so it is scaled too
    position_bias_inside_scale: bool = False
    #: that bias depends only on the key minus query position, via ``_distance_bias``
    bias_by_distance: bool = False
    #: and is c_h |j - i| (ALiBi's slopes): ``_distance_slopes`` gives c_h
    bias_linear_in_distance: bool = False
    #: and is constant past this distance on each side (T5's buckets past max_distance):
    #: ``_clipped_distance_bias`` gives it over -clip .. clip; None where it is not
    clipped_distance: int | None = None
    #: the position bias is a product of position rows: ``_fold_position_bias`` appends
    #: them to q and k, so sdpa runs with no bias tensor
    folds_position_bias: bool = False
    #: sdpa uses that fold (None: on CUDA only, where it lets SDPA pick its flash kernel;
    #: on a 2-core CPU, TUPE-A at N = 512 ran 5.9x no-bias SDPA folded, 4.4x with a mask)
    fold_bias: bool | None = None
    #: the rotary part changes q and k
    has_rotation: bool = False
    #: content-dependent relative terms enter the logits
    has_relative_terms: bool = False
    #: a value-side term is added to the output (needs the attention weights)
    has_value_term: bool = False
    #: position axes of the rotation (M-RoPE: 3); explicit positions [axes, batch, seq]
    position_axes: int = 1
    #: backend "flex" runs torch.compile'd FlexAttention (None: on CUDA only; elsewhere
    #: the unfused reference, which is exact but materialises the scores)
    flex_compile: bool | None = None

    def __init__(self, heads: int, head_dim: int, scale_factor: float | None) -> None:
        super().__init__()
        self.heads = positive_int(heads, "heads")
        self.head_dim = positive_int(head_dim, "head_dim")
        self.scale = 1.0 if scale_factor is None else 1.0 / math.sqrt(scale_factor * self.head_dim)
        self._cache: dict[tuple[Any, ...], Any] = {}  # see cache_put

    def extra_repr(self) -> str:
        return f"heads={self.heads}, head_dim={self.head_dim}, scale={self.scale:.6g}"

    # ------------------------------------------------------------------ encoding hooks

    def embed(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """Input-level positions: none for this encoding (identity)."""
        return x

    def rotate(
        self,
        q: Tensor,
        k: Tensor,
        q_positions: Tensor | None = None,
        k_positions: Tensor | None = None,
        *,
        layout: str = "bhnd",
    ) -> tuple[Tensor, Tensor]:
        """Rotate q [batch, heads, N, head_dim] and k [batch, kv_heads, M, head_dim].

        Positions default to 0, ..., M - 1 for k and to the last N key positions for q
        (N > M needs explicit q_positions). The outputs keep the input dtype and layout
        (``"bnhd"``: [batch, seq, heads, head_dim] in and out); without a rotary part
        they are q and k themselves.
        """
        q, k = to_bhnd(layout, q, k)
        check_attention_inputs(q, k, None, None, self.head_dim)
        q, k, q_positions, k_positions, rotated = self._positions_and_axes(
            q, k, q_positions, k_positions, "none"
        )
        q, k = self._rotate_for_attention(q, k, q_positions, k_positions, rotated)
        return to_bhnd(layout, q, k)  # type: ignore[return-value]

    def rotate_keys(
        self, k: Tensor, positions: Tensor | None = None, *, layout: str = "bhnd"
    ) -> Tensor:
        """Rotate keys once, at their positions, for a cache of rotated keys (decode).

        k: [batch, kv_heads, M, head_dim] (or [batch, M, kv_heads, head_dim] with layout
        "bnhd"); positions: int64 [M] or [batch, M], default 0, ..., M - 1. Append the
        result to the cache and call ``forward(q, cache, v, keys_rotated=True, ...)``:
        each decode step then rotates only its new keys and its queries. Without a
        rotary part this returns k itself.
        """
        (k,) = to_bhnd(layout, k)
        check_attention_inputs(k, k, None, None, self.head_dim)
        batch, m = k.shape[0], k.shape[2]
        axes = check_axis_positions(positions, self.position_axes, m, batch, "positions", k.device)
        if axes is None:
            positions = check_positions(positions, m, batch, "positions", k.device)
        if not self.has_rotation:
            return to_bhnd(layout, k)[0]
        rotated = self._rotate_keys(k, axes if axes is not None else positions)
        (rotated,) = to_bhnd(layout, rotated)
        return rotated

    def _rotate(
        self, q: Tensor, k: Tensor, q_positions: Tensor | None, k_positions: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        return q, k

    def _positions_and_axes(
        self,
        q: Tensor,
        k: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        rotated: Rotated,
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Rotated]:
        """Validate positions; rotate here at M-RoPE axis positions [axes, batch, seq].

        Returns q, k, the token positions that masks and biases read (None, token order,
        where axis positions were given) and what is rotated already.
        """
        n, m, batch = q.shape[2], k.shape[2], q.shape[0]
        axes, device = self.position_axes, q.device
        q_axes = check_axis_positions(q_positions, axes, n, batch, "q_positions", device)
        k_axes = check_axis_positions(k_positions, axes, m, batch, "k_positions", device)
        if q_axes is None and k_axes is None:
            q_positions, k_positions = check_position_pair(
                q_positions, k_positions, n, m, batch, q.device
            )
            return q, k, q_positions, k_positions, rotated
        for name, axes, other in (("q", q_axes, q_positions), ("k", k_axes, k_positions)):
            if axes is None and other is not None:
                raise ValueError(
                    f"{name}_positions must also be [axes, batch, seq] when the other "
                    "positions are (or leave it out for the default)"
                )
        if k_axes is None:
            default = torch.arange(m, device=q.device)
            k_axes = default.expand(self.position_axes, 1, m)  # [axes, 1, M]
        if q_axes is None:
            if n > m:
                raise ValueError(f"{n} queries but {m} keys: N > M needs explicit q_positions")
            q_axes = k_axes[..., m - n :]  # the queries are the newest keys
        if rotated == "keys":
            q = self._rotate_queries(q, q_axes, m)
        else:
            q, k = self._rotate(q, k, q_axes, k_axes)
        return q, k, None, None, "both"

    def _sampled_positions(self, length: int, device: torch.device) -> Tensor | None:
        """Positions to use where none are given ([length]), or None for 0 .. length - 1.

        Randomized encodings draw them in training; every other encoding uses the range.
        """
        return None

    def _rotate_queries(self, q: Tensor, q_positions: Tensor | None, m: int) -> Tensor:
        return q

    def _rotate_keys(self, k: Tensor, k_positions: Tensor | None) -> Tensor:
        return k

    def _rotate_for_attention(
        self,
        q: Tensor,
        k: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        rotated: Rotated,
    ) -> tuple[Tensor, Tensor]:
        """q and k as the logits read them: rotated here, or q alone when k already is
        (``"keys"``), or both as given (``"both"``: rotated at M-RoPE axis positions)."""
        if not self.has_rotation or rotated == "both":
            return q, k
        if rotated == "keys":
            return self._rotate_queries(q, q_positions, k.shape[2]), k
        return self._rotate(q, k, q_positions, k_positions)

    def score_bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor | None:
        """Position-only score bias: none for this encoding."""
        return None

    def _position_bias(
        self,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        n: int,
        m: int,
        device: torch.device,
    ) -> Tensor | None:
        return None

    def _fold_position_bias(
        self, q: Tensor, k: Tensor, q_positions: Tensor | None, k_positions: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """q' and k' whose scaled product includes the position bias (see the flag)."""
        return q, k

    def _flex_bias(
        self,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        n: int,
        m: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> Any:
        """A bias per (batch, head, query, key) index for the flex score_mod, or None to
        read the per-distance vector (``bias_by_distance``, default positions) or capture
        ``_position_bias``'s tensor instead. Blocks render one where the bias is cheap
        arithmetic of the indices (ALiBi's slopes, T5's clipped distances, expressions):
        a gather per score from an [H, N + M - 1] vector cost 3-6x the bias-free kernel
        on an H100."""
        return None

    def _flex_relative(
        self,
        q: Tensor,
        k: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        dtype: torch.dtype,
    ) -> Any:
        """Relative terms per (batch, head, query, key) index for the flex score_mod, or
        None to capture ``_relative_terms``' dense tensors instead."""
        return None

    def _distance_bias(self, n: int, m: int, device: torch.device) -> Tensor:
        """The position-only bias per distance for default positions: [heads, N + M - 1].

        Entry t is the bias at key minus query position t - (M - 1) (see
        ``default_distances``). Encodings with ``bias_by_distance`` override it.
        """
        raise NotImplementedError("this encoding's bias is not a function of j - i alone")

    def _distance_slopes(self, device: torch.device) -> Tensor:
        """c_h of a bias c_h |j - i|, ``bias_linear_in_distance``: [heads] (ALiBi: minus
        the slopes). Encodings with ``bias_linear_in_distance`` override it."""
        raise NotImplementedError("this encoding's bias is not linear in |j - i|")

    def _clipped_distance_bias(self, device: torch.device) -> Tensor:
        """The position-only bias at key minus query position -clip .. clip, clip being
        ``clipped_distance``: [heads, 2 clip + 1]; every distance past +-clip has the
        bias at +-clip. Encodings with ``clipped_distance`` override it."""
        raise NotImplementedError("this encoding's bias is not clipped at a distance")

    def _relative_terms(
        self,
        q: Tensor,
        k: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        dtype: torch.dtype,
    ) -> dict[str, Tensor]:
        return {}

    def _value_term(
        self, weights: Tensor, q_positions: Tensor | None, k_positions: Tensor | None
    ) -> Tensor:
        raise NotImplementedError("this encoding has no value-side term")

    def _check_value_width(self, v: Tensor) -> None:
        """Encodings with a value-side table check v's last dim here."""

    # ------------------------------------------------------------------ logits

    def score_terms(
        self,
        q: Tensor,
        k: Tensor,
        *,
        q_positions: Tensor | None = None,
        k_positions: Tensor | None = None,
        layout: str = "bhnd",
    ) -> dict[str, Tensor]:
        """The non-zero terms of the logits, each as it enters the sum.

        q: [batch, heads, N, head_dim], k: [batch, kv_heads, M, head_dim] (or
        [batch, seq, heads, head_dim] with layout "bnhd"). Content terms are
        [batch, heads, N, M]; position-only terms are [heads, N, M] (or
        [batch, heads, N, M] for batched positions) and broadcast over the batch. All
        are float32, or float64 for float64 inputs.
        """
        q, k = to_bhnd(layout, q, k)
        check_attention_inputs(q, k, None, self._expected_heads(), self.head_dim)
        # the oracle: float32 (float64 for float64 inputs) even under autocast
        with autocast_off(q.device.type):
            q, k, q_positions, k_positions, rotated = self._positions_and_axes(
                q, k, q_positions, k_positions, "none"
            )
            return self._score_terms_exact(q, k, q_positions, k_positions, rotated)

    def _expected_heads(self) -> int | None:
        return self.heads if self.checks_heads else None

    def _score_terms_exact(
        self,
        q: Tensor,
        k: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        rotated: Rotated = "none",
    ) -> dict[str, Tensor]:
        q, k = self._rotate_for_attention(q, k, q_positions, k_positions, rotated)
        k = repeat_kv(k, q.shape[1] // k.shape[1])  # [B, H, M, D]
        dtype = compute_dtype(q)
        content = torch.matmul(q.to(dtype), k.to(dtype).transpose(-2, -1))  # [B, H, N, M]
        terms = {"content_content": content * self.scale}
        if self.has_position_bias:
            bias = self._position_bias(q_positions, k_positions, q.shape[2], k.shape[2], q.device)
            assert bias is not None  # has_position_bias
            bias = bias.to(dtype)
            if self.position_bias_inside_scale:
                bias = bias * self.scale
            terms["position_position"] = bias
        if self.has_relative_terms:
            terms.update(self._relative_terms(q, k, q_positions, k_positions, dtype))
        return terms

    def scores(
        self,
        q: Tensor,
        k: Tensor,
        *,
        q_positions: Tensor | None = None,
        k_positions: Tensor | None = None,
        layout: str = "bhnd",
    ) -> Tensor:
        """Pre-softmax logits, the sum of ``score_terms``: [batch, heads, N, M].

        Computed in float32 (float64 for float64 inputs).
        """
        terms = self.score_terms(
            q, k, q_positions=q_positions, k_positions=k_positions, layout=layout
        )
        logits = terms.pop("content_content")
        for term in terms.values():
            logits = logits + term
        return logits

    # ------------------------------------------------------------------ attention

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        q_positions: Tensor | None = None,
        k_positions: Tensor | None = None,
        causal: bool = False,
        attn_mask: Tensor | None = None,
        backend: str = "auto",
        layout: str = "bhnd",
        keys_rotated: bool = False,
        window: int | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Attention with this encoding: softmax(logits + masks) @ v.

        Args:
            q: [batch, heads, N, head_dim] queries.
            k: [batch, kv_heads, M, head_dim] keys; kv_heads divides heads (grouped-query
                attention: query head h reads key/value head h // (heads / kv_heads)).
            v: [batch, kv_heads, M, value_dim] values.
            q_positions: int64 [N] or [batch, N]; default the last N key positions
                (k_positions[..., M - N:], or M - N, ..., M - 1), as with a KV cache.
                N > M needs them explicitly.
            k_positions: int64 [M] or [batch, M]; default 0, ..., M - 1.
            causal: mask keys whose position is greater than the query's.
            attn_mask: bool (True = attend) or additive float mask, broadcastable to
                [batch, heads, N, M].
            backend: "eager" (term by term, the reference), "sdpa"
                (F.scaled_dot_product_attention with a materialised bias), "flex"
                (FlexAttention: the position terms as a score_mod, masks as a block
                mask; compiled on CUDA, or where ``flex_compile`` is True) or "auto"
                (the fastest measured: flex on CUDA for most biases and relative
                terms, eager for a value-side term, else sdpa; see ``_auto_backend``).
            layout: "bhnd" (the shapes above) or "bnhd" ([batch, seq, heads, dim], as
                Hugging Face projections produce before their transpose); the output
                has the same layout.
            keys_rotated: k was rotated already by ``rotate_keys`` at k_positions (a
                cache of rotated keys): only q is rotated here. No effect without a
                rotary part.
            window: sliding-window attention by position, a positive int: query i
                attends key j only where |q_pos_i - k_pos_j| < window (a symmetric band,
                Longformer-style local attention); with ``causal`` that is
                q_pos_i - window < k_pos_j <= q_pos_i (Mistral's sliding window: window
                1 keeps only the key at the query's own position).
            document_ids: packed sequences, integer [M] or [batch, M]: each key's
                document. The queries are the last N keys (as with a KV cache; N > M
                raises ValueError), so query i's document is document_ids[..., M - N + i]
                and it attends only keys of that document. Positions are not changed:
                pass k_positions restarting at each document where the encoding should
                see them restart.

            causal, window, document_ids and attn_mask combine (a key must pass all of
            them). On "flex" the first three become one block mask, so FlexAttention
            skips the blocks outside the window or the document.

        Returns:
            [batch, heads, N, value_dim] in the dtype of v. A query row whose every key
            is masked (by ``causal``, ``window``, ``document_ids`` or ``attn_mask``) is
            all zeros on every backend, as F.scaled_dot_product_attention gives.
        """
        q, k, v = to_bhnd(layout, q, k, v)
        out = self._attend(
            q,
            k,
            v,
            q_positions,
            k_positions,
            causal,
            attn_mask,
            backend,
            keys_rotated,
            window=window,
            document_ids=document_ids,
        )
        return out.transpose(1, 2) if layout == "bnhd" else out

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        causal: bool,
        attn_mask: Tensor | None,
        backend: str,
        keys_rotated: bool,
        window: int | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        check_attention_inputs(q, k, v, self._expected_heads(), self.head_dim)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        window = check_window(window)
        q, k, q_positions, k_positions, rotated = self._positions_and_axes(
            q, k, q_positions, k_positions, "keys" if keys_rotated else "none"
        )
        n, m = q.shape[2], k.shape[2]
        if q_positions is None and k_positions is None:
            sampled = self._sampled_positions(m, q.device)  # randomized encodings, training
            if sampled is not None:
                k_positions, q_positions = sampled, sampled[m - n :]
        attn_mask = check_attn_mask(attn_mask, q, m)
        document_ids = check_document_ids(document_ids, n, m, q.shape[0], q.device)
        if window is not None and window >= m and q_positions is None and k_positions is None:
            window = None  # default positions: every |query - key| < M (N <= M)
        self._check_value_width(v)
        if backend == "auto":
            backend = self._auto_backend(q)
        args = (q, k, v, q_positions, k_positions, causal, attn_mask, rotated)
        if backend == "flex":
            return self._flex_attention(*args, window=window, document_ids=document_ids)
        if backend == "eager":
            return self._eager_attention(*args, window=window, document_ids=document_ids)
        return self._sdpa_attention(*args, window=window, document_ids=document_ids)

    def _auto_backend(self, q: Tensor) -> str:
        """The backend "auto" runs, from benchmarks/results (bf16, batch 2, 16 heads,
        head_dim 64, N = 2048 and 8192; ratios to FlashAttention):

        - a value-side term needs the attention weights, which SDPA and FlexAttention do
          not return: "eager" on CUDA; on the CPU "sdpa", whose value-term path forms
          the weights once and chunks causal queries (Shaw, 2 threads, float32, N =
          2048, causal: 8.9x plain SDPA forward against eager's 27x, training 4.6x
          against 12x; not causal within 15% of eager);
        - on CUDA, a position bias or relative terms that stay in the logits: "flex"
          (H200, attention_backends_cuda_bfloat16_fused.md: ALiBi forward 1.6-2.9x
          against sdpa's 3.3-6.5x and training 1.6-2.3x against 2.2-3.8x, T5 forward
          2.6-4.0x against 3.4-6.8x and training 3.8-6.6x against 5.4-18x, N = 2048 and
          8192 alike; H100, attention_backends_cuda_bfloat16_family.md: the relative
          family 11-16x against 15-32x at N = 2048);
        - otherwise (no position term in the logits, a bias folded into q and k, or the
          CPU, where FlexAttention is not fused): "sdpa" (FlashAttention where it can).
        """
        if self.has_value_term:
            return "eager" if q.is_cuda else "sdpa"
        folded = self.folds_position_bias and self.fold_bias is not False
        in_logits = self.has_relative_terms or (self.has_position_bias and not folded)
        flex_width = q.shape[-1] >= 16 and q.shape[-1] & (q.shape[-1] - 1) == 0
        return "flex" if in_logits and q.is_cuda and flex_width else "sdpa"

    def _trains_terms(self) -> bool:
        """Gradients flow into the position terms' parameters (tables, slopes, kernels):
        the module holds nothing else."""
        return torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())

    def _eager_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        causal: bool,
        attn_mask: Tensor | None,
        rotated: Rotated = "none",
        window: int | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """The literal decomposition in float32 (float64 for float64 inputs): the oracle."""
        n, m = q.shape[2], k.shape[2]
        with autocast_off(q.device.type):
            terms = self._score_terms_exact(q, k, q_positions, k_positions, rotated)
            logits = terms.pop("content_content")
            for term in terms.values():
                logits = logits + term  # [B, H, N, M]
            allowed = attention_allowed(
                q_positions, k_positions, n, m, q.device, causal, window, document_ids
            )  # [N, M] or [B, 1, N, M], or None
            weights = masked_softmax(apply_masks(logits, allowed, attn_mask))
            v = repeat_kv(v, q.shape[1] // v.shape[1])  # [B, H, M, value_dim]
            out = torch.matmul(weights, v.to(weights.dtype))  # [B, H, N, value_dim]
            if self.has_value_term:
                out = out + self._value_term(weights, q_positions, k_positions)
        return out.to(v.dtype)

    def _sdpa_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        causal: bool,
        attn_mask: Tensor | None,
        rotated: Rotated = "none",
        window: int | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """F.scaled_dot_product_attention with the position terms as an additive mask."""
        q, k = self._rotate_for_attention(q, k, q_positions, k_positions, rotated)
        if self.has_relative_terms:
            return self._sdpa_relative(
                q, k, v, q_positions, k_positions, causal, attn_mask, window, document_ids
            )
        n, m = q.shape[2], k.shape[2]
        has_bias = self.has_position_bias
        fold = self.fold_bias if self.fold_bias is not None else q.device.type == "cuda"
        if self.folds_position_bias and fold:
            v = repeat_kv(v, q.shape[1] // v.shape[1])
            q, k = self._fold_position_bias(q, k, q_positions, k_positions)
            has_bias = False  # now inside q' . k'
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        default_positions = q_positions is None and k_positions is None
        # a window folds into the per-distance vector (it depends on j - i alone); the
        # documents do not, so they take the materialised bias below
        by_distance = default_positions and attn_mask is None and document_ids is None
        if self.bias_by_distance and by_distance:
            return self._sdpa_by_distance(q, k, v, causal, gqa, window)
        # causal or window masking at default positions: chunks that skip masked keys
        chunkable = by_distance and (causal or window is not None)
        spans = query_chunks(n, m, q.device.type, causal, window) if chunkable else []
        if has_bias and len(spans) > 1:
            # each chunk of queries gets the bias at its own positions, over the keys it
            # may read
            def chunk_bias(i0: int, i1: int, lo: int, hi: int) -> Tensor:
                q_chunk = torch.arange(m - n + i0, m - n + i1, device=q.device)
                k_chunk = torch.arange(lo, hi, device=q.device)
                return self._sdpa_bias(
                    q_chunk, k_chunk, i1 - i0, hi - lo, q.device, q.dtype, causal, window
                )

            return self._sdpa_in_chunks(q, k, v, spans, chunk_bias, gqa)
        if has_bias:
            mask = self._sdpa_bias(
                q_positions, k_positions, n, m, q.device, q.dtype, causal, window, document_ids
            )
            if attn_mask is not None:
                mask = apply_masks(mask, None, attn_mask)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, **gqa)
        only_causal = window is None and document_ids is None and attn_mask is None
        if causal and default_positions and n == m and only_causal:
            # keys 0..M-1 and queries 0..N-1: SDPA's own causal mask, no mask tensor
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, **gqa)
        allowed = attention_allowed(
            q_positions, k_positions, n, m, q.device, causal, window, document_ids
        )  # [N, M] or [B, 1, N, M], or None
        if allowed is not None and len(spans) > 1:
            # a window, or causal queries that are the last N of M keys: each chunk of
            # queries against only the keys it may read
            grid = allowed  # [N, M]

            def chunk_allowed(i0: int, i1: int, lo: int, hi: int) -> Tensor:
                return grid[i0:i1, lo:hi]

            return self._sdpa_in_chunks(q, k, v, spans, chunk_allowed, gqa)
        mask: Tensor | None = allowed
        if attn_mask is not None:
            if allowed is None:
                mask = attn_mask if attn_mask.dtype == torch.bool else attn_mask.to(q.dtype)
            elif attn_mask.dtype == torch.bool:
                mask = allowed & attn_mask
            else:
                mask = apply_masks(attn_mask.to(q.dtype), allowed, None)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, **gqa)

    def _flex_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        causal: bool,
        attn_mask: Tensor | None,
        rotated: Rotated = "none",
        window: int | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """FlexAttention: position terms as a score_mod; causal, window and document
        masking as one block mask (``_flex_block_mask``).

        A bias of j - i alone at default positions without attn_mask or documents first
        tries the fused Triton kernel (``_fused_distance_attention``, where
        FUSED_DISTANCE_ROUTES lists the device for its form); otherwise it is computed
        per score (``_flex_bias``) or read from its [H, N + M - 1] vector (O(N + M)
        memory); other position terms are captured as the tensor the sdpa backend
        would add. Value-side terms need the weights and are refused.
        """
        if self.has_value_term:
            raise ValueError(
                'backend="flex" cannot add a value-side term (it needs the attention '
                'weights): use backend="eager" or "auto"'
            )
        q, k = self._rotate_for_attention(q, k, q_positions, k_positions, rotated)
        n, m = q.shape[2], k.shape[2]
        dtype = compute_dtype(q)
        has_bias = self.has_position_bias
        if self.folds_position_bias:  # the bias rides in extra features of q and k
            v = repeat_kv(v, q.shape[1] // v.shape[1])
            q, k = self._fold_position_bias(q, k, q_positions, k_positions)
            has_bias = False
        gqa = k.shape[1] != q.shape[1]
        default = q_positions is None and k_positions is None
        by_distance = has_bias and self.bias_by_distance and not self.has_relative_terms
        if by_distance and default and attn_mask is None and document_ids is None:
            fused = self._fused_distance_attention(q, k, v, causal, window)
            if fused is not None:
                return fused
        vec: Tensor | None = None
        added: Tensor | None = None  # [B or 1, H or 1, N, M], added to the scaled scores
        bias_fn: Any = None  # a bias per (b, h, q, kv) index, computed in the score_mod
        relative_fn: Any = None  # relative terms per (b, h, q, kv) index
        if self.has_relative_terms:
            heads_k = repeat_kv(k, q.shape[1] // k.shape[1])
            relative_fn = self._flex_relative(q, heads_k, q_positions, k_positions, dtype)
            if relative_fn is None:  # dense: the [B, H, N, M] terms, captured
                terms = self._relative_terms(q, heads_k, q_positions, k_positions, dtype)
                parts = list(terms.values())
                added = sum_into_new(parts) if parts else None
        trains_terms = self._trains_terms()
        clipped_gradient = (
            trains_terms
            and has_bias
            and default
            and added is None
            and attn_mask is None
            and window is None
            and document_ids is None
            and self._flex_trains_clipped(q, m)
        )
        if clipped_gradient:
            # the bias as a constant per score (no gradient through the kernel), its
            # gradient attached below from a band and two triangles
            with torch.no_grad():
                bias_fn = self._flex_bias(q_positions, k_positions, n, m, q.device, dtype)
        elif has_bias and not trains_terms:
            # computed per score where the block can (no gather per score). Not when
            # training it: the backward would add every score's gradient atomically
            # into a few values (T5's [H, 257], KERPLE's [H]): a T5 training step at
            # N = 8192 took 1.5 s (H100, bf16); the distance vector or the captured
            # tensor spreads those adds over N + M - 1 or N * M entries
            bias_fn = self._flex_bias(q_positions, k_positions, n, m, q.device, dtype)
        if bias_fn is None and self.bias_by_distance and default and added is None:
            vec = self._distance_bias(n, m, q.device).to(dtype)  # [H, N + M - 1]
            if self.position_bias_inside_scale:
                vec = vec * self.scale
        elif bias_fn is None and has_bias:
            bias = self._position_bias(q_positions, k_positions, n, m, q.device)
            assert bias is not None  # has_position_bias
            bias = bias.to(dtype) * (self.scale if self.position_bias_inside_scale else 1.0)
            added = bias if added is None else added + bias
        if attn_mask is not None:
            mask = attn_mask.to(dtype) if attn_mask.dtype != torch.bool else None
            if mask is None:
                zero = torch.zeros((), dtype=dtype, device=q.device)
                mask = torch.where(attn_mask, zero, torch.full_like(zero, float("-inf")))
            added = mask if added is None else added + mask
        inside = self.scale if self.position_bias_inside_scale else 1.0
        score_mod = flex_score_mod(vec, added, n, bias_fn, inside, relative_fn)
        block_mask = self._flex_block_mask(
            q_positions, k_positions, q.shape[0], n, m, q.device, causal, window, document_ids
        )
        compile_flex = self.flex_compile
        if compile_flex is None:
            compile_flex = q.device.type == "cuda"
        io_dtype = dtype  # the position terms above stay in float32 (or float64)
        if compile_flex and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            # the fused kernel reads half-precision q, k, v and computes the scores and
            # the score_mod in float32 (an up-cast here cost the tensor cores)
            io_dtype = q.dtype
        with autocast_off(q.device.type):
            inputs = (q.to(io_dtype), k.to(io_dtype), v.to(io_dtype))
            if clipped_gradient:
                out = self._flex_with_clipped_gradient(
                    *inputs, score_mod, block_mask, gqa, compile_flex, causal, inside
                )
            else:
                out = run_flex(
                    *inputs, score_mod, block_mask, self.scale, gqa, compile_flex, trains_terms
                )
        return out.to(v.dtype)

    def _flex_trains_clipped(self, q: Tensor, m: int) -> bool:
        """flex trains this encoding's clipped bias through ``_flex_with_clipped_gradient``
        (given default positions and no other mask or term): the bias is clipped, the
        device is in ``CLIPPED_BIAS_FLEX_DEVICES`` and there are at least
        ``CLIPPED_BIAS_MIN_KEYS_PER_CLIP`` keys per unit of the clip distance."""
        clip = self.clipped_distance
        return (
            clip is not None
            and q.device.type in CLIPPED_BIAS_FLEX_DEVICES
            and band_gradient_pays(m, clip)
        )

    def _fused_distance_attention(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, window: int | None
    ) -> Tensor | None:
        """flex's route for a bias of j - i alone at default positions (no attn_mask or
        documents) through ``fused_distance_attention`` where FUSED_DISTANCE_ROUTES
        lists the device for the bias's form: the kernel computes ALiBi's c_h |j - i|
        per score ("slope") and reads other biases from their per-distance vector
        ("vector": T5's clipped [H, 2K + 1], one value per tile past the clip). None
        where it does not serve: other devices, forms or widths, or a bias that
        trains, except a clipped one (T5's table), whose gradient comes from
        ``attach_clipped_bias_gradient`` as on flex's ``_flex_with_clipped_gradient``.
        """
        n, m = q.shape[2], k.shape[2]
        clip = self.clipped_distance
        trains = self._trains_terms()
        trains_clipped = (
            trains and clip is not None and window is None and band_gradient_pays(m, clip)
        )
        kind = "slope" if self.bias_linear_in_distance else "vector"
        if (
            (trains and not trains_clipped)
            or q.device.type not in FUSED_DISTANCE_ROUTES.get(kind, ())
            or not fused_distance_attention_serves(q, k, v)
        ):
            return None
        inside = self.scale if self.position_bias_inside_scale else 1.0
        if self.bias_linear_in_distance:
            bias, base = self._distance_slopes(q.device), 0  # [H]
        elif clip is not None:  # [H, 2 clip + 1] at r = -clip .. clip
            bias, base = self._clipped_distance_bias(q.device), clip
        else:  # [H, N + M - 1] at r = -(M - 1) .. N - 1
            bias, base = self._distance_bias(n, m, q.device), m - 1
        bias = bias * inside  # keeps its graph where the clipped table trains
        constant = bias.detach().float()  # what the kernel reads
        out, lse = fused_distance_attention(
            q, k, v, self.scale, constant, kind, base, causal, window
        )
        if not trains_clipped:
            return out

        def triangle(qr: Tensor, kr: Tensor, vr: Tensor, scale: float) -> tuple[Tensor, Tensor]:
            # in the backward: the kernel that served the forward, whatever the settings now
            return _distance_forward(qr, kr, vr, None, "none", 0, scale, True, None)

        clipped = bias  # [H, 2 clip + 1], trained
        groups = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        return attach_clipped_bias_gradient(
            out, clipped, q, k, v, lse, self.scale, causal, triangle
        )

    def _flex_with_clipped_gradient(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        score_mod: Any,
        block_mask: Any,
        gqa: bool,
        compile_flex: bool,
        causal: bool,
        inside: float,
    ) -> Tensor:
        """flex_attention whose score_mod reads the clipped bias as a constant, with the
        bias's gradient attached from a band and two triangles
        (``attach_clipped_bias_gradient``); ``inside`` scales the bias (the logit scale
        where the bias sits inside it, else 1)."""
        n = q.shape[2]
        out, lse = run_flex(
            q, k, v, score_mod, block_mask, self.scale, gqa, compile_flex, return_lse=True
        )
        clipped = self._clipped_distance_bias(q.device) * inside  # [H, 2 clip + 1]
        # the backward's triangle: top-left causal over the n - clip queries that have keys
        # at least clip after them (its block mask made here: a backward fills no cache)
        rows = n - (clipped.shape[1] - 1) // 2
        triangle_mask = None
        if not causal and rows > 0:
            triangle_mask = self._flex_block_mask(
                None, None, q.shape[0], rows, rows, q.device, True
            )

        def triangle(qr: Tensor, kr: Tensor, vr: Tensor, scale: float) -> tuple[Tensor, Tensor]:
            return run_flex(
                qr, kr, vr, None, triangle_mask, scale, False, compile_flex, return_lse=True
            )

        groups = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        return attach_clipped_bias_gradient(
            out, clipped, q, k, v, lse, self.scale, causal, triangle
        )

    def _flex_block_mask(
        self,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        batch: int,
        n: int,
        m: int,
        device: torch.device,
        causal: bool,
        window: int | None = None,
        document_ids: Tensor | None = None,
    ) -> Any:
        """The block mask of ``attention_allowed`` (mask_mod: ``flex_mask_mod``), or None
        when nothing masks.

        FlexAttention skips the blocks the mask_mod rules out entirely, so a window or
        documents cost only the blocks they keep. At default positions without documents
        the mask is cached per (N, M, causal, window, device); with explicit positions or
        documents it is built per call, per batch row where those are batched.
        """
        if not causal and window is None and document_ids is None:
            return None
        from torch.nn.attention.flex_attention import create_block_mask

        if q_positions is None and k_positions is None and document_ids is None:
            key = ("flex_mask", n, m, causal, window, str(device))
            cached = cache_get(self._cache, key)
            if cached is None:
                mask_mod = flex_mask_mod(None, None, n, m, causal, window, None)
                cached = create_block_mask(mask_mod, None, None, n, m, device=device)
                cached = cache_put(self._cache, key, cached)
            return cached
        per_batch = any(
            t is not None and t.dim() == 2 and t.shape[0] > 1
            for t in (q_positions, k_positions, document_ids)
        )
        mask_mod = flex_mask_mod(q_positions, k_positions, n, m, causal, window, document_ids)
        mask_batch = batch if per_batch else None
        return create_block_mask(mask_mod, mask_batch, None, n, m, device=device)

    def _sdpa_relative(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        causal: bool,
        attn_mask: Tensor | None,
        window: int | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """SDPA with the relative terms (they depend on q and k) materialised as the mask.

        With causal or window masking at default positions, the queries go in chunks
        (``query_chunks``), each with the explicit positions of its queries and of the
        keys it may read: its terms span only those keys.
        """
        n, m = q.shape[2], k.shape[2]
        default = q_positions is None and k_positions is None and document_ids is None
        if default and attn_mask is None and (causal or window is not None):
            spans = query_chunks(n, m, q.device.type, causal, window)
            if len(spans) > 1:
                outs = [
                    self._sdpa_relative(
                        q[:, :, i0:i1],
                        k[:, :, lo:hi],
                        v[:, :, lo:hi],
                        torch.arange(m - n + i0, m - n + i1, device=q.device),
                        torch.arange(lo, hi, device=q.device),
                        causal,
                        None,
                        window,
                    )
                    for i0, i1, lo, hi in spans
                ]
                return torch.cat(outs, dim=2)
        groups = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)  # the terms read every head
        n, m = q.shape[2], k.shape[2]
        dtype = compute_dtype(q)
        parts = list(self._relative_terms(q, k, q_positions, k_positions, dtype).values())
        if self.has_position_bias:
            bias = self._position_bias(q_positions, k_positions, n, m, q.device)
            assert bias is not None  # has_position_bias
            bias = bias.to(dtype)
            if self.position_bias_inside_scale:
                bias = bias * self.scale
            parts.append(bias)
        if parts:
            mask = sum_into_new(parts)  # [B, H, N, M], a fresh tensor
        else:
            mask = torch.zeros((n, m), dtype=dtype, device=q.device)
        allowed = attention_allowed(
            q_positions, k_positions, n, m, q.device, causal, window, document_ids
        )
        if allowed is not None:
            mask = block_fresh(mask, allowed)
        mask = apply_masks(mask, None, attn_mask)
        if self.has_value_term:
            # the value term needs the weights, which SDPA does not return: form them
            # once and apply them to v here as well (an SDPA call on top would double
            # the work: Shaw at N = 512 on the CPU ran 10.6x plain SDPA, eager 6.7x)
            content = torch.matmul(q.to(dtype), k.to(dtype).transpose(-2, -1)) * self.scale
            weights = masked_softmax(content + mask)  # [B, H, N, M]
            out = torch.matmul(weights, v.to(dtype))
            return (out + self._value_term(weights, q_positions, k_positions)).to(v.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), scale=self.scale)
        return out.to(v.dtype)

    def _sdpa_by_distance(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool,
        gqa: dict[str, bool],
        window: int | None = None,
    ) -> Tensor:
        """SDPA with a bias of j - i alone, never an [H, N, M] tensor: O(N + M) memory.

        The bias per distance [H, N + M - 1] (causal and window masking folded in as -inf
        on the distances they exclude, ``distance_allowed``) is viewed as [1, H, N, M]
        with the queries reversed (``query_reversed_bias``); q goes in reversed and the
        output comes back in order.
        """
        n, m = q.shape[2], k.shape[2]
        clip = self.clipped_distance
        if (
            clip is not None
            and self._trains_terms()
            and clipped_bias_attention_serves(q, m, clip, window)
        ):
            # a training step without SDPA's math kernel: the bias's gradient from a band
            # of clip diagonals and two triangles (``_ClippedBiasAttention``)
            clipped = self._clipped_distance_bias(q.device)  # [H, 2 clip + 1]
            if self.position_bias_inside_scale:
                clipped = clipped * self.scale
            groups = q.shape[1] // k.shape[1]
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
            return clipped_bias_attention(q, k, v, clipped.to(q.dtype), self.scale, causal)
        vec = self._distance_bias(n, m, q.device)  # [H, N + M - 1]
        if self.position_bias_inside_scale:
            vec = vec * self.scale  # SDPA scales q.k only; this bias sits inside the scale
        allowed = distance_allowed(n, m, q.device, causal, window)  # [N + M - 1] or None
        if allowed is not None:
            vec = vec.masked_fill(~allowed, float("-inf"))
        vec = half_precision_bias(vec, q.dtype)  # [H, N + M - 1]
        if n == 1:  # one query (a decode step): the vector is its row, in key order
            mask = vec[None, :, None, :]  # [1, H, 1, M]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, **gqa)
        if allowed is None and not vec.requires_grad:
            spans = [(0, n, 0, m)]  # nothing to skip: one call over every key
        else:
            spans = query_chunks(n, m, q.device.type, causal, window)

        def chunk_view(i0: int, i1: int, lo: int, hi: int) -> Tensor:
            return distance_chunk_view(vec, n, i0, i1, lo, hi)  # [1, H, rows, keys]

        return self._sdpa_in_chunks(q, k, v, spans, chunk_view, gqa, queries_reversed=True)

    def _sdpa_in_chunks(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        spans: list[tuple[int, int, int, int]],
        mask_of: Any,
        gqa: dict[str, bool],
        queries_reversed: bool = False,
    ) -> Tensor:
        """One SDPA call per (i0, i1, lo, hi) of ``query_chunks``: queries i0 .. i1 - 1
        against keys lo .. hi - 1 with the mask ``mask_of(i0, i1, lo, hi)``, whose rows
        run in reverse query order when ``queries_reversed`` (then the chunk's queries
        go in reversed and its output comes back in order) -> [B, H, N, value_dim]."""
        outs = []
        for i0, i1, lo, hi in spans:
            rows = q[:, :, i0:i1].flip(2) if queries_reversed else q[:, :, i0:i1]
            keys, values, mask = k[:, :, lo:hi], v[:, :, lo:hi], mask_of(i0, i1, lo, hi)
            if trained_mask_attention_serves(rows, mask):
                out = trained_mask_attention(rows, keys, values, mask, self.scale)
            else:
                out = F.scaled_dot_product_attention(
                    rows, keys, values, attn_mask=mask, scale=self.scale, **gqa
                )
            outs.append(out.flip(2) if queries_reversed else out)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _sdpa_bias(
        self,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        n: int,
        m: int,
        device: torch.device,
        dtype: torch.dtype,
        causal: bool,
        window: int | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Additive mask for SDPA: the (scaled) position bias with -inf where masked."""
        bias = self._position_bias(q_positions, k_positions, n, m, device)
        assert bias is not None  # has_position_bias
        if self.position_bias_inside_scale:
            bias = bias * self.scale  # SDPA scales q.k only; this bias sits inside the scale
        allowed = attention_allowed(
            q_positions, k_positions, n, m, device, causal, window, document_ids
        )
        mask = half_precision_bias(apply_masks(bias, allowed, None), dtype)
        # SDPA's CPU kernels take a 4-D mask directly; a 3-D one is ~3x slower (measured)
        return mask.unsqueeze(0) if mask.dim() == 3 else mask  # [1 or B, H, N, M]
