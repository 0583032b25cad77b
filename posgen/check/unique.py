"""The ``unique`` claim: distinct positions get distinct encodings.

Pairs of positions are drawn by hypothesis, then an exhaustive scan looks for the
collision closest to the origin, so a claim of ``false`` is only confirmed by an actual
collision. What is compared depends on the route (``Probe``):

* input: the table rows p_m and p_n (relative tolerance: a tiny table is no collision);
* rotation: the rotations R_m and R_n, on the query and the key output of rotate, and
  past the span R_0 against R_d for every d up to 2^24 at which the angles of R_1 turn
  back to a whole turn (``posgen.check.periods``: a period repeats every position, so
  positions m and m + d collide however far past the span d lies);
* scores that depend on j - i only (a Toeplitz matrix, ``shift_invariant_scores``: over
  the whole span and in windows far out, past every length the spec names): distances,
  not positions (``unique_distances``); the distances reach past every ``max_distance``
  the spec states and every number an expression bias compares or combines with a
  distance (a period), and are sampled log-spaced past ``EXACT_DISTANCES``;
* other scores (absolute positions): position m as a query (its row) and as a key (its
  column) of the position-only scores, in every head.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st
from torch import Tensor

from posgen.check.contract import F64
from posgen.check.decay import distance_lengths, threshold_distances
from posgen.check.lengths import Length, spec_lengths
from posgen.check.periods import (
    ANGLE_SLACK,
    PERIOD_REACH,
    linear_reach,
    measured_angles,
    rotations_at,
    turns_back,
)
from posgen.check.probe import Probe, input_unreachable, stated
from posgen.check.search import (
    EXACT_DISTANCES,
    Search,
    Violation,
    distance_sample,
    fmt,
    generator,
    run_search,
    spread,
)
from posgen.check.verdicts import Outcome, failed

EPS64 = torch.finfo(F64).eps
Pair = tuple[int, int]


@dataclass
class _Compared:
    """What one route compares: a check of two positions, and features for the scan."""

    check: Callable[[Pair], float]
    features: Tensor  # [span, width]: one row per position
    what: str
    span: int
    # pairs past the span for the scan to judge after the span's, and what they are
    beyond: list[Pair] = field(default_factory=list)
    beyond_what: str = ""
    # pairs of positions compared only up to this one (a rotation not R_1^m past a switch)
    compared_up_to: int | None = None


def unique(probe: Probe, claimed: bool | None) -> Outcome:
    """Judge or measure ``unique`` for one probe."""
    unreachable = input_unreachable(probe, "unique", claimed)
    if unreachable is not None:
        return unreachable
    search, what, beyond, up_to = _unique(probe)
    if search.violation is not None:
        return failed("unique", "claim", claimed, search)
    evidence = (
        f"no collision of {what} in {search.examples} examples (hypothesis and a scan); "
        f"smallest gap {fmt(search.worst)}{beyond}"
    )
    if up_to is None:
        return Outcome("unique", "claim", claimed, True, evidence)
    return Outcome(
        "unique",
        "claim",
        claimed,
        True,
        f"tested only for positions up to {up_to}: past it the rotation is not R_1^m, so "
        f"two positions farther out that collide go unseen; {evidence}",
        limited_to=f"m ≤ {up_to}",
    )


def _unique(probe: Probe) -> tuple[Search, str, str, int | None]:
    """The search for a collision along the probe's route; what was compared; what past
    the span (evidence text, "" where nothing); the position up to which alone pairs
    were compared (None: every position the module takes)."""
    span = probe.limit if probe.limit is not None else probe.span
    span = min(span, 4096)
    if probe.route == "input":
        compared = _table_rows(probe, span)
    elif probe.route == "rotation":
        compared = _rotations(probe, span)
    elif shift_invariant_scores(probe, span):
        return (*unique_distances(probe), "", None)
    else:
        compared = _score_rows_and_columns(probe, span)
    size = compared.span
    pairs = st.tuples(st.integers(0, size - 1), st.integers(0, size - 1)).filter(
        lambda t: t[0] != t[1]
    )
    scan = _nearest_pairs(compared.features, size, compared.beyond)
    search = run_search(compared.check, pairs, probe.budget, scan)
    what = f"{compared.what} for positions [0, {size})"
    return search, what, compared.beyond_what, compared.compared_up_to


def _table_rows(probe: Probe, span: int) -> _Compared:
    """Input route: the table rows p_m; with a rotation too, p_m and R_m (two positions
    collide only where both agree: either tells them apart)."""
    table = probe.table(torch.arange(span))
    norms = table.norm(dim=-1)
    rotation = _rotation_distance(probe) if probe.spec.rotation is not None else None

    def check(example: Pair) -> float:
        m, n = example
        distance = float((table[m] - table[n]).norm())
        if distance > 1e-12 * max(float(norms[m]), float(norms[n])):  # relative
            return distance
        if rotation is not None:
            turned, same = rotation(m, n)
            if not same:
                return turned
        rotated = " and the same rotation" if rotation is not None else ""
        raise Violation(
            f"positions {m} and {n} get the same input encoding{rotated} "
            f"(|p_{m} - p_{n}| = {fmt(distance)})",
            positions=[m, n],
            distance=distance,
            values=[table[m][:4].tolist(), table[n][:4].tolist()],
        )

    what = "p_m and R_m" if rotation is not None else "p_m"
    return _Compared(check, table, what, span)


def _rotation_distance(probe: Probe) -> Callable[[int, int], tuple[float, bool]]:
    """(|R_m - R_n| on the query or key side, whichever is smaller; whether the two
    rotations are equal within a tolerance that grows with the position)."""
    tol_base = 64 * EPS64 * probe.head_dim

    def distance(m: int, n: int) -> tuple[float, bool]:
        gap = min(
            float((probe.rotation_matrix(m, side) - probe.rotation_matrix(n, side)).norm())
            for side in (0, 1)  # the query and the key rotation
        )
        return gap, gap <= tol_base * (1 + max(m, n))

    return distance


def _rotations(probe: Probe, span: int) -> _Compared:
    """Rotation route: R_m on the query and the key side; one rotated vector per m; and
    R_0 against R_d at each period candidate d past the span (``rotation_periods``)."""
    rotation = _rotation_distance(probe)
    periods, searched, up_to = rotation_periods(probe)

    def check(example: Pair) -> float:
        m, n = example
        distance, same = rotation(m, n)
        if same:
            period = (
                f": R_{n} = R_0, a period of the rotation (every m and m + {n} collide)"
                if m == 0 and n in periods
                else ""
            )
            raise Violation(
                f"positions {m} and {n} get the same rotation (|R_{m} - R_{n}| = "
                f"{fmt(distance)}){period}",
                positions=[m, n],
                distance=distance,
            )
        return distance

    drawn = generator(probe.budget.seed)
    x = torch.randn(1, 1, span, probe.head_dim, generator=drawn, dtype=F64)
    x = x[:, :, :1].expand(1, 1, span, probe.head_dim)
    positions = torch.arange(span)
    features, _ = probe.pe64.rotate(x.contiguous(), x.contiguous(), positions, positions)
    beyond = [(0, d) for d in periods]
    up_to = None if up_to is None else max(up_to, span - 1)  # the span's pairs, directly
    return _Compared(check, features[0, 0], "R_m", span, beyond, searched, up_to)


# R_0 is compared with R_d at the first PERIOD_CANDIDATES period candidates d (each one
# a period of the measured angles: the module's own rule decides)
PERIOD_CANDIDATES = 64


def rotation_periods(probe: Probe) -> tuple[list[int], str, int | None]:
    """(the candidates d ≤ 2^24 at which R_d may equal R_0 = I, ascending; what was
    searched, for the evidence; the reach, where R_m stops being R_1^m, or None).

    Positions m and n collide exactly where R_{n-m} = I for a rotation with R_m = R_1^m,
    so an exact search for the periods of the angles of R_1 (``periods.turns_back``, on
    the query and the key side) covers every pair of positions up to the reach, not
    only the span's. The reach is ``PERIOD_REACH`` (2^24, where float32 positions stop
    being integers), below a table's end, and below the first power of two where R_m is
    not R_1^m (``periods.linear_reach``: dynamic NTK, LongRoPE; past it only the span's
    positions are compared, and a claim that holds is "limited").

    The tolerance on the angles comes from the route's own rule (``_rotation_distance``:
    R_d equals R_0 where |R_0 - R_d| ≤ 64·eps·head_dim·(1 + d), which covers the float64
    error of the angles d·θ_k, at most a few eps·d·π each): |R_0 - R_d| ≥ 2√2·|sin(r/2)|
    ≥ 0.9·|r| for the residual r of any pair, so a d the rule calls equal has every
    residual within 2·64·eps·head_dim·(1 + d); ``ANGLE_SLACK``·(1 + d) more covers the
    error of the measured angles times d. The filter is therefore never tighter than
    the rule, and each candidate it lets through is judged by the rule on the module.
    """
    reach = PERIOD_REACH if probe.limit is None else min(PERIOD_REACH, probe.limit - 1)
    reach, switch = linear_reach(probe, reach)
    rule = 2 * 64 * EPS64 * probe.head_dim

    def tolerance(distances: Tensor) -> Tensor:
        return (rule + ANGLE_SLACK) * (1 + distances)

    query, key = rotations_at(probe, 1)
    found: set[int] = set()
    for side in (query,) if torch.equal(query, key) else (query, key):
        found.update(turns_back(measured_angles(side), reach, tolerance, PERIOD_CANDIDATES))
    periods = sorted(found)[:PERIOD_CANDIDATES]
    if periods:
        searched = (
            f"; R_d ≠ R_0 by the same rule at each of the {len(periods)} d up to {reach} "
            f"where the angles of R_1 come within float64 error of a whole turn (the first "
            f"{periods[0]})"
        )
    else:
        searched = f"; no period: no d up to {reach} turns every angle of R_1 back to a whole turn"
    if switch is not None:
        searched += f" (sought no further: R_m is not R_1^m at m = {switch})"
    return periods, searched, None if switch is None else reach


def _score_rows_and_columns(probe: Probe, span: int) -> _Compared:
    """Absolute positions in the scores: position m is its row (as a query) and its
    column (as a key) of the position-only scores."""
    span = score_span(probe, span)
    scores = probe.score_matrix(span)  # [heads, span, span]
    head_scale = _head_scale(scores.reshape(scores.shape[0], -1))

    def check(example: Pair) -> float:
        m, n = example
        for position in (m, n):
            rows = (scores[:, position, :], scores[:, :, position])
            if not all(bool(torch.isfinite(part).all()) for part in rows):
                raise Violation(
                    f"position {position} gets position scores that are not finite (NaN "
                    "or inf), as a query or as a key: they tell no position apart",
                    positions=[position],
                )
        gaps = torch.maximum(
            (scores[:, m, :] - scores[:, n, :]).abs().amax(dim=-1),
            (scores[:, :, m] - scores[:, :, n]).abs().amax(dim=-1),
        )  # [heads]
        sizes = torch.maximum(
            scores[:, m, :].abs().amax(dim=-1), scores[:, :, m].abs().amax(dim=-1)
        )
        gap = float(gaps.max())
        if bool((gaps <= same_tolerance(sizes, head_scale)).all()):  # head by head
            raise Violation(
                f"positions {m} and {n} get the same position scores, as a query and "
                f"as a key, against every position in [0, {span}) in every head",
                positions=[m, n],
                values=[scores[0, m, :4].tolist(), scores[0, n, :4].tolist()],
            )
        return gap

    rows = torch.cat(
        (scores.transpose(0, 1).reshape(span, -1), scores.permute(2, 0, 1).reshape(span, -1)),
        dim=1,
    )
    drawn = generator(probe.budget.seed)
    features = rows @ torch.randn(rows.shape[1], 64, generator=drawn, dtype=F64)
    return _Compared(check, features, "position scores (rows and columns)", span)


# The scan checks at most this many candidate pairs (near pairs first, each verified by
# the route's own check), so a degenerate encoding with millions of near pairs is bounded.
SCAN_CANDIDATES = 4096


def _nearest_pairs(
    features: Tensor, span: int, beyond: Iterable[Pair] = ()
) -> Callable[[], Iterable[Pair]]:
    """The scan: every near pair of rows, those that look equal first and each group
    closest to position 0 first, for the route's check to judge; then the closest pair;
    then the pairs ``beyond`` the span (a rotation's period candidates), in order.

    A pair is near where the squared distance of its rows, from their Gram matrix, is
    within 1e-9 of the larger squared norm: loose, because that difference cancels, so
    each near pair's distance is then computed directly and the check (with its own,
    tighter tolerance) decides. Every near pair is offered, not just the first: a near
    but distinct pair must not hide an equal one farther out.
    """

    def scan() -> Iterable[Pair]:
        norms = (features * features).sum(-1)  # [span]
        gram = norms.unsqueeze(0) + norms.unsqueeze(1) - 2 * features @ features.T
        gram.fill_diagonal_(math.inf)
        scale = torch.maximum(norms.unsqueeze(0), norms.unsqueeze(1))  # relative
        near = torch.triu(gram <= 1e-9 * scale, diagonal=1)  # [span, span], a < b
        if not bool(near.any()):
            flat = int(gram.argmin())
            yield (flat // span, flat % span)
            yield from beyond
            return
        later, earlier = near.T.nonzero().unbind(1)  # ordered by b, then a: from 0 out
        gaps = torch.cat(
            [
                (features[b] - features[a]).norm(dim=-1)
                for a, b in zip(earlier.split(4096), later.split(4096), strict=True)
            ]
        )  # [pairs], direct
        size = torch.maximum(norms[earlier], norms[later]).sqrt()
        looks_equal = gaps <= 1e-10 * size
        order = torch.argsort((~looks_equal).to(torch.int8), stable=True)[:SCAN_CANDIDATES]
        for index in order.tolist():
            yield int(earlier[index]), int(later[index])
        closest = int(gaps.argmin())
        yield int(earlier[closest]), int(later[closest])
        yield from beyond

    return scan


def closest_pair(hit: Tensor, anchor: int) -> Pair:
    """Among the True cells (a, b) of a square mask, the one with the smallest
    max(|a - anchor|, |b - anchor|), then the smallest (a, b)."""
    size = hit.shape[0]
    index = torch.arange(size)
    reach = (index - anchor).abs()
    order = torch.maximum(reach.unsqueeze(1), reach.unsqueeze(0)) * size * size
    order = order + index.unsqueeze(1) * size + index.unsqueeze(0)
    flat = int(torch.where(hit, order, torch.full_like(order, int(order.max()) + 1)).argmin())
    return flat // size, flat % size


def score_span(probe: Probe, span: int) -> int:
    """The positions [0, S) whose position-only scores are held at once: S ≤ 512, and
    fewer where many heads would make the [heads, S, S] matrix large (memory)."""
    return min(span, 512, max(16, math.isqrt(4_000_000 // probe.heads)))


# Far windows: TOEPLITZ_WINDOW positions at each power of two up to the far reach (at
# least TOEPLITZ_REACH, past 4 × every length the spec names and the positions the
# distance route reads, at most MAX_TOEPLITZ_REACH), and one straddling each named
# length (up to MAX_NAMED_POSITION: past it, the scores are not known to be of j - i).
TOEPLITZ_WINDOW = 64
TOEPLITZ_REACH = 1 << 16
MAX_TOEPLITZ_REACH = 1 << 24
MAX_NAMED_POSITION = 1 << 40
MAX_NAMED_WINDOWS = 64


def shift_invariant_scores(probe: Probe, span: int | None = None) -> bool:
    """Whether the position-only scores depend on j - i only (a Toeplitz matrix).

    The rule: the scores over the whole span [0, S) (``score_span``: the positions the
    rows-and-columns route compares) are Toeplitz, and the scores of a window of
    ``TOEPLITZ_WINDOW`` positions far out equal those of the window at 0: at every power
    of two up to the far reach (``toeplitz_windows``), and straddling every length the
    spec names (``posgen.check.lengths``: a threshold such as the 1000 of
    ``where(i > 1000, 0, -abs(i - j))`` or a query scale's ``floor_scale``), so a switch
    past the first positions is seen. A named length past ``MAX_NAMED_POSITION`` (and
    below a table's end) makes the scores absolute: no window reaches it. Equal within
    a relative 1e-9; NaN against NaN and equal infinities count as equal (a score that
    is not finite at the same distances is still of j - i; the route's check refutes it).
    Where this is False, the rows-and-columns rule applies, whose every counterexample
    is a collision of positions (and, for a Toeplitz matrix, of distances too).
    """
    size = score_span(probe, probe.span if span is None else span)
    scores = probe.score_matrix(size)  # [heads, size, size]
    if not _same_scores(scores[:, 1:, 1:], scores[:, :-1, :-1]):
        return False
    lengths = spec_lengths(probe.spec, probe.expression_parameters())
    window = min(TOEPLITZ_WINDOW, size)
    starts = toeplitz_windows(probe, window, lengths)
    if starts is None:
        return False
    origin = scores[:, :window, :window]
    for start in starts:
        positions = torch.arange(start, start + window)
        if not _same_scores(probe.position_scores(positions, positions), origin):
            return False
    return True


def toeplitz_windows(probe: Probe, window: int, lengths: Iterable[Length]) -> list[int] | None:
    """The first positions of the far windows ``shift_invariant_scores`` compares with
    the window at 0: each power of two from ``window`` up to the far reach, and
    ⌊L⌋ - window / 2 for each named length L (at most ``MAX_NAMED_WINDOWS``, spread over
    them in order), all below a table's end; None where a named length lies past
    ``MAX_NAMED_POSITION`` and below a table's end (no window reaches it)."""
    ceiling = math.inf if probe.limit is None else probe.limit
    values = sorted({length.value for length in lengths if 0 < length.value < ceiling})
    if any(value > MAX_NAMED_POSITION for value in values):
        return None
    # the distance route reads query R and keys up to 2R (``unique_distances``)
    distances = distance_reach(probe, distance_lengths(probe))
    wanted = [float(TOEPLITZ_REACH), 2 * float(distances), *(4 * value for value in values)]
    reach = math.ceil(min(max(wanted), float(MAX_TOEPLITZ_REACH)))
    starts = set()
    start = window
    while start <= reach:
        starts.add(start)
        start *= 2
    values = spread(values, MAX_NAMED_WINDOWS)
    starts.update(max(0, math.floor(value) - window // 2) for value in values)
    return sorted(start for start in starts if start + window <= ceiling)


def _same_scores(a: Tensor, b: Tensor) -> bool:
    """Whether two score tensors agree: within 1e-9 of the larger finite magnitude, NaN
    against NaN and equal infinities alike."""
    finite = torch.cat((a[torch.isfinite(a)], b[torch.isfinite(b)]))
    tol = 1e-9 * (1.0 + float(finite.abs().max() if finite.numel() else 0.0))
    same = (a == b) | (a.isnan() & b.isnan()) | ((a - b).abs() <= tol)
    return bool(same.all())


def distance_reach(probe: Probe, expression_lengths: list[Length]) -> int:
    """R of ``unique_distances``: the span, or 2 × every ``max_distance`` the spec states
    and every length an expression bias compares or combines with a distance
    (``decay.distance_lengths``: the 1500 of ``(j - i + 100000) % 1500``, whose scores
    repeat every 1500 distances: ``expression_lengths``) where farther; at most half a
    table, at most 2^40."""
    lengths = [*stated(probe.spec, "max_distance"), *(x.value for x in expression_lengths)]
    reach = max([probe.budget.span] + [math.ceil(2 * length) for length in lengths])
    if probe.limit is not None:
        reach = min(reach, probe.limit // 2)
    return min(reach, 1 << 40)


def named_distances(expression_lengths: list[Length], reach: int) -> list[int]:
    """Distances ±⌊L⌋ and ±(⌊L⌋ + 1) (``decay.threshold_distances``) for each length L
    of ``decay.distance_lengths`` within ``reach``: a period L repeats distance 0 at L,
    which the log-spaced sample past ``EXACT_DISTANCES`` need not hit."""
    found = [d for d in threshold_distances(expression_lengths) if d < reach]
    return sorted({*found, *(-d for d in found)})


def unique_distances(probe: Probe) -> tuple[Search, str]:
    """Relative scores: distinct distances k - q must get distinct position scores.

    Distances run over (-R, R) (``distance_reach``: the span, or 2 × every max_distance
    the spec states and every length an expression bias compares or combines with a
    distance, where farther), so the range reaches past any clip, bucket range or period
    the spec declares; past EXACT_DISTANCES they are sampled log-spaced
    (``distance_sample``), with each such length (``named_distances``) added.
    """
    expression_lengths = distance_lengths(probe)
    reach = distance_reach(probe, expression_lengths)
    distances = sorted(
        {*distance_sample(reach), *named_distances(expression_lengths, reach)},
        key=lambda d: (abs(d), d < 0),
    )
    keys = torch.tensor(distances) + reach
    row = probe.position_scores(torch.tensor([reach]), keys)[:, 0, :]  # [heads, D]
    head_scale = _head_scale(row)
    count = len(distances)

    def check(example: Pair) -> float:
        i1, i2 = sorted(example, key=lambda i: distances[i])
        d1, d2 = distances[i1], distances[i2]
        a, b = row[:, i1], row[:, i2]
        for distance, scores in ((d1, a), (d2, b)):
            if not bool(torch.isfinite(scores).all()):  # NaN or inf tells nothing apart
                raise Violation(
                    f"distance k - q = {distance} gets a position score that is not finite "
                    f"({fmt(float(scores[~torch.isfinite(scores)][0]))}; e.g. query "
                    f"{reach}, key {reach + distance})",
                    rank=abs(distance),
                    distances=[distance],
                    query=reach,
                    keys=[reach + distance],
                    values=[scores.tolist()],
                )
        gaps = (a - b).abs()
        gap = float(gaps.max())
        if bool((gaps <= same_tolerance(torch.maximum(a.abs(), b.abs()), head_scale)).all()):
            raise Violation(
                f"distances k - q = {d1} and {d2} get the same position score in every head "
                f"(head 0: {fmt(float(a[0]))} and {fmt(float(b[0]))}; e.g. query {reach}, "
                f"keys {reach + d1} and {reach + d2})",
                rank=max(abs(d1), abs(d2)),
                distances=[d1, d2],
                query=reach,
                keys=[reach + d1, reach + d2],
                values=[a.tolist(), b.tolist()],
            )
        return gap

    @st.composite
    def pairs(draw: st.DrawFn) -> Pair:  # shrinks towards the smallest distances
        first = draw(st.integers(0, count - 2))  # (the list starts at distance 0)
        return first, first + draw(st.integers(1, count - 1 - first))

    search = run_search(check, pairs(), probe.budget, _first_repeat(row, head_scale))
    sampled = (
        ""
        if reach <= EXACT_DISTANCES
        else (
            f", every one in (-{EXACT_DISTANCES}, {EXACT_DISTANCES}) and "
            f"{count - 2 * EXACT_DISTANCES + 1} past it (log-spaced, and at the lengths "
            "the spec names)"
        )
    )
    return search, f"position scores of distinct distances in (-{reach}, {reach}){sampled}"


# Two scores of one head are the same where they differ by at most this share of the
# larger (relative: a tiny table is not a collision) plus SAME_ROUNDING of the head's
# largest score (rounding: sin(2π) is -2.4e-16, not 0). Head by head: a head of scores
# near 10^6 made 1e-12 of them the tolerance of a head of scores near 10^-7, and
# distances that head told apart by 200 % were called the same.
SAME_SHARE = 1e-12
SAME_ROUNDING = 64 * EPS64


def _head_scale(scores: Tensor) -> Tensor:
    """The largest finite |score| of each head, [heads] (scores [heads, …])."""
    finite = torch.isfinite(scores)
    return torch.where(finite, scores.abs(), 0.0).amax(dim=-1)


def same_tolerance(larger: Tensor, head_scale: Tensor) -> Tensor:
    """How far two scores of a head may differ and still be the same, per head: the
    share ``SAME_SHARE`` of the larger of the two (``larger``, [heads, …]) plus
    ``SAME_ROUNDING`` of the head's largest score (``head_scale``, [heads])."""
    floor = SAME_ROUNDING * head_scale
    return SAME_SHARE * larger + floor.view(-1, *([1] * (larger.dim() - 1)))


def _first_repeat(row: Tensor, head_scale: Tensor) -> Callable[[], Iterable[Pair]]:
    """The scan over distances (row [heads, D], ordered by |d|): the repeat closest to
    distance 0, by the check's own rule (``same_tolerance``, head by head), or nothing.

    Exhaustive without comparing all pairs: two distances can only repeat where their
    scores in one head (the most varied) are within the loosest tolerance of each other,
    so candidates are the pairs inside such windows of the sorted scores.
    """

    def scan() -> Iterable[Pair]:
        unfinished = (~torch.isfinite(row)).any(dim=0).nonzero()  # [bad, 1], ordered by |d|
        if unfinished.numel():  # the non-finite score nearest distance 0 (the check refutes it)
            bad = int(unfinished[0])
            yield (bad, bad + 1) if bad + 1 < row.shape[1] else (bad - 1, bad)
            return
        distinct = [scores.unique().numel() for scores in row.unbind(0)]
        head = distinct.index(max(distinct))
        # the most the rule lets two scores of this head differ
        loose = (SAME_SHARE + SAME_ROUNDING) * float(head_scale[head])
        ranked, order = row[head].sort()  # [D]
        lower = torch.searchsorted(ranked, ranked - loose)  # each window [lower, upper)
        upper = torch.searchsorted(ranked, ranked + loose, right=True)
        if bool(((upper - lower) <= 1).all()):
            return
        best: tuple[int, int] | None = None  # (later, earlier) index: by |d| (the order)
        for start in range(row.shape[1]):
            width = int(upper[start] - lower[start])
            if width <= 1:
                continue
            a = order[start].expand(width)
            b = order[int(lower[start]) : int(upper[start])]
            gaps = (row[:, a] - row[:, b]).abs()  # [heads, width]
            larger = torch.maximum(row[:, a].abs(), row[:, b].abs())
            repeat = (a != b) & (gaps <= same_tolerance(larger, head_scale)).all(dim=0)
            for i, j in zip(a[repeat].tolist(), b[repeat].tolist(), strict=True):
                key = (max(i, j), min(i, j))
                if best is None or key < best:
                    best = key
        if best is not None:
            yield best[1], best[0]

    return scan
