"""Spec diagnostics: one error, pointing at ``file:line:col`` and naming the field.

Everything posgen prints that comes from a spec or a path goes through ``printable``
first, so a spec (or a file name) cannot send control sequences to the terminal, and
every value a message quotes goes through ``quoted``, so it cannot flood it either.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass

MAX_ECHO = 80
"""The most characters of a spec's value that a message quotes (the rest is elided).

A diagnostic is one terminal line; a 1 MB value in an enum field must not become a
1 MB line, and the position already says where the whole value is.
"""


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped as Python does (``\\x1b``).

    Escapes C0 and C1 controls (ESC, BEL, U+009B CSI, ...), bidirectional overrides
    and isolates (U+202A-U+202E, U+2066-U+2069), line and paragraph separators, format
    characters and every other character that ``str.isprintable`` refuses, so a
    terminal shows what the text holds instead of obeying it. Printable text, including
    non-ASCII letters, passes unchanged.
    """
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def shorten(text: str, limit: int = MAX_ECHO) -> str:
    """``text`` cut to ``limit`` characters with an ellipsis and the full length."""
    if len(text) <= limit:
        return text
    return f"{text[: limit - 3]}... ({len(text):,} characters)"


def quoted(value: object) -> str:
    """A spec value as a message quotes it: its ``repr``, escaped and shortened.

    ``'abc'`` for short text; ``'abcdef...' (1,048,576 characters)`` past ``MAX_ECHO``.
    """
    if isinstance(value, str) and len(value) > MAX_ECHO:
        head = repr(value[:MAX_ECHO])
        return f"{printable(head[: MAX_ECHO - 3])}...{head[-1]} ({len(value):,} characters)"
    return shorten(printable(repr(value)))


@dataclass(frozen=True, order=True)
class Diagnostic:
    """An error in a spec file, at the position of the offending value (1-based)."""

    path: str
    line: int
    col: int
    field: str
    message: str

    def render(self) -> str:
        """``path:line:col: field.path: message`` — the one format every error uses.

        Path, field and message are escaped (``printable``): each may hold text from
        the spec or from a file name.
        """
        return printable(f"{self.path}:{self.line}:{self.col}: {self.field}: {self.message}")


class SpecError(Exception):
    """One or more diagnostics for spec files; the CLI prints them and exits 2."""

    def __init__(self, diagnostics: Iterable[Diagnostic]) -> None:
        self.diagnostics = sorted(diagnostics)
        super().__init__("\n".join(d.render() for d in self.diagnostics))


def closest_name(word: str, allowed: Iterable[str]) -> str | None:
    """The allowed name closest to a misspelt ``word``, if any is close enough.

    A word longer than ``MAX_ECHO`` is no typo of a field name: no suggestion.
    """
    if len(word) > MAX_ECHO:
        return None
    matches = difflib.get_close_matches(word, sorted(allowed), n=1, cutoff=0.6)
    return matches[0] if matches else None


def dotted_path(path: tuple[str | int, ...]) -> str:
    """``("terms", "position_position", "bias")`` → ``terms.position_position.bias``."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += ("." if text else "") + shorten(part)
    return text or "<document>"
