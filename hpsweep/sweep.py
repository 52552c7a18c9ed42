"""The search layer: checks a search before anything is written, then hands a `TrialRunner` to
the chosen backend. The runner trains one trial, records it in ``run-<id>/trial.json`` and
promotes it to ``best/`` when it beats the best so far. Backends only decide what to try."""
from __future__ import annotations

import os
import shutil
import socket
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import runs
from .arguments import FIELD_NAMES, TrainingArguments, apply_params
from .backends import SearchSettings, TrialFailed, get_backend
from .callbacks import TrainerCallback, TrialReporter, metric_value
from .errors import TrialPruned, UserError
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
    def on_sweep_end(self, best: Any, records: list[runs.TrialRecord], interrupted: bool) -> None: ...


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

    @property
    def output_dir(self) -> Path:
        return Path(self.args.output_dir)

    @property
    def objective_name(self) -> str:
        return self.objective if isinstance(self.objective, str) else getattr(self.objective, "__name__", "objective")

    def objective_value(self, metrics: Mapping[str, float]) -> float | list[float]:
        if isinstance(self.objective, str):
            return metric_value(metrics, self.objective)
        value = self.objective(metrics)
        if len(self.directions) > 1:
            if not isinstance(value, Sequence) or len(value) != len(self.directions):
                raise UserError(f"objective returned {value!r} for {len(self.directions)} directions; "
                                f"return a sequence of {len(self.directions)} floats")
            return [float(v) for v in value]
        try:
            return float(value)
        except (TypeError, ValueError):
            raise UserError(f"objective returned {value!r}; return one float (or a list for several directions)") from None


class TrialRunner:
    """Trains one trial from a `SweepJob`. This is the function every backend calls."""

    def __init__(self, job: SweepJob, backend: str) -> None:
        self.job = job
        self.backend = backend

    def __call__(self, trial: Trial) -> float | list[float]:
        from .trainer import Trainer

        job = self.job
        if job.hp_space is not None:
            trial.params.update(_call_hp_space(job.hp_space, trial))
        run_dir = runs.run_dir_for(job.output_dir, trial.id, job.hp_name(trial) if job.hp_name else None)
        fresh = not run_dir.exists()
        record = runs.TrialRecord(id=trial.id, number=trial.number, backend=self.backend, params=dict(trial.params),
                                  objective_name=job.objective_name, directions=list(job.directions),
                                  run_dir=str(run_dir),
                                  user_attrs={**trial.user_attrs, "pid": os.getpid(), "host": socket.gethostname()})
        try:
            args = _trial_args(job, trial.params, run_dir)
            record.save()
            reporter = TrialReporter(trial, job.objective_value)
            extra = [cb for sc in job.sweep_callbacks for cb in sc.trial_callbacks(trial, record)]
            trainer = Trainer(model_init=job.model_init, args=args, train_dataset=job.train_dataset,
                              eval_dataset=job.eval_dataset, data_collator=job.data_collator,
                              compute_metrics=job.compute_metrics, callbacks=[*job.callbacks, *extra, reporter])
            trainer.train(resume_from_checkpoint=trial.user_attrs.get("resume_from"), trial=trial)
            record.params = dict(trial.params)  # define-by-run model_init(trial) may have added some
            if reporter.pruned:
                record.history = _eval_history(trainer)
                record.finish("pruned")
                raise TrialPruned(f"trial {trial.number} pruned at evaluation {trainer.state.num_evaluations}")
            metrics = record.metrics = _final_metrics(trainer)  # may evaluate once more
            record.history = _eval_history(trainer)
            record.checkpoint = _final_checkpoint(trainer).name
            record.finish("complete", objective=job.objective_value(metrics))
        except (TrialPruned, TrialFailed):
            raise
        except UserError:
            if fresh:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        except Exception as exc:
            record.finish("failed", error=f"{type(exc).__name__}: {exc}")
            (run_dir / "error.log").write_text(traceback.format_exc())
            raise TrialFailed(f"trial {trial.number} failed: {type(exc).__name__}: {exc}") from exc
        except BaseException:  # Ctrl-C, or a scheduler stopping the worker
            record.finish("stopped")
            raise
        finally:
            if record.state != "running":  # a user error before the trial ran ends the sweep instead
                for sc in job.sweep_callbacks:
                    sc.on_trial_end(record)
        runs.promote_if_best(job.output_dir, record)
        return record.objective  # type: ignore[return-value]


