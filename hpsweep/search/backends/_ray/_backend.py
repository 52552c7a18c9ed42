"""The Ray Tune backend: the same space file, run by Ray Tune on this machine or on a Ray cluster.

Ray decides what to try and where trials run; the sweep's ledger (`hpsweep.search.ledger`) counts them
and runs cut-short ones again, as for every backend (DESIGN.md, section 5):

- Tune's search algorithm picks params (``--sampler tpe``: Optuna's TPE through Tune's
  `OptunaSearch`; ``random``), its scheduler (``--scheduler fifo|asha|hyperband|pbt``) stops,
  pauses, resumes and (PBT) clones trials, and Ray places them on the cluster's nodes with
  ``--resources-per-trial``, at most ``--n-jobs`` at once.
- The driver runs Tune in rounds, each its own Tune experiment in ``<output-dir>/.ray/`` (or
  ``--storage``). First a round that runs again the trials the ledger holds as cut short (a
  killed command, a dead worker, Ctrl-C), each with its params, in its folder, from its latest
  checkpoint; then rounds of new trials, as many as the ledger still needs, until it holds
  ``--n-trials`` finished (complete or pruned) trials, the timeout passed, or
  ``--max-failed-trials`` trials of this command failed. Each round's Optuna searcher starts from
  the results of the finished trials. So the same command continues a stopped sweep;
  ``--resume`` is accepted and changes nothing.
- Each Tune trial takes its lease from the ledger on its worker before it trains (see
  `._ray_trial`): two commands on one folder share the work, and a failed trial is recorded
  while another runs instead. Tune's ``FailureConfig`` retries a trial whose worker died within
  a round; one whose workers died in two rounds of one command is recorded as failed.

Each evaluation is reported to Tune with the metrics, ``objective`` and, when one was saved at
that step, the checkpoint. ``hp_space`` may be define-by-run (``trial.suggest_*``, with
``--sampler tpe``) or, as Hugging Face users write it for Ray, return Ray Tune domains
(``{"learning_rate": tune.loguniform(1e-5, 1e-3)}``); ``model_init(trial)`` and ``hp_name(trial)``
may index the trial like a dict (``trial["learning_rate"]``).

This module holds the backend's settings and the rounds; three private helpers beside it carry
the rest: `._ray_search` (the space, search algorithms and schedulers in Tune's terms),
`._ray_trial` (what runs on the workers) and `._ray_cluster` (joining a cluster, nodes
without ``--output-dir``).

    $ hpsweep run space.py --backend ray --scheduler asha --n-jobs 4 --address auto
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import logging
import math
import os
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
from ray import tune

from hpsweep import runs
from hpsweep.errors import Interrupted, UserError
from hpsweep.search.backends._base import Backend, SearchSettings
from hpsweep.search.backends._ray._cluster import (
    collect_shipped_runs,
    connected,
    output_dir_marker,
    pickle_space_modules_by_value,
    shipped_record,
    stop_file,
)
from hpsweep.search.backends._ray._search import (
    VariantGenerator,
    fresh_copy,
    is_tune_object,
    mode,
    native_space,
    own_metric,
    scheduler,
    scheduler_kind,
    search_algorithm,
    tune_run_keywords,
    tune_space,
    worst_of,
)
from hpsweep.search.backends._ray._trial import (
    AGAIN_KEY,
    METRIC,
    USER_ERROR_KEY,
    RoundPlan,
    trainable,
)
from hpsweep.search.ledger import AGAIN
from hpsweep.search.loop import RESTARTS_PER_WORKER
from hpsweep.search.space import Float, Int
from hpsweep.train.arguments import apply_params, field_types

EXPERIMENT_DIR = ".ray"
WAIT_S = 2.0  # how often the driver looks again while only other commands' trials run
# How long the driver waits, after a round, for its actors to record their trials' endings (after a
# stop, those on this host; always, the runs shipped from nodes without --output-dir): a stopped
# trial's actor waits up to 8 s for its ending (see _ray_trial.trainable).
ENDINGS_WAIT_S = 15.0
# rounds of one command in which a trial's worker died before it is recorded failed
DEATHS_TO_FAIL = 2


# --- the backend ----------------------------------------------------------------------------------


class RayBackend(Backend):
    """Search with Ray Tune. Samplers: tpe (default; Optuna's TPE via `OptunaSearch`), random;
    schedulers: fifo (default), asha, hyperband, pbt. ``--n-jobs`` caps concurrent trials,
    ``--resources-per-trial cpu=N,gpu=F`` reserves resources for each (fractional GPUs allowed;
    by default a CPU per process of a ``--processes-per-trial`` trial, which its worker forks).

    Options (``hyperparameter_search(backend="ray", ...)``): ``max_failures`` (Tune's retries of a
    trial whose worker died, default 1), ``reuse_actors`` (default True), ``max_t`` (evaluations per
    trial for ASHA/HyperBand), ``reduction_factor``, ``perturbation_interval`` (PBT, in
    evaluations), ``storage`` (Ray's storage path or URI), ``name`` (the Tune experiments' name).
    ``scheduler=`` / ``sampler=`` (``search_alg=``) take Tune's own objects too, and transformers'
    other ``tune.run`` keywords are read by `._ray_search.tune_run_keywords`.
    """

    name = "ray"
    samplers = ("random", "tpe")
    pruners = ()
    schedulers = ("fifo", "asha", "hyperband", "pbt")
    reads = frozenset({"storage", "address", "resources_per_trial"})
    _takes_object, transformers_keywords = (
        staticmethod(is_tune_object),
        staticmethod(tune_run_keywords),
    )
    option_names = (
        "max_failures",
        "reuse_actors",
        "max_t",
        "reduction_factor",
        "perturbation_interval",
        "storage",
        "name",
    )

    def __init__(self, settings: SearchSettings) -> None:
        super().__init__(settings)
        self.native = native_space(settings.hp_space)  # Ray Tune domains from hp_space(None), if so
        # Tune's own scheduler and search algorithm objects, as given (a copy per round)
        self.scheduler_object, self.sampler_object = (
            None if isinstance(v, (str, type(None))) else v
            for v in (settings.scheduler, settings.sampler)
        )
        self.scheduler_name = (
            scheduler_kind(self.scheduler_object)
            if self.scheduler_object
            else settings.scheduler or "fifo"
        )
        self.sampler_name = (
            type(self.sampler_object).__name__
            if self.sampler_object
            else settings.sampler or ("random" if self.scheduler_name == "pbt" else "tpe")
        )
        # One made with its own metric (PBT(metric="eval_acc", ...)) ranks trials by it, not the objective
        self.own_metric = own_metric(self.scheduler_object) or own_metric(self.sampler_object)
        if self.scheduler_name == "pbt" and self.sampler_name != "random":
            raise UserError(
                "--scheduler pbt chooses params itself and takes no search algorithm; "
                "use --sampler random (or drop --sampler)"
            )
        if settings.hp_space is not None and self.native is None and self.sampler_name != "tpe":
            raise UserError(
                "a define-by-run hp_space runs on the ray backend only with --sampler tpe; "
                "use --sampler tpe or declare a `space` dict"
            )
        grid = self.native is not None and any(isinstance(v, dict) for v in self.native.values())
        if grid and self.sampler_name == "tpe":
            raise UserError(
                "hp_space uses tune.grid_search, which Optuna's TPE cannot sample; use --sampler random"
            )
        if settings.multi_objective and self.scheduler_name != "fifo":
            raise UserError(
                f"--scheduler {self.scheduler_name} stops trials by one metric; with "
                f"{len(settings.directions)} directions use --scheduler fifo"
            )
        if self.scheduler_name == "pbt" and settings.space is None and self.native is None:
            raise UserError(
                "--scheduler pbt mutates a `space` dict (or an hp_space of Ray Tune domains); "
                "declare `space` instead of a define-by-run hp_space"
            )
        resources = dict(settings.resources_per_trial)
        unknown = sorted(set(resources) - {"cpu", "gpu"})
        if unknown:
            raise UserError(
                f"--resources-per-trial {','.join(unknown)}: give cpu=N,gpu=F (e.g. cpu=2,gpu=0.5)"
            )
        if resources.get("cpu", 1.0) < 0 or resources.get("gpu", 0.0) < 0:
            raise UserError(f"--resources-per-trial {resources}: resources cannot be negative")
        # A data-parallel trial (--processes-per-trial N) runs N processes forked by its Tune worker:
        # a CPU for each by default, as the GPUs are one per process (`hpsweep.devices.plan`).
        self.resources = {
            "cpu": resources.get("cpu", float(settings.processes_per_trial)),
            "gpu": resources.get("gpu", 0.0),
        }
        storage = settings.options.get("storage") or settings.storage
        if storage and "://" in str(storage):
            self.storage_path = str(storage)
        else:
            self.storage_path = str(
                Path(storage).resolve() if storage else settings.output_dir / EXPERIMENT_DIR
            )
        self.max_failures = int(settings.options.get("max_failures", 1))
        # A reused actor skips the worker start and the imports (about 2 s per trial on 2 cores).
        # reset_config() needs the previous trial's thread to have ended: train_trial leaves with
        # SystemExit after a stop, so Tune's wrapper never blocks on a last report (see there).
        self.reuse_actors = bool(settings.options.get("reuse_actors", True))
        # Rounds in which Tune saw each trial's worker die, in this command.
        self._deaths: collections.Counter[str] = collections.Counter()
        # Tune trials that ended in ERROR (their worker died), in this command
        self._workers_lost = 0

    # --- running ------------------------------------------------------------------------------------

    @property
    def param_space(self) -> dict[str, Any]:
        if self.native is not None:
            return self.native
        return tune_space(self.settings.space) if self.settings.space is not None else {}

    def run(self, loop: Any) -> None:
        """Tune rounds until the ledger is done, the timeout passed or too many trials failed."""
        runner = self._runner(loop.runner)
        job = getattr(loop.runner, "job", None)
        pickle_space_modules_by_value(
            []
            if job is None
            else [
                job.model_init,
                job.hp_space,
                job.hp_name,
                job.compute_metrics,
                job.objective,
                type(job.args),
                job.trainer_cls,
                *map(type, job.callbacks),
            ]
        )
        with (
            connected(self.settings.address, self.resources["cpu"]),
            _StopSignals() as signals,
            output_dir_marker(self.settings.output_dir) as marker,
        ):
            if (
                "gpu" not in self.settings.resources_per_trial
                and ray.cluster_resources().get("GPU", 0) > 0
            ):
                # A cluster (--address) with GPUs and no gpu= given: a GPU per process, as on one machine.
                self.resources["gpu"] = float(self.settings.processes_per_trial)
            signals.stop_file = stop_file(self.settings.output_dir, marker)
            deadline = loop.deadline_wall
            plan = RoundPlan(
                marker=marker,
                n_trials=self.settings.n_trials,
                started=loop.started,
                max_failed_trials=self.settings.max_failed_trials,
                deadline=deadline,
                budget=self._evaluation_budget(runner),
                worst_extra=worst_of(self.own_metric),
            )
            while deadline is None or time.time() < deadline:
                if not self._next_round(loop, runner, plan, signals):
                    return
                loop.check_failures()

    def _runner(self, runner: Any) -> Any:
        """The trial runner the workers get: with a Tune-domain hp_space, Tune samples the params
        (the runner must not call hp_space again), and their names must fit the arguments first."""
        if self.native is None:
            return runner
        job = runner.job
        apply_params(
            job.args,
            {n: None for n in self.native if n not in field_types(type(job.args))},
            model_takes_trial=job.model_takes_trial,
            source="hp_space",
        )
        runner = copy.copy(runner)
        runner.job = dataclasses.replace(job, hp_space=None)
        return runner

    def _next_round(self, loop: Any, runner: Any, plan: RoundPlan, signals: _StopSignals) -> bool:
        """Run the next Tune round; False when the ledger needs none."""
        ledger = loop.ledger
        with ledger.locked():
            ledger.reap()
            records = runs.read_trials(ledger.output_dir)
            live = [lease for lease in ledger.leases() if lease.alive()]
        waiting = [r for r in records if r.state == AGAIN]
        if waiting:
            again = {r.id: dataclasses.asdict(r) for r in waiting}
            self._round(
                ledger, runner, dataclasses.replace(plan, again=again), records, live, signals
            )
            return True
        n = self.settings.n_trials
        need = (
            max(2 * self.settings.n_jobs, 4)
            if n is None
            else n - ledger.finished(records) - len(live)
        )
        if need > 0:
            self._round(ledger, runner, plan, records, live, signals, new=need)
        elif live:
            # other commands' trials run: they may end cut short and need running again
            time.sleep(WAIT_S)
        return need > 0 or bool(live)

    def _round(
        self,
        ledger: Any,
        runner: Any,
        plan: RoundPlan,
        records: list[runs.TrialRecord],
        live: list[Any],
        signals: _StopSignals,
        *,
        new: int = 0,
    ) -> None:
        s = self.settings
        single = not s.multi_objective
        first = 1 + max(
            [r.number for r in records] + [_lease_number(lease) for lease in live], default=-1
        )
        if plan.again:  # the trials to run again, as they are: no searcher, no scheduler
            numbers = {r["id"]: r["number"] for r in plan.again.values()}
            param_space: dict[str, Any] = {AGAIN_KEY: tune.grid_search(sorted(plan.again))}
            search_alg, trial_scheduler, samples = (
                VariantGenerator(None, max_concurrent=s.n_jobs),
                None,
                1,
            )
            namer = _TrialNamer(first, offset=0, numbers=numbers)
        else:
            param_space, samples = self.param_space, new
            define_by_run = s.hp_space is not None and self.native is None
            search_alg = (
                fresh_copy(self.sampler_object)
                if self.sampler_object
                else search_algorithm(
                    s,
                    self.sampler_name,
                    param_space,
                    define_by_run,
                    records,
                    plan.deadline,
                    explicit_metric=self.own_metric is not None,
                )
            )
            trial_scheduler = (
                fresh_copy(self.scheduler_object)
                if self.scheduler_object
                else scheduler(s, self.scheduler_name, param_space, plan.budget)
            )
            namer = _TrialNamer(first, offset=1 if self.sampler_name == "tpe" else 0)
        run_metric = single and self.own_metric is None  # a user's object with its own takes none
        tune_config = tune.TuneConfig(
            metric=METRIC if run_metric else None,
            mode=mode(s.directions[0]) if run_metric else None,
            search_alg=search_alg,
            scheduler=trial_scheduler,
            num_samples=samples,
            max_concurrent_trials=s.n_jobs,
            reuse_actors=self.reuse_actors,
            trial_name_creator=namer,
            trial_dirname_creator=namer,
        )
        stopper = _StopOnUserError(signals.stop_file)
        # Tune's copies of the checkpoints: 2 a trial, except under PBT, which restores a trial from
        # another's checkpoint some time after choosing it; by then that trial may have saved two
        # more and Tune deleted the one chosen (a trial failed so in CI; Ray warns of num_to_keep <= 2).
        keep = None if self.scheduler_name == "pbt" else 2
        run_config = tune.RunConfig(
            name=f"{runs.safe_name(str(s.options.get('name') or s.study_name), 'hpsweep')}-"
            f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}",
            storage_path=self.storage_path,
            verbose=0,
            stop=stopper,
            failure_config=tune.FailureConfig(max_failures=self.max_failures),
            checkpoint_config=tune.CheckpointConfig(num_to_keep=keep),
            progress_reporter=None,
            log_to_file=False,
        )
        tuner = tune.Tuner(
            tune.with_resources(trainable(runner, plan), self.resources),
            param_space=param_space,
            tune_config=tune_config,
            run_config=run_config,
        )
        with signals.tune_running():
            results = tuner.fit()
        trials = results._experiment_analysis.trials
        _await_shipped_runs(trials, s.output_dir)
        collect_shipped_runs(trials, s.output_dir)
        self._reconcile(ledger, trials, results, stopper, signals)

    def _evaluation_budget(self, runner: Any) -> int | None:
        """How many evaluations a full trial makes, when the arguments say so without the data."""
        if "max_t" in self.settings.options:
            return int(self.settings.options["max_t"])
        args, space = runner.job.args, self.settings.space or {}
        searched = set(space) | set(self.native or {})
        if args.eval_strategy != "epoch" or args.max_steps > 0 or "max_steps" in searched:
            return None
        if "num_train_epochs" in searched and "num_train_epochs" not in space:
            return None  # a Tune domain: its bounds are Tune's business
        epochs = space.get("num_train_epochs")
        high = (
            epochs.high
            if isinstance(epochs, (Float, Int))
            else max(epochs.choices)
            if epochs
            else args.num_train_epochs
        )
        return max(1, math.ceil(high))

    # --- after a round ------------------------------------------------------------------------------

    def _reconcile(
        self,
        ledger: Any,
        trials: list[Any],
        results: Any,
        stopper: _StopOnUserError,
        signals: _StopSignals,
    ) -> None:
        """Make trial.json say what Tune did where a trial could not say so itself: a trial the
        sweep's stop cut short runs again, not ``pruned``; a trial whose worker died runs again,
        unless that happened in `DEATHS_TO_FAIL` rounds (then it failed)."""
        user_error = next(
            (m for r in results if (m := (r.metrics or {}).get(USER_ERROR_KEY))), None
        )
        # Tune stops every trial the same way (SystemExit in tune.report, status TERMINATED),
        # whether its scheduler pruned it or the sweep stopped: what ended after the stop was cut
        # short (a trial that saw the stop file said so itself; one on a node without it could not).
        stops = [t for t in (signals.stopped_at, stopper.stopped_at) if t is not None]
        stopped_at = min(stops) if stops else math.inf
        if stops:
            _await_endings(ledger, {str(t.config.get(AGAIN_KEY) or t.trial_id) for t in trials})
        records = {r.id: r for r in runs.read_trials(ledger.output_dir)}
        with ledger.locked():
            for tune_trial in trials:
                died = tune_trial.status == "ERROR"
                self._workers_lost += died
                record = records.get(tune_trial.config.get(AGAIN_KEY) or tune_trial.trial_id)
                if record is None:
                    continue
                if record.state == "pruned" and (record.finished_at or 0) >= stopped_at:
                    record.finish(AGAIN, error="the sweep stopped while it ran")
                elif died and record.state in ("running", AGAIN):
                    self._deaths[record.id] += 1
                    if self._deaths[record.id] >= DEATHS_TO_FAIL:
                        record.finish(
                            "failed",
                            error=f"its Ray worker died in {self._deaths[record.id]} rounds "
                            "of Tune; see Ray's logs (out of memory?)",
                        )
            ledger.reap()  # workers that died with the round: their trials run again
        if user_error:
            raise UserError(str(user_error))
        if signals.stopped_at is not None:
            raise Interrupted(signals.signum)
        # before a trial could even record
        if self._workers_lost > RESTARTS_PER_WORKER * self.settings.n_jobs:
            raise RuntimeError(
                f"{self._workers_lost} Ray workers died (Tune's trials ended in ERROR); "
                "see Ray's logs and the system log (out of memory?)"
            )


class _StopOnUserError(tune.Stopper):
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


class _StopSignals:
    """Ctrl-C and SIGTERM stop the sweep alike: inside a Tune round, SIGTERM becomes the SIGINT
    that Tune stops its trials on (noticed in Tune's log, as Tune only logs it); between rounds,
    either is an `Interrupted` at once."""

    def __init__(self) -> None:
        self.signum = signal.SIGINT
        self.stopped_at: float | None = None  # when Tune began to stop the round on a signal
        self.stop_file = Path(os.devnull)  # set per command: see _ray_cluster.stop_file
        self._in_tune = False
        self._logger = logging.getLogger("ray.tune.tune")

    def __enter__(self) -> _StopSignals:
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

    def __init__(self, signals: _StopSignals) -> None:
        super().__init__(logging.WARNING)
        self.signals = signals

    def emit(self, record: Any) -> None:
        if "Stop signal received" in record.getMessage() and self.signals.stopped_at is None:
            self.signals.stopped_at = time.time()
            self.signals.stop_file.touch()


class _TrialNamer:
    """Names trials ``trial-<number>-<id>``: new trials by the order Tune creates them in, from
    ``first``; trials run again by their own number."""

    def __init__(self, first: int, offset: int, numbers: dict[str, int] | None = None) -> None:
        self.first = first
        self.offset = offset  # Tune's searcher counter starts at 1, the variant generator at 0
        self.numbers = numbers or {}

    def __call__(self, trial: Any) -> str:
        again = trial.config.get(AGAIN_KEY)
        if again in self.numbers:
            return f"trial-{self.numbers[again]}-{trial.trial_id}"
        counter = int(str(trial.experiment_tag).split("_", 1)[0])
        return f"trial-{self.first + counter - self.offset}-{trial.trial_id}"


def _await_endings(ledger: Any, trial_ids: set[str], timeout: float = ENDINGS_WAIT_S) -> None:
    """Wait until no process on this host holds the lease of one of ``trial_ids`` (a round's
    trials), up to ``timeout`` seconds.

    Tune's ``fit()`` returns once it has asked the round's actors to stop, not once they are
    gone: on a loaded machine an actor may still be recording its trial's ending. Waiting for
    their leases lets `Ledger.reap` (after it) say at once, on disk, that a trial killed mid-way
    runs again, and the command ends with nothing of its sweep still running here. Leases on
    other hosts age out on their own (`hpsweep.search.ledger.STALE_S`); they are not waited for.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(
            str(lease.trial) in trial_ids and lease.on_this_host and lease.alive()
            for lease in ledger.leases()
        ):
            return
        time.sleep(0.1)


def _await_shipped_runs(
    tune_trials: list[Any], output_dir: Path, timeout: float = ENDINGS_WAIT_S
) -> None:
    """Wait until every trial of a round that trained has a record, up to ``timeout`` seconds.

    A trial on a node without ``--output-dir`` records its ending in a node-local folder and ships
    it through Ray's storage (`NodeLocalRuns.ship`) on the actor's way out, which can come after
    Tune's ``fit()`` has returned (Tune stops a trial without waiting for it; an ASHA-pruned
    trial's ship was seen landing 0.1 s after the round ended). Collecting before it landed would
    lose that trial's record, and the next round would train another trial in its place. A trial
    that trained (reported a result) and whose worker did not die has its record in
    ``--output-dir`` (it ran on a node that sees it) or shipped.
    """

    def pending() -> list[Any]:
        here = {r.id for r in runs.read_trials(output_dir)}
        return [
            t
            for t in tune_trials
            if t.status != "ERROR"
            and METRIC in (t.last_result or {})
            and USER_ERROR_KEY not in t.last_result
            and str(t.config.get(AGAIN_KEY) or t.trial_id) not in here
            and ((shipped := shipped_record(t)) is None or shipped.state == "running")
        ]

    deadline = time.monotonic() + timeout
    while pending() and time.monotonic() < deadline:
        time.sleep(0.1)


def _lease_number(lease: Any) -> int:
    ref = lease.info.get("ref")
    number = ref.get("number") if isinstance(ref, dict) else None
    return number if isinstance(number, int) else -1
