"""A hard wall-time limit for one property, including a single slow example.

The searches stop drawing new examples once their soft budget is spent (see
``search.run_search``), but one example can be slow by itself (a module that integrates
an ODE to a far position, say). ``hard_deadline`` bounds that too: after ``seconds`` of
wall time it raises ``OutOfTime`` inside the running code, from a SIGALRM handler.
``OutOfTime`` is a BaseException, so neither hypothesis nor a property's own
``except Exception`` swallows it; the runner turns it into an "inconclusive (time
budget)" outcome. The signal is delivered between Python bytecodes, so a single torch
operation still finishes first (each is bounded by the position span).

Signals need the main thread of a POSIX process: elsewhere (a worker thread, Windows)
the limit is not enforced and only the soft budget applies.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class OutOfTime(BaseException):
    """A property ran past its hard time limit (raised by ``hard_deadline``)."""


def enforceable() -> bool:
    """Whether a hard limit can be enforced here (SIGALRM on the main thread)."""
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


def _raise_out_of_time(signum: int, frame: FrameType | None) -> None:
    raise OutOfTime


@contextmanager
def hard_deadline(seconds: float) -> Iterator[None]:
    """Raise ``OutOfTime`` in the block once ``seconds`` of wall time have passed."""
    if not enforceable():
        yield
        return
    previous = signal.signal(signal.SIGALRM, _raise_out_of_time)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
