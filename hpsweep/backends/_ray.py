"""The Ray Tune backend: the same space file, run by Ray Tune on this machine or on a Ray cluster.

Ray Tune decides what to try (random search, or Optuna's TPE through Tune's `OptunaSearch`) and
when to stop (`--scheduler fifo|asha|hyperband|pbt`); each trial is one call of the sweep's
`TrialRunner` inside a Tune function trainable. Each evaluation is reported to Tune with the
metrics, ``objective`` and, when one was saved at that step, the checkpoint, so schedulers can
stop, pause, resume and (PBT) clone trials.

Tune keeps its experiment in ``<output-dir>/.ray/<study-name>`` (or under ``--storage``), which
on a cluster must be a path every node mounts or a cloud URI (``s3://``, ``gs://``). The run
folders, ``best/`` and ``best_run.json`` end up in ``--output-dir`` as with Optuna: a trial on a
node that sees ``--output-dir`` writes there directly; a trial on a node that does not writes a
node-local run folder and ships it through Ray's storage, and the driver copies it into
``--output-dir`` (and promotes it) when Tune's run ends.

    $ hpsweep run space.py --backend ray --scheduler asha --n-jobs 4 --address auto
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import math
import os
import secrets
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import ray
from ray import tune

from .. import runs
from ..errors import TrialPruned, UserError
from ..space import Categorical, Distribution, Float, Int
from ..trial import Trial
from ._base import Backend, SearchSettings, TrialFunction

METRIC = "objective"
USER_ERROR_KEY = "hpsweep_user_error"
EXPERIMENT_DIR = ".ray"
CONNECT_TIMEOUT_S = 3.0
# In --output-dir: a token per sweep run, by which a worker tells whether it sees the driver's folder.
MARKER_FILE = ".hpsweep-ray-marker"
# A trial's run folder, shipped from a node without --output-dir, in the trial's folder in Ray's storage.
SHIPPED_RUN_DIR = "hpsweep-run"
# On a worker: write run folders under this node-local folder even when --output-dir is visible
# (a node without the shared mount, as tests simulate it).
LOCAL_RUNS_ENV = "HPSWEEP_RAY_LOCAL_RUNS"
# Set on the workers: with reuse_actors, how long reset_config() waits for a stopped trial to record itself.
WORKER_ENV = {"TUNE_FUNCTION_THREAD_TIMEOUT_S": "60", "RAY_DEDUP_LOGS": "1"}

# Quiet Ray's console and skip work hpsweep does not need (per-trial CSV/JSON/TensorBoard
# loggers, usage reporting); users may still override each of these in their environment.
_QUIET_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "TUNE_DISABLE_AUTO_CALLBACK_LOGGERS": "1",
              "RAY_AIR_NEW_OUTPUT": "0", "TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S": "100000",
              "RAY_DEDUP_LOGS": "1", "RAY_TRAIN_V2_ENABLED": "0"}


class RayTrial(Trial):
    """A Ray Tune trial as the trainer sees it.

    Tune stops or pauses a trial by raising ``SystemExit(0)`` inside `ray.tune.report`; that is
    turned into `should_prune` so the trainer ends the run cleanly and records it as pruned
    (a paused trial is resumed later from its checkpoint and runs on).
    """

    backend = "ray"

    def __init__(self, number: int, params: dict[str, Any], *, id: str, budget: int | None = None) -> None:
        super().__init__(number, params, id=id)
        self._budget = budget
        self._stopped = False
        self._detached = False  # Tune has let go of this trial: reporting again would block for ever

    def report(self, step: int, metrics: Any, objective: Any, checkpoint: str | None = None) -> None:
        if self._detached:
            return
        result = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        result.update(objective_metrics(objective))
        result["evaluation"] = step
        try:
            tune.report(result, checkpoint=tune.Checkpoint.from_directory(checkpoint) if checkpoint else None)
        except SystemExit:
            # Tune stopped the trial and reads no more of its results: any later report would wait
            # for ever on Tune's lock (see train_trial's ending).
            self._detached = True
            # A stop at the last evaluation of the budget is the scheduler ending a finished trial.
            self._stopped = self._budget is None or step < self._budget

    def should_prune(self) -> bool:
        return self._stopped

    @property
    def detached(self) -> bool:
        return self._detached


def objective_metrics(objective: Any) -> dict[str, float]:
    if isinstance(objective, (list, tuple)):
        return {f"{METRIC}_{i}": float(v) for i, v in enumerate(objective)}
    return {METRIC: float(objective)}


# --- the space, in Tune's terms -------------------------------------------------------------------

def tune_domain(dist: Distribution) -> Any:
    """A backend-neutral distribution as a Ray Tune search-space domain (same bounds, both included)."""
    if isinstance(dist, Float):
        if dist.log:
            return tune.loguniform(dist.low, dist.high)
        if dist.step is not None:  # Tune quantises to multiples of q; off-grid bounds need a choice
            aligned = abs(dist.low / dist.step - round(dist.low / dist.step)) < 1e-9
            return tune.quniform(dist.low, dist.high, dist.step) if aligned else tune.choice(dist.grid())
        return tune.uniform(dist.low, dist.high)
    if isinstance(dist, Int):
        if dist.log:
            return tune.lograndint(dist.low, dist.high + 1)
        if dist.step == 1:
            return tune.randint(dist.low, dist.high + 1)
        return tune.qrandint(dist.low, dist.high, dist.step) if dist.low % dist.step == 0 else tune.choice(dist.grid())
    assert isinstance(dist, Categorical)
    return tune.choice(list(dist.choices))


def tune_space(space: dict[str, Distribution]) -> dict[str, Any]:
    return {name: tune_domain(dist) for name, dist in space.items()}


# --- what runs on the workers --------------------------------------------------------------------

def train_trial(config: dict[str, Any], runner: TrialFunction, budget: int | None = None,
                marker: str | None = None) -> None:
    """The Tune function trainable: one trial of the sweep, on whichever node Tune placed it.

    On a node that does not see the driver's ``--output-dir`` (its ``marker`` token is not there),
    or where ``HPSWEEP_RAY_LOCAL_RUNS`` is set, the trial writes its run folder to a node-local
    folder and ships it to the trial's folder in Ray's storage when it ends (see `_NodeLocalRuns`);
    the driver copies it into ``--output-dir`` after the sweep.
    """
    for key, value in WORKER_ENV.items():  # read by this actor's reset_config(), also when the user called ray.init
        os.environ.setdefault(key, value)
    ctx = tune.get_context()
    trial = RayTrial(_number(ctx.get_trial_name()), dict(config), id=ctx.get_trial_id(), budget=budget)
    node = ray.get_runtime_context().get_node_id()
    local = _NodeLocalRuns.for_trial(runner, marker, ctx)
    if local is not None:
        runner = local.runner
    checkpoint = tune.get_checkpoint()  # set when Tune resumes, retries or (PBT) clones the trial
    try:
        with checkpoint.as_directory() if checkpoint else contextlib.nullcontext(None) as folder:
            if folder is not None:
                trial.user_attrs["resume_from"] = folder
            earlier = _load_record(runner, trial)
            try:
                runner(trial)
            except TrialPruned:
                pass
            except UserError as exc:  # the whole sweep cannot go on: tell the driver, do not retry
                if trial.detached:
                    raise  # Tune reads no more results from this trial; fail it instead
                tune.report({USER_ERROR_KEY: str(exc)})
            finally:
                _note_ray_attrs(runner, trial, earlier, node, folder)
    finally:
        if local is not None:  # every ending: complete, pruned, failed, stopped by Tune or Ctrl-C
            local.ship(_load_record(runner, trial))
    if trial.detached:
        # Tune stopped the trial inside tune.report and we caught that to record it. Returning now
        # would let Tune's function wrapper report once more ({"__duplicate__": True}) to a session
        # nobody reads: the thread would hang, reset_config() would time out, and with reuse_actors
        # the actor's next trial would fail ("Could not re-use actor"). Leave as Tune's stop expects.
        raise SystemExit(0)


class _NodeLocalRuns:
    """A trial's run folder on a node without ``--output-dir``, shipped through Ray's storage.

    The trial trains into ``<HPSWEEP_RAY_LOCAL_RUNS or the temp dir>/hpsweep-<experiment>-<token>/<trial id>/``
    (its own ``--output-dir`` there); when it ends, its run folder replaces
    ``<trial folder in Ray's storage>/hpsweep-run/`` and the node-local copy is deleted. A trial that
    starts again on such a node (a retry, a PBT exploit, ``--resume``) first gets that folder back.
    """

    def __init__(self, runner: Any, folder: Path, storage: Any) -> None:
        job = runner.job
        self.folder = folder
        self.runner = copy.copy(runner)
        self.runner.job = dataclasses.replace(job, args=job.args.replace(output_dir=str(folder)))
        self.fs = storage.storage_filesystem
        self.remote = f"{storage.trial_fs_path.rstrip('/')}/{SHIPPED_RUN_DIR}"

    @classmethod
    def for_trial(cls, runner: Any, marker: str | None, ctx: Any) -> _NodeLocalRuns | None:
        job = getattr(runner, "job", None)
        if job is None or marker is None:
            return None
        base = os.environ.get(LOCAL_RUNS_ENV)
        if not base and _sees_marker(job.output_dir, marker):
            return None  # --output-dir is shared with the driver: write there directly
        experiment = runs.safe_name(ctx.get_experiment_name(), "sweep")
        folder = Path(base or tempfile.gettempdir()).resolve() / f"hpsweep-{experiment}-{marker[:12]}" / ctx.get_trial_id()
        local = cls(runner, folder, ctx.get_storage())
        local._fetch()
        return local

    def _fetch(self) -> None:
        """Bring back the run folder this trial shipped before, if it ran already."""
        from ray.train._internal.storage import _download_from_fs_path

        shutil.rmtree(self.folder, ignore_errors=True)  # a leftover of a worker that died mid-trial
        record = _remote_record(self.fs, self.remote)
        if record is not None:
            record.run_dir = str(self.folder / runs.safe_name(Path(record.run_dir).name, f"run-{record.id}"))
            _download_from_fs_path(self.fs, self.remote, record.run_dir, filelock=False)
            record.save()  # with this node's path

    def ship(self, record: runs.TrialRecord | None) -> None:
        from ray.train._internal import storage as ray_storage

        try:
            if record is None or not Path(record.run_dir).is_dir():
                return  # nothing was recorded (a UserError before training): nothing to ship
            record.user_attrs["ray_shipped_from"] = record.run_dir
            record.save()
            if ray_storage._exists_at_fs_path(self.fs, self.remote):
                ray_storage._delete_fs_path(self.fs, self.remote)  # drop checkpoints rotated away since the last trip
            ray_storage._upload_to_fs_path(record.run_dir, self.fs, self.remote)
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
            with contextlib.suppress(OSError):
                self.folder.parent.rmdir()  # the sweep's folder on this node, once its last trial ended


def _sees_marker(output_dir: Path, token: str) -> bool:
    try:
        return json.loads((output_dir / MARKER_FILE).read_text()) == token
    except (OSError, ValueError):
        return False


def _remote_record(fs: Any, remote: str) -> runs.TrialRecord | None:
    """The trial.json a trial shipped to ``remote`` (a folder in Ray's storage), if any."""
    try:
        with fs.open_input_stream(f"{remote}/{runs.TRIAL_FILE}") as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return None
    known = {k: v for k, v in data.items() if k in runs.TrialRecord.__dataclass_fields__}
    try:
        return runs.TrialRecord(**known)
    except TypeError:
        return None


def _freshness(record: runs.TrialRecord) -> tuple[float, bool, float]:
    """Which of two records of one trial is newer: the later run, then an ended one."""
    return record.started_at, record.state != "running", record.finished_at or 0.0


def _number(trial_name: str) -> int:
    return int(trial_name.split("-", 2)[1])


def _load_record(runner: Any, trial: RayTrial) -> runs.TrialRecord | None:
    job = getattr(runner, "job", None)
    if job is None:
        return None
    run_dir = runs.run_dir_for(job.output_dir, trial.id, job.hp_name(trial) if job.hp_name else None)
    record = runs.TrialRecord.load(run_dir / runs.TRIAL_FILE)
    return record if record is not None and record.id == trial.id else None


def _note_ray_attrs(runner: Any, trial: RayTrial, earlier: runs.TrialRecord | None, node: str,
                    restored_from: str | None) -> None:
    """Keep in trial.json which Ray nodes ran the trial and how often Tune restored it from a
    checkpoint (``user_attrs``: ``ray_node_id``, ``ray_node_ids``, ``ray_restores``, ``ray_restored_from``)."""
    record = _load_record(runner, trial)
    if record is None:
        return
    before = earlier.user_attrs if earlier is not None else {}
    nodes = list(before.get("ray_node_ids", []))
    record.user_attrs.update(ray_node_id=node, ray_node_ids=nodes + [node] if node not in nodes else nodes,
                             ray_restores=before.get("ray_restores", 0) + (restored_from is not None))
    if restored_from is not None:
        record.user_attrs["ray_restored_from"] = restored_from
    record.save()


class _StopOnUserError(tune.Stopper):
    """Ends the whole experiment when a trial reports a `UserError` (a bad objective name, ...)."""

    def __init__(self) -> None:
        self.failed = False

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        self.failed = self.failed or USER_ERROR_KEY in result
        return self.failed

    def stop_all(self) -> bool:
        return self.failed


# --- the backend ----------------------------------------------------------------------------------

class RayBackend(Backend):
    """Search with Ray Tune. Samplers: tpe (default; Optuna's TPE via `OptunaSearch`), random;
    schedulers: fifo (default), asha, hyperband, pbt. ``--n-jobs`` caps concurrent trials,
    ``--resources-per-trial cpu=N,gpu=F`` reserves resources for each (fractional GPUs allowed).

    Options (``hyperparameter_search(backend="ray", ...)``): ``max_failures`` (retries of a crashing
    trial, default 1), ``reuse_actors`` (default True), ``max_t`` (evaluations per trial for
    ASHA/HyperBand), ``reduction_factor``, ``perturbation_interval`` (PBT, in evaluations),
    ``storage`` (Ray's storage path or URI).
    """

    name = "ray"
    samplers = ("random", "tpe")
    pruners = ()
    schedulers = ("fifo", "asha", "hyperband", "pbt")

    def __init__(self, settings: SearchSettings) -> None:
        super().__init__(settings)
        self.scheduler_name = settings.scheduler or "fifo"
        self.sampler_name = settings.sampler or ("random" if self.scheduler_name == "pbt" else "tpe")
        if self.scheduler_name == "pbt" and self.sampler_name != "random":
            raise UserError("--scheduler pbt chooses params itself and takes no search algorithm; "
                            "use --sampler random (or drop --sampler)")
        if settings.hp_space is not None and self.sampler_name != "tpe":
            raise UserError("a define-by-run hp_space runs on the ray backend only with --sampler tpe; "
                            "use --sampler tpe or declare a `space` dict")
        if settings.multi_objective and self.scheduler_name != "fifo":
            raise UserError(f"--scheduler {self.scheduler_name} stops trials by one metric; with "
                            f"{len(settings.directions)} directions use --scheduler fifo")
        if settings.scheduler == "pbt" and settings.space is None:
            raise UserError("--scheduler pbt mutates a `space` dict; declare `space` instead of hp_space")
        resources = dict(settings.resources_per_trial)
        unknown = sorted(set(resources) - {"cpu", "gpu"})
        if unknown:
            raise UserError(f"--resources-per-trial {','.join(unknown)}: give cpu=N,gpu=F (e.g. cpu=2,gpu=0.5)")
        if resources.get("cpu", 1.0) < 0 or resources.get("gpu", 0.0) < 0:
            raise UserError(f"--resources-per-trial {resources}: resources cannot be negative")
        self.resources = {"cpu": resources.get("cpu", 1.0), "gpu": resources.get("gpu", 0.0)}
        storage = settings.options.get("storage") or settings.storage
        if storage and not _is_local(str(storage)):
            self.storage_path = str(storage)
        else:
            self.storage_path = str(Path(storage).resolve() if storage else settings.output_dir.resolve() / EXPERIMENT_DIR)
        self.max_failures = int(settings.options.get("max_failures", 1))
        # A reused actor skips the worker start and the imports (about 2 s per trial on 2 cores).
        # reset_config() needs the previous trial's thread to have ended: train_trial leaves with
        # SystemExit after a stop, so Tune's wrapper never blocks on a last report (see there).
        self.reuse_actors = bool(settings.options.get("reuse_actors", True))

    # --- connecting ---------------------------------------------------------------------------------

    def connect(self) -> bool:
        """Join ``--address`` or start a local Ray; returns whether this call started Ray."""
        for key, value in _QUIET_ENV.items():
            os.environ.setdefault(key, value)
        if ray.is_initialized():  # a Python API user connected already
            return False
        address = self.settings.address
        kwargs: dict[str, Any] = dict(logging_level=logging.ERROR, log_to_driver=False, configure_logging=True,
                                      runtime_env={"env_vars": dict(WORKER_ENV)})
        if address is None:
            num_cpus = max(os.cpu_count() or 1, math.ceil(self.resources["cpu"]))
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                     **kwargs)
            return True
        check_reachable(address)
        try:
            ray.init(address=address, **kwargs)
        except Exception as exc:  # ConnectionError, AuthenticationError, a Ray Client handshake, ...
            raise UserError(f"--address {address}: cannot join the Ray cluster ({_first_line(exc)}); "
                            "check the address and that `ray status` works there") from None
        return True

    # --- running ------------------------------------------------------------------------------------

    def run(self, trial_fn: TrialFunction) -> None:
        started = self.connect()
        try:
            self._run(trial_fn)
        finally:
            if started:
                ray.shutdown()

    def _run(self, trial_fn: TrialFunction) -> None:
        s = self.settings
        runner = trial_fn  # output_dir is absolute (sweep.search), so workers in other folders write there
        _pickle_space_modules_by_value()
        budget = self._evaluation_budget(runner)
        marker = secrets.token_hex(16)  # workers that read it here write to --output-dir directly
        runs.write_json(s.output_dir / MARKER_FILE, marker)
        trainable = tune.with_resources(tune.with_parameters(train_trial, runner=runner, budget=budget, marker=marker),
                                        self.resources)
        experiment = _join(self.storage_path, s.study_name)
        if s.resume and tune.Tuner.can_restore(experiment):
            tuner = tune.Tuner.restore(experiment, trainable=trainable, resume_unfinished=True,
                                       resume_errored=True)
        elif not s.resume and _is_local(experiment) and Path(experiment).exists():
            raise UserError(f"{s.output_dir} already holds the Ray experiment {s.study_name!r}; "
                            "add --resume to continue it, or give another --output-dir or --study-name")
        else:
            tuner = self._new_tuner(trainable, budget)
        with _InterruptWatch() as watch:
            results = tuner.fit()
        self._collect_shipped_runs(results)
        self._reconcile(results, interrupted=watch.seen)

    def _new_tuner(self, trainable: Any, budget: int | None) -> tune.Tuner:
        s = self.settings
        single = not s.multi_objective
        param_space = tune_space(s.space) if s.space is not None else {}
        order = "tpe" if self.sampler_name == "tpe" else "random"
        tune_config = tune.TuneConfig(
            metric=METRIC if single else None, mode=_mode(s.directions[0]) if single else None,
            search_alg=self._search_alg(), scheduler=self._scheduler(budget),
            num_samples=s.n_trials if s.n_trials is not None else -1, time_budget_s=s.timeout,
            max_concurrent_trials=s.n_jobs, reuse_actors=self.reuse_actors,
            trial_name_creator=_TrialNamer(order), trial_dirname_creator=_TrialNamer(order))
        run_config = tune.RunConfig(
            name=s.study_name, storage_path=self.storage_path, verbose=0, stop=_StopOnUserError(),
            failure_config=tune.FailureConfig(max_failures=self.max_failures),
            checkpoint_config=tune.CheckpointConfig(num_to_keep=2), progress_reporter=None,
            log_to_file=False)
        return tune.Tuner(trainable, param_space=param_space, tune_config=tune_config, run_config=run_config)

    def _search_alg(self) -> Any:
        s = self.settings
        if self.sampler_name == "random":
            from ray.tune.search.basic_variant import BasicVariantGenerator

            return BasicVariantGenerator(random_state=s.seed)
        import optuna
        from ray.tune.search.optuna import OptunaSearch

        from ._optuna import OptunaTrial

        optuna.logging.set_verbosity(optuna.logging.ERROR)
        space = None
        if s.hp_space is not None:
            hp_space, multi = s.hp_space, s.multi_objective

            def space(ot_trial: Any) -> None:  # define-by-run: sample on the driver, replay on the worker
                hp_space(OptunaTrial(ot_trial, multi))

        metrics = None if not s.multi_objective else [f"{METRIC}_{i}" for i in range(len(s.directions))]
        modes = None if not s.multi_objective else [_mode(d) for d in s.directions]
        return OptunaSearch(space=space, metric=metrics, mode=modes,
                            sampler=optuna.samplers.TPESampler(seed=s.seed))

    def _scheduler(self, budget: int | None) -> Any:
        from ray.tune.schedulers import (
            ASHAScheduler,
            FIFOScheduler,
            HyperBandScheduler,
            PopulationBasedTraining,
        )

        opts = self.settings.options
        eta = opts.get("reduction_factor", 3)
        if self.scheduler_name == "asha":
            # Rungs at 1, eta, eta^2, ... evaluations; max_t beyond the budget so no trial is cut at its end.
            return ASHAScheduler(time_attr="training_iteration", grace_period=1, reduction_factor=eta,
                                 max_t=(budget or 10_000) + 1)
        if self.scheduler_name == "hyperband":
            return HyperBandScheduler(time_attr="training_iteration", max_t=budget or 81, reduction_factor=eta)
        if self.scheduler_name == "pbt":
            from ..arguments import FIELD_NAMES

            # A checkpoint only loads into the same model: mutate training arguments, keep model params.
            mutations = {n: tune_domain(d) for n, d in (self.settings.space or {}).items() if n in FIELD_NAMES}
            if not mutations:
                raise UserError("--scheduler pbt mutates TrainingArguments fields (learning_rate, weight_decay, ...) "
                                "and the space has none; add one to `space` or use --scheduler asha")
            return PopulationBasedTraining(time_attr="training_iteration",
                                           perturbation_interval=opts.get("perturbation_interval", 1),
                                           hyperparam_mutations=mutations)
        return FIFOScheduler()

    def _evaluation_budget(self, runner: Any) -> int | None:
        """How many evaluations a full trial makes, when the arguments say so without the data."""
        if "max_t" in self.settings.options:
            return int(self.settings.options["max_t"])
        job = getattr(runner, "job", None)
        if job is None:
            return None
        args, space = job.args, self.settings.space or {}
        if args.eval_strategy != "epoch" or args.max_steps > 0 or "max_steps" in space:
            return None
        epochs = space.get("num_train_epochs")
        high = epochs.high if isinstance(epochs, (Float, Int)) else max(epochs.choices) if epochs else args.num_train_epochs
        return max(1, math.ceil(high))

    # --- after Tune -----------------------------------------------------------------------------------

    def _collect_shipped_runs(self, results: Any) -> None:
        """Copy the run folders that trials on nodes without ``--output-dir`` shipped through Ray's
        storage into ``--output-dir`` (unless it holds a newer record of the trial), and promote them."""
        from ray.train._internal.storage import _download_from_fs_path

        out = self.settings.output_dir
        for tune_trial in results._experiment_analysis.trials:
            storage = tune_trial.storage
            if storage is None or not storage.trial_dir_name:  # a trial that never started has no folder
                continue
            fs, remote = storage.storage_filesystem, f"{storage.trial_fs_path.rstrip('/')}/{SHIPPED_RUN_DIR}"
            shipped = _remote_record(fs, remote)
            if shipped is None:
                continue
            target = runs.run_dir_for(out, shipped.id, Path(shipped.run_dir).name)
            here = runs.TrialRecord.load(target / runs.TRIAL_FILE)
            if here is not None and here.id == shipped.id and _freshness(here) >= _freshness(shipped):
                continue
            with runs.atomic_dir(target) as tmp:
                _download_from_fs_path(fs, remote, str(tmp), filelock=False)
            record = runs.TrialRecord.load(target / runs.TRIAL_FILE)
            if record is None:
                continue
            record.run_dir = str(target)
            record.save()
            if record.state == "complete" and record.objective is not None:
                runs.promote_if_best(out, record)

    def _reconcile(self, results: Any, *, interrupted: bool) -> None:
        """Make trial.json agree with Tune where a trial could not say so itself, and surface user errors."""
        states = {t.trial_id: (t.status, t.error_file if hasattr(t, "error_file") else None)
                  for t in results._experiment_analysis.trials}
        records = {r.id: r for r in runs.read_trials(self.settings.output_dir) if r.backend == "ray"}
        for result in results:
            message = (result.metrics or {}).get(USER_ERROR_KEY)
            if message:
                raise UserError(str(message))
        interrupted = interrupted or any(status in ("RUNNING", "PENDING", "PAUSED") for status, _ in states.values())
        for trial_id, (status, _) in states.items():
            record = records.get(trial_id)
            if record is None:
                continue
            if status == "TERMINATED" and record.state in ("running", "stopped"):
                # the scheduler (or Ctrl-C) stopped it before it could record that
                record.finish("stopped" if interrupted else "pruned")
            elif status == "ERROR" and record.state == "running":
                record.finish("failed", error="the trial's Ray worker died; see Ray's logs")
            elif status in ("RUNNING", "PENDING", "PAUSED") and record.state in ("running", "pruned"):
                record.finish("stopped")  # interrupted; --resume continues it
        if interrupted:
            raise KeyboardInterrupt


