"""How the sweep's stop reaches a Ray Tune round, for the Ray Tune backend: Ctrl-C, SIGTERM and a
trial's user error. A private helper of `hpsweep.search.backends._ray`.

Tune stops every trial the same way, whether its scheduler pruned it or the sweep stopped; the
driver notes when the sweep began to stop (`StopSignals.stopped_at`, `StopOnUserError.stopped_at`)
and writes the command's stop file, so trials and the ledger (`Ledger.settle`) can tell the two
apart.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ray import tune

from hpsweep.errors import Interrupted
from hpsweep.search.backends._ray._trial import USER_ERROR_KEY


class StopOnUserError(tune.Stopper):
    """Ends the whole round when a trial reports a `UserError` (a bad objective name, ...)."""

    def __init__(self, stop_file: Path) -> None:
        self.stop_file = stop_file
        self.stopped_at: float | None = None

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        if USER_ERROR_KEY in result and self.stopped_at is None:
            self.stopped_at = time.time()
            self.stop_file.touch()
        return self.stopped_at is not None

    def stop_all(self) -> bool:
        return self.stopped_at is not None


class StopSignals:
    """Ctrl-C and SIGTERM stop the sweep alike: inside a Tune round, SIGTERM becomes the SIGINT
    that Tune stops its trials on (noticed in Tune's log, as Tune only logs it); between rounds,
    either is an `Interrupted` at once."""

    def __init__(self) -> None:
        self.signum = signal.SIGINT
        self.stopped_at: float | None = None  # when Tune began to stop the round on a signal
        self.stop_file = Path(os.devnull)  # set per command: see `._cluster.stop_file`
        self._in_tune = False
        self._logger = logging.getLogger("ray.tune.tune")

    def __enter__(self) -> StopSignals:
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.signum = signal.SIGTERM
        if self._in_tune:
            signal.raise_signal(signal.SIGINT)
            return
        raise Interrupted(signal.SIGTERM)

    @contextlib.contextmanager
    def tune_running(self) -> Iterator[None]:
        watch = _InterruptWatch(self)
        saved = self._logger.level, self._logger.propagate
        self._logger.setLevel(logging.WARNING)
        self._logger.propagate = False  # watched, not printed: the CLI says it in one line
        self._logger.addHandler(watch)
        self._in_tune = True
        try:
            yield
        finally:
            self._in_tune = False
            self._logger.removeHandler(watch)
            self._logger.setLevel(saved[0])
            self._logger.propagate = saved[1]


class _InterruptWatch(logging.Handler):
    """Notices Tune's graceful stop on Ctrl-C, which Tune reports only as a log warning."""

    def __init__(self, signals: StopSignals) -> None:
        super().__init__(logging.WARNING)
        self.signals = signals

    def emit(self, record: Any) -> None:
        if "Stop signal received" in record.getMessage() and self.signals.stopped_at is None:
            self.signals.stopped_at = time.time()
            self.signals.stop_file.touch()
