"""The ``relative`` claim: shifting every position by c leaves the logits unchanged.

hypothesis draws a few query and key positions in the first half of the span or out to
``wide_positions`` (twice every length the spec names and every number an expression
bias compares or combines with a distance, so a break only between a query and a far key
is seen), a shift c ≥ 1 (up to half the span, or far: past four times every length the
spec names, ``posgen.check.lengths``: ``original_max_positions`` of a rope scaling or a
query scale, a query scale's ``floor_scale``, and the numbers of an expression bias that
meet a position, such as the 300000 of ``where(i > 300000, 1, 0)``; at least to 2^16, at
most to 2^24, and never past a table) and a seed for random content (projected q and k,
or token embeddings through embed on the input route); then every run tries the same
fixed shifts, each power of two up to the far reach and each length named (and one past
it) within it, and queries and keys at 0 and at each far distance (``fixed_shifts``,
``wide_distances``). The float64 logits at the shifted positions must equal the
unshifted ones within a tolerance of each head's own (``shift_tolerance``: 256 eps per
unit of the head's logit spread and of the largest position; NaN logits, or
an infinite one that the shift changes, refute it). Where a length lies past the far
reach (beyond the 2^24 cap, and not past a table's end), no shift crosses it: a claim
that held is then "limited", neither confirmed nor refuted, and the evidence names the
length. The input route needs explicit positions (an embed that only takes the default
ones makes it n/a).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from hypothesis import strategies as st
from torch import Tensor

from posgen.check.decay import distance_lengths, threshold_distances
from posgen.check.lengths import Length, spec_lengths
from posgen.check.probe import Probe, input_unreachable
from posgen.check.search import (
    SEEDS,
    Violation,
    fmt,
    generator,
    run_search,
    short_list,
    spread,
)
from posgen.check.verdicts import Outcome, failed

# query positions, key positions, the shift c, the content's seed
Example = tuple[list[int], list[int], int, int]

FAR_SHIFT = 1 << 16  # far shifts reach at least this far ...
MAX_SHIFT = 1 << 24  # ... and at most this far (float64 angles stay exact to ~1e-9)
EPSILON = 2.0**-52  # float64's
SHOWN_LENGTHS = 3  # lengths past the reach named in the evidence
MAX_NAMED_LENGTHS = 64  # lengths tried exactly (``named_shifts``)
MAX_WIDE = 1 << 20  # positions (and so distances) drawn reach at most this far


def far_shift(probe: Probe, near: int, lengths: Iterable[Length]) -> int:
    """The largest shift drawn: past 4 × every length the spec names (a rope scaling's
    switch at original_max_positions, a clip or bucket range, an expression's
    threshold), at least ``FAR_SHIFT``, at most ``MAX_SHIFT``; where a table ends,
    positions + shift stay below its end."""
    wanted = [4 * length.value for length in lengths]
    reach = math.ceil(min(max([float(FAR_SHIFT), *wanted]), float(MAX_SHIFT)))
    if probe.limit is not None:
        reach = min(reach, probe.limit - near)
    return max(reach, near)


def past_reach(probe: Probe, near: int, reach: int, lengths: Iterable[Length]) -> list[Length]:
    """The lengths no shift up to ``reach`` crosses: past it, and below a table's end
    (none where the shifts reach every row of a table)."""
    if probe.limit is not None and near + reach >= probe.limit:
        return []
    ceiling = math.inf if probe.limit is None else probe.limit
    return sorted(
        (length for length in lengths if reach < length.value < ceiling),
        key=lambda length: length.value,
    )


def named_shifts(lengths: Iterable[Length], reach: int) -> list[int]:
    """Shifts onto and just past each named length within ``reach`` (c = ⌊L⌋ and
    ⌊L⌋ + 1, so that position 0 lands on it and past it): a narrow band at a named
    position, which no power of two need hit. At most ``MAX_NAMED_LENGTHS`` lengths,
    spread evenly over them in order, where a threshold per head names more."""
    within = sorted({math.floor(length.value) for length in lengths if length.value < reach})
    within = spread(within, MAX_NAMED_LENGTHS)
    found = {c for start in within for c in (start, start + 1) if 1 <= c <= reach}
    return sorted(found)


def wide_positions(probe: Probe, near: int, lengths: Iterable[Length]) -> int:
    """How far the drawn positions reach, and with them the distances between a query
    and a key: past twice every length the spec names (``spec_lengths``) and every
    length an expression bias compares or combines with a distance
    (``decay.distance_lengths``: the 300 of ``where(abs(i - j) > 300, i, 0)``, which
    breaks the claim only for keys more than 300 from their query), at least the span,
    at most ``MAX_WIDE``, and below half a table's end (so shifts reach the other half)."""
    wanted = [float(probe.span), *(2 * length.value for length in lengths)]
    wide = math.ceil(min(max(wanted), float(MAX_WIDE)))
    if probe.limit is not None:
        wide = min(wide, probe.limit // 2)
    return max(wide, near)


def relative(probe: Probe, claimed: bool | None) -> Outcome:
    """Judge or measure ``relative`` for one probe."""
    unreachable = input_unreachable(probe, "relative", claimed, need_explicit=True)
    if unreachable is not None:
        return unreachable
    limit = probe.span // 2
    lengths = spec_lengths(probe.spec, probe.expression_parameters())
    expression_lengths = distance_lengths(probe)
    wide = wide_positions(probe, limit, [*lengths, *expression_lengths])
    reach = far_shift(probe, limit, lengths)
    if probe.limit is not None:  # every drawn position + shift stays below the table's end
        reach = max(1, min(reach, probe.limit - wide))
    named = named_shifts(lengths, reach)
    position = st.one_of(st.integers(0, limit - 1), st.integers(0, wide - 1))

    @st.composite
    def examples(draw: st.DrawFn) -> Example:
        n = draw(st.integers(1, 3))
        m = draw(st.integers(1, 4))
        q_pos = draw(st.lists(position, min_size=n, max_size=n))
        k_pos = draw(st.lists(position, min_size=m, max_size=m))
        shift = draw(st.one_of(st.integers(1, limit), st.integers(1, reach)))
        return q_pos, k_pos, shift, draw(SEEDS)

    def check(example: Example) -> float:
        return _shifted_logits_agree(probe, example)

    scan = fixed_shifts(limit, reach, named, wide_distances(expression_lengths, limit, wide))
    search = run_search(check, examples(), probe.budget, scan)
    if search.violation is not None:
        return failed("relative", "claim", claimed, search)
    extra = [c for c in named if c & (c - 1) and c != reach]  # not a power of two
    at_lengths = f", and c = {short_list(extra)} at the lengths the spec names" if extra else ""
    far_apart = f", positions up to {wide - 1}" if wide > limit else ""
    evidence = (
        f"logits unchanged under {search.examples} shifts of random content, float64: "
        f"random ones (c ≤ {limit}, and far ones up to {reach}{far_apart}) and c = 1, 2, "
        f"4, … {reach}{at_lengths}"
    )
    beyond = past_reach(probe, wide, reach, lengths)
    if not beyond:
        return Outcome("relative", "claim", claimed, True, evidence)
    shown = [length.describe() for length in beyond[:SHOWN_LENGTHS]]
    if len(beyond) > SHOWN_LENGTHS:
        shown.append(f"{len(beyond) - SHOWN_LENGTHS} more")
    return Outcome(
        "relative",
        "claim",
        claimed,
        True,
        f"tested only up to c = {reach}: no shift crosses {', '.join(shown)} (shifts stop "
        f"at 2^24, where float64 angles stay exact), so a change there goes unseen; "
        f"{evidence}",
        limited_to=f"c ≤ {reach}",
    )


def wide_distances(lengths: list[Length], limit: int, wide: int) -> list[int]:
    """The distances the scan tries past the near positions: each power of two from
    ``limit`` up to ``wide`` and, within it, either side of each of ``lengths`` (those of
    ``decay.distance_lengths``; ``decay.threshold_distances``: just past a threshold
    such as ``abs(i - j) > 300``)."""
    found = {wide - 1}
    distance = 1
    while distance < wide:
        if distance >= limit:
            found.add(distance)
        distance *= 2
    found.update(threshold_distances(lengths))
    return sorted(d for d in found if limit <= d < wide)


def fixed_shifts(
    limit: int, reach: int, named: Iterable[int] = (), distances: Iterable[int] = ()
) -> Callable[[], Iterable[Example]]:
    """The examples every run tries after the random ones, whatever its budget: the
    queries at 0 and limit - 1 against keys at 0, limit / 2 and limit - 1, shifted by
    every power of two up to ``reach``, by ``reach`` itself and by the ``named`` shifts
    (at the lengths the spec names), in ascending order (a budget of a few random
    examples may draw no far shift, a switch such as LongRoPE's at 4096 shows only past
    it, and a narrow band at a named position between two powers of two); then, for
    each of ``distances`` d (past the near positions), queries and keys at 0 and d,
    shifted by 1 and by ``reach`` (a change only between a query and a far key)."""
    shifts = {reach, *named}
    shift = 1
    while shift < reach:
        shifts.add(shift)
        shift *= 2
    far = list(distances)

    def scan() -> Iterable[Example]:
        queries, keys = sorted({0, limit - 1}), sorted({0, limit // 2, limit - 1})
        for shift in sorted(shifts):
            yield queries, keys, shift, 0
        for distance in far:
            for shift in sorted({1, reach}):
                yield [0, distance], [0, distance], shift, 0

    return scan


def _shifted_logits_agree(probe: Probe, example: Example) -> float:
    """The margin by which shifted logits agree with unshifted ones, or a Violation."""
    q_pos, k_pos, shift, example_seed = example
    content = probe.content(generator(example_seed), len(q_pos), len(k_pos))
    q, k = torch.tensor(q_pos), torch.tensor(k_pos)
    before = probe.logits(content, q, k)
    after = probe.logits(content, q + shift, k + shift)
    top = max(q_pos + k_pos) + shift
    tol = shift_tolerance(before, top)  # [H], one per head
    # equal infinities agree; NaN, or an infinity on one side only, never does
    delta = torch.where(before == after, 0.0, (after - before).abs()).nan_to_num(math.inf)
    excess = delta - tol.view(1, -1, 1, 1)
    if float(excess.max()) > 0:
        _, h, i, j = (int(x) for x in divmod_index(int(excess.argmax()), delta.shape))
        raise Violation(
            f"query positions {q_pos}, key positions {k_pos}, shift c = {shift}: "
            f"head {h} logit[{i}, {j}] {fmt(float(before[0, h, i, j]))} -> "
            f"{fmt(float(after[0, h, i, j]))} (|Δ| {fmt(float(delta[0, h, i, j]))} > "
            f"tol {fmt(float(tol[h]))})",
            q_positions=q_pos,
            k_positions=k_pos,
            shift=shift,
            head=h,
            values=[float(before[0, h, i, j]), float(after[0, h, i, j])],
            content_seed=example_seed,
        )
    return -float(excess.max())


# float64 rounding that grows with the positions, per unit of a head's logit spread and
# of the largest position: 256 eps. The catalogue's relative encodings need at most
# 1.5 eps (RoPE's angles at 2^24); the former 1e-11 (45036 eps) let a step of 0.005 in
# one logit at positions past 3 * 10^6 through as rounding.
POSITION_ROUNDING = 256 * EPSILON


def shift_tolerance(logits: Tensor, top: int) -> Tensor:
    """How far each head's shifted logits may move and still count as unchanged, [H]:
    rounding that grows with the positions, scaled by how far that head's logits spread
    (not a constant they share, which softmax ignores, and which hid a change of 5 under
    1000000 - abs(i - j)), plus each value's own rounding. Head by head: the rounding
    of one head's logits is of their own size, and a head of large logits hid a break
    of 0.5 in a head of small ones."""
    finite = torch.isfinite(logits)
    largest = torch.where(finite, logits.abs(), 0.0).amax(dim=(0, 2, 3))  # [H]
    spreads = head_spreads(logits)
    return POSITION_ROUNDING * (1.0 + spreads) * (1.0 + top) + 64 * EPSILON * largest


def head_spreads(logits: Tensor) -> Tensor:
    """The range (max − min) of each head's finite logits in [1, H, N, M], [H] (0 for a
    head with none)."""
    finite = torch.isfinite(logits)
    high = torch.where(finite, logits, -math.inf).amax(dim=(0, 2, 3))  # [H]
    low = torch.where(finite, logits, math.inf).amin(dim=(0, 2, 3))
    some = finite.any(dim=3).any(dim=2).any(dim=0)  # heads with a finite logit
    return torch.where(some, high - low, 0.0)


def divmod_index(flat: int, shape: torch.Size) -> list[int]:
    """Unravel a flat index into ``shape``."""
    out = []
    for size in reversed(shape):
        flat, rest = divmod(flat, size)
        out.append(rest)
    return list(reversed(out))
