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
    """click.echo, with every line of ``message`` escaped, and a character the stream's
    encoding cannot write (a generated module's ``ᵀ`` in a diff, a spec's title on a
    Latin-1 terminal) written as its ``\\u`` escape instead of failing."""
    text = printable_lines(str(message))
    stream = click.get_text_stream("stderr" if err else "stdout")
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        text = text.encode(encoding, "backslashreplace").decode(encoding)
    except LookupError:  # an encoding Python does not know: click's own handling
        pass
    click.echo(text, err=err, nl=nl)


class UsageError(click.UsageError):
    """click's usage error (exit 2), with its message escaped."""

    def __init__(self, message: str, ctx: click.Context | None = None) -> None:
        super().__init__(printable_lines(message), ctx)
