"""Time-budgeted hypothesis searches: how hard and how long each property looks.

Every property is a predicate over examples drawn by hypothesis: a check function returns
a margin (how far from failing; the worst one seen is reported) or raises ``Violation``
with a readable message and the example's facts. ``run_search`` runs it; hypothesis
shrinks a failure and replays the minimal example last, so the last violation recorded is
the shrunk counterexample. Where a property is a statement about a finite range, an
exhaustive scan follows the random search, so a claim of ``false`` is only confirmed when
a counterexample is actually found; after a hypothesis failure, the scan's first failing
candidate (the closest one) is shown beside it when it is simpler.

Every search stops drawing after its share of the time budget (``Budget.seconds`` per
property, ``Budget.spec_seconds`` per spec, slow modules only) and marks the budget
``timed_out``; the runner shares ``spec_seconds`` among the properties left.

Distances past ``EXACT_DISTANCES`` are sampled log-spaced (``distance_sample``), and
positions go up to ``FAR`` = 2^20, so work and memory stay bounded.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
from hypothesis import strategies as st

from posgen.check.contract import F64

T = TypeVar("T")

FAR = 1 << 20  # positions up to 2^20 (bf16, rotations, extrapolation)
EXACT_DISTANCES = 2048  # every distance in (-2048, 2048) is compared
FAR_DISTANCES = 512  # past it, this many log-spaced distances on each side
SEEDS = st.integers(0, 2**31 - 1)  # seeds of an example's random content


@dataclass
class Budget:
    """How hard to look: hypothesis examples per property, its seed, the position span."""

    max_examples: int = 100
    seed: int = 0
    span: int = 512  # positions checked for unique/relative/decay (capped by a table)
    seconds: float = 10.0  # per property: no new examples after this (slow modules)
    spec_seconds: float = 45.0  # per spec: each property gets at most a fair share of it
    timed_out: bool = field(default=False, compare=False, repr=False)  # set by searches


class Violation(AssertionError):
    """A property failed on one example: a readable message plus the example's facts."""

    def __init__(self, message: str, rank: float | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.rank = rank  # how far from the origin the example is (smaller is simpler)
        self.details = details


class _OutOfTime(Exception):
    """Raised inside a search once its time budget is spent (no failure found yet)."""


@dataclass
class Search:
    """What a search found: the (shrunk) violation, and the worst margin seen otherwise."""

    violation: Violation | None
    found_by: str | None  # "hypothesis" | "scan" | None
    examples: int
    worst: float


@dataclass
class _Progress(Generic[T]):
    """What a running search has seen so far."""

    started: float
    count: int = 0
    worst: float = math.inf
    failures: list[Violation] = field(default_factory=list)
    failing: list[T] = field(default_factory=list)


def run_search(
    check: Callable[[T], float],
    strategy: st.SearchStrategy[T],
    budget: Budget,
    scan: Callable[[], Iterable[T]] | None = None,
) -> Search:
    """Run ``check`` on examples from ``strategy``; then, if nothing failed, on ``scan``.

    ``check`` returns a margin (how far from failing; reported as the worst seen) or raises
    Violation. hypothesis shrinks a failure and replays the minimal example last, so the
    last violation recorded is the shrunk counterexample.
    """
    progress: _Progress[T] = _Progress(started=time.perf_counter())
    try:
        _hypothesis_run(check, strategy, budget, progress)()
    except _OutOfTime:
        budget.timed_out = True
    except Violation:
        found = progress.failures[-1]
        if scan is not None:
            _add_closest(check, scan, found)
        return Search(found, "hypothesis", progress.count, progress.worst)
    if scan is not None:
        for example in scan():
            progress.count += 1
            try:
                progress.worst = min(progress.worst, check(example))
            except Violation as violation:
                return Search(violation, "scan", progress.count, progress.worst)
    return Search(None, None, progress.count, progress.worst)


def _hypothesis_run(
    check: Callable[[T], float],
    strategy: st.SearchStrategy[T],
    budget: Budget,
    progress: _Progress[T],
) -> Callable[[], None]:
    """The hypothesis test that runs ``check`` under ``budget``, recording into progress."""

    @seed(budget.seed)
    @settings(
        max_examples=budget.max_examples,
        deadline=None,
        database=None,
        derandomize=False,
        verbosity=Verbosity.quiet,
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
    )
    @given(strategy)
    def run(example: T) -> None:
        if progress.count and time.perf_counter() - progress.started > budget.seconds:
            # out of time (slow modules): draw no more; while shrinking, keep the smallest
            # failing example found so far and let hypothesis replay only that one
            if not progress.failures:
                raise _OutOfTime  # hypothesis shrinks it in no time; caught by the caller
            if example != progress.failing[-1]:
                return
        progress.count += 1
        try:
            margin = check(example)
        except Violation as violation:
            progress.failures.append(violation)
            progress.failing.append(example)
            raise
        progress.worst = min(progress.worst, margin)

    return run


def _add_closest(
    check: Callable[[T], float], scan: Callable[[], Iterable[T]], found: Violation
) -> None:
    """Add the scan's first failing example to ``found`` where it is simpler and differs.

    The scan orders candidates closest first: the first failure it meets is the closest.
    """
    for example in scan():
        try:
            check(example)
        except Violation as closest:
            simpler = closest.rank is None or found.rank is None or closest.rank < found.rank
            if closest.message != found.message and simpler:
                found.message += f"; closest (scan): {closest.message}"
                found.details["closest"] = closest.details
            break


def generator(example_seed: int) -> torch.Generator:
    """A torch generator seeded with ``example_seed`` (an example's random content)."""
    made = torch.Generator()
    made.manual_seed(example_seed)
    return made


def distance_sample(reach: int) -> list[int]:
    """Distances k - q to compare, ordered by |d| (+d before -d): every one in (-E, E) for
    E = min(reach, EXACT_DISTANCES), then log-spaced ones out to ±reach (bounded work
    and memory however large a stated max_distance is)."""
    exact = min(reach, EXACT_DISTANCES)
    found = set(range(-exact + 1, exact))
    if reach > exact:
        far = torch.logspace(math.log10(exact), math.log10(reach), FAR_DISTANCES, dtype=F64)
        for value in far.round().long().unique().tolist():
            found.update((value, -value))
    return sorted(found, key=lambda d: (abs(d), d < 0))


def fmt(value: float) -> str:
    """A number in evidence text: 4 significant digits."""
    return f"{value:.4g}"


def spread(items: Sequence[T], count: int) -> list[T]:
    """At most ``count`` (≥ 2) of ``items``, evenly spread over them in order, the first
    and the last among them; all of them where there are no more."""
    if len(items) <= count:
        return list(items)
    last = len(items) - 1
    return [items[index] for index in sorted({round(k * last / (count - 1)) for k in range(count)})]


def short_list(values: Iterable[Any], limit: int = 6) -> str:
    """A list in evidence text, its middle elided past ``limit`` items."""
    items = [str(v) for v in values]
    if len(items) > limit:
        items = items[: limit - 1] + ["…", items[-1]]
    return "[" + ", ".join(items) + "]"