def _trial_args(job: SweepJob, params: Mapping[str, Any], run_dir: Path) -> TrainingArguments:
    args = apply_params(job.args, params, model_takes_trial=job.model_takes_trial)
    changes: dict[str, Any] = {"output_dir": str(run_dir), "disable_progress": True}
    if args.metric_for_best_model is None and isinstance(job.objective, str) and len(job.directions) == 1:
        changes.update(metric_for_best_model=job.objective, greater_is_better=job.directions[0] == "maximize")
    return args.replace(**changes)


def _eval_history(trainer: Any) -> list[dict[str, Any]]:
    return [h for h in trainer.state.log_history if "eval_loss" in h]


def _final_metrics(trainer: Any) -> dict[str, float]:
    """The metrics of the model as training left it; evaluates once more if the last step was not."""
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    best_loaded = trainer.args.load_best_model_at_end and trainer.state.best_model_checkpoint
    if not best_loaded and (not evals or evals[-1]["step"] != trainer.state.global_step):
        trainer.evaluate()
    return trainer.last_eval_metrics()


def _final_checkpoint(trainer: Any) -> Path:
    """The checkpoint that holds the trial's result (saving one if training ended unsaved)."""
    state = trainer.state
    if trainer.args.load_best_model_at_end and state.best_model_checkpoint:
        return Path(state.best_model_checkpoint)
    latest = runs.latest_checkpoint(Path(trainer.args.output_dir))
    if latest is not None and latest.name == f"{runs.CHECKPOINT_PREFIX}{state.global_step}":
        return latest
    return trainer.save_checkpoint()


def _call_hp_space(hp_space: Callable[[Trial], Any], trial: Trial) -> dict[str, Any]:
    """The user's define-by-run space; it fails the same way for every trial, so it is a user error."""
    try:
        params = hp_space(trial)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"hp_space(trial) raised {type(exc).__name__}: {exc}; fix hp_space in the space file") from None
    if not isinstance(params, Mapping):
        raise UserError(f"hp_space(trial) returned {type(params).__name__}; return a dict of name -> value")
    return dict(params)


# --- validation before anything is written ------------------------------------------------------------

def normalise_directions(direction: str | Sequence[str]) -> list[str]:
    directions = [direction] if isinstance(direction, str) else list(direction)
    for d in directions:
        if d not in ("minimize", "maximize"):
            raise UserError(f"direction {d!r} is not 'minimize' or 'maximize'")
    if not directions:
        raise UserError("direction: give 'minimize', 'maximize' or a list of them")
    return directions


def check_space_against_args(space: Mapping[str, Any], args: TrainingArguments, model_takes_trial: bool) -> None:
    """Every name is placed and every bound is a valid value for its field, before trial 0."""
    apply_params(args, {name: None for name in space if name not in FIELD_NAMES}, model_takes_trial=model_takes_trial,
                 source="space")
    for name, dist in space.items():
        if name not in FIELD_NAMES:
            continue
        values = dist.choices if isinstance(dist, Categorical) else (dist.low, dist.high)
        for value in values:
            try:
                apply_params(args, {name: value}, source="space")
            except UserError as exc:
                raise UserError(f"space[{name!r}] = {dist!r} allows {name}={value!r}, which is invalid: {exc}") from None


