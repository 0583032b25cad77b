"""Argument checks and plumbing shared by every backend.

Inputs are q [B, H, N, D] and k, v [B, KVH, M, D] (or [batch, seq, heads, dim] with
``layout="bnhd"``); KVH divides H (grouped-query attention: query head h reads key head
h // (H / KVH)). Positions are int64 [seq] or [batch, seq] on the device of q, in
[0, 2^53); keys default to 0 .. M - 1 and queries to the last N key positions, as with
a KV cache. Each check raises ValueError naming the argument. The shape-keyed caches
here are bounded and safe across inference mode.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from ._triton import power_of_two_at_least

BACKENDS = ("auto", "eager", "sdpa", "flex")
LAYOUTS = ("bhnd", "bnhd")  # [batch, heads, seq, dim] (default) or [batch, seq, heads, dim]
CACHE_SIZE = 8  # shape-keyed caches keep this many most recent entries
# Positions are exact in float64 (angles, distances) below 2^53; larger ones are refused.
MAX_POSITION = 2**53 - 1
#: device types where ``parameters_unchanged`` compares every parameter on the device
#: and reads one flag back (one sync on a GPU, where a comparison per parameter is one
#: sync each); elsewhere ``torch.equal`` per parameter, which stops at the first
#: difference (on a CPU 1.5-2x faster than forming the comparison, and a read costs no
#: sync there). Tests add "cpu" to run the one-read form.
PARAMETERS_COMPARED_AT_ONCE: set[str] = {"cuda"}
# What a backend receives already rotated: nothing, the keys (a cache of rotated keys), or
# both q and k (rotated at M-RoPE axis positions before the backend).
Rotated = Literal["none", "keys", "both"]


def positive_int(value: int, name: str) -> int:
    """``value`` if it is a positive int (not a bool), else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_flag(value: bool, name: str) -> bool:
    """``value`` if it is a bool, else ValueError naming ``name`` (a tensor or a string
    would otherwise pass as "truthy" on one backend and fail on another)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_attention_inputs(
    q: Tensor, k: Tensor, v: Tensor | None, heads: int | None, head_dim: int
) -> None:
    """Raise ValueError unless q, k (and v) are [batch, heads, seq, dim] float tensors.

    k and v share a head count that divides q's (grouped-query attention). ``heads``,
    when given, is the head count q must have.
    """
    # each tensor's shape, dtype and device read once: a decode step calls this per layer
    named = (("q", q), ("k", k)) if v is None else (("q", q), ("k", k), ("v", v))
    shapes = [_attention_input_shape(name, tensor) for name, tensor in named]
    q_shape, k_shape = shapes[0], shapes[1]
    for (name, tensor), shape in zip(named[1:], shapes[1:], strict=True):
        if tensor.dtype != q.dtype or tensor.device != q.device:
            raise ValueError(
                f"q, k and v must share dtype and device: q is {q.dtype} on {q.device}, "
                f"{name} is {tensor.dtype} on {tensor.device}"
            )
        if shape[0] != q_shape[0]:
            raise ValueError(f"batch sizes differ: q has {q_shape[0]}, {name} has {shape[0]}")
    v_shape = shapes[2] if v is not None else None
    if v_shape is not None and v_shape[1] != k_shape[1]:
        raise ValueError(f"k and v must have the same heads, got {k_shape[1]} and {v_shape[1]}")
    if k_shape[1] == 0 or q_shape[1] % k_shape[1]:
        hint = ""
        swapped_divides = k_shape[2] and q_shape[2] % k_shape[2] == 0
        # valid with dims 1 and 2 swapped, and q's dim 2 (not dim 1) is the heads, where known
        if swapped_divides and (heads is None or q_shape[1] != heads == q_shape[2]):
            hint = (
                "; q and k look like the other layout: layout='bhnd' takes [batch, heads, "
                "seq, head_dim], layout='bnhd' [batch, seq, heads, head_dim]"
            )
        raise ValueError(
            f"q's {q_shape[1]} heads must be a multiple of k's {k_shape[1]} "
            f"(grouped-query attention: each key/value head serves heads / kv_heads queries){hint}"
        )
    if heads is not None and q_shape[1] != heads:
        hint = ""
        if q_shape[2] == heads:
            hint = (
                "; q looks like [batch, seq, heads, head_dim]: pass layout='bnhd' or "
                "transpose(1, 2)"
            )
        raise ValueError(f"expected {heads} heads (dim 1), got {q_shape[1]}{hint}")
    for name, shape in (("q", q_shape), ("k", k_shape)):
        if shape[3] != head_dim:
            raise ValueError(f"{name} must have head_dim {head_dim} (last dim), got {shape[3]}")
    if v_shape is not None and v_shape[2] != k_shape[2]:
        raise ValueError(f"k and v must have the same length, got {k_shape[2]} and {v_shape[2]}")


def check_one_input(x: Tensor, head_dim: int, name: str, heads: int | None = None) -> None:
    """Raise ValueError naming ``name`` unless x is a [batch, heads, seq, head_dim] float
    tensor (the argument of ``rotate_keys`` or ``scale_queries``), with ``heads`` heads
    where given."""
    shape = _attention_input_shape(name, x)
    if heads is not None and shape[1] != heads:
        raise ValueError(f"{name} must have {heads} heads (dim 1), got {shape[1]}")
    if shape[3] != head_dim:
        raise ValueError(f"{name} must have head_dim {head_dim} (last dim), got {shape[3]}")


# The floating-point dtypes posgen computes with. The float8 types pass
# is_floating_point() but most CPU and CUDA ops refuse them deep inside a call.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_strided(tensor: Tensor, name: str) -> None:
    """Raise ValueError naming ``name`` unless the tensor has the dense (strided) layout
    every path reads: a sparse or MKLDNN one failed deep inside torch."""
    if tensor.layout != torch.strided:
        raise ValueError(
            f"{name} must be a dense tensor (torch.strided layout), got {tensor.layout}: "
            "convert it with .to_dense()"
        )


def check_float_dtype(tensor: Tensor, name: str) -> None:
    """Raise ValueError naming ``name`` unless the tensor is in one of ``FLOAT_DTYPES``."""
    if tensor.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{name} must be a float16, bfloat16, float32 or float64 tensor, got {tensor.dtype}"
        )


def check_embed_input(x: Tensor, model_dim: int | None) -> None:
    """Raise ValueError naming x unless it is a [batch, seq, model_dim] float tensor
    (any feature count where ``model_dim`` is None: an encoding without an input-level
    part, whose ``embed`` returns x as it is)."""
    features = "features" if model_dim is None else str(model_dim)
    if not isinstance(x, Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    check_strided(x, "x")
    if x.dim() != 3 or model_dim not in (None, x.shape[-1]):
        raise ValueError(f"x must have shape [batch, seq, {features}], got {list(x.shape)}")
    check_float_dtype(x, "x")


def _attention_input_shape(name: str, tensor: Tensor) -> torch.Size:
    """The shape of the attention input ``name``, after ValueErrors naming it unless it
    is a floating-point tensor of rank 4."""
    if not isinstance(tensor, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    check_strided(tensor, name)
    shape = tensor.shape
    if len(shape) != 4:
        raise ValueError(f"{name} must have shape [batch, heads, seq, head_dim], got {list(shape)}")
    check_float_dtype(tensor, name)
    return shape


def check_positions(
    positions: Tensor | None,
    length: int,
    batch: int | None,
    name: str,
    device: torch.device,
    read_values: bool = True,
) -> Tensor | None:
    """Validate explicit positions: integers >= 0, shape [length] or [batch, length].

    The values are checked (``check_position_values``) unless ``read_values`` is False,
    where the caller checks them later, with another read of the device.
    """
    if positions is None:
        return None
    if not isinstance(positions, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(positions).__name__}")
    check_strided(positions, name)
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer positions (int64), got {positions.dtype}")
    if positions.dtype == torch.uint64:  # past 2^63 it would wrap to negative int64 values
        raise ValueError(
            f"{name} must hold integer positions that int64 holds (int64, int32, ..., "
            f"uint32), got {positions.dtype}"
        )
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
    if read_values:
        check_position_values(((name, positions),))
    return positions


class TensorVerdicts:
    """Verdicts on tensors' values (positions in range, positions at the defaults), each
    kept while every tensor it was drawn from is alive, the same object and at the same
    version: a model whose layers are each given the same positions (Hugging Face's
    ``position_ids``) reads them from the device once per forward, not once per layer
    (on a GPU each read is a host sync). The tensors are held by weak reference.
    Inference tensors have no version counter, so no verdict on them is kept (an edit
    in place, such as a position buffer refilled each step, would go unseen). The
    ``VERDICTS_KEPT`` most recent verdicts are kept. A view is known by its base and
    where it sits in it, so the same slice taken anew (a mask cut to the keys in every
    layer) finds the verdict on the last one.

    Some writes move no version counter: through ``.data``, or to memory shared with a
    NumPy array (``torch.from_numpy``) or through DLPack. On
    ``VALUE_CHECKED_VERDICT_DEVICES`` (the CPU, where a read costs no sync) a verdict
    therefore keeps a copy of each tensor's values and is used only while they are
    equal (``torch.equal``), and none is kept on a tensor of more than
    ``VERDICT_SNAPSHOT_MAX_ELEMENTS`` elements. Elsewhere (CUDA) that comparison would be
    the host sync the verdicts save, so a write that moves no version counter goes
    unseen there: pass a new tensor, or call
    ``torch.autograd.graph.increment_version`` on it after such a write. A tensor whose
    data was replaced (``t.data = other``) is seen on every device: its data pointer and
    shape are part of the stamp."""

    def __init__(self) -> None:
        self._kept: dict[tuple[Any, ...], tuple[tuple[Any, ...], Any]] = {}

    @staticmethod
    def _owner(t: Tensor) -> Tensor:
        """The tensor that holds t's data: its base for a view, else t itself."""
        return t if t._base is None else t._base

    @staticmethod
    def _identity(t: Tensor | None) -> Any:
        """What names t in a key: its id, or for a view its base's id, its place and its
        dtype (a view may read the same bytes as another dtype)."""
        if t is None:
            return None
        if t._base is None:
            return id(t)
        return (id(t._base), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)

    def _stamps(self, tensors: tuple[Tensor | None, ...]) -> tuple[Any, ...] | None:
        """(weak reference to the owner, version, data pointer, shape, copy of the values
        or None) of each tensor (None for None); None where a verdict on them cannot be
        kept."""
        stamps: list[Any] = []
        for t in tensors:
            if t is None:
                stamps.append(None)
                continue
            if t.is_inference():
                return None
            values = None
            if t.device.type in VALUE_CHECKED_VERDICT_DEVICES:
                if t.numel() > VERDICT_SNAPSHOT_MAX_ELEMENTS:
                    return None
                values = t.detach().clone()
            owner = weakref.ref(self._owner(t))
            stamps.append((owner, t._version, t.data_ptr(), t.shape, values))
        return tuple(stamps)

    def get(self, what: tuple[Any, ...], tensors: tuple[Tensor | None, ...]) -> Any:
        """The verdict ``what`` kept on these tensors, or None."""
        key = (*what, *(self._identity(t) for t in tensors))
        entry = self._kept.get(key)
        if entry is None:
            return None
        stamps, verdict = entry
        for t, stamp in zip(tensors, stamps, strict=True):
            if t is None:
                continue
            reference, version, pointer, shape, values = stamp  # (no inference tensor)
            stale = reference() is not self._owner(t) or t._version != version
            stale = stale or t.data_ptr() != pointer or t.shape != shape
            if stale or (values is not None and not torch.equal(t, values)):
                self._kept.pop(key, None)  # the tensor died, was replaced or edited
                return None
        return verdict

    def put(self, what: tuple[Any, ...], tensors: tuple[Tensor | None, ...], verdict: Any) -> None:
        """Keep the verdict ``what`` (not None) on these tensors."""
        stamps = self._stamps(tensors)
        if stamps is None:
            return
        key = (*what, *(self._identity(t) for t in tensors))
        self._kept.pop(key, None)
        self._kept[key] = (stamps, verdict)
        while len(self._kept) > VERDICTS_KEPT:
            del self._kept[next(iter(self._kept))]  # the oldest first


