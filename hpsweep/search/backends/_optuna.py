"""The Optuna backend: Optuna's samplers and pruners over a study in ``DIR/study.journal``.

The study lives in an Optuna storage (by default Optuna's journal file in the sweep folder, see
`._journal`; any storage URL with ``--storage``), so a sweep stopped and started again continues
the same study. The search layer's loop asks this backend for trials (``study.ask``)
and tells it how they ended (``study.tell``); counting, ``--n-jobs`` worker processes and
running interrupted trials again are the ledger's (`hpsweep.search.ledger`). A trial that runs again
is a new Optuna trial with the same params (enqueued), while the cut-short one is told FAIL
with the user attribute ``hpsweep_stopped``, so the study never keeps a trial RUNNING that no
process runs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from hpsweep.errors import UserError
from hpsweep.search.backends._base import Backend, SearchSettings
from hpsweep.search.backends._storages import (
    OPEN_TRIES,
    StorageSpec,
    cause,
    open_storage,
    parse_storage,
    retryable,
    storage_error,
)
from hpsweep.search.space import Distribution, Float, Int
from hpsweep.trial import Trial


class OptunaTrial(Trial):
    """An Optuna trial as the trainer sees it; ``suggest_*`` samples define-by-run."""

    backend = "optuna"
    define_by_run = True
    reads_checkpoints = False

    def __init__(
        self, trial: optuna.Trial, multi_objective: bool, number: int | None = None
    ) -> None:
        super().__init__(trial.number if number is None else number, trial.params)
        self._trial = trial
        self._multi = multi_objective
        self.ref = trial._trial_id

    def report(
        self, step: int, metrics: Any, objective: Any, checkpoint: str | None = None
    ) -> None:
        if not self._multi and objective is not None:  # Optuna prunes single-objective studies only
            self._trial.report(float(objective), step)

    def should_prune(self) -> bool:
        return not self._multi and self._trial.should_prune()

    def suggest_float(
        self, name: str, low: float, high: float, *, log: bool = False, step: float | None = None
    ) -> float:
        return self._keep(name, self._trial.suggest_float(name, low, high, log=log, step=step))

    def suggest_int(
        self, name: str, low: int, high: int, *, log: bool = False, step: int = 1
    ) -> int:
        return self._keep(name, self._trial.suggest_int(name, low, high, log=log, step=step))

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        return self._keep(name, self._trial.suggest_categorical(name, list(choices)))

    def _keep(self, name: str, value: Any) -> Any:
        self.params[name] = value
        return value


def suggest(trial: OptunaTrial, name: str, dist: Distribution) -> Any:
    if isinstance(dist, Float):
        return trial.suggest_float(name, dist.low, dist.high, log=dist.log, step=dist.step)
    if isinstance(dist, Int):
        return trial.suggest_int(name, dist.low, dist.high, log=dist.log, step=dist.step)
    return trial.suggest_categorical(name, dist.choices)


class OptunaBackend(Backend):
    """Search with Optuna. Samplers: tpe (default), random, cmaes, gp, grid, nsga2; pruners:
    median (default), hyperband, sha, none. Pruners see every evaluation's objective.

    Options: the two transformers' Optuna users pass on to ``create_study`` / ``optimize``, which
    hpsweep always does: ``load_if_exists`` (the same command continues its study) and
    ``gc_after_trial`` (each trial's memory is released after it: the README's "Devices")."""

    name = "optuna"
    samplers = ("tpe", "random", "cmaes", "gp", "grid", "nsga2")
    pruners = ("median", "hyperband", "sha", "none")
    reads = frozenset({"storage", "resources_per_trial"})
    option_names = ("load_if_exists", "gc_after_trial")

    def __init__(self, settings: SearchSettings) -> None:
        super().__init__(settings)
        if settings.sampler == "grid":
            if settings.space is None:
                raise UserError(
                    "--sampler grid needs a `space` dict (a grid cannot be define-by-run)"
                )
            self._grid = {name: dist.grid() for name, dist in settings.space.items()}
        #: where the study lives (`._storages`); messages name it by its password-free label
        self.storage: StorageSpec = parse_storage(settings.storage, settings.output_dir)
        #: the journal file holding the study, or None for another storage
        self.journal: Path | None = self.storage.path if self.storage.kind == "journal" else None
        self.study: optuna.Study | None = None
        optuna.logging.set_verbosity(optuna.logging.ERROR)  # trial.json records failures

    # --- the pieces Optuna provides -------------------------------------------------------------------

    def _takes_object(self, what: str, value: Any) -> bool:
        kinds = {"sampler": optuna.samplers.BaseSampler, "pruner": optuna.pruners.BasePruner}
        if what in kinds and not isinstance(value, kinds[what]):
            raise UserError(
                f"{what}={value!r} is neither a name nor an optuna.{what}s.Base{what.title()}; "
                f"give one of {', '.join(self.samplers if what == 'sampler' else self.pruners)}"
            )
        return what in kinds

    def _sampler(self, stream: int) -> optuna.samplers.BaseSampler:
        s = self.settings
        if isinstance(s.sampler, optuna.samplers.BaseSampler):
            return s.sampler
        seed = None if s.seed is None else s.seed + stream
        name = s.sampler or "tpe"
        if name == "tpe":
            return optuna.samplers.TPESampler(seed=seed)
        if name == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        if name == "cmaes":
            return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
        if name == "gp":
            return optuna.samplers.GPSampler(seed=seed)
        if name == "grid":
            return optuna.samplers.GridSampler(self._grid, seed=seed)
        return optuna.samplers.NSGAIISampler(seed=seed)

    def _pruner(self) -> optuna.pruners.BasePruner:
        if isinstance(self.settings.pruner, optuna.pruners.BasePruner):
            return self.settings.pruner
        name = self.settings.pruner or "median"
        if name == "median":
            # Measured, not guessed (bench/pruner_settings.py, bench/README.md): on the shipped digits
            # space these settings reached a typical sweep's accuracy in the least CPU time of six
            # candidates (startup 3 or 5, warmup 1 or 2, Hyperband, none) with the same best accuracy,
            # and spent 27% less than no pruning on a 30-trial sweep. Evaluations count from 1, so
            # warmup 1 allows pruning from the first; a trial's last is never offered (TrialReporter).
            return optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1)
        if name == "hyperband":
            return optuna.pruners.HyperbandPruner(min_resource=1)
        if name == "sha":
            return optuna.pruners.SuccessiveHalvingPruner(min_resource=1)
        return optuna.pruners.NopPruner()

    def _storage(self) -> optuna.storages.BaseStorage:
        return open_storage(self.storage)

    def load_study(self, stream: int = 0) -> optuna.Study:
        """The study, created if missing. A storage that cannot be opened is one line at once;
        only a race between processes creating the tables together is tried again."""
        for attempt in range(OPEN_TRIES):
            try:
                return self._load_study(stream)
            except UserError:
                raise
            except Exception as exc:
                if cause(exc) is None:  # not the storage's: a bug, with its traceback
                    raise
                if attempt == OPEN_TRIES - 1 or not retryable(exc):
                    raise storage_error(self.storage, exc) from None
                time.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")

    def _load_study(self, stream: int) -> optuna.Study:
        s = self.settings
        study = optuna.create_study(
            storage=self._storage(),
            study_name=s.study_name,
            sampler=self._sampler(stream),
            pruner=self._pruner(),
            directions=s.directions,
            load_if_exists=True,
        )
        stored = [d.name.lower() for d in study.directions]
        if stored != s.directions:  # Optuna 5 loads a study with other directions without a word
            raise UserError(
                f"study {s.study_name!r} in {self.storage.label} was created to {', '.join(stored)}, not "
                f"{', '.join(s.directions)}; keep the direction, or use another --study-name or --output-dir"
            )
        return study

    # --- asking and telling ------------------------------------------------------------------------------

    def open(self, worker: int = 0) -> None:
        # A seeded sampler draws a stream of its own per worker, and a rerun continues after the
        # trials the study already holds instead of drawing the first ones again.
        # The study is opened once (each open builds a storage and checks its schema: ~0.8 s).
        study = self.load_study()
        asked = study._storage.get_n_trials(study._study_id)
        study.sampler = self._sampler(stream=asked + 7919 * worker)
        self.study = study

    def close(self) -> None:
        self.study = None

    def ask(self, again: Any = None) -> OptunaTrial | None:
        study = self.study
        assert study is not None, "open() first"
        s = self.settings
        # the same params again, as a new Optuna trial (the cut-short one is FAIL)
        if again is not None:
            study.enqueue_trial(
                again.params, user_attrs={"hpsweep_again": again.id}, skip_if_exists=False
            )
        elif self._grid_done(study):
            return None
        trial = OptunaTrial(
            study.ask(), s.multi_objective, number=None if again is None else again.number
        )
        if again is not None:
            trial.id = again.id
        for name, dist in (s.space or {}).items():
            try:
                suggest(trial, name, dist)
            except ValueError as exc:  # the stored study knows this name with another distribution
                study.tell(trial._trial, state=TrialState.FAIL)
                raise UserError(
                    f"space[{name!r}] = {dist!r} differs from what study {s.study_name!r} recorded "
                    f"({exc}); keep the space, or use another --study-name or --output-dir"
                ) from None
        return trial

    def tell(self, trial: Any, state: str, value: Any = None) -> None:
        assert self.study is not None
        if state == "complete":
            self.study.tell(trial._trial, value)
        elif state == "pruned":
            self.study.tell(trial._trial, state=TrialState.PRUNED)
        else:
            if state == "stopped":
                trial._trial.set_user_attr("hpsweep_stopped", True)
            self.study.tell(trial._trial, state=TrialState.FAIL)

    def abandon(self, ref: Any) -> None:
        """Fail the Optuna trial a dead process left RUNNING (it runs again as a new trial)."""
        assert self.study is not None
        storage = self.study._storage
        try:
            if storage.get_trial(int(ref)).state == TrialState.RUNNING:
                storage.set_trial_user_attr(int(ref), "hpsweep_stopped", True)
                storage.set_trial_state_values(int(ref), TrialState.FAIL)
        except (KeyError, ValueError, RuntimeError):
            pass  # already finished, or another storage's trial

    @staticmethod
    def _grid_done(study: optuna.Study) -> bool:
        sampler = study.sampler
        return isinstance(sampler, optuna.samplers.GridSampler) and sampler.is_exhausted(study)
