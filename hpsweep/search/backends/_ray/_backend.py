"""The Ray Tune backend: the same space file, run by Ray Tune on this machine or a Ray cluster.

An executor backend: Tune's search algorithm and scheduler decide what runs, Ray where. The
driver runs Tune in rounds (each its own Tune experiment in ``<output-dir>/.ray`` or
``--storage``): first one that runs again the trials the ledger holds as cut short, then rounds
of the new trials the ledger still needs, until it has ``--n-trials``, the timeout passed or
too many trials failed. Each trial claims its place from the ledger where it starts
(`._trial`); after a round the driver tells the ledger what the trials could not record.

    $ hpsweep run space.py --backend ray --scheduler asha --n-jobs 4 --address auto
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune.experiment import Trial as TuneTrial
from ray.tune.schedulers import TrialScheduler
from ray.tune.search import SearchAlgorithm, Searcher

from hpsweep import runs
from hpsweep.errors import Interrupted, UserError
from hpsweep.redaction import describe
from hpsweep.search.backends._base import Backend, Driver
from hpsweep.search.backends._ray import _cluster, _search, _stopping, _trial
from hpsweep.search.backends._ray._preflight import check_resources, check_storage
from hpsweep.search.backends._ray._search import (
    check_warm_start,
    fresh_copy,
    scheduler,
    search_algorithm,
)
from hpsweep.search.backends._ray._trial import RoundPlan
from hpsweep.search.ledger import AGAIN, FolderSession, Ledger
from hpsweep.search.options import SearchOptions
from hpsweep.search.space import Float, Int
from hpsweep.search.sweep_loop import SweepLoop
from hpsweep.search.trial_runner import TrialRunner
from hpsweep.search.warm_start import WarmStart
from hpsweep.train.arguments import apply_params, field_types

EXPERIMENT_DIR = ".ray"
WAIT_S = 2.0  # how often the driver looks again while only other commands' trials run
# How long the driver waits after a round for trials to record their endings (a stopped trial's
# actor gives its ending up to 8 s, `_trial.trainable`) and for shipped runs to land.
ENDINGS_WAIT_S = 15.0


class RayBackend(Backend, Driver):
    """Search with Ray Tune (docs/backends.md): samplers tpe (Optuna's TPE through Tune's
    `OptunaSearch`) and random; schedulers fifo, asha, hyperband and pbt, or Tune's own objects."""

    name = "ray"
    samplers = ("random", "tpe")
    pruners = ()
    schedulers = ("fifo", "asha", "hyperband", "pbt")
    reads = frozenset({"storage", "address", "resources_per_trial"})
    _takes_object = staticmethod(_search.is_tune_object)
    transformers_keywords = staticmethod(_search.tune_run_keywords)  # tune.run's other keywords
    option_names = (
        "max_failures",
        "reuse_actors",
        "max_t",
        "reduction_factor",
        "perturbation_interval",
        "storage",
        "name",
        "checkpoint_config",
        "progress_reporter",
        "stop",
    )
    #: ``--warm-start``'s trials, which each round's TPE starts from (`warm_start`).
    _warm: WarmStart | None = None

    def __init__(self, settings: SearchOptions) -> None:
        super().__init__(settings)
        self.native = _search.native_space(settings.hp_space)  # Tune domains from hp_space(None)
        self._choose_search(settings)
        self._check_search(settings)
        self.resources = _resources(settings)
        self.storage_path = _storage_path(settings)
        self.max_failures = int(settings.options.get("max_failures", 1))
        # a reused actor skips the worker's start and imports
        self.reuse_actors = bool(settings.options.get("reuse_actors", True))
        self.stop_rule = _stopping.trial_stop_rule(settings.options.get("stop"))
        self.reporter = _progress_reporter(settings.options.get("progress_reporter"))
        self.num_to_keep = self._checkpoints_kept(settings.options.get("checkpoint_config") or {})
        if self.scheduler_name == "pbt" and settings.n_jobs == 1:
            print(
                "hpsweep: PopulationBasedTraining compares trials that train side by side, and "
                "n_jobs=1 trains one at a time, so no trial takes over another's checkpoint; give "
                "n_jobs=N (or max_concurrent_trials=N) for a population of N",
                file=sys.stderr,
            )

    def _choose_search(self, settings: SearchOptions) -> None:
        """Tune's scheduler and search algorithm: objects (a copy per round), or by name."""
        self.scheduler_object, self.sampler_object = (
            None if isinstance(v, (str, type(None))) else v
            for v in (settings.scheduler, settings.sampler)
        )
        self.scheduler_name = (
            _search.scheduler_kind(self.scheduler_object)
            if self.scheduler_object
            else settings.scheduler or "fifo"
        )
        self.sampler_name = (
            type(self.sampler_object).__name__
            if self.sampler_object
            else settings.sampler or ("random" if self.scheduler_name == "pbt" else "tpe")
        )
        # one made with its own metric ranks trials by it, not by the objective
        self.own_metric = _search.own_metric(self.scheduler_object) or _search.own_metric(
            self.sampler_object
        )

    def _check_search(self, settings: SearchOptions) -> None:
        """The combinations Tune cannot run, as user errors before anything is written."""
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

    def _checkpoints_kept(self, kept: dict[str, Any]) -> int | None:
        """How many of each trial's checkpoints Tune keeps: 2, or the user's ``num_to_keep``; all
        under PBT, which restores a trial from a checkpoint another trial saved some time before."""
        wanted = kept.get("num_to_keep")
        if wanted is not None and (not isinstance(wanted, int) or wanted < 1):
            raise UserError(f"checkpoint_config num_to_keep={wanted!r}: give a count of 1 or more")
        if self.scheduler_name != "pbt":
            return wanted or 2
        if wanted is not None:
            print(
                f"hpsweep: num_to_keep={wanted}: PopulationBasedTraining restores trials from "
                "checkpoints other trials saved earlier, so Tune keeps every checkpoint under PBT",
                file=sys.stderr,
            )
        return None

    @property
    def param_space(self) -> dict[str, Any]:
        if self.native is not None:
            return self.native
        return _search.tune_space(self.settings.space) if self.settings.space is not None else {}

    def drive(self, loop: SweepLoop) -> None:
        """Join the cluster, check that it can run the sweep, then run the rounds."""
        runner = self._runner(loop.runner)
        job = self._job = runner.job
        _cluster.pickle_user_code_by_value(
            [job.model_init, job.hp_space, job.hp_name, job.compute_metrics, job.objective]
            + [type(job.args), job.trainer_cls, *map(type, job.callbacks)]
        )
        with _cluster.connected(self.settings.address, self.resources["cpu"]):
            self._check_cluster()
            with (
                _stopping.StopSignals() as signals,
                _cluster.output_dir_marker(self.settings.output_dir) as marker,
            ):
                self._rounds(loop, runner, signals, marker)

    def _check_cluster(self) -> None:
        """What each trial reserves on this cluster, and that the cluster can run the sweep."""
        if (
            "gpu" not in self.settings.resources_per_trial
            and ray.cluster_resources().get("GPU", 0) > 0
        ):
            # a cluster with GPUs and no gpu= given: a GPU per process, as on one machine
            self.resources["gpu"] = float(self.settings.processes_per_trial)
        check_resources(self.resources)
        given = self.settings.options.get("storage") or self.settings.storage
        check_storage(self.storage_path, given=bool(given))

    def _rounds(
        self, loop: SweepLoop, runner: TrialRunner, signals: _stopping.StopSignals, marker: str
    ) -> None:
        """Tune rounds until the ledger is done, the timeout passed or too many trials failed."""
        signals.stop_file = _cluster.stop_file(self.settings.output_dir, marker)
        deadline = loop.deadline_wall
        plan = RoundPlan(
            marker=marker,
            storage=self.storage_path,
            n_trials=self.settings.n_trials,
            started=loop.started,
            max_failed_trials=self.settings.max_failed_trials,
            deadline=deadline,
            budget=self._evaluation_budget(runner),
            worst_extra=_search.worst_of(self.own_metric),
            driver=_trial.this_process(),
        )
        while deadline is None or time.time() < deadline:
            if not self._next_round(loop.ledger, runner, plan, signals):
                return
            loop.check_failures()

    def _runner(self, runner: TrialRunner) -> TrialRunner:
        """The runner the workers get: with a Tune-domain hp_space Tune samples the params (checked
        against the arguments first); with ``stop=`` each trial asks it (`StopWhen`)."""
        job, changes = runner.job, {}
        if self.native is not None:
            apply_params(
                job.args,
                {n: None for n in self.native if n not in field_types(type(job.args))},
                model_takes_trial=job.model_takes_trial,
                source="hp_space",
            )
            changes["hp_space"] = None
        if self.stop_rule is not None:
            stop = _stopping.StopWhen(self.stop_rule, job.objective, job.directions)
            changes["callbacks"] = [*job.callbacks, stop]
        if not changes:
            return runner
        runner = copy.copy(runner)
        runner.job = dataclasses.replace(job, **changes)
        return runner

    def _next_round(
        self, ledger: Ledger, runner: TrialRunner, plan: RoundPlan, signals: _stopping.StopSignals
    ) -> bool:
        """Run the next Tune round: the trials waiting to run again, else the new trials the
        ledger still needs; False when it needs none and no trial runs anywhere."""
        with ledger.locked() as session:
            session.reap()
            records = ledger.records(fresh=True)
            needed, live, first = session.needed(), ledger.live(), session.next_number()
        waiting = {r.id: r for r in records if r.state == AGAIN}
        if waiting:
            plan = dataclasses.replace(
                plan, again={i: dataclasses.asdict(r) for i, r in waiting.items()}
            )
            namer = _TrialNamer(first, again={i: r.number for i, r in waiting.items()})
            self._round(ledger, runner, plan, self._again_search(plan, namer), signals)
            return True
        # without --n-trials: rounds of a few trials each, until the timeout
        need = max(2 * self.settings.n_jobs, 4) if needed is None else needed
        if need > 0:
            search = self._new_search(records, plan, need, _TrialNamer(first))
            self._round(ledger, runner, plan, search, signals)
        elif live:
            # other commands' trials run: they may end cut short and need running again
            time.sleep(WAIT_S)
        return need > 0 or bool(live)

    def _again_search(self, plan: RoundPlan, namer: _TrialNamer) -> _RoundSearch:
        """The trials to run again, as they are: one each, no searcher, no scheduler."""
        return _RoundSearch(
            param_space={_trial.AGAIN_KEY: tune.grid_search(sorted(plan.again))},
            search_alg=_search.VariantGenerator(None, max_concurrent=self.settings.n_jobs),
            scheduler=None,
            samples=1,
            namer=namer,
        )

    def _new_search(
        self, records: list[runs.TrialRecord], plan: RoundPlan, new: int, namer: _TrialNamer
    ) -> _RoundSearch:
        """``new`` new trials, from fresh copies of the search algorithm and the scheduler."""
        s, param_space = self.settings, self.param_space
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
                warm=self._warm,
            )
        )
        trial_scheduler = (
            fresh_copy(self.scheduler_object)
            if self.scheduler_object
            else scheduler(s, self.scheduler_name, param_space, plan.budget)
        )
        return _RoundSearch(param_space, search_alg, trial_scheduler, new, namer)

    def _round(
        self,
        ledger: Ledger,
        runner: TrialRunner,
        plan: RoundPlan,
        search: _RoundSearch,
        signals: _stopping.StopSignals,
    ) -> None:
        """One Tune experiment of the trials ``search`` makes, then what its end leaves on disk."""
        watch = _stopping.RoundWatch(self.resources, signals.stop_file)
        tuner = tune.Tuner(
            tune.with_resources(_trial.trainable(runner, plan), self.resources),
            param_space=search.param_space,
            tune_config=self._tune_config(search),
            run_config=self._run_config(watch),
        )
        with signals.tune_running():
            results = tuner.fit()
        _gather_shipped_runs(watch.trials, self.storage_path, self.settings.output_dir)
        self._after_round(ledger, watch, results, signals)

    def _tune_config(self, search: _RoundSearch) -> tune.TuneConfig:
        s = self.settings
        # a user's scheduler or search algorithm with its own metric takes none from the config
        run_metric = not s.multi_objective and self.own_metric is None
        return tune.TuneConfig(
            metric=_trial.METRIC if run_metric else None,
            mode=_search.mode(s.directions[0]) if run_metric else None,
            search_alg=search.search_alg,
            scheduler=search.scheduler,
            num_samples=search.samples,
            max_concurrent_trials=s.n_jobs,
            reuse_actors=self.reuse_actors,
            trial_name_creator=search.namer,
            trial_dirname_creator=search.namer,
        )

    def _run_config(self, watch: _stopping.RoundWatch) -> tune.RunConfig:
        s = self.settings
        kept = s.options.get("checkpoint_config") or {}
        return tune.RunConfig(
            name=f"{runs.safe_name(str(s.options.get('name') or s.study_name), 'hpsweep')}-"
            f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}",
            storage_path=self.storage_path,
            # a user's reporter prints Tune's table of trials, at the end at least
            verbose=2 if self.reporter else 0,
            stop=watch,
            callbacks=[watch],
            failure_config=tune.FailureConfig(max_failures=self.max_failures),
            checkpoint_config=tune.CheckpointConfig(
                num_to_keep=self.num_to_keep,
                checkpoint_score_attribute=kept.get("score_attribute")
                if self.num_to_keep
                else None,
                checkpoint_score_order=kept.get("score_order") or "max",
            ),
            progress_reporter=self.reporter,
            log_to_file=False,
        )

    def _evaluation_budget(self, runner: TrialRunner) -> int | None:
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

    def _after_round(
        self,
        ledger: Ledger,
        watch: _stopping.RoundWatch,
        results: tune.ResultGrid,
        signals: _stopping.StopSignals,
    ) -> None:
        """Tell the ledger what Tune saw that the trials could not record, then end the sweep on a
        user error or a signal (the loop ends it on too many failed trials)."""
        key = _trial.USER_ERROR_KEY
        user_error = next((m for r in results if (m := (r.metrics or {}).get(key))), None)
        # a trial pruned after the sweep's stop was cut short (`FolderSession.settle`)
        stops = [t for t in (signals.stopped_at, watch.stopped_at) if t is not None]
        ids = [_trial.record_id(t) for t in watch.trials]
        if stops:
            # fit() returns once it asked the actors to stop, not once they are gone
            ledger.wait_for_endings(ids, ENDINGS_WAIT_S)
        lost = {
            _trial.record_id(t)
            for t in watch.trials
            if t.status == "ERROR" or t.trial_id in watch.stuck
        }
        with ledger.locked() as session:
            self._fail_unrecorded(session, watch)
            session.settle(
                ids,
                stopped_at=min(stops) if stops else None,
                lost=lost,
                lost_error="its Ray worker died in {times} rounds of Tune; "
                "see Ray's logs (out of memory?)",
            )
        if user_error:
            raise UserError(str(user_error))
        if signals.stopped_at is not None:
            raise Interrupted(signals.signum)

    def _fail_unrecorded(self, session: FolderSession, watch: _stopping.RoundWatch) -> None:
        """Record as failed the trials Tune failed before they recorded themselves, or Ray could
        not place: they count towards ``--max-failed-trials``, so a cluster that cannot run a
        trial ends the sweep in one line, not in rounds of trials failing out of sight."""
        known = {r.id for r in session.ledger.records(fresh=True)}
        for t in watch.trials:
            if _trial.record_id(t) in known:
                continue
            if t.status == "ERROR":
                error = f"Ray Tune failed it before it could record itself: {_tune_error(t)}"
            elif t.trial_id in watch.stuck:
                error = watch.reason
            else:
                continue  # it had nothing to run (the ledger had enough)
            template = runs.TrialRecord(
                id=t.trial_id,
                number=0,
                backend=self.name,
                params=_trial.config_params(t.config),
                objective_name=self._job.objective_name,
                directions=list(self.settings.directions),
                user_attrs={"ray_trial_id": t.trial_id},
            )
            number = t.config.get(_trial.NUMBER_KEY)
            session.fail_unrecorded(t.trial_id, error=error, template=template, number=number)

    def warm_start(self, warm: WarmStart) -> None:
        """Each round's TPE starts from the earlier trials beside the sweep's own complete ones
        (`._search.seeded_storage`; `._search.check_warm_start` refuses a search that takes
        none)."""
        check_warm_start(warm, self.settings, self.sampler_name)
        self._warm = warm