VERDICTS_KEPT = 8
# Device types where a kept verdict holds a copy of its tensors' values and is used only
# while they are equal (see ``TensorVerdicts``), and the most elements such a tensor may
# have (a copy of 2^20 is 8 MiB of int64 positions, 1 MiB of a bool mask; a larger one,
# a mask over a long prefill, is read afresh each call, a pass that costs far less than
# the attention over it).
VALUE_CHECKED_VERDICT_DEVICES = {"cpu"}
VERDICT_SNAPSHOT_MAX_ELEMENTS = 1 << 20
POSITION_VERDICTS = TensorVerdicts()


def outside_position_range(positions: Tensor) -> Tensor:
    """Whether some position lies outside [0, 2^53 - 1] (exact in float64): a 0-d bool
    tensor, no host read. One op on the values: an int64 lies in that range exactly when
    no bit above bit 52 is set (a negative one has its sign bit set)."""
    return (positions & ~MAX_POSITION).any()


def check_position_values(
    named: tuple[tuple[str, Tensor | None], ...], outside: bool | None = None
) -> None:
    """ValueError naming the first of ``named`` (name, int64 positions or None) with a
    position outside [0, 2^53 - 1]. ``outside``: whether any of them has one, read
    already; else one read of them all here (a host sync): eager mode only, never while
    compiling."""
    given = [(name, t) for name, t in named if t is not None and t.numel()]
    if not given or torch.compiler.is_compiling():
        return
    if outside is None:
        # positions found in range before, unchanged since, are not read again
        given = [(name, t) for name, t in given if not POSITION_VERDICTS.get(("in range",), (t,))]
        if not given:
            return
        flags = [outside_position_range(t) for _, t in given]
        outside = bool(flags[0] if len(flags) == 1 else torch.stack(flags).any())
    if not outside:
        for _, positions in given:
            POSITION_VERDICTS.put(("in range",), (positions,), True)
        return
    for name, positions in given:
        if bool(outside_position_range(positions)):
            low, high = int(positions.min()), int(positions.max())
            raise ValueError(
                f"{name} must lie in [0, 2^53 - 1] (exact in float64), got {low} .. {high}"
            )


