"""The search layer: checks a search before anything is written, then hands a `TrialRunner`
(`hpsweep.runner`, which trains and records one trial) to the chosen backend. Backends only
decide what to try."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import devices, runs
from .arguments import TrainingArguments, apply_params, field_types
from .backends import SearchSettings, get_backend, transformers_keywords
from .callbacks import TrainerCallback, metric_value
from .errors import UserError
from .objective import function_name
from .runner import TrialRunner
from .space import Categorical, validate_space
from .trial import Trial

Objective = str | Callable[[Mapping[str, float]], Any]


class SweepCallback:
    """Hooks around a whole sweep (tracking, pushing). Instances travel to the processes and
    nodes that run trials, so keep their state picklable; `on_sweep_begin` runs before that.

    `trial_callbacks` adds `TrainerCallback`s to one trial's training run.
    """

    def on_sweep_begin(self, settings: SearchSettings) -> None: ...
    def trial_callbacks(self, trial: Trial, record: runs.TrialRecord) -> list[TrainerCallback]:
        return []

    def on_trial_end(self, record: runs.TrialRecord) -> None: ...
    def on_sweep_end(
        self, best: Any, records: list[runs.TrialRecord], interrupted: bool
    ) -> None: ...


@dataclass
class SweepJob:
    """What every trial needs, independent of the backend; picklable for remote workers."""

    model_init: Callable[..., Any]
    args: TrainingArguments
    train_dataset: Any
    eval_dataset: Any
    objective: Objective = "eval_loss"
    directions: list[str] = field(default_factory=lambda: ["minimize"])
    data_collator: Callable | None = None
    compute_metrics: Callable | None = None
    callbacks: list[TrainerCallback] = field(default_factory=list)
    hp_space: Callable[[Trial], dict[str, Any]] | None = None
    hp_name: Callable[[Trial], str] | None = None
    sweep_callbacks: list[SweepCallback] = field(default_factory=list)
    model_takes_trial: bool = True
    #: The class that trains each trial (the user's `Trainer` subclass, if any) and the extra
    #: keyword arguments it was given.
    trainer_cls: Any = None
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    #: Data-parallel processes per trial (``--processes-per-trial``; see `hpsweep.distributed`).
    processes_per_trial: int = 1

    @property
    def output_dir(self) -> Path:
        return Path(self.args.output_dir)

    @property
    def objective_name(self) -> str:
        return self.objective if isinstance(self.objective, str) else function_name(self.objective)

    def objective_value(self, metrics: Mapping[str, float]) -> float | list[float]:
        if isinstance(self.objective, str):
            return metric_value(metrics, self.objective)
        value = self.objective(metrics)
        if len(self.directions) > 1:
            if not isinstance(value, Sequence) or len(value) != len(self.directions):
                raise UserError(
                    f"objective returned {value!r} for {len(self.directions)} directions; "
                    f"return a sequence of {len(self.directions)} floats"
                )
            return [float(v) for v in value]
        try:
            return float(value)
        except (TypeError, ValueError):
            raise UserError(
                f"objective returned {value!r}; return one float (or a list for several directions)"
            ) from None


# --- validation before anything is written ------------------------------------------------------------


def normalise_directions(direction: str | Sequence[str]) -> list[str]:
    directions = [direction] if isinstance(direction, str) else list(direction)
    for d in directions:
        if d not in ("minimize", "maximize"):
            raise UserError(f"direction {d!r} is not 'minimize' or 'maximize'")
    if not directions:
        raise UserError("direction: give 'minimize', 'maximize' or a list of them")
    return directions


def check_space_against_args(
    space: Mapping[str, Any], args: TrainingArguments, model_takes_trial: bool
) -> None:
    """Every name is placed and every bound is a valid value for its field, before trial 0."""
    fields = field_types(type(args))  # a subclass's extra fields are fields too
    apply_params(
        args,
        {name: None for name in space if name not in fields},
        model_takes_trial=model_takes_trial,
        source="space",
    )
    for name, dist in space.items():
        if name not in fields:
            continue
        values = dist.choices if isinstance(dist, Categorical) else (dist.low, dist.high)
        for value in values:
            try:
                apply_params(args, {name: value}, source="space")
            except UserError as exc:
                raise UserError(
                    f"space[{name!r}] = {dist!r} allows {name}={value!r}, which is invalid: {exc}"
                ) from None


def search(
    trainer: Any,
    *,
    space: Mapping[str, Any] | None,
    hp_space: Callable | None,
    n_trials: int | None,
    direction: str | Sequence[str],
    objective: Objective | None,
    backend: str,
    hp_name: Callable | None = None,
    timeout: float | None = None,
    n_jobs: int = 1,
    study_name: str = "hpsweep",
    storage: str | None = None,
    resume: bool = False,
    sampler: str | None = None,
    pruner: str | None = None,
    scheduler: str | None = None,
    seed: int | None = None,
    address: str | None = None,
    resources_per_trial: Mapping[str, float] | None = None,
    max_failed_trials: int = 5,
    processes_per_trial: int = 1,
    sweep_callbacks: Sequence[SweepCallback] = (),
    show_progress: bool = True,
    **options: Any,
) -> Any:
    """Validate, run the backend, and return the best run(s); see `Trainer.hyperparameter_search`.

    ``resume`` is accepted for compatibility: the same command always continues its sweep.
    """
    from .loop import TrialLoop
    from .modelinit import model_init_arity
    from .objective import resolve_objective

    # what transformers hands the backend's library (tune.run's keywords, W&B's project)
    if options:
        options, theirs, note = transformers_keywords(backend, options)
        sampler, storage, timeout = (
            mine if mine is not None else theirs.get(name)
            for name, mine in (("sampler", sampler), ("storage", storage), ("timeout", timeout))
        )
        n_jobs = theirs.get("n_jobs", n_jobs) if n_jobs == 1 else n_jobs
        max_failed_trials = theirs.get("max_failed_trials", max_failed_trials)
        study_name = theirs.get("study_name", study_name) if study_name == "hpsweep" else study_name
        if note:
            print(f"hpsweep: {note}", file=sys.stderr)
    directions = normalise_directions(direction)
    check_counts(
        n_trials=n_trials,
        timeout=timeout,
        n_jobs=n_jobs,
        max_failed_trials=max_failed_trials,
        processes_per_trial=processes_per_trial,
    )
    if processes_per_trial > 1 and trainer.args.auto_find_batch_size:
        raise UserError(
            "auto_find_batch_size with --processes-per-trial: a process that runs out of memory cannot "
            "restart the others; set per_device_train_batch_size to a size that fits instead"
        )
    if processes_per_trial > 1 and trainer.args.train_sampling_strategy == "group_by_length":
        raise UserError(
            "train_sampling_strategy='group_by_length' with --processes-per-trial: the processes' "
            "shares of a grouped order are not drawn per epoch yet; use 'random' or one process per trial"
        )
    if scheduler == "pbt" and trainer.args.save_only_model:
        raise UserError(
            "--scheduler pbt goes on from other trials' checkpoints, and save_only_model=True writes the "
            "model alone, nothing to train on from; set save_only_model=False"
        )
    # Devices are checked before anything is written: a request this machine cannot meet is one line.
    placement = devices.plan(
        n_jobs=n_jobs,
        resources=resources_per_trial,
        processes_per_trial=processes_per_trial,
        gpus=devices.visible_gpus(),
        cores=devices.usable_cores(),
        local=address is None,
    )
    devices.check_fork_safe(placement)
    if (space is None) == (hp_space is None):
        raise UserError("give exactly one of space={...} or hp_space=function")
    takes_trial = model_init_arity(trainer.model_init) == 1
    if space is not None:
        space = validate_space(space)
        check_space_against_args(space, trainer.args, takes_trial)
    # HF's default; says which
    objective = resolve_objective(objective, directions, trainer.compute_metrics)
    if len(directions) > 1 and isinstance(objective, str):
        raise UserError(
            f"{len(directions)} directions need an objective function returning {len(directions)} values"
        )
    if isinstance(objective, str) and not objective.startswith("eval_"):
        raise UserError(
            f"objective {objective!r}: evaluation metrics are named eval_*; did you mean 'eval_{objective}'?"
        )
    if trainer.eval_dataset is None:
        raise UserError("a search evaluates every trial: give an eval_dataset")

    # Absolute, so trials that run in another working directory (Ray workers) write here too.
    output_dir = check_output_dir(Path(trainer.args.output_dir))
    check_one_study(output_dir, study_name)
    args = trainer.args.replace(output_dir=str(output_dir))
    given = {
        name
        for name, value in (
            ("storage", storage),
            ("address", address),
            ("resources_per_trial", resources_per_trial),
        )
        if value is not None
    }
    settings = SearchSettings(
        output_dir=output_dir,
        space=dict(space) if space else None,
        hp_space=hp_space,
        directions=directions,
        objective_name=objective if isinstance(objective, str) else "objective",
        n_trials=n_trials,
        timeout=timeout,
        n_jobs=n_jobs,
        study_name=study_name,
        storage=storage,
        resume=resume,
        sampler=sampler,
        pruner=pruner,
        scheduler=scheduler,
        seed=seed,
        address=address,
        resources_per_trial=placement.resources,
        options=options,
        backend=backend,
        max_failed_trials=max_failed_trials,
        processes_per_trial=processes_per_trial,
        given=frozenset(given),
    )
    chosen = get_backend(backend, settings)
    # the backend read a native hp_space (a W&B sweep config)
    if space is None and settings.space is not None:
        space, hp_space = validate_space(settings.space), settings.hp_space
        check_space_against_args(space, trainer.args, takes_trial)
    job = SweepJob(
        model_init=trainer.model_init,
        args=args,
        train_dataset=trainer.train_dataset,
        eval_dataset=trainer.eval_dataset,
        objective=objective,
        directions=directions,
        data_collator=trainer.data_collator,
        compute_metrics=trainer.compute_metrics,
        callbacks=list(trainer.user_callbacks),
        hp_space=hp_space,
        hp_name=hp_name,
        sweep_callbacks=[*sweep_callbacks, *tracker_for(trainer.args, sweep_callbacks)],
        model_takes_trial=takes_trial,
        trainer_cls=type(trainer),
        trainer_kwargs=trial_trainer_kwargs(trainer),
        processes_per_trial=processes_per_trial,
    )
    if placement.note:
        print(f"hpsweep: {placement.note}", file=sys.stderr)

    existed = output_dir.exists() and any(output_dir.iterdir())
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(
            f"--output-dir {output_dir}: cannot create it ({exc.strerror}); give a writable folder"
        ) from None
    runs.recover_interrupted_swaps(output_dir)
    runs.write_text(output_dir / STUDY_FILE, study_name + "\n")  # checked by check_one_study
    progress = None
    if show_progress:
        from .progress import SweepProgress

        progress = SweepProgress(
            output_dir,
            n_trials=n_trials,
            timeout=timeout,
            directions=directions,
            objective_name=job.objective_name,
        )
    finished = False
    records: list[runs.TrialRecord] = []
    best = None
    try:
        for sc in job.sweep_callbacks:
            sc.on_sweep_begin(settings)
        if progress:
            progress.start()
        chosen.run(TrialLoop(TrialRunner(job, backend), settings))
        finished = True
    except UserError:
        # refused before any trial: leave nothing behind
        if not existed and not runs.read_trials(output_dir):
            shutil.rmtree(output_dir, ignore_errors=True)
        raise
    finally:
        if progress:
            progress.stop()
        if output_dir.exists():
            records = runs.read_trials(output_dir)
            best = runs.read_best(output_dir)
            # interrupted: Ctrl-C or an error; pushers skip, trackers close
            for sc in job.sweep_callbacks:
                sc.on_sweep_end(best, records, interrupted=not finished)
    if best is None:
        states = sorted({r.state for r in records})
        raise UserError(
            f"no trial completed ({len(records)} trials: {', '.join(states) or 'none ran'}); "
            f"see the trial.json and error.log files in {output_dir}"
        )
    if isinstance(best, runs.BestRun):
        trainer._hold_best_model(best)  # evaluate / predict / save_model use the best trial's model
    return best


def tracker_for(args: Any, callbacks: Sequence[SweepCallback]) -> list[SweepCallback]:
    """transformers' ``report_to="mlflow"`` (or ``"all"``: every installed integration, and MLflow
    is one of hpsweep's): the sweep tracked as its MLflowCallback would, through
    ``MLFLOW_TRACKING_URI`` and ``MLFLOW_EXPERIMENT_NAME``, unless it has an `MLflowTracker` already."""
    named = [args.report_to] if isinstance(args.report_to, str) else list(args.report_to or [])
    if not {"mlflow", "all"} & set(named):
        return []
    from .integrations.mlflow import MLflowTracker

    return [] if any(isinstance(c, MLflowTracker) for c in callbacks) else [MLflowTracker()]


def trial_trainer_kwargs(trainer: Any) -> dict[str, Any]:
    """The keyword arguments, beyond the ones every trial sets, that rebuild ``trainer`` for a trial."""
    return dict(getattr(trainer, "trial_kwargs", {}) or {})


def check_counts(**counts: Any) -> None:
    """Counts and limits a user gives: positive, finite numbers (``--timeout nan`` is refused)."""
    import math

    for name, value in counts.items():
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        least = 0 if name == "timeout" else 1
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or (value <= 0 if name == "timeout" else value < least)
        ):
            what = (
                "a positive number of seconds"
                if name == "timeout"
                else f"a whole number of at least {least}"
            )
            raise UserError(f"{flag} {value}: give {what}")


#: In ``--output-dir``: the name of the study whose sweep the folder holds.
STUDY_FILE = ".study"


def check_one_study(output_dir: Path, study_name: str) -> None:
    """One output folder holds one sweep: another study's trials would take the same run folders
    (Optuna numbers every study's trials from 0) and be counted as this one's."""
    try:
        recorded = (output_dir / STUDY_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return
    if recorded and recorded != study_name and runs.read_trials(output_dir):
        raise UserError(
            f"--output-dir {output_dir} holds the sweep of study {recorded!r}, not {study_name!r}; "
            f"give --study-name {recorded} to continue it, or another --output-dir"
        )


def check_output_dir(path: Path) -> Path:
    """``--output-dir`` as an absolute folder this process can write in, or one `UserError` line."""
    path = path.resolve()
    for parent in [path, *path.parents]:
        if parent.exists():
            if not parent.is_dir():
                where = "is a file" if parent == path else f"is under the file {parent}"
                raise UserError(f"--output-dir {path} {where}; give a folder")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise UserError(
                    f"--output-dir {path}: {parent} is not writable; give a folder you can write in"
                )
            break
    return path