def _progress_reporter(reporter: object) -> tune.ProgressReporter | None:
    """A user's Tune progress reporter (a ``CLIReporter``), checked."""
    if reporter is None or isinstance(reporter, tune.ProgressReporter):
        return reporter
    raise UserError(
        f"progress_reporter={reporter!r}: give a ray.tune.CLIReporter (or another "
        "tune.ProgressReporter)"
    )


def _tune_error(tune_trial: TuneTrial) -> str:
    """The first line of the error Tune kept for a trial it ended in ERROR."""
    try:
        exc = tune_trial.get_pickled_error() or tune_trial.get_error()
    except Exception:  # Tune keeps it in its storage: unreadable, or never written
        exc = None
    if exc is None:
        return "see Ray's logs"
    cause = getattr(exc, "cause", None) or exc  # a RayTaskError carries the trial's own exception
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"


@dataclasses.dataclass
class _RoundSearch:
    """What one Tune round tries, and the namer that numbers its trials."""

    param_space: dict[str, Any]
    search_alg: Searcher | SearchAlgorithm
    scheduler: TrialScheduler | None
    samples: int
    namer: _TrialNamer


def _resources(settings: SearchOptions) -> dict[str, float]:
    """What each trial reserves: ``--resources-per-trial`` (checked by `hpsweep.devices.plan`),
    by default a CPU per process of a ``--processes-per-trial`` trial (its Tune worker forks them)."""
    given = settings.resources_per_trial or {}
    cpu = given.get("cpu", float(settings.processes_per_trial))
    return {"cpu": cpu, "gpu": given.get("gpu", 0.0)}