FLOAT32_EXACT_POSITIONS = 2**24  # float32 holds every integer below this, not past it


def exact_positions_dtype(
    dtype: torch.dtype, q_positions: Tensor | None, k_positions: Tensor | None, m: int
) -> torch.dtype:
    """``dtype``, or float64 where a position in a narrower float would be rounded: a
    default key position M - 1 at or past 2^24, or an explicit one (``position_reach``,
    in eager mode; under torch.compile, which would need a sync to know, explicit
    positions always take float64)."""
    if dtype == torch.float64 or m > FLOAT32_EXACT_POSITIONS:
        return torch.float64
    for positions in (q_positions, k_positions):
        if positions is None or not positions.numel():
            continue
        if torch.compiler.is_compiling():
            return torch.float64
        if not position_reach(positions, FLOAT32_EXACT_POSITIONS):
            return torch.float64
    return dtype


def position_reach(positions: Tensor, limit: int) -> int:
    """The largest of ``positions`` (non-empty) plus one where all lie in [0, limit), else
    0: one read of their range (a host sync on a GPU), kept for the same tensor while
    unchanged (``POSITION_VERDICTS``), so the layers of a model given one positions
    tensor read it once. Eager mode only."""
    what = ("reach", limit)
    reach = POSITION_VERDICTS.get(what, (positions,))
    if reach is None:
        low, high = (int(end) for end in torch.aminmax(positions))
        reach = high + 1 if 0 <= low and high < limit else 0
        POSITION_VERDICTS.put(what, (positions,), reach)
    return int(reach)


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
    check_strided(positions, name)
    axes_first = positions.shape[0] == axes and positions.shape[-1] == length
    if not axes_first and positions.shape[-1] == axes and positions.shape[1] == length:
        positions = positions.movedim(-1, 0)  # coordinates [batch, length, axes]
    elif not axes_first:
        raise ValueError(
            f"{name} must have shape [{axes}, batch, {length}] (one row per position axis) "
            f"or [batch, {length}, {axes}] (coordinates), got {list(positions.shape)}"
        )
    rows = positions.shape[0] * positions.shape[1]  # (-1 cannot be read off 0 elements)
    flat = check_positions(positions.reshape(rows, length), length, None, name, device)
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
    read_values: bool = True,
) -> tuple[Tensor | None, Tensor | None]:
    """Validate both position tensors and resolve the queries' default.

    Without q_positions the queries are the last N keys: k_positions[..., M - N:] when
    key positions are given, M - N, ..., M - 1 otherwise (both None stays None, the
    cacheable default). N > M then has no default and raises ValueError. The values
    of both are checked with one read, unless ``read_values`` is False (the caller
    checks them: ``position_verdict(..., check_values=True)``).
    """
    q_positions = check_positions(q_positions, n, batch, "q_positions", device, False)
    k_positions = check_positions(k_positions, m, batch, "k_positions", device, False)
    if read_values:  # before the queries' default is taken from the keys
        check_position_values((("q_positions", q_positions), ("k_positions", k_positions)))
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


