"""Argument checks and plumbing shared by every backend.

Inputs are q [B, H, N, D] and k, v [B, KVH, M, D] (or [batch, seq, heads, dim] with
``layout="bnhd"``); KVH divides H (grouped-query attention: query head h reads key head
h // (H / KVH)). Positions are int64 [seq] or [batch, seq] on the device of q, in
[0, 2^53); keys default to 0 .. M - 1 and queries to the last N key positions, as with
a KV cache. Each check raises ValueError naming the argument. A verdict on positions'
values (in range; their reach) is kept per unchanged tensor (``_tensor_verdicts``), so
a model's layers given one positions tensor read it once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from ._tensor_verdicts import POSITION_VERDICTS

BACKENDS = ("auto", "eager", "sdpa", "flex")
LAYOUTS = ("bhnd", "bnhd")  # [batch, heads, seq, dim] (default) or [batch, seq, heads, dim]
# Positions are exact in float64 (angles, distances) below 2^53; larger ones are refused.
MAX_POSITION = 2**53 - 1
# What a backend receives already rotated: nothing, the keys (a cache of rotated keys), or
# both q and k (rotated at M-RoPE axis positions before the backend).
Rotated = Literal["none", "keys", "both"]


# The largest sizes a constructor takes: four times a spec's own bounds for heads and
# head_dim (published models: up to 128 heads of up to 256 features), a width of heads
# times head_dim up to 2^17 (published: up to about 25,600), a spec's bound for model_dim.
# Past them a module's tables would take gigabytes (DeBERTa's rows are heads * head_dim
# wide) or its construction minutes (ALiBi's slopes are a Python list per head).
MAX_HEADS = 4096
MAX_HEAD_DIM = 4096
MAX_WIDTH = 1 << 17
MAX_MODEL_DIM = 1 << 16
# The most patches ``grid_positions`` lays out (a 46,340-square grid): past it the
# positions alone would take 32 GiB.
MAX_GRID_PATCHES = 1 << 31


def positive_int(value: int, name: str, most: int | None = None) -> int:
    """``value`` if it is a positive int (not a bool) of at most ``most`` (where given),
    else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if most is not None and value > most:
        raise ValueError(f"{name} must be at most {most:,}, got {value:,}")
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


def table_reach_error(given: str, position: int, table: str) -> ValueError:
    """The error for a position past a table of positions (an encoding that cannot
    extrapolate): ``given`` names the argument, ``table`` the table and its size."""
    return ValueError(
        f"{given}: position {position} is out of range for {table}; this encoding cannot "
        "extrapolate"
    )


def check_table_reach(
    positions: Tensor | None,
    length: int,
    size: int,
    table: str,
    name: str = "positions",
    counted: str = "tokens",
) -> None:
    """ValueError (``table_reach_error``) for a position at or past ``size``: the largest
    of ``positions`` (read from the device, in eager mode only), or ``length`` - 1 for
    the default positions 0 .. length - 1 (known on the host) of ``length`` ``counted``."""
    if positions is None:
        largest, given = length - 1, f"{name} (the default, from {length} {counted})"
    elif positions.numel() and not torch.compiler.is_compiling():
        largest, given = int(positions.max()), name
    else:
        return
    if largest >= size:
        raise table_reach_error(given, largest, table)


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


_TRANSFORMS_ACTIVE: Callable[[], bool] = getattr(
    torch._C, "_are_functorch_transforms_active", lambda: False
)


def under_function_transform() -> bool:
    """Whether a torch.func transform (``grad``, ``jacrev``, ``vmap``, ...) is running;
    False while compiling (dynamo traces the transform's own ops)."""
    return not torch.compiler.is_compiling() and _TRANSFORMS_ACTIVE()


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
