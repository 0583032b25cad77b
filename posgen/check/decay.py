"""The ``decay`` claim: the position-only score falls with distance.

The curve is the position-only score of a query against the keys before it, at distances
r = 0, 1, …, R - 1 (``decay_curve``); a rotation without a bias uses the RoFormer bound
(1/(d/2)) Σ_j |S_j| on the frequencies measured from the module instead. The reach R is
the span, or twice every length the spec names where that is farther (``decay_reach``:
``posgen.check.lengths``, and the numbers an expression bias compares or combines with a
distance, such as the 1000 of ``abs(i - j) > 1000``), or a randomized-positions range
itself (the distances training sees), or twice the distance at which a rotation turns
back (``rotation_return``: θ_k = 2π(k + 1)/1000 at 1000, where the bound is back at its
maximum), at most ``MAX_DECAY_REACH`` and never past a table; a length the curve does not
reach makes a claim that held "limited".
The curve is averaged over log windows of distance, [0, 1), [1, 2), [2, 4), [4, 8), …
up to R (``distance_windows``, ``window_means``); past the span, a window wider than
``WINDOW_SAMPLES`` distances is averaged over that many evenly spaced ones
(``curve_distances``), so the work stays bounded. It decays when the curve is finite
(a NaN or an infinity refutes it, at the first distance where it is not), no window
mean rises over the previous one, the last is below the first, and at least half of the
adjacent windows fall strictly. hypothesis draws the head, the query position (up to
the table's end) and the content's seed; the curve shown is checked too. A query before
R - 1 (``early_queries``, drawn and scanned) is judged over the whole windows its keys
fill, by the first part of the rule: no window mean rises. ``posgen plot``
draws the same curve and window means, up to its own ``--distance``. A long curve is
evaluated a chunk of distances at a time (``distance_chunk``), which bounds its memory
and lets the runner's hard deadline stop it between chunks.
"""

from __future__ import annotations

import ast
import math
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from posgen.check.contract import F64
from posgen.check.lengths import (
    Length,
    assignments_of,
    bound_names,
    constant_value,
    expression_biases,
    length_of,
    spec_lengths,
)
from posgen.check.periods import turns_back
from posgen.check.probe import Probe, input_unreachable, stated
from posgen.check.search import SEEDS, Search, Violation, fmt, run_search
from posgen.check.verdicts import Outcome, failed, jsonable
from posgen.spec.model import SpecModel

Window = tuple[int, int]
# the head, the query position, the content's seed
Example = tuple[int, int, int]


def distance_windows(span: int) -> list[Window]:
    """Distance windows [0,1), [1,2), [2,4), [4,8), …, up to span."""
    edges = [0, 1]
    while edges[-1] * 2 < span:
        edges.append(edges[-1] * 2)
    edges.append(span)
    return list(zip(edges[:-1], edges[1:], strict=True))


def window_means(
    curve: Tensor, windows: list[Window], distances: Tensor | None = None
) -> list[float]:
    """The mean of the curve over each window: curve[r] at distance r, or, with
    ``distances`` (ascending), curve[k] at distance distances[k]."""
    if distances is None:
        return [float(curve[a:b].mean()) for a, b in windows]
    edges = torch.tensor([edge for window in windows for edge in window])
    bounds = torch.searchsorted(distances, edges).view(-1, 2).tolist()
    return [float(curve[lo:hi].mean()) for lo, hi in bounds]


# Past the span, a window wider than this many distances is averaged over this many
# evenly spaced ones (the RoFormer bound, one curve whatever the example and quick to
# evaluate: BOUND_WINDOW_SAMPLES, so its fast oscillation is averaged, not aliased); the
# reach is at most MAX_DECAY_REACH (a contextual form, whose keys are scored in one
# call, CONTEXTUAL_DECAY_REACH).
WINDOW_SAMPLES = 512
BOUND_WINDOW_SAMPLES = 1 << 16
MAX_DECAY_REACH = 1 << 24
CONTEXTUAL_DECAY_REACH = 4096