class PositionVerdict(NamedTuple):
    """What ``position_verdict`` tells of positions given.

    default: whether they are the defaults (or, where allowed, the defaults shifted).
    queries_last: whether in every batch row each query sits at or after every key, so
    that a causal mask hides nothing (a decode step at explicit positions: the newest
    query against its cache, evicted keys and rolling offsets included). Told from the
    positions' bounds where they were read (``_defaults_told_by_ranges``), else by a
    flag in the general test's read where no shift is allowed; False where not told.
    """

    default: bool
    queries_last: bool


def position_verdict(
    q_positions: Tensor | None,
    k_positions: Tensor | None,
    n: int,
    m: int,
    shifted: bool = False,
    document_ids: Tensor | None = None,
    check_values: bool = False,
    attn_mask: Tensor | None = None,
) -> PositionVerdict:
    """Whether validated positions (``check_position_pair``) that were given equal the
    defaults in every batch row: queries M - N, ..., M - 1 and keys 0, ..., M - 1, as a
    caller passing Hugging Face-style position ids for a plain sequence or a KV cache
    does. One read of the tensors (a host sync on a GPU): eager mode only, False while
    compiling, so that a traced call keeps the positions it was given.

    With ``shifted`` (an encoding with ``shift_invariant``), also the defaults plus a
    constant: one per batch row (positions 1 ... N; a rolling KV cache whose oldest key
    sits at position c), or, with validated ``document_ids``, one per document of a row
    (packed sequences whose positions restart at each document), where each query
    keeps the constant of its own key index M - N + i. Only pairs within a document are
    ever attended, and there every key minus query position is the defaults'.

    ``check_values``: also check the positions' values (``check_position_values``,
    raising ValueError) in the same read, for a caller that validated them with
    ``read_values=False``: one host sync per call for both.

    ``attn_mask`` (checked, ``check_attn_mask``; without ``document_ids``): keys it masks
    for every query of a batch row (False, -inf, or at most half the dtype's lowest
    value, as Hugging Face's additive masks hold) are never read, so their positions
    may be anything, where every query of the row reads some other key. A batch
    left-padded for generation, its positions counting the tokens each row keeps and
    padding at 0, then takes the paths for default positions (the rows shifted by their
    padding, for an encoding with ``shift_invariant``). The caller passes it only where
    no term reads masked keys' positions (not CoPE's counted positions).

    The verdict also says, where the same read tells it, whether every query comes
    after every key (``PositionVerdict.queries_last``).
    """
    unknown = PositionVerdict(False, False)
    if torch.compiler.is_compiling() or (q_positions is None and k_positions is None):
        return unknown
    if document_ids is not None:
        attn_mask = None  # (the documents' test takes every key)
    # keys first: queries left out are a slice of the keys, whose name the error takes
    named = (("k_positions", k_positions), ("q_positions", q_positions))
    tensors = (q_positions, k_positions, document_ids, attn_mask)
    what = ("default", n, m, shifted)
    kept: PositionVerdict | None = POSITION_VERDICTS.get(what, tensors)
    if kept is not None:  # the same tensors, unchanged, were read (and checked) before
        return kept
    if _equal_to_defaults(q_positions, k_positions, n, m):  # in range too
        verdict = PositionVerdict(True, False)
        POSITION_VERDICTS.put(what, tensors, verdict)
        return verdict
    checked, told, queries_last = False, None, False
    if document_ids is None and attn_mask is None:
        checked, told, queries_last = _defaults_told_by_ranges(
            q_positions, k_positions, n, m, shifted, check_values
        )
    if told is not None:  # the values were checked too, where asked
        verdict = PositionVerdict(told, queries_last)
        if check_values:
            POSITION_VERDICTS.put(what, tensors, verdict)
        return verdict
    given = [t for _, t in named if t is not None and t.numel()]
    flags = [outside_position_range(t) for t in given] if check_values and not checked else []
    default = (
        None
        if n > m
        else _default_flag(q_positions, k_positions, n, m, shifted, document_ids, attn_mask)
    )
    if not flags and default is None:
        return unknown  # (N > M: the default queries would sit before the first key)
    # whether every query comes after every key, in the same read, where the bounds were
    # not read already (other devices; document_ids or an attn_mask: a left-padded
    # batch) and no shift is allowed: positions that pass a test allowing one are mostly
    # shifted defaults, whose paths drop a decode step's causal mask anyway (a left-padded
    # batch against 512 keys: the flag's ops cost ALiBi's step 4% for nothing; FIRE's
    # step took 6% less with it)
    last = None
    sides_read = all(t is None or t.numel() for t in (q_positions, k_positions))
    if default is not None and not (queries_last or shifted) and q_positions is not None:
        last = _queries_last_flag(q_positions, k_positions, m) if sides_read else None
    tested = [*flags, *([] if default is None else [default]), *([] if last is None else [last])]
    read = torch.stack(tested).tolist()  # one read
    if flags:
        check_position_values(named, outside=any(read[: len(flags)]))
    is_default = default is not None and bool(read[len(flags)])
    verdict = PositionVerdict(is_default, queries_last or (last is not None and bool(read[-1])))
    if check_values:  # the values were checked too: a later call needs no read
        POSITION_VERDICTS.put(what, tensors, verdict)
    return verdict


