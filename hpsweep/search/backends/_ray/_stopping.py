"""How the sweep's stop reaches a Ray Tune round, for the Ray Tune backend: Ctrl-C, SIGTERM, a
trial's user error, and trials Ray cannot place (`PlacementWatch`). A private helper of
`hpsweep.search.backends._ray`.

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
from hpsweep.search.backends._ray._preflight import autoscaling, describe, fits, live_nodes, offers
from hpsweep.search.backends._ray._trial import USER_ERROR_KEY

# How long a round may wait with none of its trials running and one that no live node can hold
# (the nodes that could left the cluster) before it ends and those trials fail.
PLACE_WAIT_S = float(os.environ.get("HPSWEEP_RAY_PLACE_WAIT_S", "120"))


class PlacementWatch(tune.Callback):
    """Notices a round that Ray cannot go on with: none of its trials runs, and those waiting
    need more (``resources``) than any live node has, for `PLACE_WAIT_S` seconds, on a cluster no
    autoscaler grows. Tune itself would wait for ever, logging a warning now and then. The trials
    it gave up on (`stuck`, Tune's ids) and why (`reason`) go to the ledger as failures."""

    LOOK_S = 1.0

    def __init__(self, resources: dict[str, float]) -> None:
        self.resources = resources
        self.stuck: set[str] = set()
        self.reason = ""
        self._since: float | None = None
        self._looked = 0.0

    def on_step_begin(self, iteration: int, trials: list[Any], **info: Any) -> None:
        waiting = [t for t in trials if t.status == "PENDING"]
        if self.stuck or not waiting or any(t.status == "RUNNING" for t in trials):
            self._since = None
            return
        now = time.monotonic()
        if now - self._looked < self.LOOK_S:
            return
        self._looked = now
        nodes = live_nodes()
        if any(fits(n, self.resources) for n in nodes) or autoscaling():
            self._since = None
        elif self._since is None:
            self._since = now
        elif now - self._since >= PLACE_WAIT_S:
            self.stuck = {t.trial_id for t in waiting}
            self.reason = (
                f"Ray could not place it for {PLACE_WAIT_S:g} s: no live node has "
                f"{describe(self.resources)} for a trial ({offers(nodes) or 'no node'}); "
                "did a node leave the cluster?"
            )


class StopOnUserError(tune.Stopper):
    """Ends the whole round when a trial reports a `UserError` (a bad objective name, ...), or
    when Ray cannot place its trials (`PlacementWatch`)."""

    def __init__(self, stop_file: Path, watch: PlacementWatch | None = None) -> None:
        self.stop_file = stop_file
        self.stopped_at: float | None = None
        self.watch = watch

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        if USER_ERROR_KEY in result and self.stopped_at is None:
            self.stopped_at = time.time()
            self.stop_file.touch()
        return self.stop_all()

    def stop_all(self) -> bool:
        return self.stopped_at is not None or bool(self.watch and self.watch.stuck)


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