def curve_distances(
    windows: list[Window], span: int, samples: int | None = WINDOW_SAMPLES
) -> Tensor:
    """The distances of a decay curve over ``windows``, ascending: every one below the
    span; past it, every one of a window of at most ``samples`` distances (of every
    window where ``samples`` is None) and ``samples`` evenly spaced ones of a wider
    window. Over windows up to the span: 0, 1, …, span - 1."""
    parts = []
    for a, b in windows:
        if b <= span or samples is None or b - a <= samples:
            parts.append(torch.arange(a, b))
        else:
            spaced = torch.linspace(a, b - 1, samples, dtype=F64)
            parts.append(spaced.round().long().unique())
    return torch.cat(parts)


def threshold_distances(lengths: list[Length]) -> list[int]:
    """⌊L⌋ and ⌊L⌋ + 1 for each length L, ascending: the distances on either side of a
    threshold such as ``abs(i - j) > 300`` (or a period, repeated at L), which a
    log-spaced sample of distances need not hit."""
    floors = {math.floor(length.value) for length in lengths}
    return sorted(floors | {d + 1 for d in floors})


def distance_lengths(probe: Probe) -> list[Length]:
    """The lengths of distance an expression bias names, which ``spec_lengths`` leaves
    out for an expression of j - i (no shift moves it): the constant operands (each
    folded in float64, parameters, h and heads at the values the module reads, head by
    head) of every comparison, arithmetic operation and function call that also reads i
    or j, such as the 1000 of ``abs(i - j) > 1000``, ``maximum(abs(i - j) - 1000, 0)``
    or ``exp(-abs(i - j) / 1000)``; a magnitude below 1 as its reciprocal (a scale).
    The values ``where`` chooses between are heights, not lengths: its own operands
    are not read (its condition's are)."""
    found: dict[float, str] = {}
    parameters = probe.expression_parameters()
    for bias in expression_biases(probe.spec):
        body = bias.parsed().tree.body
        values = bound_names(bias, parameters, probe.heads)
        operands = [
            child
            for parent in ast.walk(body)
            if _meets_distance(parent)
            for child in ast.iter_child_nodes(parent)
            if isinstance(child, ast.expr) and not _reads_position(child)
        ]
        for assignment in assignments_of(body, values):
            for operand in operands:
                length = length_of(constant_value(operand, assignment))
                if length is not None:
                    found.setdefault(length, ast.unparse(operand))
    return [Length(value, f"the bias expression's {text}") for value, text in sorted(found.items())]


def _reads_position(node: ast.AST) -> bool:
    """Whether ``node`` reads i or j."""
    return any(isinstance(part, ast.Name) and part.id in ("i", "j") for part in ast.walk(node))


def _meets_distance(node: ast.AST) -> bool:
    """An operation (not ``where``) one of whose operands reads i or j."""
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Name) and node.func.id == "where":
            return False
        operands: list[ast.expr] = list(node.args)
    elif isinstance(node, ast.BinOp):
        operands = [node.left, node.right]
    elif isinstance(node, ast.Compare):
        operands = [node.left, *node.comparators]
    else:
        return False
    return any(_reads_position(operand) for operand in operands)


def decay_reach(probe: Probe, returns: list[Length] | None = None) -> tuple[int, list[Length]]:
    """(R, the lengths short of it): the curve's distances are [0, R), R the span, 2 ×
    every length the spec names (``spec_lengths`` and ``distance_lengths``) and every
    randomized-positions range (``training_ranges``) where farther, at most
    ``MAX_DECAY_REACH`` (``CONTEXTUAL_DECAY_REACH`` for a contextual form) and at most a
    table's end; the lengths whose distance (``decay_distance``) lies past R, below the
    table's end, are ones the curve does not reach (a claim that held is then limited).

    A randomized-positions range L (``positions: {kind: randomized}``) is the length of
    the sequences the model is trained to serve: training draws positions from [0, L),
    so it sees every distance below L, and a decay it relies on must hold there (the
    span alone would judge only the first 512). Its reach is L, not 2L: the evaluated
    module scores no distance differently past L (it is where training ends, not where
    the module changes), and a distance past L is extrapolation, which ``extrapolates``
    judges from L on.

    A rotation's return d (``rotation_return``; ``returns`` where already found) is a
    length too: the RoFormer bound is back near its maximum at d, so the curve reaches
    2d, past the return and over what follows it."""
    evaluated = probe.spec.model_copy(update={"positions": None})
    lengths = spec_lengths(evaluated, probe.expression_parameters()) + distance_lengths(probe)
    lengths += training_ranges(probe)
    lengths += rotation_return(probe) if returns is None else returns
    ceiling = math.inf if probe.limit is None else float(probe.limit)
    cap = MAX_DECAY_REACH if keys_independent(probe) else CONTEXTUAL_DECAY_REACH
    wanted = max([0.0, *(min(decay_distance(length), ceiling) for length in lengths)])
    reach = max(probe.span, min(math.ceil(wanted), cap))
    short = sorted(
        (length for length in lengths if min(decay_distance(length), ceiling) > reach),
        key=lambda length: length.value,
    )
    return reach, short