# Device types where ``position_verdict`` first compares the positions with the
# defaults exactly (``torch.equal``, one read each, a host sync elsewhere) before its
# general test (about 15 small operations and one read): on a 2-core CPU, Hugging
# Face-style positions (one query at M - 1, keys 0 .. M - 1) made a decode step against
# 512 keys cost 152 us instead of the 56 us of no positions.
EXACT_DEFAULT_DEVICES = {"cpu"}


def _equal_to_defaults(
    q_positions: Tensor | None, k_positions: Tensor | None, n: int, m: int
) -> bool:
    """Whether the positions given (int64 [N] / [batch, N], [M] / [batch, M]) are the
    defaults exactly, on ``EXACT_DEFAULT_DEVICES`` (False elsewhere, and for N > M)."""
    given = q_positions if q_positions is not None else k_positions
    if given is None or n > m or given.device.type not in EXACT_DEFAULT_DEVICES:
        return False
    keys = arange_view(_KEPT_RANGES, 0, m, given.device)  # [M]: 0 .. M - 1
    for positions, defaults in ((q_positions, keys[m - n :]), (k_positions, keys)):
        if positions is not None and not torch.equal(positions, defaults.expand_as(positions)):
            return False
    return True


# The integer ranges ``_equal_to_defaults`` compares positions with (``arange_view``).
_KEPT_RANGES: dict[tuple[Any, ...], Any] = {}


