"""Render ``posgen check`` results: a verdict table per spec, or one JSON document."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Sequence

from posgen.check.search import Budget
from posgen.check.verdicts import Report, jsonable


def _claimed(value: bool | None) -> str:
    """The claimed column: true, false, or - where the spec states nothing."""
    return "-" if value is None else str(value).lower()


def render_table(report: Report, width: int = 100) -> list[str]:
    """The verdict table of one spec: property, claimed, verdict, evidence."""
    lines = [
        f"{report.path}: {report.name} — {report.title}",
        f"  route: {report.route}; {report.seconds:.1f} s",
    ]
    name_width = max(len("property"), *(len(o.name) for o in report.outcomes))
    verdict_width = max(len("verdict"), *(len(o.verdict) for o in report.outcomes))
    head = f"  {'property':<{name_width}}  {'claimed':<7}  {'verdict':<{verdict_width}}  "
    lines.append(head + "evidence")
    lines.append("  " + "-" * (max(width, len(head) + 20) - 2))
    evidence_width = max(30, width - len(head))
    for outcome in report.outcomes:
        wrapped = textwrap.wrap(outcome.evidence, evidence_width) or [""]
        lines.append(
            f"  {outcome.name:<{name_width}}  {_claimed(outcome.claimed):<7}  "
            f"{outcome.verdict:<{verdict_width}}  {wrapped[0]}"
        )
        lines.extend(" " * len(head) + more for more in wrapped[1:])
    problems = [o for o in report.outcomes if not o.ok]
    if problems:
        listed = ", ".join(f"{o.name} ({o.verdict})" for o in problems)
        lines.append(f"  => {len(problems)} problem{'s' if len(problems) > 1 else ''}: {listed}")
    else:
        stated = [o for o in report.outcomes if o.claimed is not None]
        checked = sum(o.holds is not None and not o.limited for o in stated)
        verb = "claim holds" if checked == 1 else "claims hold"
        unchecked = [f"{o.name} ({o.verdict})" for o in stated if o.holds is None]
        note = f", not checked: {', '.join(unchecked)}" if unchecked else ""
        limited = [f"{o.name} ({o.limited_to})" for o in stated if o.limited]
        if limited:
            note += f", tested only in part: {', '.join(limited)}"
        stopped = [o.name for o in report.outcomes if o.inconclusive and o.claimed is None]
        if stopped:
            note += f"; out of time: {', '.join(stopped)}"
        lines.append(f"  => ok: {checked} stated {verb}{note}; building blocks hold")
    return lines


def render_summary(reports: Sequence[Report], seconds: float) -> str:
    """The last line of a run: how many specs, how long, and what failed."""
    failed = [report.name for report in reports if not report.ok]
    unchecked = sum(
        outcome.claimed is not None and outcome.holds is None
        for report in reports
        for outcome in report.outcomes
    )
    limited = sum(
        outcome.claimed is not None and outcome.limited
        for report in reports
        for outcome in report.outcomes
    )
    if failed:
        status = f"problems in {', '.join(failed)}"
    elif unchecked or limited:
        parts = []
        if unchecked:
            plural = "s" if unchecked > 1 else ""
            parts.append(f"{unchecked} stated claim{plural} could not be checked")
        if limited:
            plural = "s" if limited > 1 else ""
            parts.append(f"{limited} stated claim{plural} tested only in part")
        status = f"no claim refuted; {'; '.join(parts)}"
    else:
        status = "all claims hold"
    count = len(reports)
    return f"{count} spec{'s' if count != 1 else ''} checked in {seconds:.1f} s: {status}."


def render_json(reports: Sequence[Report], budget: Budget, seconds: float) -> str:
    """Every report as one JSON document, with the budget the run used: standard JSON,
    a non-finite number written as the string "nan", "inf" or "-inf" (``jsonable``)."""
    document = {
        "ok": all(report.ok for report in reports),
        "seed": budget.seed,
        "max_examples": budget.max_examples,
        "span": budget.span,
        "time_budget": {"property_seconds": budget.seconds, "spec_seconds": budget.spec_seconds},
        "seconds": round(seconds, 3),
        "specs": [report.as_json() for report in reports],
    }
    # every float through jsonable (non-finite ones as the strings "nan", "inf", "-inf"),
    # and allow_nan=False so that a bare NaN or Infinity (not JSON) can never be printed
    return json.dumps(jsonable(document), indent=2, ensure_ascii=False, allow_nan=False)
