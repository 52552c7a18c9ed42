"""The Optuna backend: Optuna's samplers and pruners over a study in ``DIR/study.db``.

The study lives in an Optuna storage (SQLite by default), so a sweep stopped and started again
continues the same study, and several ``hpsweep run`` processes on one storage share the work.
``n_trials`` is the study's target: trials already finished count towards it.
``--n-jobs N`` runs N worker processes on the storage (threads would fight over the GIL).
"""
from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from ..errors import TrialPruned, UserError
from ..space import Distribution, Float, Int
from ..trial import Trial
from ._base import Backend, SearchSettings, TrialFailed, TrialFunction

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


class OptunaTrial(Trial):
    """An Optuna trial as the trainer sees it; ``suggest_*`` samples define-by-run."""

    backend = "optuna"
    define_by_run = True

    def __init__(self, trial: optuna.Trial, multi_objective: bool) -> None:
        super().__init__(trial.number, trial.params)
        self._trial = trial
        self._multi = multi_objective
        if "resume_from" in trial.user_attrs:
            self.user_attrs["resume_from"] = trial.user_attrs["resume_from"]

    def report(self, step: int, metrics: Any, objective: Any, checkpoint: str | None = None) -> None:
        if not self._multi and objective is not None:  # Optuna prunes single-objective studies only
            self._trial.report(float(objective), step)

    def should_prune(self) -> bool:
        return not self._multi and self._trial.should_prune()

    def suggest_float(self, name: str, low: float, high: float, *, log: bool = False,
                      step: float | None = None) -> float:
        return self._keep(name, self._trial.suggest_float(name, low, high, log=log, step=step))

    def suggest_int(self, name: str, low: int, high: int, *, log: bool = False, step: int = 1) -> int:
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
    median (default), hyperband, sha, none. Pruners see every evaluation's objective."""

    name = "optuna"
    samplers = ("tpe", "random", "cmaes", "gp", "grid", "nsga2")
    pruners = ("median", "hyperband", "sha", "none")

    def __init__(self, settings: SearchSettings) -> None:
        super().__init__(settings)
        if settings.address is not None:
            raise UserError("--address names a Ray cluster; add --backend ray")
        if (settings.sampler or "tpe") == "grid":
            if settings.space is None:
                raise UserError("--sampler grid needs a `space` dict (a grid cannot be define-by-run)")
            self._grid = {name: dist.grid() for name, dist in settings.space.items()}
        self.storage_url = settings.storage or f"sqlite:///{settings.output_dir.resolve() / 'study.db'}"
        optuna.logging.set_verbosity(optuna.logging.ERROR)  # trial.json records failures

    # --- the pieces Optuna provides -------------------------------------------------------------------

    def _sampler(self, worker: int = 0) -> optuna.samplers.BaseSampler:
        s = self.settings
        seed = None if s.seed is None else s.seed + worker  # distinct streams for parallel workers
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
        url = self.storage_url
        if url.startswith("sqlite"):
            # Several processes write one SQLite file: wait for its lock instead of failing.
            storage = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 120}})
            _fast_sqlite(storage)
            return storage
        return optuna.storages.RDBStorage(url) if "://" in url else optuna.storages.get_storage(url)

    def load_study(self, worker: int = 0) -> optuna.Study:
        # Processes starting together race to create the tables and the study: try again.
        for attempt in range(6):
            try:
                return self._load_study(worker)
            except _StorageError as exc:
                if attempt == 5:
                    raise UserError(f"--storage {self.storage_url} cannot be opened ({exc}); "
                                    "check the URL and that the database is reachable") from None
                time.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")

    def _load_study(self, worker: int) -> optuna.Study:
        s = self.settings
        try:
            return optuna.create_study(storage=self._storage(), study_name=s.study_name, sampler=self._sampler(worker),
                                       pruner=self._pruner(), directions=s.directions, load_if_exists=True)
        except ValueError as exc:  # e.g. the stored study has other directions
            raise UserError(f"study {s.study_name!r} in {self.storage_url}: {exc}; "
                            "use another --study-name or --output-dir") from None
        except ImportError as exc:
            raise UserError(f"--storage {self.storage_url}: {exc}") from None
        except Exception as exc:
            if type(exc).__module__.startswith("sqlalchemy"):
                raise _StorageError(type(exc).__name__) from None
            raise

    # --- running ---------------------------------------------------------------------------------------

    def run(self, trial_fn: TrialFunction) -> None:
        study = self.load_study()
        self._requeue_stopped(study)
        s = self.settings
        remaining = None if s.n_trials is None else s.n_trials - _finished(study)
        if remaining is not None and remaining <= 0:
            return
        if s.n_jobs == 1:
            self._optimize(study, trial_fn, remaining)
            return
        self._optimize_in_processes(trial_fn, remaining)

    def _requeue_stopped(self, study: optuna.Study) -> None:
        """Trials stopped by Ctrl-C run again with the same params, resuming from their last checkpoint."""
        from .. import runs

        trials = study.get_trials(deepcopy=False)
        requeued = _requeued(trials)
        pending = [t for t in trials if t.state == TrialState.FAIL and t.number not in requeued]
        if not pending:
            return
        stopped = {r.number: r for r in runs.read_trials(self.settings.output_dir)
                   if r.backend == "optuna" and r.state == "stopped"}
        for t in pending:
            if t.number in stopped:
                latest = runs.latest_checkpoint(Path(stopped[t.number].run_dir))
                attrs = {"requeued_from": t.number, **({"resume_from": str(latest)} if latest else {})}
                study.enqueue_trial(t.params, user_attrs=attrs, skip_if_exists=False)

    def _optimize(self, study: optuna.Study, trial_fn: TrialFunction, n_trials: int | None) -> None:
        s = self.settings
        space = s.space

        def objective(otrial: optuna.Trial) -> Any:
            trial = OptunaTrial(otrial, s.multi_objective)
            if space is not None:
                for name, dist in space.items():
                    try:
                        suggest(trial, name, dist)
                    except ValueError as exc:  # the stored study knows this name with another distribution
                        raise UserError(f"space[{name!r}] = {dist!r} differs from what study {s.study_name!r} "
                                        f"recorded ({exc}); keep the space, or use another --study-name or "
                                        "--output-dir") from None
            try:
                return trial_fn(trial)
            except TrialPruned:
                raise optuna.TrialPruned() from None

        callbacks = [] if s.n_trials is None else [_StopAtTotal(s.n_trials)]
        study.optimize(objective, n_trials=n_trials, timeout=s.timeout, catch=(TrialFailed,), callbacks=callbacks,
                       gc_after_trial=False, show_progress_bar=False)

    def _optimize_in_processes(self, trial_fn: TrialFunction, remaining: int | None) -> None:
        s = self.settings
        ctx = multiprocessing.get_context("fork")
        errors = ctx.SimpleQueue()
        threads = max(1, (os.cpu_count() or 1) // s.n_jobs)
        shares = _split(remaining, s.n_jobs)
        procs = [ctx.Process(target=_worker, args=(self, trial_fn, i, share, threads, errors), daemon=False)
                 for i, share in enumerate(shares) if share != 0]
        for p in procs:
            p.start()
        try:
            for p in procs:
                p.join()
        except KeyboardInterrupt:  # the workers got the same SIGINT: let them record their trials
            for p in procs:
                p.join()
            raise
        if not errors.empty():
            kind, message = errors.get()
            raise UserError(message) if kind == "user" else RuntimeError(message)
        if any(p.exitcode not in (0, None) for p in procs):
            raise KeyboardInterrupt if any(p.exitcode == 130 for p in procs) else RuntimeError(
                f"an Optuna worker process died (exit codes {[p.exitcode for p in procs]})")


def _worker(backend: OptunaBackend, trial_fn: TrialFunction, index: int, n_trials: int | None, threads: int,
            errors: Any) -> None:
    import torch

    torch.set_num_threads(threads)
    try:
        backend._optimize(backend.load_study(index), trial_fn, n_trials)
    except UserError as exc:
        errors.put(("user", str(exc)))
        os._exit(2)
    except KeyboardInterrupt:
        os._exit(130)
    except Exception as exc:
        errors.put(("internal", f"{type(exc).__name__}: {exc}"))
        os._exit(1)


def _fast_sqlite(storage: optuna.storages.RDBStorage) -> None:
    """Write-ahead logging without an fsync per commit.

    Every report is a commit; with SQLite's defaults each one waits for the disk (~7 ms here,
    ~20 per trial). In WAL mode with synchronous=NORMAL a commit survives a crash of the
    process (what a sweep must survive) and needs no fsync; only a power cut may lose the last
    commits. Readers no longer block the writer either, which helps --n-jobs.
    """
    import sqlalchemy

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    sqlalchemy.event.listen(storage.engine, "connect", on_connect)
    storage.engine.dispose()  # connections opened while the storage set itself up get the pragmas too


class _StorageError(Exception):
    """The storage refused a connection or a write (often a race between starting processes)."""


class _StopAtTotal:
    """Stop once the study holds ``n`` finished trials (from every process sharing it)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, study: optuna.Study, trial: Any) -> None:
        if _finished(study) >= self.n:
            study.stop()


def _requeued(trials: Sequence[Any]) -> set[int]:
    return {t.user_attrs["requeued_from"] for t in trials if "requeued_from" in t.user_attrs}


def _finished(study: optuna.Study) -> int:
    """Finished trials, not counting stopped ones that were queued to run again."""
    trials = study.get_trials(deepcopy=False)
    requeued = _requeued(trials)
    return sum(1 for t in trials if t.state in FINISHED and t.number not in requeued)


def _split(total: int | None, parts: int) -> list[int | None]:
    if total is None:
        return [None] * parts
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]
