"""Everything the CLI prints goes through here, so no spec or path can drive the terminal.

Text that comes from a spec or from a path (names, titles, file names, echoed values)
may hold escape sequences or bidirectional overrides; each line is passed through
``printable`` (control characters shown as ``\\x1b``-style escapes) before it is shown.
"""

from __future__ import annotations

import click

from posgen.spec.diagnostics import printable


def printable_lines(text: str) -> str:
    """``text`` with every line escaped by ``printable``; the line breaks are kept."""
    return "\n".join(printable(line) for line in text.split("\n"))


def say(message: object = "", *, err: bool = False, nl: bool = True) -> None:
    """click.echo, with every line of ``message`` escaped."""
    click.echo(printable_lines(str(message)), err=err, nl=nl)


class UsageError(click.UsageError):
    """click's usage error (exit 2), with its message escaped."""

    def __init__(self, message: str, ctx: click.Context | None = None) -> None:
        super().__init__(printable_lines(message), ctx)
