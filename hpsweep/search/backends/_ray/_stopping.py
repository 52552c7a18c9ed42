"""How a Tune round stops: Ctrl-C and SIGTERM (`StopSignals`), a trial's user error or trials
Ray cannot place (`RoundWatch`); and Tune's ``stop=`` for one trial (`StopWhen`). Tune stops a
trial the same way whether its scheduler pruned it or the sweep stopped, so the driver notes when
the sweep began to stop and writes the command's stop file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ray import tune
from ray.tune.experiment import Trial as TuneTrial

from hpsweep.errors import Interrupted, UserError
from hpsweep.search.backends._ray._preflight import autoscaling, describe, fits, live_nodes, offers
from hpsweep.search.backends._ray._trial import USER_ERROR_KEY, numbers_of, objective_metrics
from hpsweep.search.job import Objective, objective_value
from hpsweep.train.callbacks import TrainerCallback

# How long a round may wait with none of its trials running and one that no live node can hold
# (the nodes that could left the cluster) before it ends and those trials fail.
PLACE_WAIT_S = float(os.environ.get("HPSWEEP_RAY_PLACE_WAIT_S", "120"))


class RoundWatch(tune.Callback, tune.Stopper):
    """Ends a Tune round when a trial reports a `UserError`, or when Ray cannot go on with it:
    none of its trials runs and no live node can hold one for `PLACE_WAIT_S`, with no autoscaler,
    where Tune would wait for ever; the trials it gave up on (`stuck`) fail with `reason`. Keeps
    the round's Tune trials (`trials`)."""

    LOOK_S = 1.0

    def __init__(self, resources: dict[str, float], stop_file: Path) -> None:
        self.resources, self.stop_file = resources, stop_file
        self.stopped_at: float | None = None  # when a trial's user error stopped the round
        self.stuck: set[str] = set()
        self.reason = ""
        self.trials: list[TuneTrial] = []
        self._since: float | None = None
        self._looked = 0.0

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        if USER_ERROR_KEY in result and self.stopped_at is None:
            self.stopped_at = time.time()
            self.stop_file.touch()
        return self.stop_all()

    def stop_all(self) -> bool:
        return self.stopped_at is not None or bool(self.stuck)

    def on_experiment_end(self, trials: list[TuneTrial], **info: Any) -> None:
        self.trials = list(trials)

    def on_step_begin(self, iteration: int, trials: list[TuneTrial], **info: Any) -> None:
        self.trials = list(trials)
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


class StopSignals(logging.Handler):
    """Ctrl-C and SIGTERM stop the sweep alike: in a Tune round SIGTERM becomes the SIGINT Tune
    stops its trials on; between rounds either is `Interrupted` at once. As a handler of Tune's
    logger it notices Tune's graceful stop on Ctrl-C, which Tune reports only as a warning."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.signum = signal.SIGINT
        self.stopped_at: float | None = None  # when Tune began to stop the round on a signal
        self.stop_file = Path(os.devnull)  # the command's: `._cluster.stop_file`
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

    def emit(self, record: logging.LogRecord) -> None:
        if "Stop signal received" in record.getMessage() and self.stopped_at is None:
            self.stopped_at = time.time()
            self.stop_file.touch()

    @contextlib.contextmanager
    def tune_running(self) -> Iterator[None]:
        saved = self._logger.level, self._logger.propagate
        self._logger.setLevel(logging.WARNING)
        self._logger.propagate = False  # watched, not printed: the CLI says it in one line
        self._logger.addHandler(self)
        self._in_tune = True
        try:
            yield
        finally:
            self._in_tune = False
            self._logger.removeHandler(self)
            self._logger.setLevel(saved[0])
            self._logger.propagate = saved[1]


def trial_stop_rule(stop: Any) -> Any:
    """``stop=`` as Tune takes it, checked: None, a dict of thresholds (``result[key] >= value``),
    a function ``(trial_id, result) -> bool`` or a per-trial `tune.Stopper`. One that ends the
    whole experiment (``stop_all``) is refused: a trial's rule is asked on its worker."""
    if not stop:
        return None
    if isinstance(stop, Mapping):
        bad = [k for k, v in stop.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
        if bad:
            raise UserError(
                f"stop={dict(stop)!r}: {bad[0]!r} needs a number (a trial stops once its result "
                "reaches it); give {name: number}"
            )
        return dict(stop)
    if isinstance(stop, tune.Stopper) and not _stops_trials_only(stop):
        raise UserError(
            f"stop={type(stop).__name__}(...) ends the whole run (stop_all), which hpsweep does with "
            "timeout= (time_budget_s=) and n_trials=; give those, or a per-trial stop"
        )
    if not callable(stop):
        raise UserError(
            f"stop={stop!r}: give a dict such as {{'training_iteration': 3}}, a function "
            "(trial_id, result) -> bool or a tune.Stopper"
        )
    return stop


def _stops_trials_only(stopper: Any) -> bool:
    from ray.tune.stopper import (
        CombinedStopper,
        FunctionStopper,
        MaximumIterationStopper,
        NoopStopper,
        TrialPlateauStopper,
    )

    if isinstance(stopper, CombinedStopper):
        # Private: a CombinedStopper does not expose the stoppers it combines.
        return all(_stops_trials_only(s) for s in stopper._stoppers)
    per_trial = (FunctionStopper, MaximumIterationStopper, NoopStopper, TrialPlateauStopper)
    return type(stopper).stop_all in {cls.stop_all for cls in per_trial}


class StopWhen(TrainerCallback):
    """Tune's ``stop=`` for one trial, asked after each evaluation with the result Tune gets and
    ``training_iteration``; when it says stop, the trial ends complete there, as under Tune."""

    def __init__(self, rule: Any, objective: Objective, directions: list[str]) -> None:
        self.rule, self.objective, self.directions = rule, objective, directions

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        metrics = kwargs.get("metrics") or {}
        result = numbers_of(metrics)
        result.update(objective_metrics(objective_value(self.objective, self.directions, metrics)))
        result["training_iteration"] = state.num_evaluations
        if self._says_stop(result, state):
            control.should_training_stop = True

    def _says_stop(self, result: dict[str, float], state: Any) -> bool:
        if isinstance(self.rule, dict):
            missing = [k for k in self.rule if k not in result]
            if missing:
                raise UserError(
                    f"stop: the result has no {missing[0]!r} (it has {', '.join(sorted(result))}); "
                    "name one of those"
                )
            return any(result[k] >= v for k, v in self.rule.items())
        rule: Callable[[str, dict[str, float]], Any] = self.rule
        try:
            trial_id = str(tune.get_context().get_trial_id())
        except Exception:  # off a Tune worker: the run's name
            trial_id = str(getattr(state, "trial_name", "") or "")
        return bool(rule(trial_id, result))