TRAINING_RANGE = "the randomized positions' range"
RETURN = "the rotation's return"
# R_d turns every pair to within this angle of a whole turn: the RoFormer bound at d is
# then at least cos(0.1) > 99.5 % of its maximum, its value at distance 0
RETURN_ANGLE = 0.1


def rotation_return(probe: Probe) -> list[Length]:
    """The first distance d ≤ ``MAX_DECAY_REACH`` at which the rotation turns back:
    every angle of R_1 (``Probe.rotation_angles``, the ones the RoFormer bound is formed
    of) times d within ``RETURN_ANGLE`` of a whole turn (``periods.turns_back``, exact),
    as a ``Length`` the curve must reach twice (``decay_distance``); none for a route
    without a rotation, or where no d up to the cap turns back.

    There the bound (1/(d/2)) Σ_j |S_j| climbs back to within 0.5 % of its maximum, and
    where d is a period (θ_k = 2π(k + 1)/1000 at d = 1000) the curve repeats: over
    [d, 2d) it is the curve over [0, d) again, so a curve reaching 2d shows the window
    means rise; the checks read only the span before (a bound that fell over [0, 512)
    and climbed back to its maximum at 1000 was confirmed to decay).

    Not the longest wavelength 2π/θ_min itself: RoPE's (47117 at base 10^4, d 64) is no
    return (the other pairs are far from a whole turn there), and past about 4096 its
    bound is flat (3.39, 3.39, 3.35, 3.44: random phases), so a curve made to reach it
    would judge noise, refuting RoFormer's claim on a rise of 0.06 %."""
    if probe.route != "rotation":
        return []
    angles = probe.rotation_angles()
    if angles.numel() == 0:
        return []
    # a return, not the start: the fastest pair has made a whole turn (below that, every
    # angle is within RETURN_ANGLE of 0 only while the curve has not left its maximum)
    start = math.ceil((2 * math.pi - RETURN_ANGLE) / float(angles.max()))
    found = turns_back(
        angles,
        MAX_DECAY_REACH,
        lambda distances: torch.full_like(distances, RETURN_ANGLE),
        1,
        start,
    )
    return [
        Length(
            float(d),
            f"{RETURN} to within {RETURN_ANGLE} of a whole turn on every pair at distance {d}",
        )
        for d in found
    ]


def training_ranges(probe: Probe) -> list[Length]:
    """The randomized-positions range of the spec (``positions.max_positions``), as a
    ``Length`` whose curve reaches the range itself (``decay_distance``)."""
    return [
        Length(float(value), f"{TRAINING_RANGE} {value}")
        for value in stated(probe.spec.positions, "max_positions")
    ]


def decay_distance(length: Length) -> float:
    """How far the curve must reach for ``length``: a randomized training range L is
    every distance below L (L); any other length, twice it (past where it acts)."""
    return length.value if length.source.startswith(TRAINING_RANGE) else 2 * length.value


def _reach_text(length: Length) -> str:
    """What a length asks of the curve, in evidence text."""
    if length.source.startswith(TRAINING_RANGE):
        return length.describe()
    return f"2 × {length.describe()}"


