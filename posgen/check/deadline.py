"""A hard wall-time limit for one property, including a single slow example.

The searches stop drawing new examples once their soft budget is spent (see
``search.run_search``), but one example can be slow by itself (a module that integrates
an ODE to a far position, say). ``hard_deadline`` bounds that too: after ``seconds`` of
wall time it raises ``OutOfTime`` inside the running code, from a SIGALRM handler.
``OutOfTime`` is a BaseException, so neither hypothesis nor a property's own
``except Exception`` swallows it; the runner turns it into an "inconclusive (time
budget)" outcome. The signal is delivered between Python bytecodes, so a single torch
operation still finishes first (each is bounded by the position span).

The limit never strikes inside an import (a module half-executed would stay broken in
``sys.modules`` for the rest of the process): it is put off, ``RETRY_SECONDS`` at a time,
until the import is done.

A raise the running code cannot see, because the signal landed in a garbage-collector
callback or a ``__del__`` (Python prints such exceptions as "Exception ignored in" and
goes on), is not lost: the handler arms the timer again before it raises, so the limit
strikes again ``RETRY_SECONDS`` later, and inside the block ``OutOfTime`` never reaches
``sys.unraisablehook``'s printout.

Code that catches the strike and raises an error of its own (hypothesis does: an
``OutOfTime`` in the middle of drawing an example ends that example early, and its replay
check then raises ``FlakyStrategyDefinition``) still ends with ``OutOfTime``: once the
limit has struck, any ``Exception`` leaving the block becomes ``OutOfTime``, chained to it.

Signals need the main thread of a POSIX process: elsewhere (a worker thread, Windows)
the limit is not enforced and only the soft budget applies.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

RETRY_SECONDS = 0.05
"""How soon the limit strikes again after a raise that was swallowed."""

GRACE_FACTOR, GRACE_SECONDS = 0.25, 0.5
"""A property's hard limit past its soft budget: budget * (1 + factor) + seconds."""

MIN_SHARE_SECONDS = 0.2
"""The least soft budget a property gets, whatever is left of its spec's (light enough
for the CLI's help to read without importing torch)."""


class OutOfTime(BaseException):
    """A property ran past its hard time limit (raised by ``hard_deadline``)."""


def enforceable() -> bool:
    """Whether a hard limit can be enforced here (SIGALRM on the main thread)."""
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


def _inside_import(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs (at any depth) under the import machinery: a module's body
    being executed, or the finders and loaders of ``importlib._bootstrap``. An exception
    there would leave a module half-initialised in ``sys.modules`` (torch imports sympy
    lazily, inside the first compile), and every later import of it in this process
    would fail."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


class _Strikes:
    """The SIGALRM handler of one ``hard_deadline`` block, and whether it has struck."""

    def __init__(self) -> None:
        self.struck = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        signal.setitimer(signal.ITIMER_REAL, RETRY_SECONDS)  # again, should this be lost
        if _inside_import(frame):
            return  # strike once the import is done: a half-run import poisons the process
        self.struck = True
        raise OutOfTime


@contextmanager
def hard_deadline(seconds: float) -> Iterator[None]:
    """Raise ``OutOfTime`` in the block once ``seconds`` of wall time have passed."""
    if not enforceable():
        yield
        return
    strikes = _Strikes()
    previous = signal.signal(signal.SIGALRM, strikes.handle)
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _quiet_about_out_of_time(previous_hook)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield
    except Exception as error:
        if strikes.struck:  # the strike, caught and re-raised as something else
            raise OutOfTime from error
        raise
    finally:
        while True:  # a strike between these lines would skip the rest: disarm again
            try:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
                sys.unraisablehook = previous_hook
                break
            except OutOfTime:
                continue


def _quiet_about_out_of_time(hook: Any) -> Any:
    """``hook``, except for an ``OutOfTime`` raised where no caller could catch it (the
    handler strikes again shortly)."""

    def quiet(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, OutOfTime):
            hook(unraisable)

    return quiet
