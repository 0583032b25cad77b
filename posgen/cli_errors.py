"""How a command reports errors that are not bugs in the command itself.

A ``SpecError`` prints its ``path:line:col: field: message`` lines on stderr and exits 2;
a ``SourceGateError`` (generated code that failed its own gate: a posgen bug) exits 3.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps
from typing import ParamSpec, TypeVar

from posgen.cli_output import say
from posgen.codegen.render import SourceGateError
from posgen.spec.diagnostics import SpecError

P = ParamSpec("P")
R = TypeVar("R")


def reports_spec_errors(command: Callable[P, R]) -> Callable[P, R]:
    """Turn SpecError into diagnostics on stderr and exit code 2 (SourceGateError: 3)."""

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

    return wrapper