def decay_curve(
    probe: Probe,
    head: int = 0,
    query: int | None = None,
    example_seed: int | None = None,
    span: int | None = None,
    distances: Tensor | None = None,
) -> tuple[str, Tensor]:
    """(label, curve[r]) for r in [0, span): keys j = i - r before query i (query
    span - 1 by default); with ``distances`` (ascending), the curve at those distances
    instead (query max(distances) by default).

    The distances go in chunks (``distance_chunk``), one call of the module each, so a
    long span over many heads never holds an [heads, span, …] tensor at once and the
    hard deadline's signal lands between calls; a span within one chunk (the default
    512) is one call, as before. Keys are chunked only where each key's score depends
    on that key alone (``keys_independent``)."""
    chunk = distance_chunk(probe)
    if distances is None:
        distances = torch.arange(span or probe.span)
    span = int(distances[-1]) + 1
    if probe.route == "rotation" and probe.spec.bias is None:
        # each distance's bound is its own row: chunks give the same values
        bound = [probe.roformer_bound(part) for part in distances.split(chunk)]
        return "RoFormer bound (1/(d/2)) Σ|S_j|", torch.cat(bound)
    query = span - 1 if query is None else query
    keys = query - distances
    parts = keys.split(chunk) if keys_independent(probe) else (keys,)
    curve = []
    for part in parts:
        scores = probe.position_scores(torch.tensor([query]), part, example_seed)
        curve.append(scores[min(head, scores.shape[0] - 1), 0])  # [len(part)]
    label = "p_i · p_j / √d" if probe.route == "input" else "position-only score"
    return label, torch.cat(curve)


# One call of the module scores at most this many (head, key, feature) elements of the
# curve's constant content (2^22: 32 MiB of float64), within [MIN, MAX] keys.
CHUNK_ELEMENTS = 1 << 22
MIN_DISTANCE_CHUNK, MAX_DISTANCE_CHUNK = 512, 4096