def _defaults_told_by_ranges(
    q_positions: Tensor | None,
    k_positions: Tensor | None,
    n: int,
    m: int,
    shifted: bool,
    check_values: bool,
) -> tuple[bool, bool | None, bool]:
    """(whether the values were checked, the verdict on the defaults or None where it
    is left to the general test, whether every query comes after every key:
    ``PositionVerdict.queries_last``) for positions that ``_equal_to_defaults`` found
    unequal to the defaults, from one read of each row's smallest and largest position,
    where the general test takes about fifteen small ops and a read.

    Unshifted defaults were ruled out by that comparison, so only the defaults shifted
    by a constant per row remain (``shifted``, both given): the bounds rule them out
    where a row's keys do not span exactly M - 1, its queries N - 1, or its last query
    is not at its last key; otherwise positions of one row each are compared with the
    defaults shifted by the keys' smallest (two ``torch.equal``), and batched ones are
    left to the general test. With ``check_values`` the same read checks the values
    (raising as ``check_position_values`` does). (False, None) where the test does not
    serve: off ``EXACT_DEFAULT_DEVICES`` (a second read would be a second sync; there
    ``_equal_to_defaults`` compares nothing either), N > M, no positions or empty ones.
    A decode step against 512 keys on a 2-core CPU took this test in 70 us before (keys
    two apart, as a cache with evicted keys has them, or shifted by a constant), 29 and
    38 us after."""
    given = [t for t in (k_positions, q_positions) if t is not None]
    if not given or n > m or any(not t.numel() for t in given):
        return False, None, False
    if given[0].device.type not in EXACT_DEFAULT_DEVICES:
        return False, None, False
    one_row = all(t.dim() == 1 for t in given)
    if one_row:  # four 0-d bounds at most
        read = torch.stack([b for t in given for b in torch.aminmax(t)]).tolist()  # one read
    else:
        bounds = [torch.aminmax(t, dim=-1) for t in given]  # per row: [batch] each
        read = torch.cat([b.reshape(-1) for pair in bounds for b in pair]).tolist()
    rows: list[tuple[list[int], list[int]]] = []  # (lows, highs) per tensor given
    for t in given:
        count = t.shape[0] if t.dim() == 2 else 1
        rows.append((read[:count], read[count : 2 * count]))
        read = read[2 * count :]
    if check_values and any(
        lo < 0 or hi > MAX_POSITION
        for lows, highs in rows
        for lo, hi in zip(lows, highs, strict=True)
    ):  # (in range otherwise: the verdict on the defaults, kept by the caller, says so)
        named = (("k_positions", k_positions), ("q_positions", q_positions))
        check_position_values(named, outside=True)  # raises
    # keys left out sit at the defaults, 0 .. M - 1 (queries are never left out once
    # validated, ``check_position_pair``; where they are, the verdict stays unknown)
    key_lows, key_highs = rows[0] if k_positions is not None else ([0], [m - 1])
    query_lows, query_highs = rows[-1]
    queries_last = q_positions is not None and _each_row_at_or_after(query_lows, key_highs)
    if not (shifted and q_positions is not None and k_positions is not None):
        return True, False, queries_last  # no shift: _equal_to_defaults ruled them out
    if _bounds_rule_out_shift(query_lows, query_highs, key_lows, key_highs, n, m):
        return True, False, queries_last
    if not one_row:
        return True, None, queries_last
    # the keys less their least against 0 .. M - 1: a range kept up to the position
    # itself would grow with the shift (a rolling cache's keys sit anywhere below 2^53)
    keys = arange_view(_KEPT_RANGES, 0, m, given[0].device)  # [M]
    low = key_lows[0]
    shifted_defaults = torch.equal(k_positions - low, keys) and torch.equal(
        q_positions - low, keys[m - n :]
    )
    return True, shifted_defaults, queries_last


def _queries_last_flag(q_positions: Tensor, k_positions: Tensor | None, m: int) -> Tensor:
    """``_each_row_at_or_after`` as a 0-d bool tensor (no host read): each row's first
    query position at least its last key's (keys left out: M - 1)."""
    # [batch] or 0-d: one query's position is its own least
    first_query = q_positions[..., 0] if q_positions.shape[-1] == 1 else q_positions.amin(-1)
    if k_positions is None:
        return (first_query >= m - 1).all()
    return (first_query >= k_positions.amax(-1)).all()  # rows broadcast


def _each_row_at_or_after(query_lows: list[int], key_highs: list[int]) -> bool:
    """Whether each batch row's first query position is at least its last key position
    (rows of one broadcast): no key of the row comes after any of its queries."""
    if len(query_lows) == 1:
        query_lows = query_lows * len(key_highs)
    if len(key_highs) == 1:
        key_highs = key_highs * len(query_lows)
    return all(low >= high for low, high in zip(query_lows, key_highs, strict=True))


def _bounds_rule_out_shift(
    query_lows: list[int],
    query_highs: list[int],
    key_lows: list[int],
    key_highs: list[int],
    n: int,
    m: int,
) -> bool:
    """Whether each row's bounds rule out the defaults shifted by a constant per row
    (``_defaults_told_by_ranges``): keys spanning other than M - 1, queries other than
    N - 1, or a last query not at its row's last key (rows broadcast)."""
    if any(hi - lo != m - 1 for lo, hi in zip(key_lows, key_highs, strict=True)):
        return True
    if any(hi - lo != n - 1 for lo, hi in zip(query_lows, query_highs, strict=True)):
        return True
    if len(key_highs) == 1:  # rows broadcast
        key_highs = key_highs * len(query_highs)
    if len(query_highs) == 1:
        query_highs = query_highs * len(key_highs)
    return len(query_highs) == len(key_highs) and any(
        q_high != k_high for q_high, k_high in zip(query_highs, key_highs, strict=True)
    )


def _default_flag(
    q_positions: Tensor | None,
    k_positions: Tensor | None,
    n: int,
    m: int,
    shifted: bool,
    document_ids: Tensor | None,
    attn_mask: Tensor | None = None,
) -> Tensor:
    """``position_verdict``'s test of the defaults as a 0-d bool tensor (no host read); N <= M and
    at least one of the positions given."""
    given = q_positions if q_positions is not None else k_positions
    assert given is not None  # one of them (position_verdict)
    device = given.device
    q_offsets = None if q_positions is None else q_positions - torch.arange(m - n, m, device=device)
    k_offsets = None if k_positions is None else k_positions - torch.arange(m, device=device)
    if attn_mask is not None and k_offsets is not None:
        return _default_flag_on_read_keys(q_offsets, k_offsets, shifted, attn_mask)
    if not shifted or q_offsets is None or k_offsets is None:
        # a side left out is at the defaults, so the other must be too
        offsets = [t for t in (q_offsets, k_offsets) if t is not None]
        return torch.stack([(t == 0).all() for t in offsets]).all()
    checks = [(q_offsets == k_offsets[..., m - n :]).all()]  # [N] / [batch, N]
    if m > 1:
        if document_ids is None:  # one document per row: consecutive keys agree
            steps = k_offsets[..., 1:] == k_offsets[..., :-1]  # [M - 1] / [batch, M - 1]
        else:  # keys grouped by document, consecutive keys of a document agree
            documents, k_offsets = torch.broadcast_tensors(document_ids, k_offsets)
            order = documents.argsort(dim=-1)  # [M] / [batch, M]
            documents, k_offsets = documents.gather(-1, order), k_offsets.gather(-1, order)
            apart = documents[..., 1:] != documents[..., :-1]
            steps = apart | (k_offsets[..., 1:] == k_offsets[..., :-1])
        checks.append(steps.all())
    return torch.stack(checks).all()