def search(trainer: Any, *, space: Mapping[str, Any] | None, hp_space: Callable | None, n_trials: int | None,
           direction: str | Sequence[str], objective: Objective | None, backend: str,
           hp_name: Callable | None = None, timeout: float | None = None, n_jobs: int = 1,
           study_name: str = "hpsweep", storage: str | None = None, resume: bool = False,
           sampler: str | None = None, pruner: str | None = None, scheduler: str | None = None,
           seed: int | None = None, address: str | None = None,
           resources_per_trial: Mapping[str, float] | None = None,
           sweep_callbacks: Sequence[SweepCallback] = (), show_progress: bool = True,
           **options: Any) -> Any:
    """Validate, run the backend, and return the best run(s); see `Trainer.hyperparameter_search`."""
    from .objective import resolve_objective
    from .trainer import model_init_arity

    directions = normalise_directions(direction)
    if (space is None) == (hp_space is None):
        raise UserError("give exactly one of space={...} or hp_space=function")
    takes_trial = model_init_arity(trainer.model_init) == 1
    if space is not None:
        space = validate_space(space)
        check_space_against_args(space, trainer.args, takes_trial)
    objective = resolve_objective(objective, directions, trainer.compute_metrics)  # HF's default; says which
    if len(directions) > 1 and isinstance(objective, str):
        raise UserError(f"{len(directions)} directions need an objective function returning {len(directions)} values")
    if isinstance(objective, str) and not objective.startswith("eval_"):
        raise UserError(f"objective {objective!r}: evaluation metrics are named eval_*; did you mean 'eval_{objective}'?")
    if trainer.eval_dataset is None:
        raise UserError("a search evaluates every trial: give an eval_dataset")

    # Absolute, so trials that run in another working directory (Ray workers) write here too.
    output_dir = Path(trainer.args.output_dir).resolve()
    args = trainer.args.replace(output_dir=str(output_dir))
    settings = SearchSettings(output_dir=output_dir, space=dict(space) if space else None, hp_space=hp_space,
                              directions=directions,
                              objective_name=objective if isinstance(objective, str) else "objective",
                              n_trials=n_trials, timeout=timeout, n_jobs=n_jobs, study_name=study_name,
                              storage=storage, resume=resume, sampler=sampler, pruner=pruner, scheduler=scheduler,
                              seed=seed, address=address,
                              resources_per_trial=dict(resources_per_trial or {"cpu": 1.0, "gpu": 0.0}),
                              options=options, backend=backend)
    chosen = get_backend(backend, settings)
    job = SweepJob(model_init=trainer.model_init, args=args, train_dataset=trainer.train_dataset,
                   eval_dataset=trainer.eval_dataset, objective=objective, directions=directions,
                   data_collator=trainer.data_collator, compute_metrics=trainer.compute_metrics,
                   callbacks=list(trainer.user_callbacks), hp_space=hp_space, hp_name=hp_name,
                   sweep_callbacks=list(sweep_callbacks), model_takes_trial=takes_trial)

    existed = output_dir.exists() and any(output_dir.iterdir())
    output_dir.mkdir(parents=True, exist_ok=True)
    runs.recover_interrupted_swaps(output_dir)
    progress = None
    if show_progress:
        from .progress import SweepProgress

        progress = SweepProgress(output_dir, n_trials=n_trials, timeout=timeout, directions=directions,
                                 objective_name=job.objective_name)
    finished = False
    try:
        for sc in job.sweep_callbacks:
            sc.on_sweep_begin(settings)
        if progress:
            progress.start()
        chosen.run(TrialRunner(job, backend))
        finished = True
    except UserError:
        if not existed:
            shutil.rmtree(output_dir, ignore_errors=True)
        raise
    finally:
        if progress:
            progress.stop()
        if output_dir.exists():
            records = runs.read_trials(output_dir)
            best = runs.read_best(output_dir)
            for sc in job.sweep_callbacks:  # interrupted: Ctrl-C or an error; pushers skip, trackers close
                sc.on_sweep_end(best, records, interrupted=not finished)
    if best is None:
        states = sorted({r.state for r in records})
        raise UserError(f"no trial completed ({len(records)} trials: {', '.join(states) or 'none ran'}); "
                        f"see the trial.json and error.log files in {output_dir}")
    return best
