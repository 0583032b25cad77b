"""How a command reports errors that are not bugs in the command itself.

A ``SpecError`` prints its ``path:line:col: field: message`` lines on stderr and exits 2;
a ``SourceGateError`` (generated code that failed its own gate: a posgen bug) exits 3; a
file error (``OSError``, ``OutputError``) is one line naming the file, exit 2.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps
from typing import NoReturn, ParamSpec, TypeVar

from posgen.cli_output import say
from posgen.codegen.render import SourceGateError
from posgen.codegen.writing import OutputError
from posgen.spec.diagnostics import SpecError

P = ParamSpec("P")
R = TypeVar("R")


def file_error(error: OSError | OutputError, doing: str = "") -> NoReturn:
    """One line naming the file on stderr, exit 2 (a bad path is a usage problem).

    A closed stdout (``posgen generate --diff | head``) is no file error: it goes on to
    click, which exits 1 quietly, as other tools do when their reader stops."""
    if isinstance(error, BrokenPipeError):
        raise error
    if isinstance(error, OSError):
        reason = error.strerror or str(error)
        if isinstance(error, (FileExistsError, NotADirectoryError)):
            reason = "a file is in the way where a folder is needed"
        message = f"{error.filename}: {reason}" if error.filename else reason
    else:
        message = str(error)
    say(f"Error: {doing}: {message}" if doing else f"Error: {message}", err=True)
    sys.exit(2)


def reports_spec_errors(command: Callable[P, R]) -> Callable[P, R]:
    """Turn SpecError into diagnostics on stderr and exit code 2 (SourceGateError: 3), and
    an OSError no step caught (a path component longer than the file system allows, met
    while looking a name up) into one line naming the path, exit 2."""

    @wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except SpecError as error:
            for diagnostic in error.diagnostics:
                say(diagnostic.render(), err=True)
            count = len(error.diagnostics)
            say(f"{count} error{'s' if count != 1 else ''}; nothing written.", err=True)
            sys.exit(2)
        except SourceGateError as error:
            say(f"internal error: {error}", err=True)
            sys.exit(3)
        except OSError as error:
            file_error(error)

    return wrapper
