"""The runner: every property of a spec, checked in order, into one ``Report``.

``check_loaded`` builds the spec's ``Probe`` (a module that cannot be built gives an
ERROR outcome for every property asked for), then runs the claims (``CLAIM_CHECKS``:
judged where stated, measured where not) and the building-block checks
(``BLOCK_CHECKS``: only where the block is present, n/a elsewhere). Each property gets at
most ``Budget.seconds`` and a fair share of what is left of ``Budget.spec_seconds``; a
property that stopped drawing says so in its evidence. That share is a soft budget (no
new examples), at least ``MIN_SHARE_SECONDS``; ``GRACE`` past it a hard deadline stops the
property mid-example (``deadline.hard_deadline``) and its verdict is "inconclusive (time
budget)", so a spec takes at most the larger of ``spec_seconds`` and
``MIN_SHARE_SECONDS`` per property, plus ``GRACE`` per property and the last torch
operation each was in (the deadline strikes between Python bytecodes). An exception inside a
property is an ERROR outcome, never a traceback. Everything runs on one thread: the tensors are
small, and oversubscribed threads made it 10-20x slower.

This module is the checker's entry point: it re-exports what the CLI and the report need.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posgen.check.agreement import backends, bf16, kv_cache
from posgen.check.buckets import buckets
from posgen.check.deadline import (
    GRACE_FACTOR,
    GRACE_SECONDS,
    MIN_SHARE_SECONDS,
    OutOfTime,
    hard_deadline,
)
from posgen.check.decay import decay
from posgen.check.extrapolates import extrapolates
from posgen.check.probe import Probe
from posgen.check.relative import relative
from posgen.check.rotation import rotation_norm, rotation_pairing
from posgen.check.search import Budget
from posgen.check.slopes import slopes
from posgen.check.unique import unique
from posgen.check.verdicts import BLOCKS, CLAIMS, Outcome, Report, kind_of
from posgen.spec.loader import LoadedSpec, load_spec

__all__ = [
    "BLOCK_CHECKS",
    "BLOCKS",
    "CLAIM_CHECKS",
    "CLAIMS",
    "PROPERTIES",
    "Budget",
    "Outcome",
    "Report",
    "check_loaded",
    "check_spec",
]

CLAIM_CHECKS: dict[str, Callable[[Probe, bool | None], Outcome]] = {
    "unique": unique,
    "relative": relative,
    "decay": decay,
    "extrapolates": extrapolates,
}
BLOCK_CHECKS: dict[str, Callable[[Probe], Outcome]] = {
    "rotation_norm": rotation_norm,
    "rotation_pairing": rotation_pairing,
    "buckets": buckets,
    "slopes": slopes,
    "backends": backends,
    "bf16": bf16,
    "kv_cache": kv_cache,
}
PROPERTIES = CLAIMS + BLOCKS
ROUTE_SHARE = 0.1  # of spec_seconds, for reading the table the route line describes


def check_loaded(
    loaded: LoadedSpec,
    budget: Budget | None = None,
    only: Iterable[str] | None = None,
    progress: Callable[[str], None] | None = None,
    weights: Mapping[str, Tensor] | None = None,
) -> Report:
    """Check every property (or ``only`` those) of one loaded spec.

    ``weights``: a state_dict to judge the module at, instead of its seeded random
    initialisation (see ``posgen.check.weights``).
    """
    budget = budget or Budget()
    started = time.perf_counter()
    threads = torch.get_num_threads()
    # Every tensor here is small: one thread avoids oversubscription (on a busy 2-core
    # machine, 2 threads made the checks 10-20x slower).
    torch.set_num_threads(1)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # the flex backend runs FlexAttention's unfused reference on CPU on purpose
            warnings.filterwarnings("ignore", message="flex_attention called without")
            return _check_loaded(loaded, budget, only, progress, started, weights)
    finally:
        torch.set_num_threads(threads)


def check_spec(path: Path, budget: Budget | None = None, **kwargs: Any) -> Report:
    """Load, build in memory and check one spec file (raises SpecError if invalid)."""
    return check_loaded(load_spec(path), budget, **kwargs)


def _claimed(loaded: LoadedSpec, name: str) -> bool | None:
    """What the spec states for a claim (None: not stated, or a building block)."""
    if name not in CLAIMS:
        return None
    claimed: bool | None = getattr(loaded.spec.claims, name)
    return claimed


def _check_loaded(
    loaded: LoadedSpec,
    budget: Budget,
    only: Iterable[str] | None,
    progress: Callable[[str], None] | None,
    started: float,
    weights: Mapping[str, Tensor] | None = None,
) -> Report:
    """check_loaded's work, on one thread and without gradients."""
    wanted = list(PROPERTIES) if only is None else [p for p in PROPERTIES if p in set(only)]
    try:
        probe = Probe(loaded, budget, weights)
    except Exception as error:  # noqa: BLE001 - a module that cannot even be built
        return _unbuildable(loaded, wanted, error, started)
    try:
        with hard_deadline(ROUTE_SHARE * budget.spec_seconds):
            route = probe.route_text()
    except OutOfTime:
        route = f"{probe.route} (the table was not read: it took over its time budget)"
    except Exception as error:  # noqa: BLE001 - reported, never a traceback
        route = f"{probe.route} (the table could not be read: {type(error).__name__}: {error})"
    report = Report(loaded.spec.name, loaded.display_path, loaded.spec.title, route)
    for done, name in enumerate(wanted):
        began = time.perf_counter()
        # the per-spec cap: what is left of spec_seconds, shared by the properties left
        left = budget.spec_seconds - (began - started)
        share = max(MIN_SHARE_SECONDS, left / (len(wanted) - done))
        probe.budget = replace(budget, seconds=min(budget.seconds, share), timed_out=False)
        limit = probe.budget.seconds * (1 + GRACE_FACTOR) + GRACE_SECONDS
        outcome = _run_property(probe, name, _claimed(loaded, name), limit)
        outcome.seconds = time.perf_counter() - began
        if probe.budget.timed_out and not outcome.inconclusive:
            outcome.evidence += (
                f" [stopped drawing at the {probe.budget.seconds:.3g} s time budget]"
            )
        report.outcomes.append(outcome)
        if progress is not None:
            progress(name)
    report.seconds = time.perf_counter() - started
    return report