def _default_flag_on_read_keys(
    q_offsets: Tensor | None, k_offsets: Tensor, shifted: bool, attn_mask: Tensor
) -> Tensor:
    """``_default_flag`` where the positions of keys that ``attn_mask`` masks for every
    query of their batch row are free: the queries' offsets from the defaults ([N] /
    [batch, N], None for the defaults) one constant per row (0 unless ``shifted``), each
    key's offset ([M] / [batch, M]) that constant or the key unread, and every query
    reading some key (a row masked whole would weigh its masked keys alike, positions
    and all). A 0-d bool tensor, no host read."""
    if attn_mask.dtype == torch.bool:
        reads = attn_mask
    else:  # -inf, or a finite mask as hard as Hugging Face's finfo.min
        reads = attn_mask > torch.finfo(attn_mask.dtype).min / 2
    every_query_reads = reads.any(-1).all()
    if reads.dim() == 4:  # [batch or 1, heads or 1, N or 1, M or 1]: per batch row
        key_read = reads.flatten(1, 2).any(1)  # [batch or 1, M or 1]
    else:  # [heads or 1, N or 1, M or 1] or [N or 1, M or 1]: alike in every row
        key_read = reads.reshape(-1, reads.shape[-1]).any(0)  # [M or 1]
    if q_offsets is None:  # the queries at the defaults: every row's constant is 0
        constant = torch.zeros((), dtype=k_offsets.dtype, device=k_offsets.device)
        checks = []
    else:
        constant = q_offsets[..., -1:]  # [1] / [batch, 1]: the last query's
        checks = [(q_offsets == constant).all()]
    if not shifted:
        checks.append((constant == 0).all())
    checks += [((k_offsets == constant) | ~key_read).all(), every_query_reads]
    return torch.stack(checks).all()


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


_TRANSFORMS_ACTIVE: Callable[[], bool] = getattr(
    torch._C, "_are_functorch_transforms_active", lambda: False
)


def under_function_transform() -> bool:
    """Whether a torch.func transform (``grad``, ``jacrev``, ``vmap``, ...) is running;
    False while compiling (dynamo traces the transform's own ops)."""
    return not torch.compiler.is_compiling() and _TRANSFORMS_ACTIVE()


def parameter_states(module: torch.nn.Module) -> tuple[tuple[int, int, int], ...]:
    """(id, storage address, version counter) of each of module's parameters: a cache key
    part that changes with an in-place update (an optimizer step, load_state_dict) and
    with a new tensor assigned to ``.data`` (which leaves the version counter as it is)."""
    return tuple((id(p), p.data_ptr(), p._version) for p in module_parameters(module))


def module_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """list(module.parameters()), in its order (each module's own, then its children's,
    depth first, each parameter once), read from the modules' parameter dicts, not
    through the generators over named members: ``parameter_states`` of DeBERTa's 7
    parameters in 5.1 us where it took 8.4 us, Transformer-XL's 3 in 2.6 where 3.9
    (2-core AMD EPYC), once or twice per decode step."""
    found: dict[int, torch.nn.Parameter] = {}
    pending = [module]
    while pending:
        current = pending.pop()
        for p in current._parameters.values():
            if p is not None:
                found.setdefault(id(p), p)
        pending.extend(child for child in reversed(current._modules.values()) if child is not None)
    return list(found.values())


class ParameterSnapshot:
    """Detached copies of a module's parameters, kept beside a value cached from them so
    that ``parameters_unchanged`` can tell later whether the value still holds, and the
    ``parameters_frozen`` block and optimizer step (``frozen_in``, ``frozen_since``) at
    which they were last found equal to the parameters: until the next step within that
    block they are not compared again."""

    __slots__ = ("tensors", "frozen_in")

    def __init__(self, tensors: tuple[Tensor, ...], frozen_in: tuple[object, int] | None) -> None:
        self.tensors = tensors
        self.frozen_in = frozen_in


def frozen_block(module: torch.nn.Module) -> object | None:
    """The ``parameters_frozen`` block module is inside (a token per block), or None."""
    return getattr(module, "_frozen_block", None)


class _OptimizerSteps:
    """How many ``torch.optim`` steps this process has taken since the first
    ``parameters_frozen`` block (a global step post hook, registered once): a fused step
    (``fused=True``, Hugging Face's default AdamW) writes the parameters without moving
    their version counters, so a block's promise holds between steps only."""

    count = 0
    hook: Any = None

    @classmethod
    def start(cls) -> None:
        if cls.hook is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            cls.hook = register_optimizer_step_post_hook(cls.taken)

    @classmethod
    def taken(cls, optimizer: Any, args: Any, kwargs: Any) -> None:
        cls.count += 1


