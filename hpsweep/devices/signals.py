"""The processes that run trials: they stop on SIGTERM as on Ctrl-C, and die with their parent.

A sweep's worker processes (``--n-jobs``), a trial's data-parallel ranks and an in-process
search share these rules, so that a signal to the command stops every process it started and a
``kill -9`` of the command leaves none behind.
"""

from __future__ import annotations

import ctypes
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hpsweep import faults
from hpsweep.errors import Interrupted

#: The stopping signal this process received. Kept as well as raised: Python drops an exception
#: raised while it runs a weakref callback or a ``__del__`` (a finished import's lock, say), and
#: the loop must still stop, at the next trial at the latest.
_received: list[int] = []


def raise_interrupted(signum: int, frame: Any) -> None:
    # once: a second signal must not cut the trial's record short
    signal.signal(signum, signal.SIG_IGN)
    _received.append(signum)
    faults.release()
    raise Interrupted(signum)


def forget_signals() -> None:
    """Start afresh: a forked worker inherits the signals its parent had received."""
    _received.clear()


def stop_if_signalled() -> None:
    if _received:
        raise Interrupted(_received[0])


@contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGTERM stops an in-process sweep the way Ctrl-C does (the trial is recorded ``stopped``)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    previous = signal.signal(signal.SIGTERM, raise_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _received.clear()


def die_with_parent() -> None:
    """Ask Linux to send this process SIGTERM when its parent dies (a no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