def _run_property(probe: Probe, name: str, claimed: bool | None, limit: float) -> Outcome:
    """One property's outcome within ``limit`` seconds; an exception is an ERROR outcome."""
    began = time.perf_counter()
    try:
        with hard_deadline(limit):
            if name in CLAIM_CHECKS:
                return CLAIM_CHECKS[name](probe, claimed)
            return BLOCK_CHECKS[name](probe)
    except OutOfTime:
        spent = time.perf_counter() - began
        return Outcome(
            name,
            kind_of(name),
            claimed,
            None,
            f"inconclusive (time budget): stopped after {spent:.3g} s, the hard limit of "
            f"{limit:.3g} s (soft budget {probe.budget.seconds:.3g} s), in the middle of an "
            "example; no verdict. Raise --time-budget / --spec-time-budget, or lower --span",
            inconclusive=True,
        )
    except Exception as error:  # noqa: BLE001 - reported, never a traceback
        return Outcome(
            name, kind_of(name), claimed, None, f"{type(error).__name__}: {error}", error=True
        )


def _unbuildable(loaded: LoadedSpec, wanted: list[str], error: Exception, started: float) -> Report:
    """The report of a module that cannot be built: an ERROR for every property."""
    report = Report(
        loaded.spec.name,
        loaded.display_path,
        loaded.spec.title,
        "none: the module could not be built",
    )
    for name in wanted:
        report.outcomes.append(
            Outcome(
                name,
                kind_of(name),
                _claimed(loaded, name),
                None,
                f"building the module failed: {type(error).__name__}: {error}",
                error=True,
            )
        )
    report.seconds = time.perf_counter() - started
    return report
