"""Spec diagnostics: one error, pointing at ``file:line:col`` and naming the field."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Diagnostic:
    """An error in a spec file, at the position of the offending value (1-based)."""

    path: str
    line: int
    col: int
    field: str
    message: str

    def render(self) -> str:
        """``path:line:col: field.path: message`` — the one format every error uses."""
        return f"{self.path}:{self.line}:{self.col}: {self.field}: {self.message}"


class SpecError(Exception):
    """One or more diagnostics for spec files; the CLI prints them and exits 2."""

    def __init__(self, diagnostics: Iterable[Diagnostic]) -> None:
        self.diagnostics = sorted(diagnostics)
        super().__init__("\n".join(d.render() for d in self.diagnostics))


def closest_name(word: str, allowed: Iterable[str]) -> str | None:
    """The allowed name closest to a misspelt ``word``, if any is close enough."""
    matches = difflib.get_close_matches(word, sorted(allowed), n=1, cutoff=0.6)
    return matches[0] if matches else None


def dotted_path(path: tuple[str | int, ...]) -> str:
    """``("terms", "position_position", "bias")`` → ``terms.position_position.bias``."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += ("." if text else "") + part
    return text or "<document>"