# --- helpers --------------------------------------------------------------------------------------

class _InterruptWatch(logging.Handler):
    """Notices Tune's graceful stop after Ctrl-C, which Tune reports only as a log warning."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen = False
        self._logger = logging.getLogger("ray.tune.tune")

    def emit(self, record: logging.LogRecord) -> None:
        self.seen = self.seen or "has been interrupted" in record.getMessage()

    def __enter__(self) -> _InterruptWatch:
        self._saved = self._logger.level, self._logger.propagate
        self._logger.setLevel(logging.WARNING)
        self._logger.propagate = False  # watched, not printed: the CLI says it in one line
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._saved[0])
        self._logger.propagate = self._saved[1]


class _TrialNamer:
    """Names trials ``trial-<number>-<id>``: the 0-based number Tune gives them in creation order."""

    def __init__(self, order: str) -> None:
        self.offset = 1 if order == "tpe" else 0  # Tune's searcher counter starts at 1, the variant generator at 0

    def __call__(self, trial: Any) -> str:
        counter = int(str(trial.experiment_tag).split("_", 1)[0])
        return f"trial-{counter - self.offset}-{trial.trial_id}"


def _mode(direction: str) -> str:
    return "max" if direction == "maximize" else "min"


def _join(storage: str, name: str) -> str:
    return f"{storage.rstrip('/')}/{name}"


def _is_local(path: str) -> bool:
    return "://" not in path


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def check_reachable(address: str) -> None:
    """Fail within seconds when nothing listens at ``address`` (Ray itself would retry for minutes)."""
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS") or _current_cluster() or ""
        if not address:
            raise UserError("--address auto: no Ray cluster runs on this machine; start one with "
                            "`ray start --head`, or give --address HOST:PORT")
        if address.startswith("ray://") or ":" not in address:
            return
    target = address.split("://", 1)[-1]
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--address {address!r} is not auto, HOST:PORT or ray://HOST:10001")
    try:
        speaks_grpc = _speaks_grpc(host, int(port))
    except OSError as exc:
        raise UserError(f"--address {address}: no Ray cluster answers there ({exc.strerror or type(exc).__name__}); "
                        "check the address, that the head node runs (`ray status`) and that its port is open") from None
    if not speaks_grpc:  # ray.init would wait on it for minutes
        raise UserError(f"--address {address}: something listens there but it is not a Ray cluster (no gRPC "
                        "answer); give the head node's GCS port (`ray status` on the head prints it, 6379 by "
                        "default) or ray://HOST:10001")


_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + an empty SETTINGS frame


def _speaks_grpc(host: str, port: int) -> bool:
    """Whether ``host:port`` answers like a gRPC server (Ray's GCS and Ray Client are both gRPC):
    an HTTP/2 server's first frame is SETTINGS. Raises OSError when nothing accepts the connection."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return True  # the server waits for a TLS hello, not a preface: an open port is all we check
    with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S) as sock:
        sock.settimeout(CONNECT_TIMEOUT_S)
        header = b""
        try:
            sock.sendall(_H2_PREFACE)
            while len(header) < 9:
                chunk = sock.recv(9 - len(header))
                if not chunk:
                    break
                header += chunk
        except OSError:  # silence until the timeout, or a reset: not gRPC
            return False
    return len(header) == 9 and header[3] == 0x04


def _current_cluster() -> str | None:
    try:
        from ray._private.utils import read_ray_address

        return read_ray_address()
    except Exception:
        return None


def _pickle_space_modules_by_value() -> None:
    """Space files are imported under synthetic module names that workers cannot import: ship them
    (and helper modules imported from their folder) by value."""
    from ray import cloudpickle

    folders = set()
    for name, module in list(sys.modules.items()):
        if name.startswith("hpsweep_space_") and module is not None:
            cloudpickle.register_pickle_by_value(module)
            if getattr(module, "__file__", None):
                folders.add(Path(module.__file__).resolve().parent)
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and "." not in name and not name.startswith("hpsweep") and not file.endswith("__init__.py") \
                and Path(file).resolve().parent in folders:
            cloudpickle.register_pickle_by_value(module)