def _storage_path(settings: SearchOptions) -> str:
    """Where Tune keeps its experiments: ``--storage`` (a path or a URI), else ``.ray`` in the
    sweep's home: at an object-store home's URL on a cluster (other nodes do not see this
    machine's staging folder), in the staging folder with a local Ray."""
    storage = settings.options.get("storage") or settings.storage
    if storage is not None and not isinstance(storage, (str, os.PathLike)):
        raise UserError(
            f"storage={describe(storage)}: Ray keeps its trials under a path or a URI "
            "(s3://...); an Optuna storage object is for the optuna backend"
        )
    if storage and "://" in str(storage):
        return str(storage)
    if storage:
        return str(Path(storage).resolve())
    home = settings.home
    if home is not None and home.remote and (settings.address or ray.is_initialized()):
        return f"{home.url}/{EXPERIMENT_DIR}"
    return str(settings.output_dir / EXPERIMENT_DIR)


class _TrialNamer:
    """Numbers a round's trials, ``trial-<number>-<id>`` for Tune's names and folders, and puts
    the number in the trial's config (`NUMBER_KEY`) for its worker: a trial run again keeps its
    own, a new one takes the next from ``first`` (`FolderSession.next_number` of the round)."""

    def __init__(self, first: int, again: dict[str, int] | None = None) -> None:
        self.next = first
        self.again = again or {}  # the id of a trial run again -> its number
        self.numbers: dict[str, int] = {}  # Tune's id of a new trial -> its number

    def __deepcopy__(self, memo: dict[int, Any]) -> _TrialNamer:
        return self  # Tune copies the experiment's spec per trial: the round's trials share one

    def __call__(self, trial: TuneTrial) -> str:
        number = self.again.get(trial.config.get(_trial.AGAIN_KEY))
        if number is None:
            if trial.trial_id not in self.numbers:
                self.numbers[trial.trial_id] = self.next
                self.next += 1
            number = self.numbers[trial.trial_id]
        trial.config[_trial.NUMBER_KEY] = number
        return f"trial-{number}-{trial.trial_id}"


def _gather_shipped_runs(tune_trials: list[TuneTrial], storage: str, output_dir: Path) -> None:
    """Copy into ``--output-dir`` the runs a round's trials shipped (`._cluster.NodeLocalRuns`),
    once every trial that trained and whose worker lived has a record there or shipped one, or
    `ENDINGS_WAIT_S` passed: Tune ends a round without waiting for its stopped trials, whose
    ship may land after ``fit()`` returned."""
    stores = {t.trial_id: _cluster.trial_store(storage, t) for t in tune_trials}
    trained = [
        t
        for t in tune_trials
        if t.status != "ERROR"
        and _trial.METRIC in (t.last_result or {})
        and _trial.USER_ERROR_KEY not in t.last_result
    ]

    def pending() -> list[TuneTrial]:
        here = {r.id for r in runs.read_trials(output_dir)}
        return [
            t
            for t in trained
            if _trial.record_id(t) not in here
            and (
                (shipped := _cluster.shipped_record(stores[t.trial_id])) is None
                or shipped.state == "running"
            )
        ]

    deadline = time.monotonic() + ENDINGS_WAIT_S
    while pending() and time.monotonic() < deadline:
        time.sleep(0.1)
    _cluster.collect_shipped_runs(list(stores.values()), output_dir)
