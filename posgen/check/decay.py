"""The ``decay`` claim: the position-only score falls with distance.

The curve is the position-only score of a query against the keys before it, at distances
r = 0, 1, …, span - 1 (``decay_curve``); a rotation without a bias uses the RoFormer bound
(1/(d/2)) Σ_j |S_j| on the frequencies measured from the module instead. The curve is
averaged over log windows of distance, [0, 1), [1, 2), [2, 4), [4, 8), … up to the span
(``distance_windows``, ``window_means``); it decays when no window mean rises over the
previous one, the last is below the first, and at least half of the adjacent windows fall
strictly. hypothesis draws the head, the query position (up to the table's end) and the
content's seed. ``posgen plot`` draws the same curve and window means. A long curve is
evaluated a chunk of distances at a time (``distance_chunk``), which bounds its memory
and lets the runner's hard deadline stop it between chunks.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from posgen.check.probe import Probe, input_unreachable, stated
from posgen.check.search import SEEDS, Violation, fmt, run_search
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


def window_means(curve: Tensor, windows: list[Window]) -> list[float]:
    """The mean of the curve over each window."""
    return [float(curve[a:b].mean()) for a, b in windows]


def decay_curve(
    probe: Probe,
    head: int = 0,
    query: int | None = None,
    example_seed: int | None = None,
    span: int | None = None,
) -> tuple[str, Tensor]:
    """(label, curve[r]) for r in [0, span): keys j = i - r before query i.

    The distances go in chunks (``distance_chunk``), one call of the module each, so a
    long span over many heads never holds an [heads, span, …] tensor at once and the
    hard deadline's signal lands between calls; a span within one chunk (the default
    512) is one call, as before. Keys are chunked only where each key's score depends
    on that key alone (``keys_independent``)."""
    span = span or probe.span
    chunk = distance_chunk(probe)
    distances = torch.arange(span)
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
    windows = distance_windows(span)
    top = (probe.limit or 2 * span) - 1
    bound_route = probe.route == "rotation" and probe.spec.bias is None
    heads = 1 if probe.route == "input" or bound_route else probe.heads

    @st.composite
    def examples(draw: st.DrawFn) -> Example:
        return (
            draw(st.integers(0, heads - 1)),
            draw(st.integers(span - 1, max(span - 1, top))),
            draw(SEEDS),
        )

    def check(example: Example) -> float:
        return _falls(probe, example, windows, bound_route)

    search = run_search(check, examples(), probe.budget)
    label, curve = decay_curve(probe)
    means = window_means(curve, windows)
    shown = jsonable(  # non-finite means and values (a log bias at distance 0) as text
        {
            "label": label,
            "windows": [list(w) for w in windows],
            "means": means,
            "head": 0,
            "query": None if bound_route else span - 1,
            "values": curve.tolist(),  # the curve at distances 0, 1, ..., span - 1
        }
    )
    if search.violation is not None:
        outcome = failed("decay", "claim", claimed, search)
        outcome.curve = shown
        return outcome
    over = " over windows" if bound_route else " over heads and query positions"
    return Outcome(
        "decay",
        "claim",
        claimed,
        True,
        f"{label} on log windows of distance: {_chain(curve, means)} "
        f"({search.examples} examples{over})",
        curve=shown,
    )


def _falls(probe: Probe, example: Example, windows: list[Window], bound_route: bool) -> float:
    """The smallest fall between adjacent window means, or a Violation."""
    head, query, example_seed = example
    label, curve = decay_curve(probe, head, query, example_seed)
    means = window_means(curve, windows)
    tol = 1e-9 * (1.0 + float(curve.abs().max()))
    where = "" if bound_route else f"head {head}, query {query}: "
    details: dict[str, Any] = dict(
        head=None if bound_route else head,
        query=None if bound_route else query,
        windows=[list(w) for w in windows],
        means=means,
        curve_label=label,
    )
    shown = "; window means " + ", ".join(fmt(m) for m in means)
    for window in range(len(windows) - 1):
        a, b = windows[window], windows[window + 1]
        if means[window + 1] > means[window] + tol:
            raise Violation(
                f"{where}{label} rises from distance window [{a[0]}, {a[1]}) to "
                f"[{b[0]}, {b[1]}): mean {fmt(means[window])} -> "
                f"{fmt(means[window + 1])}{shown}",
                window=window,
                **details,
            )
    if means[-1] >= means[0] - tol:
        raise Violation(
            f"{where}{label} does not fall: mean {fmt(means[0])} at distance 0, "
            f"{fmt(means[-1])} over [{windows[-1][0]}, {windows[-1][1]}){shown}",
            **details,
        )
    pairs = len(windows) - 1
    falls = sum(1 for x, y in zip(means, means[1:], strict=False) if y < x - tol)
    if 2 * falls < pairs:
        raise Violation(
            f"{where}{label} falls strictly between only {falls} of {pairs} adjacent "
            f"distance windows (at least half must){shown}",
            **details,
        )
    return min(x - y for x, y in zip(means, means[1:], strict=False))


def _chain(curve: Tensor, means: list[float]) -> str:
    """The window means joined by >, < or = (honest: = where equal within tolerance)."""
    scale = max(abs(m) for m in means)
    tidy = [0.0 if abs(m) <= 1e-12 * scale else m for m in means]  # q · k = 0 round-off
    tol = 1e-9 * (1.0 + float(curve.abs().max()))
    chain = fmt(tidy[0])
    for before, after in zip(tidy, tidy[1:], strict=False):
        chain += _relation(before, after, tol) + fmt(after)
    return chain


def _relation(before: float, after: float, tol: float) -> str:
    """How two window means compare: " > " falls, " < " rises, " = " within ``tol``."""
    if after < before - tol:
        return " > "
    if after > before + tol:
        return " < "
    return " = "