def count_optimizer_steps() -> None:
    """Start counting optimizer steps (``_OptimizerSteps``); a ``parameters_frozen``
    block calls it on entry."""
    _OptimizerSteps.start()


def frozen_since(module: torch.nn.Module) -> tuple[object, int] | None:
    """module's ``parameters_frozen`` block and the optimizer steps taken so far: values
    found equal under one such pair are not compared again; None outside a block."""
    block = frozen_block(module)
    return None if block is None else (block, _OptimizerSteps.count)


def parameter_snapshot(module: torch.nn.Module) -> ParameterSnapshot:
    """Detached copies of module's parameters, taken now (so equal to them within the
    ``parameters_frozen`` block that module is in, if any)."""
    copies = tuple(p.detach().clone() for p in module_parameters(module))
    return ParameterSnapshot(copies, frozen_since(module))


def parameters_unchanged(module: torch.nn.Module, snapshot: ParameterSnapshot) -> bool:
    """Whether module's parameters hold the values of ``snapshot``, element for element.

    ``parameter_states`` misses an in-place edit through ``p.data`` (an EMA update,
    Hugging Face's ``_init_weights``): ``.data`` is a tensor with a version counter of its
    own. Comparing the values sees every edit, at the cost of one read of each parameter
    and a host sync (eager mode only; the caches are bypassed under torch.compile): one
    for all of them on ``PARAMETERS_COMPARED_AT_ONCE`` devices. Inside a
    ``parameters_frozen`` block a snapshot found equal once is not compared again until
    an optimizer step (``frozen_since``): the block's promise is that no parameter
    changes unseen by its version counter, and a fused step moves none.
    """
    block = frozen_since(module)
    if block is not None and snapshot.frozen_in == block:
        return True
    parameters = module_parameters(module)
    if len(parameters) != len(snapshot.tensors):
        return False
    pairs = [(p.detach(), kept) for p, kept in zip(parameters, snapshot.tensors, strict=True)]
    if not parameters_equal(pairs):
        return False
    snapshot.frozen_in = block
    return True


def parameters_equal(pairs: list[tuple[Tensor, Tensor]]) -> bool:
    """Whether each pair of tensors has one shape, dtype, device and the same values."""
    if any(
        p.shape != kept.shape or p.dtype != kept.dtype or p.device != kept.device
        for p, kept in pairs
    ):
        return False
    devices = {p.device for p, _ in pairs}
    if len(devices) != 1 or next(iter(devices)).type not in PARAMETERS_COMPARED_AT_ONCE:
        return all(torch.equal(p, kept) for p, kept in pairs)
    same = [torch.eq(p, kept).all() for p, kept in pairs]
    return bool(torch.stack(same).all())  # one read for every parameter


def cache_put(cache: dict[tuple[Any, ...], Any], key: tuple[Any, ...], value: Any) -> Any:
    """Store value as the most recent entry, keeping the CACHE_SIZE most recent ones."""
    if torch.compiler.is_compiling():
        return value
    cache.pop(key, None)
    cache[key] = value
    while len(cache) > CACHE_SIZE:
        del cache[next(iter(cache))]  # least recently used first
    return value


def arange_view(
    cache: dict[tuple[Any, ...], Any],
    start: int,
    stop: int,
    device: torch.device,
    descending: bool = False,
) -> Tensor:
    """torch.arange(start, stop), int64 (``descending``: stop - 1 down to start), as a
    view of a vector kept in ``cache`` for the integers -R .. R, R a power of two that
    grows as calls need: a decode step's new key count makes no new tensor. Read-only
    (a view of the kept vector). While compiling, made in the graph."""
    if torch.compiler.is_compiling():
        values = torch.arange(start, stop, device=device)
        return values.flip(0) if descending else values

    def integers(reach: int) -> Tensor:  # -R .. R, [2 R + 1]
        values = torch.arange(-reach, reach + 1, device=device)
        return values.flip(0) if descending else values

    key = ("arange", descending, str(device))
    reach, values = kept_over_reach(cache, key, max(abs(start), abs(stop - 1)), integers)
    if descending:  # entry t holds R - t
        return values[reach - stop + 1 : reach - start + 1]
    return values[start + reach : stop + reach]


def kept_over_reach(
    cache: dict[tuple[Any, ...], Any], key: tuple[Any, ...], needed: int, make: Callable[[int], Any]
) -> tuple[int, Any]:
    """(R, make(R)) kept in ``cache`` under ``key``, R the least power of two (at least
    1) that covers ``needed``: made again, wider, only when a call needs more than the
    kept R (``arange_view``'s integers, ``monotone_index_ends``' host list)."""
    reach = power_of_two_at_least(max(needed, 1))
    kept = cache_get(cache, key)
    if kept is None or kept[0] < reach:
        kept = cache_put(cache, key, (reach, make(reach)))
    return kept


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


def positions_or_default(
    positions: Tensor | None, start: int, length: int, device: torch.device
) -> Tensor:
    """Explicit positions, or start, start + 1, ..., start + length - 1."""
    if positions is not None:
        return positions
    return torch.arange(start, start + length, device=device)
