"""Whether positions given are the defaults, so that they take the default paths.

Keys default to 0 .. M - 1 and queries to the last N of them; positions given that equal
these in every batch row (Hugging Face-style position ids, a KV cache's last N of M), or,
for an encoding that reads only key minus query positions, differ from them by one
constant per row or per packed document, take the fast paths of default positions
(``position_verdict``). The verdict costs one read of the positions (a host sync on a
GPU), kept per unchanged tensor (``POSITION_VERDICTS``); eager mode only.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._caches import arange_view
from ._inputs import MAX_POSITION, check_position_values, outside_position_range
from ._masks import attn_mask_reads
from ._tensor_verdicts import POSITION_VERDICTS


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
    reads = attn_mask_reads(attn_mask)  # -inf, or as hard as Hugging Face's finfo.min, masks
    every_query_reads = reads.any(-1).all()
    if reads.dim() == 4:  # [batch or 1, heads or 1, N or 1, M or 1]: per batch row
        key_read = reads.flatten(1, 2).any(1)  # [batch or 1, M or 1]
    else:  # [heads or 1, N or 1, M or 1] or [N or 1, M or 1]: alike in every row
        key_read = reads.reshape(-1, reads.shape[-1]).any(0)  # [M or 1]
    if q_offsets is None or q_offsets.shape[-1] == 0:  # the queries at the defaults (or
        # none, N = 0: q_offsets[..., -1:] would be empty): every row's constant is 0
        constant = torch.zeros((), dtype=k_offsets.dtype, device=k_offsets.device)
        checks = []
    else:
        constant = q_offsets[..., -1:]  # [1] / [batch, 1]: the last query's
        checks = [(q_offsets == constant).all()]
    if not shifted:
        checks.append((constant == 0).all())
    checks += [((k_offsets == constant) | ~key_read).all(), every_query_reads]
    return torch.stack(checks).all()