def distance_chunk(probe: Probe) -> int:
    """How many distances of a decay curve one call of the module evaluates: bounded by
    the heads × head_dim of the expanded content (``CHUNK_ELEMENTS``), never below 512
    (so the default span is one call) nor above 4096 (a bias such as FIRE's expands each
    score through a hidden layer the contract does not expose)."""
    per_key = max(1, probe.heads * probe.head_dim)
    return min(MAX_DISTANCE_CHUNK, max(MIN_DISTANCE_CHUNK, CHUNK_ELEMENTS // per_key))


def keys_independent(probe: Probe) -> bool:
    """Whether a key's position-only score depends only on that key (and the query), so
    the keys can be scored in chunks: every form but a contextual one (CoPE counts gates
    over the other keys between the key and the query)."""
    return not stated(probe.spec, "contextual", SpecModel)


def decay(probe: Probe, claimed: bool | None) -> Outcome:
    """Judge or measure ``decay`` for one probe; the curve goes into the outcome."""
    unreachable = input_unreachable(probe, "decay", claimed)
    if unreachable is not None:
        return unreachable
    span = probe.span
    returns = rotation_return(probe)
    reach, short = decay_reach(probe, returns)
    windows = distance_windows(reach)
    top = (probe.limit or 2 * reach) - 1
    bound_route = probe.route == "rotation" and probe.spec.bias is None
    heads = 1 if probe.route == "input" or bound_route else probe.heads
    samples = WINDOW_SAMPLES if keys_independent(probe) else None  # CoPE: every key
    distances = curve_distances(windows, span, BOUND_WINDOW_SAMPLES if bound_route else samples)
    # the bound ignores the head, the query and the content: one curve for every example
    bound = decay_curve(probe, distances=distances) if bound_route else None

    def curve_of(example: Example) -> tuple[str, Tensor]:
        head, query, example_seed = example
        if bound is not None:
            return bound
        return decay_curve(probe, head, query, example_seed, distances=distances)

    # a query before reach - 1 has a curve of its own over the keys before it (scores
    # of absolute positions depend on the query): no window of it may rise
    early = [] if bound_route else early_queries(reach)
    queries = st.integers(reach - 1, max(reach - 1, top))
    if early:
        queries = st.one_of(queries, st.integers(early[0], reach - 2))

    @st.composite
    def examples(draw: st.DrawFn) -> Example:
        return (draw(st.integers(0, heads - 1)), draw(queries), draw(SEEDS))

    def check(example: Example) -> float:
        head, query, example_seed = example
        if query >= reach - 1:
            return _falls(example, curve_of(example), windows, distances, bound_route)
        # the whole windows its keys fill: distances 0 … W - 1, W the largest power of
        # two within query + 1, sampled past the span as the curve at reach - 1 is
        width = 1 << ((query + 1).bit_length() - 1)
        near_windows = distance_windows(width)
        near = curve_distances(near_windows, span, samples)
        curve = decay_curve(probe, head, query, example_seed, distances=near)
        return _falls(example, curve, near_windows, near, False, rises_only=True)

    def scan() -> list[Example]:
        return [(head, query, probe.budget.seed) for query in early for head in range(heads)]

    search = run_search(check, examples(), probe.budget, scan if early else None)
    shown_example = (0, reach - 1, probe.budget.seed)  # the curve shown: judged too
    label, curve = curve_of(shown_example)
    if search.violation is None:
        search.examples += 1
        try:
            search.worst = min(
                search.worst, _falls(shown_example, (label, curve), windows, distances, bound_route)
            )
        except Violation as violation:
            search = Search(violation, "scan", search.examples, search.worst)
    means = window_means(curve, windows, distances)
    listed = curve_distances(windows, span)  # in the JSON: at most WINDOW_SAMPLES a window
    shown: dict[str, Any] = {
        "label": label,
        "windows": [list(w) for w in windows],
        "means": means,
        "head": 0,
        "query": None if bound_route else reach - 1,
        # the curve at distances 0, 1, ..., reach - 1, or at "distances" where sampled
        "values": curve[torch.searchsorted(distances, listed)].tolist(),
    }
    if len(listed) < reach:
        shown["distances"] = listed.tolist()
    shown = jsonable(shown)  # non-finite means and values (a log bias at distance 0) as text
    if search.violation is not None:
        outcome = failed("decay", "claim", claimed, search)
        outcome.curve = shown
        if returns:  # why the curve went that far: the rotation turns back
            outcome.evidence += f" (distances up to {reach - 1}, for {_reach_text(returns[0])})"
        return outcome
    over = " over windows" if bound_route else " over heads and query positions"
    extent = ""
    if reach > span:  # the curve goes past the span, to twice the lengths named
        returned = [length for length in returns if length not in short]
        extent = f"; distances up to {reach - 1}, {_reach_reason(probe, returned)}"
        if len(distances) < reach:
            most = BOUND_WINDOW_SAMPLES if bound_route else WINDOW_SAMPLES
            extent += (
                f", each window past {span} wider than {most} averaged over {most} evenly "
                "spaced distances"
            )
    evidence = (
        f"{label} on log windows of distance: {_chain(means)} "
        f"({search.examples} examples{over}{extent})"
    )
    if not short:
        return Outcome("decay", "claim", claimed, True, evidence, curve=shown)
    named = ", ".join(_reach_text(length) for length in short[:3])
    return Outcome(
        "decay",
        "claim",
        claimed,
        True,
        f"tested only up to distance {reach - 1}: the curve does not reach {named}, so a "
        f"rise there goes unseen; {evidence}",
        curve=shown,
        limited_to=f"r < {reach}",
    )


# an early query has at least the windows [0, 1), [1, 2), [2, 4)
FIRST_EARLY_QUERY = 3


def early_queries(reach: int) -> list[int]:
    """The queries before reach - 1 that ``decay``'s scan judges after hypothesis (which
    draws them too): 2^k - 1 from ``FIRST_EARLY_QUERY`` on, whose keys fill whole
    windows, from distance 0 to 2^k - 1.

    Where the position-only scores depend on the query (absolute positions), the curve
    at reach - 1 says nothing of the curve of a query early in the sequence (every
    sequence starts at position 0): ``where(i < 400, abs(i - j), -abs(i - j))`` falls at
    query 511 and rises at every query below 400. Such a curve is judged by the rule's
    first part only, no window mean rises (its windows stop at the query, and a few
    flat ones there are no rise); for scores of j - i it is the curve at reach - 1 over
    its first windows, already judged."""
    found = []
    query = FIRST_EARLY_QUERY
    while query < reach - 1:
        found.append(query)
        query = 2 * query + 1
    return found


def _reach_reason(probe: Probe, lengths: list[Length]) -> str:
    """Why the curve goes past the span, in evidence text (``lengths``: those the
    curve reached)."""
    reason = "twice every length the spec names"
    if training_ranges(probe):
        reason = f"every distance of the randomized training range and {reason}"
    returns = [length for length in lengths if length.source.startswith(RETURN)]
    if returns:
        reason += f", and twice {returns[0].describe()}"
    return reason


def _falls(
    example: Example,
    label_curve: tuple[str, Tensor],
    windows: list[Window],
    distances: Tensor,
    bound_route: bool,
    rises_only: bool = False,
) -> float:
    """The smallest fall between adjacent window means of ``label_curve`` (the curve of
    ``example`` at ``distances``), or a Violation: first where the curve is not finite
    (NaN or ±inf, at the first such distance: a mean of it says nothing of a fall), then
    by the rule (no rise, the last below the first, at least half of the adjacent
    windows falling strictly; ``rises_only``: no rise alone, an early query's curve)."""
    head, query, _ = example
    label, curve = label_curve  # at ``distances``
    means = window_means(curve, windows, distances)
    where = "" if bound_route else f"head {head}, query {query}: "
    details: dict[str, Any] = dict(
        head=None if bound_route else head,
        query=None if bound_route else query,
        windows=[list(w) for w in windows],
        means=means,
        curve_label=label,
    )
    shown = "; window means " + ", ".join(fmt(m) for m in means)
    unfinished = (~torch.isfinite(curve)).nonzero()
    if unfinished.numel():
        index = int(unfinished[0])
        distance, value = int(distances[index]), float(curve[index])
        raise Violation(
            f"{where}{label} is not finite at distance {distance} ({fmt(value)}), the "
            f"first distance where it is not: a window mean of it neither rises nor "
            f"falls{shown}",
            distance=distance,
            value=value,
            **details,
        )
    for window in range(len(windows) - 1):
        a, b = windows[window], windows[window + 1]
        if means[window + 1] > means[window] + _tolerance(means[window], means[window + 1]):
            raise Violation(
                f"{where}{label} rises from distance window [{a[0]}, {a[1]}) to "
                f"[{b[0]}, {b[1]}): mean {fmt(means[window])} -> "
                f"{fmt(means[window + 1])}{shown}",
                window=window,
                **details,
            )
    if rises_only:
        return min(x - y for x, y in zip(means, means[1:], strict=False))
    if means[-1] >= means[0] - _tolerance(means[0], means[-1]):
        raise Violation(
            f"{where}{label} does not fall: mean {fmt(means[0])} at distance 0, "
            f"{fmt(means[-1])} over [{windows[-1][0]}, {windows[-1][1]}){shown}",
            **details,
        )
    pairs = len(windows) - 1
    falls = sum(1 for x, y in zip(means, means[1:], strict=False) if y < x - _tolerance(x, y))
    if 2 * falls < pairs:
        raise Violation(
            f"{where}{label} falls strictly between only {falls} of {pairs} adjacent "
            f"distance windows (at least half must){shown}",
            **details,
        )
    return min(x - y for x, y in zip(means, means[1:], strict=False))


def _chain(means: list[float]) -> str:
    """The window means joined by >, < or = (honest: = where equal within tolerance)."""
    # q · k = 0 round-off shown as 0: tiny beside the largest mean and in itself
    zero = min(1e-12 * max(abs(m) for m in means), 1e-9)
    tidy = [0.0 if abs(m) <= zero else m for m in means]
    chain = fmt(tidy[0])
    for before, after in zip(tidy, tidy[1:], strict=False):
        chain += _relation(before, after) + fmt(after)
    return chain


def _tolerance(before: float, after: float) -> float:
    """How far apart two window means may lie and still count as equal: 1e-9 of the
    larger (plus 1e-9 near 0), round-off of their own size; a tolerance taken from the
    whole curve's largest value joined -1e-6 and -4.9e-5 as equal beside -6e18."""
    return 1e-9 * (1.0 + max(abs(before), abs(after)))


def _relation(before: float, after: float) -> str:
    """How two window means compare: " > " falls, " < " rises, " = " within tolerance."""
    if after < before - _tolerance(before, after):
        return " > "
    if after > before + _tolerance(before, after):
        return " < "
    return " = "
