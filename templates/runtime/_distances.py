"""A bias of the key minus query position alone, kept per distance.

At default positions (queries M - N .. M - 1, keys 0 .. M - 1) the N x M bias of
j - i has only N + M - 1 distinct values, one per diagonal: a vector [H, N + M - 1].
Reversing the query order turns each diagonal into an overlapping strided row, so the
whole [H, N, M] bias is a view of that vector (``query_reversed_bias``), whose backward
sums each diagonal (``anti_diagonal_sums``).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ._caches import arange_view, cache_get, cache_put, kept_over_reach
from ._inputs import under_function_transform
from ._numerics import autocast_dtype
from ._triton import power_of_two_at_least


def default_distances(n: int, m: int, device: torch.device) -> Tensor:
    """Key minus query position, one per diagonal, for default positions: int64 [n + m - 1].

    Queries M - N .. M - 1 against keys 0 .. M - 1 give r = j - i - (M - N) from
    -(M - 1) to N - 1; entry t holds r = t - (M - 1).
    """
    return torch.arange(-(m - 1), n, device=device)


def distance_span_vector(
    cache: dict[tuple[Any, ...], Any],
    key: tuple[Any, ...],
    n: int,
    m: int,
    device: torch.device,
    of_distances: Callable[[Tensor], Tensor],
) -> Tensor:
    """``of_distances(default_distances(n, m, device))`` ([..., N + M - 1]), as a slice of
    a vector kept in ``cache`` under ``key`` that spans more distances.

    ``of_distances`` maps key minus query positions (int64 [L]) to a value per distance
    ([..., L]) that depends on the distance alone, so the vector for (N, M) is the part
    of any wider one between r = -(M - 1) and N - 1. The kept vector reaches back and
    ahead to powers of two (at least 1), at least as far as the calls before it: a decode loop's
    steps (N = 1, M one more each step) slice one vector made for up to twice their
    keys, where a vector per (N, M) was made again each step. While compiling, the
    vector is made in the graph."""
    if torch.compiler.is_compiling():
        return of_distances(default_distances(n, m, device))
    back, ahead = m - 1, n - 1  # the distances this call reads: -back .. ahead
    kept = cache_get(cache, key)
    if kept is None or kept[0] < back or kept[1] < ahead:
        reach_back, reach_ahead = power_of_two_at_least(back), power_of_two_at_least(ahead)
        if kept is not None:
            reach_back, reach_ahead = max(reach_back, kept[0]), max(reach_ahead, kept[1])
        distances = torch.arange(-reach_back, reach_ahead + 1, device=device)
        kept = cache_put(cache, key, (reach_back, reach_ahead, of_distances(distances)))
    reach_back, _, vector = kept
    start = reach_back - back  # entry of r = -(M - 1)
    return vector[..., start : start + n + m - 1]


def diagonal_rows(
    index_of: Callable[[Tensor], Tensor],
    n: int,
    m: int,
    causal: bool,
    table_rows: int,
    cache: dict[tuple[Any, ...], Any],
    index_key: tuple[Any, ...],
    ends_key: tuple[Any, ...],
    device: torch.device,
) -> tuple[Tensor, Tensor, int]:
    """The table rows a relative term reads, per diagonal of default positions.

    ``index_of`` maps key minus query positions (int64 [L]) to table rows in [0,
    table_rows), monotone in the distance (a clip, DeBERTa's signed log buckets).
    Returns each diagonal's row counted from the first row reached, int64 [N + M - 1]
    (``default_distances``' order), those rows, int64 [K], and the first of them, on the
    host: the rows the diagonals reach (with ``causal``, the first M diagonals, whose
    key is not after the query; the others read a row within them), or every row of the
    table while compiling. Being monotone, the index reaches its least and largest rows
    at the end distances, -(M - 1) and N - 1 (0 with ``causal``): ``monotone_index_ends``
    reads them from a host list kept in ``cache`` under ``ends_key``. The diagonals'
    rows are a slice of a vector kept under ``index_key`` (``distance_span_vector``),
    clamped only where causal diagonals reach past the rows (more than one query) and
    shifted only where the first row is not 0, and the rows a view of a kept range
    (``arange_view``): a decode step's new key count costs no device sync and at most
    one tensor op."""
    if torch.compiler.is_compiling():
        low, high = 0, table_rows - 1
    else:
        last = 0 if causal else n - 1
        low, high = monotone_index_ends(index_of, -(m - 1), last, cache, ends_key)
    diagonal = distance_span_vector(cache, index_key, n, m, device, index_of)  # [N + M - 1]
    if torch.compiler.is_compiling() or (causal and n > 1):  # later diagonals: the last row
        diagonal = diagonal.clamp(low, high)
    if low:
        diagonal = diagonal - low
    return diagonal, arange_view(cache, low, high + 1, device), low


def monotone_index_ends(
    index_of: Callable[[Tensor], Tensor],
    first: int,
    last: int,
    cache: dict[tuple[Any, ...], Any] | None = None,
    key: tuple[Any, ...] | None = None,
) -> tuple[int, int]:
    """The least and largest table rows that an index monotone in the distance
    (``index_of``: int64 distances [L] -> rows [L]; a clip, DeBERTa's signed log
    buckets) reaches over the distances first .. last: those of the two ends, computed
    on the host, so no device value is read.

    With ``cache`` and ``key`` (naming ``index_of``), read from a host list of the index
    over the distances -R .. R kept there, R a power of two grown as calls need: a
    decode step's new key count costs two list reads where DeBERTa's bucket formula
    on two distances took about 35 us of tensor ops (2-core AMD EPYC)."""
    if cache is None or key is None:
        low, high = sorted(index_of(torch.tensor([first, last])).tolist())
        return low, high

    def rows(reach: int) -> list[int]:  # distance -R + t at t
        # host data, as torch.tensor makes it on every device
        return index_of(torch.tensor(range(-reach, reach + 1))).tolist()

    reach, values = kept_over_reach(cache, key, max(abs(first), abs(last)), rows)
    low, high = sorted((values[first + reach], values[last + reach]))
    return low, high


class _QueryReversedDiagonals(torch.autograd.Function):
    """A per-distance vector [H, N + M - 1] as an [H, N, M] view with queries reversed.

    out[h, i', j] = vec[h, i' + j], where row i' = N - 1 - i is query i: for default
    positions the bias of query i and key j depends only on j - i, so reversing the
    queries turns every diagonal into an anti-diagonal, which one overlapping strided
    view expresses with no [H, N, M] copy. The backward sums each anti-diagonal of the gradient
    with a skew (pad each row by N, reshape to rows of N + M - 1, sum the rows): no
    scatter and no atomics, so its cost is one pass over the gradient.
    """

    @staticmethod
    def forward(ctx: Any, vec: Tensor, n: int, m: int) -> Tensor:
        ctx.n, ctx.m = n, m
        # a fresh copy (H (N + M - 1) values): as_strided reads from the start of its
        # input's storage under torch.compile, not from a view's offset (a query chunk's
        # slice of a trained vector read the entries from 0, the outputs off by 3)
        vec = vec.clone(memory_format=torch.contiguous_format)
        return vec.as_strided((vec.shape[0], n, m), (vec.shape[1], 1, 1))

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
    """[H, N + M - 1] per-distance values -> [H, N, M] view, queries in reverse order
    (under a torch.func transform, which takes no strided view, a gather)."""
    if under_function_transform():
        reversed_rows = torch.arange(n, device=vec.device)[:, None]  # [N, 1]
        return vec[:, reversed_rows + torch.arange(m, device=vec.device)]  # [H, N, M]
    return _QueryReversedDiagonals.apply(vec, n, m)


def distance_chunk_view(vec: Tensor, n: int, i0: int, i1: int, lo: int, hi: int) -> Tensor:
    """The bias of queries i0 .. i1 - 1 (of n, in reverse order) against keys lo .. hi - 1,
    as a view of a slice of the per-distance vector ``vec`` [H, n + m - 1] (entry t at
    key minus query position t - (m - 1), ``default_distances``): [1, H, rows, keys]."""
    # the chunk's first reversed row (query i1 - 1) starts at key lo: entry lo - i1 + n
    start = lo - i1 + n
    part = vec[:, start : start + (i1 - i0) + (hi - lo) - 1]
    return query_reversed_bias(part, i1 - i0, hi - lo).unsqueeze(0)


def distance_chunk_views(vec: Tensor, n: int) -> Callable[[int, int, int, int], Tensor]:
    """span (i0, i1, lo, hi) -> ``distance_chunk_view`` of ``vec`` for it: the masks of
    chunked flash calls with the queries reversed."""

    def view(i0: int, i1: int, lo: int, hi: int) -> Tensor:
        return distance_chunk_view(vec, n, i0, i1, lo, hi)  # [1, H, rows, keys]

    return view


def expand_distance_bias(vec: Tensor, n: int, m: int) -> Tensor:
    """[H, N + M - 1] per-distance values -> [H, N, M] bias for default positions (a copy)."""
    return query_reversed_bias(vec, n, m).flip(-2)


def bias_at_entries(vector: Tensor, entry: Tensor) -> Tensor:
    """A bias per distance read at each pair's entry: vector [H, L], entry int64
    [..., N, M] (each in 0 .. L - 1) -> [..., H, N, M], by one gather along the entries,
    heads first (each head's [N, M] comes out contiguous; advanced indexing took 4x as
    long on the CPU). Its backward scatters into the L entries, not the pairs."""
    flat = entry.reshape(1, -1).expand(vector.shape[0], -1)  # [H, ... N M]
    return torch.gather(vector, 1, flat).view(-1, *entry.shape).movedim(0, -3)


#: a bias of the key minus query position alone, at explicit positions on these
#: devices, is made once per distance the pairs reach and read per pair
#: (``distance_vector_range``, ``bias_read_per_distance``): a host read of the distances'
#: least and largest per call, which a GPU would wait for
DISTANCE_VECTOR_DEVICES: set[str] = {"cpu"}
#: ... where those distances are at most this many per query and key of the call
#: (positions a step apart reach N + M - 1); positions farther apart compute it per pair
DISTANCE_VECTOR_PER_POSITION = 4


def distance_vector_range(distance: Tensor, n: int, m: int) -> tuple[int, int] | None:
    """(least, count) of ``distance`` (a distance per pair, int64 [..., N, M]) where a
    bias vector over the distances least .. least + count - 1 is to be made and read per
    pair (``bias_at_entries``): eager mode on a device in ``DISTANCE_VECTOR_DEVICES``,
    at most ``DISTANCE_VECTOR_PER_POSITION`` (n + m) entries; else None."""
    if torch.compiler.is_compiling() or distance.device.type not in DISTANCE_VECTOR_DEVICES:
        return None
    if distance.numel() == 0:
        return None
    least, largest = torch.stack(torch.aminmax(distance)).tolist()  # one host read
    count = largest - least + 1
    return (least, count) if count <= DISTANCE_VECTOR_PER_POSITION * (n + m) else None


def bias_read_per_distance(
    bias_of_distances: Callable[[Tensor], Tensor], relative: Tensor, n: int, m: int
) -> Tensor | None:
    """A bias of the key minus query position alone at explicit positions, made once per
    distance and read per pair: ``bias_of_distances`` maps distances int64 [L] to the
    bias [H, L] (or [1, L] for a bias alike in every head); relative: key minus query
    position per pair, int64 [..., N, M]. Returns [..., H or 1, N, M], or None where
    ``distance_vector_range`` declines (the caller then computes the bias per pair).
    The formula then runs L times per head, not N M times, and its backward reaches
    the parameters through the L entries."""
    reach = distance_vector_range(relative, n, m)
    if reach is None:
        return None
    least, count = reach
    distances = torch.arange(least, least + count, device=relative.device)  # [L]
    return bias_at_entries(bias_of_distances(distances), relative - least)  # [..., H, N, M]


def distance_span_with_zero(relative: Tensor) -> tuple[int, int] | None:
    """(low, high), the least and largest of 0 and the distances ``relative`` (int64
    [N, M], a distance per pair), where ``distance_vector_range`` allows their run and
    low .. high holds at most ``DISTANCE_VECTOR_PER_POSITION`` (N + M) distances; else
    None."""
    n, m = relative.shape[-2:]
    reach = distance_vector_range(relative, n, m)
    if reach is None:
        return None
    least, count = reach
    low, high = min(least, 0), max(least + count - 1, 0)
    return (low, high) if high - low + 1 <= DISTANCE_VECTOR_PER_POSITION * (n + m) else None


def distance_rows_at_positions(relative: Tensor, n: int, m: int) -> tuple[Tensor, Tensor]:
    """The rows of a table over distances (Transformer-XL's relative sinusoids) that
    explicit positions read, and where each pair reads: (index [..., N, M], rows int64
    [K], ascending), ``relative`` being each pair's distance, int64 [..., N, M].

    Where ``distance_vector_range`` allows it (positions no farther apart than a few
    steps), the rows are the whole run least .. largest, and index = relative - least:
    the kept projected rows are then read as a slice, with no sort of the N M distances
    and no gather of the rows. Elsewhere (positions far apart, a GPU, compiling) only
    the distinct distances present, so that the range between far positions is never
    built. A decode step of a batch of two at positions two apart, each row its own
    (8 heads of 64, 2-core AMD EPYC): 1.03 -> 0.84 ms against 449-512 keys, 9.6-11.4 ->
    9.1-9.3 ms against 4033-4096 (two runs)."""
    reach = distance_vector_range(relative, n, m)
    if reach is None:
        rows, index = torch.unique(relative, return_inverse=True)  # [K], like relative
        if torch.compiler.is_compiling() and relative.numel() > 0:
            # K is data-dependent in a graph; inductor's matmul over the rows must know
            # that K >= 1 (it failed to decide "Max(1, u0) >= u0" without it)
            torch._check(rows.shape[0] >= 1)
        return index, rows
    least, count = reach
    return relative - least, torch.arange(least, least + count, device=relative.device)


# Devices where the sdpa backend raises a bias's finite entries to at least
# ``BIAS_FLOOR`` below the largest entry each query surely reads (``floored_bias``),
# in float32 and half precision. A steep bias (ALiBi, KERPLE, Sandwich far from the
# query) otherwise leaves softmax weights between 2^-149 and 2^-126, denormal floats,
# on which CPU arithmetic is slow: an ALiBi training step through CPU SDPA (batch 2,
# 16 heads, head_dim 64, N = 2048, float32, denormals not flushed) took 3.1x the
# bias-free step with the bias as it is and 1.08x floored, with the same outputs to the
# last bit. ``flush_denormals`` does more, process-wide; GPUs compute on denormals at
# full speed.
BIAS_FLOOR_DEVICES: set[str] = {"cpu"}

# How far below that entry the floor sits, beyond a bound on how much the row's content
# logits differ (``content_spread``): a floored key's weight is then at most e^-40 times
# the row's largest, so over M keys an output moves by at most M e^-40 of v's scale (8192
# keys: 3.5e-14, below float32's resolution); float64 is left exact.
BIAS_FLOOR = 40.0

# The largest spread bound under which the floor sits BIAS_FLOOR below: a floored key's
# logit then lies about BIAS_FLOOR + spread under the row's largest (the bound is loose,
# so the keys' own content differences are small beside it), at most 80 here, above
# float32's denormal range of e^-103.3 .. e^-87.3. With a larger bound that distance
# would land in the range: ALiBi with randn q and k scaled by 1.3 (bounds up to 50, 1024
# keys) had 13.8% of its softmax weights denormal under such a floor against 2.6% with
# no floor (benchmarks/results/denormal_weights_cpu_float32_content_scale.md).
BIAS_FLOOR_MOST_SPREAD = 40.0

# Past that bound the floor sits this far below the row's top less the spread instead:
# a floored key's logit is then at least 105 under the row's largest, and its weight
# exp(-105) rounds to exactly 0 rather than to a denormal (keys above the floor keep
# their bias, as with no floor).
BIAS_FLOOR_DEEP = 105.0

# The floor also sits at least this fraction of the top's magnitude below it: 128
# float32 spacings, so that top - depth does not round back to the top, which would
# raise every key of the row to it (from |top| = 2^30 for BIAS_FLOOR, where a float32's
# spacing is 128). A row that far from 0 then reads its keys above the floor exactly
# and the rest with weight 0.
BIAS_FLOOR_RELATIVE = 2.0**-16


def bias_floor_serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the sdpa backend floors a bias for SDPA in ``dtype`` on ``device``."""
    return device.type in BIAS_FLOOR_DEVICES and dtype != torch.float64


def content_spread(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """A bound on how far SDPA's content logits scale * q_i . k_j differ between the keys
    of one query row: 2 |scale| |q_i| max_j |k_j| (Cauchy-Schwarz), [H, N, 1] in float32
    (float64 for float64 inputs), the largest over the batch; the keys' bound is per key
    head, read by its group of query heads. q [B, H, N, D], k [B, KVH, M, D]; detached.
    Inf or NaN entries give an infinite or NaN bound, under which ``floored_bias``
    raises nothing."""
    heads, n = q.shape[1], q.shape[2]
    if q.numel() == 0 or k.numel() == 0:
        return torch.zeros(heads, n, 1, device=q.device)
    dtype = torch.promote_types(q.dtype, torch.float32)  # half precision summed in float32
    q_norms = torch.linalg.vector_norm(q.detach(), dim=-1, dtype=dtype)  # [B, H, N]
    k_norms = torch.linalg.vector_norm(k.detach(), dim=-1, dtype=dtype)  # [B, KVH, M]
    k_top = k_norms.amax(dim=(0, 2)).repeat_interleave(heads // k.shape[1])  # [H]
    return (2 * abs(scale) * q_norms.amax(dim=0) * k_top[:, None]).unsqueeze(-1)


def floor_moves_nothing(bias: Tensor, top: Tensor) -> bool:
    """Whether every entry of bias [..., L] lies at most ``BIAS_FLOOR`` below top
    [..., 1] (one host read): then ``floored_bias`` under that top, whose floor sits
    ``BIAS_FLOOR`` and a spread of at least 0 below it, moves no entry whatever the
    spread, so the pass over the keys that bounds the spread (``content_spread``) can be
    skipped. False while compiling (no host read) and where an entry is NaN."""
    if torch.compiler.is_compiling() or bias.numel() == 0:
        return False
    return bool((top - bias <= BIAS_FLOOR).all())


# How many keys back from its distance-0 entry each kept per-distance vector stays
# within ``BIAS_FLOOR`` of it (``kept_row_is_shallow``), keyed on the vector's id and
# that entry's index: (weak reference to the vector, that count). An entry goes when its
# vector dies, so a model's layers, each with its own kept vector, never evict one
# another.
_SHALLOW_REACH: dict[tuple[int, int], tuple[weakref.ref[Tensor], int]] = {}


def kept_row_is_shallow(row: Tensor, m: int) -> bool:
    """Whether one query's row of a per-distance bias, row [H, M] (distances -(M - 1)
    .. 0, the last at distance 0), lies everywhere at most ``BIAS_FLOOR`` below its
    distance-0 entry, told without reading the row: it is a slice of a vector that
    posgen keeps across calls (``distance_span_vector``'s, its ``_base``; rows of it,
    or one row expanded over the heads), and how many keys back every row of that
    vector stays within ``BIAS_FLOOR`` of its distance-0 entry is read from the device
    once per kept vector (kept while the vector lives; ``floor_moves_nothing`` reads
    the row on every call: 9-43 us for 80-4096 keys on a 2-core AMD EPYC). Then
    ``floored_bias`` would move no entry, so the row needs neither a floor nor flushed
    weights, and SDPA takes it as it is. False for a row not sliced from a kept vector
    (one made per call), while compiling, and where an entry is NaN or -inf."""
    base = row._base
    if torch.compiler.is_compiling() or base is None or m == 0:
        return False
    if base.dim() != 2 or row.dim() != 2 or base.stride(1) != 1 or row.stride(1) != 1:
        return False
    if base.stride(0) < base.shape[1]:  # base's rows overlap: not a vector per head
        return False
    if row.stride(0) not in (0, base.stride(0)):  # not rows of base (0: one row for every head)
        return False
    # base's column of distance 0; every row of base is judged, the row's among them
    zero = int(row.storage_offset() - base.storage_offset()) % base.stride(0) + m - 1
    if zero >= base.shape[1]:
        return False
    key = (id(base), zero)
    kept = _SHALLOW_REACH.get(key)
    if kept is None or kept[0]() is not base:
        with torch.no_grad():
            back = base[:, : zero + 1].flip(-1)  # [H, R + 1]: distances 0, -1, ..., -R
            below = back[:, :1] - back  # [H, R + 1]: how far each lies below distance 0
            deepest = below.cummax(-1).values.amax(0)  # [R + 1]: the deepest within each reach
            # non-decreasing (NaN from the first NaN on): the reach is the count within
            reach = int((deepest <= BIAS_FLOOR).sum())  # one host read per kept vector

        def forget(_: object, key: tuple[int, int] = key) -> None:  # the vector died
            _SHALLOW_REACH.pop(key, None)

        kept = (weakref.ref(base, forget), reach)
        _SHALLOW_REACH[key] = kept
    return m <= kept[1]


def floored_bias(bias: Tensor, top: Tensor, spread: Tensor) -> Tensor:
    """bias with its finite entries raised to at least ``top - BIAS_FLOOR - spread``
    (top and spread broadcast against bias and detached: per head and query row, top no
    higher than the largest entry that row reads, so no row's largest logit moves, and
    spread a bound on how far the row's content logits differ, ``content_spread``);
    -inf stays, and so does everything where the floor is -inf or NaN. A raised key's
    weight was and stays below e^-BIAS_FLOOR times the row's largest. The gradient
    reaches the entries left as they were (``_Floor``)."""
    floor = _floor_under(top, spread)
    if not (torch.is_grad_enabled() and bias.requires_grad):
        return _raised(bias, floor)
    floored: Tensor = _Floor.apply(bias, floor)
    return floored


def floored_rows(bias: Tensor, spread: Tensor, out: Tensor | None = None) -> Tensor:
    """``floored_bias`` of bias [..., rows, keys] under each row's largest entry, in as
    few passes as its entries allow, written into ``out`` (bias's shape) where given and
    the floor changes an entry. In eager mode without autograd, one host read of each
    row's smallest entry against its floor leaves a bias whose every entry is at or
    above its floor as it is (a shallow bias: T5's, ALiBi's nearest keys) and raises one
    with no -inf entry by a maximum alone (no fill). On a [16, 64, 2048] float32 chunk
    (2-core CPU) the raise took 1.4 ms with the fill and 0.3 ms without; the row minima
    0.08 ms."""
    top = bias.amax(dim=-1, keepdim=True)  # [..., rows, 1]
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and bias.requires_grad):
        return floored_bias(bias, top, spread)
    floor = _floor_under(top, spread)
    low = bias.amin(dim=-1, keepdim=True)  # [..., rows, 1]
    above_floor, finite = torch.stack([(low >= floor).all(), (low > -math.inf).all()]).tolist()
    if above_floor:  # max(bias, floor) is bias
        return bias
    return torch.maximum(bias, floor, out=out) if finite else _raised(bias, floor, out)


def rows_clear_floor(bias: Tensor, spread: Tensor) -> bool:
    """Whether ``floored_rows`` would move no finite entry of bias [..., rows, keys] with
    any masks of -inf joined to it (causal, window or document masks, a boolean
    ``attn_mask``), told from the bias before them (two row reductions, one host read):
    a mask only removes entries, so each row's largest entry read is at most its
    largest entry here, its smallest finite one at least its smallest here, and the
    floor under the former lies no higher. Then the masked bias needs no floor, which
    over a causal chunk is a maximum, a select and a scan for -inf (FIRE's causal
    forward at N = 2048 paid them on every chunk, its bias being shallow). A row whose
    first and last keys already lie farther apart than its floor's depth is steep
    (ALiBi's and KERPLE's far from the query), told from those two columns before the
    reductions. False while compiling, for an empty bias, and where an entry is NaN or
    infinite."""
    if torch.compiler.is_compiling() or bias.numel() == 0:
        return False
    with torch.no_grad():
        depth = _floor_depth(spread)  # [..., rows, 1]; NaN fails every comparison
        gap = (bias[..., :1] - bias[..., -1:]).abs()  # [..., rows, 1]
        if bool((gap > depth).any()):  # some row is wider than its floor's depth
            return False
        top = bias.amax(dim=-1, keepdim=True)  # [..., rows, 1]
        low = bias.amin(dim=-1, keepdim=True)
        return bool(((top - low <= depth) & (top < math.inf)).all())


def _floor_under(top: Tensor, spread: Tensor) -> Tensor:
    """``top - BIAS_FLOOR - spread`` where the spread is at most ``BIAS_FLOOR_MOST_SPREAD``,
    else ``top - BIAS_FLOOR_DEEP - spread`` (either way no floored key's weight was or
    becomes more than e^-BIAS_FLOOR of the row's largest), detached, with NaN and +inf
    as -inf (no floor)."""
    top = top.detach()
    # far from 0 a float32 top's spacing outgrows the depth (128 at 2^30: KERPLE-power's
    # -|i - j|^2 at distance 2^15), and top - depth rounded back to top raised every key
    depth = torch.maximum(_floor_depth(spread), top.abs() * BIAS_FLOOR_RELATIVE)
    floor = top - depth
    return floor.nan_to_num(nan=-math.inf, posinf=-math.inf, neginf=-math.inf)


def _floor_depth(spread: Tensor) -> Tensor:
    """How far below a row's top ``_floor_under`` puts its floor: ``BIAS_FLOOR`` or
    ``BIAS_FLOOR_DEEP``, plus the spread (detached; NaN or inf where the spread is)."""
    spread = spread.detach()
    return torch.where(spread <= BIAS_FLOOR_MOST_SPREAD, BIAS_FLOOR, BIAS_FLOOR_DEEP) + spread


def _raised(bias: Tensor, floor: Tensor, out: Tensor | None = None) -> Tensor:
    """max(bias, floor), -inf where bias is -inf (into ``out`` where given): a maximum and
    an in-place select. The
    select form ``where(bias == -inf, bias, maximum(bias, floor))`` took 28.7 ms against
    17.8 ms on a [16, 256, 2048] float32 chunk (2-core CPU); finding the -inf entries
    with ``isneginf`` rather than ``== -inf`` took the pair from 1.9-2.5 ms to 1.3-1.7 ms
    on a [16, 64, 2048] one, and the select in place rather than a ``masked_fill_`` from
    1.4 to 1.1 ms."""
    out = torch.maximum(bias, floor, out=out)
    if torch.compiler.is_compiling():  # traced: no out= (inductor fuses the two anyway)
        return torch.where(torch.isneginf(bias), bias, out)
    return torch.where(torch.isneginf(bias), bias, out, out=out)


class _Floor(torch.autograd.Function):
    """``floored_bias`` of a bias that trains, with a backward of one masked product.
    Through autograd, ``where(bias == -inf, bias, maximum(bias, floor))`` took a
    backward of two selects and a maximum's: for FIRE's [16, 256, 2048] chunk bias
    forward and backward 97 ms against 37-43 ms this way (2-core CPU, float32)."""

    @staticmethod
    def forward(ctx: Any, bias: Tensor, floor: Tensor) -> Tensor:
        ctx.save_for_backward(bias >= floor)  # entries left as they were
        return _raised(bias, floor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None]:
        (kept,) = ctx.saved_tensors
        return grad * kept, None


def half_precision_bias(bias: Tensor, dtype: torch.dtype) -> Tensor:
    """An additive bias cast to SDPA's ``dtype``; where SDPA computes in float16 or
    bfloat16 (``dtype`` itself, or autocast's: ``autocast_dtype``) its largest value
    along the last axis (0 where that is not finite) is subtracted first (detached).

    Softmax ignores a constant per query row (and per head, for a per-distance vector),
    so the result is the same function; the shift puts the entries that dominate the
    weights near 0, where half precision is finest. Sandwich's bias reaches 64, where
    bf16's spacing is 0.5: unshifted, outputs moved by 7e-2 (autocast rounds a float32
    mask to its dtype the same way). Four ops (a decode step
    pays each as a launch on a GPU): the maximum, ``nan_to_num`` (one op where a
    finiteness test, a zero fill and a select were three), the difference, the cast.
    """
    if autocast_dtype(dtype, bias.device.type) not in (torch.float16, torch.bfloat16):
        return bias.to(dtype)
    shift = bias.detach().amax(dim=-1, keepdim=True)
    shift = shift.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return (bias - shift).to(dtype)
