"""Verdicts: one ``Outcome`` per property, one ``Report`` per spec, and their JSON.

A claim (``unique``, ``relative``, ``decay``, ``extrapolates``) is stated in the spec as
true or false, or left out: a stated claim is judged ("confirmed" or "REFUTED", a false
claim with hypothesis' shrunk counterexample), an absent one is measured and shown. A
claim that held only as far as the search could reach, short of a length the spec names
(``Outcome.limited_to``), is "limited: holds" (unstated: "measured: holds (limited)"):
neither confirmed nor refuted, whichever value the spec states. A
building block ("block") holds or FAILS where the block is present, and is "n/a"
elsewhere. An exception inside a property is an ERROR outcome, never a traceback.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from posgen.check.search import Search

CLAIMS = ("unique", "relative", "decay", "extrapolates")
BLOCKS = (
    "rotation_norm",
    "rotation_pairing",
    "buckets",
    "slopes",
    "backends",
    "bf16",
    "kv_cache",
)
DESCRIPTIONS = {
    "unique": "distinct positions get distinct encodings",
    "relative": "shifting every position by c leaves the logits unchanged",
    "decay": "the position-only score (rotations: RoFormer bound) falls with distance",
    "extrapolates": "positions beyond the training length give finite outputs",
    "rotation_norm": "rotations keep norms and are the identity at position 0",
    "rotation_pairing": "half and interleaved pairings differ by a fixed permutation",
    "buckets": "buckets lie in range, are monotone in |i - j| and follow the recipe",
    "slopes": "slopes are positive and follow the named recipe",
    "backends": "every backend agrees with eager",
    "bf16": "bf16 input stays within bf16 error of fp32 (positions up to 2^20)",
    "kv_cache": "an offset query block reproduces the rows of the full computation",
}


def kind_of(name: str) -> str:
    """The kind of a property: "claim" for the four claims, "block" for the rest."""
    return "claim" if name in CLAIMS else "block"


@dataclass
class Outcome:
    """One property's result for one spec."""

    name: str
    kind: str  # "claim" | "block"
    claimed: bool | None
    holds: bool | None  # None: not applicable
    evidence: str
    counterexample: dict[str, Any] | None = None
    found_by: str | None = None  # "hypothesis" | "scan" | None
    curve: dict[str, Any] | None = None
    error: bool = False
    seconds: float = 0.0
    inconclusive: bool = False  # ran out of its hard time limit before any verdict
    # held only within this reach ("c ≤ 16777216"), short of a length the spec names
    limited_to: str | None = None

    @property
    def ok(self) -> bool:
        """False for a refuted claim, a failed building block or an error."""
        if self.error:
            return False
        if self.kind == "claim":
            if self.limited:  # it may break past the reach: neither value is refuted
                return True
            return self.claimed is None or self.holds is None or self.claimed == self.holds
        return self.holds is not False

    @property
    def limited(self) -> bool:
        """A claim that held, but only within a reach short of a length the spec names."""
        return self.kind == "claim" and self.holds is True and self.limited_to is not None

    @property
    def verdict(self) -> str:
        """The verdict in words: ERROR, n/a, holds/FAILS, measured/confirmed/REFUTED,
        limited."""
        if self.error:
            return "ERROR"
        if self.inconclusive:
            return "inconclusive (time budget)"
        if self.holds is None:
            return "n/a"
        state = "holds" if self.holds else "fails"
        if self.kind == "block":
            return state if self.holds else "FAILS"
        if self.limited:
            return "limited: holds" if self.claimed is not None else "measured: holds (limited)"
        if self.claimed is None:
            return f"measured: {state}"
        return f"confirmed: {state}" if self.claimed == self.holds else f"REFUTED: {state}"

    def as_json(self) -> dict[str, Any]:
        """The outcome as one entry of ``posgen check --json``."""
        return {
            "property": self.name,
            "kind": self.kind,
            "description": DESCRIPTIONS.get(self.name, ""),
            "claimed": self.claimed,
            "holds": self.holds,
            "verdict": self.verdict,
            "ok": self.ok,
            "evidence": self.evidence,
            "counterexample": jsonable(self.counterexample),
            "found_by": self.found_by,
            "limited_to": self.limited_to if self.limited else None,
            "curve": jsonable(self.curve),
            "seconds": round(self.seconds, 3),
        }


@dataclass
class Report:
    """All outcomes of one spec."""

    name: str
    path: str
    title: str
    route: str
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether every outcome is ok."""
        return all(outcome.ok for outcome in self.outcomes)

    def outcome(self, name: str) -> Outcome:
        """The outcome of the property called ``name``."""
        return next(outcome for outcome in self.outcomes if outcome.name == name)

    def as_json(self) -> dict[str, Any]:
        """The report as one entry of ``posgen check --json``."""
        return {
            "spec": self.name,
            "path": self.path,
            "title": self.title,
            "route": self.route,
            "ok": self.ok,
            "seconds": round(self.seconds, 3),
            "properties": [outcome.as_json() for outcome in self.outcomes],
        }


def failed(name: str, kind: str, claimed: bool | None, search: Search) -> Outcome:
    """The outcome of a search that found a violation, with its counterexample."""
    violation = search.violation
    assert violation is not None
    how = "shrunk counterexample" if search.found_by == "hypothesis" else "found by scan"
    return Outcome(
        name,
        kind,
        claimed,
        False,
        f"{how}: {violation.message}",
        counterexample=jsonable(violation.details),
        found_by=search.found_by,
    )


def jsonable(value: Any) -> Any:
    """``value`` with tuples as lists, keys as strings and non-finite floats as text
    ("nan", "inf", "-inf": standard JSON has no NaN or Infinity)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return value
