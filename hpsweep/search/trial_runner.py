"""`TrialRunner`: trains one trial of a `SweepJob` (what the search loop, a ``--n-jobs`` worker
or a Ray worker calls per trial), records it in ``run-<id>/trial.json`` and promotes it to
``best/`` when it beats the best so far. What stops a trial (a prune, a failure, Ctrl-C, a full
disk, a mistake every trial would make) is recorded here, in one place for every backend."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import socket
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpsweep import devices, faults, runs
from hpsweep.devices import memory
from hpsweep.errors import DiskFull, TakenOver, TrialFailed, TrialPruned, UserError
from hpsweep.search.trial_reporter import TrialReporter
from hpsweep.train.arguments import TrainingArguments, apply_params
from hpsweep.train.callbacks import TrainerCallback
from hpsweep.trial import Trial

if TYPE_CHECKING:
    from hpsweep.search.job import SweepJob


@dataclass
class TrainOutcome:
    """What training one trial produced, for its record (picklable: a data-parallel trial's first
    process sends it to the process that talks to the backend)."""

    pruned: bool
    history: list[dict[str, Any]]
    num_evaluations: int
    metrics: dict[str, float] = field(default_factory=dict)
    checkpoint: str | None = None


class TrialRunner:
    """Trains one trial from a `SweepJob`: what the search loop (or a Ray worker) calls per trial.

    A trial the ledger hands out again (``trial.user_attrs["again"]``, its old record) keeps its
    folder and resumes from its latest checkpoint, recorded as ``resumed_from``. A trial's model,
    optimizer and loaders are released when it ends (`hpsweep.devices.memory`), so the next trial in the
    same process starts with the memory the first had; with ``processes_per_trial`` > 1 it trains
    in that many data-parallel processes (`hpsweep.devices.data_parallel`) and this process keeps the record.
    """

    def __init__(self, job: SweepJob, backend: str) -> None:
        self.job = job
        self.backend = backend

    def __call__(self, trial: Trial) -> float | list[float]:
        job = self.job
        again = _pulled(job, trial.user_attrs.pop("again", None))
        latest = runs.latest_checkpoint(Path(again.run_dir)) if again is not None else None
        devices.threads_for_trial(_started_with(again, latest))  # before anything that computes
        if job.hp_space is not None:
            trial.params.update(_call_hp_space(job.hp_space, trial))
        # Before naming the folder: model_init(trial) may suggest the params hp_name reads.
        built = self._build(trial)
        run_dir, resume_from = self._place(trial, built, again, latest)
        fresh = not run_dir.exists()
        record = self._new_record(trial, run_dir, resume_from, again)
        try:
            self._train_and_record(trial, built, record, run_dir, resume_from)
        except (TrialPruned, TrialFailed, TakenOver):
            raise  # TakenOver: another machine runs the trial, and records it
        except (UserError, ImportError) as exc:
            # no params can fix these: the sweep stops, nothing is recorded
            if fresh:
                shutil.rmtree(run_dir, ignore_errors=True)
            if isinstance(exc, ImportError):
                raise _missing_package(trial, exc) from None
            raise
        except Exception as exc:
            # a full disk fails every trial alike: stop, and leave the trial to resume
            if disk_full(exc):
                _finish_quietly(record, "stopped", "the disk was full")
                raise DiskFull(
                    f"no space left on the disk of {job.output_dir} while trial {trial.number} "
                    "ran; free some space and run the same command again"
                ) from None
            self._fail(record, run_dir, trial, exc)
        except BaseException:  # Ctrl-C, SIGTERM, or a scheduler stopping the worker
            _finish_quietly(record, "stopped", None)
            raise
        finally:
            # a user error before the trial ran ends the sweep instead
            if record.state != "running":
                _upload_record(job, run_dir)
                for sc in job.sweep_callbacks:
                    sc.on_trial_end(record)
        job.runs_home.promote_best(record)
        faults.reached("ended")
        return record.objective  # type: ignore[return-value]

    def _build(self, trial: Trial) -> _Prebuilt | BaseException:
        """The trial's model, or the exception ``model_init`` raised (the trial then fails, and is
        recorded in its default folder); a missing package or a user error stops the sweep."""
        try:
            return _Prebuilt.build(self.job.model_init, trial, self.job.args.seed)
        except ImportError as exc:
            raise _missing_package(trial, exc) from None
        except UserError:
            raise
        except Exception as exc:
            return exc

    def _place(
        self,
        trial: Trial,
        built: _Prebuilt | BaseException,
        again: runs.TrialRecord | None,
        latest: Path | None,
    ) -> tuple[Path, str | None]:
        """The trial's folder and the checkpoint it resumes from: a trial that runs again keeps
        its folder; a new one is named by ``hp_name`` (once its model is built) or its id."""
        job = self.job
        if again is not None:
            run_dir = Path(again.run_dir)
            return run_dir, _resume_point(run_dir, str(latest) if latest is not None else None)
        name = (
            _call_hp_name(job.hp_name, trial)
            if job.hp_name and isinstance(built, _Prebuilt)
            else None
        )
        run_dir = runs.run_dir_for(job.output_dir, trial.id, name)
        # a backend's own resume point (Ray's)
        return run_dir, _resume_point(run_dir, trial.user_attrs.get("resume_from"))

    def _new_record(
        self,
        trial: Trial,
        run_dir: Path,
        resume_from: str | None,
        again: runs.TrialRecord | None,
    ) -> runs.TrialRecord:
        job = self.job
        return runs.TrialRecord(
            id=trial.id,
            number=trial.number,
            backend=self.backend,
            params=dict(trial.params),
            objective_name=job.objective_name,
            directions=list(job.directions),
            run_dir=str(run_dir),
            resumed_from=resume_from,
            attempts=again.attempts + 1 if again is not None else 1,
            user_attrs={
                **_plain_attrs(trial.user_attrs),
                "pid": os.getpid(),
                "host": socket.gethostname(),
                **devices.trial_devices(job.processes_per_trial),
            },
        )

    def _train_and_record(
        self,
        trial: Trial,
        built: _Prebuilt | BaseException,
        record: runs.TrialRecord,
        run_dir: Path,
        resume_from: str | None,
    ) -> None:
        """Record the trial as running, train it (here, or over its data-parallel processes) and
        record how it ended; a pruned trial raises `TrialPruned` once recorded."""
        job = self.job
        args = _trial_args(job, trial.params, run_dir)
        faults.reached("claimed")
        record.save()
        if job.home is not None:
            job.home.upload_record(run_dir)
        faults.reached("recorded")
        if not isinstance(built, _Prebuilt):
            raise built
        extra = [cb for sc in job.sweep_callbacks for cb in sc.trial_callbacks(trial, record)]
        if job.home is not None:
            extra.append(UploadCheckpoints(job.home))
        if job.processes_per_trial > 1:
            from hpsweep.devices.data_parallel import train_data_parallel

            load_datasets(job)  # once, here: the ranks inherit what the factories loaded
            outcome = train_data_parallel(self, trial, built, args, extra, resume_from)
        else:
            outcome = self.train_here(trial, built, args, extra, resume_from)
        faults.reached("checkpointed")
        # define-by-run model_init(trial) may have added some
        record.params = dict(trial.params)
        record.history = outcome.history
        if outcome.pruned:
            record.finish("pruned")
            raise TrialPruned(
                f"trial {trial.number} pruned at evaluation {outcome.num_evaluations}"
            )
        record.metrics, record.checkpoint = outcome.metrics, outcome.checkpoint
        record.finish("complete", objective=job.objective_value(outcome.metrics))

    def train_here(
        self,
        trial: Trial,
        built: Any,
        args: TrainingArguments,
        callbacks: list[TrainerCallback],
        resume_from: str | None,
    ) -> TrainOutcome:
        """Train ``trial`` in this process (the whole trial, or one data-parallel rank of it) and
        release its memory, whatever happens."""
        job = self.job
        reporter = TrialReporter(trial, job.objective_value)
        trainer = job.trainer_cls(
            model_init=built,
            args=args,
            train_dataset=job.train_dataset,
            eval_dataset=job.eval_dataset,
            data_collator=job.data_collator,
            compute_metrics=job.compute_metrics,
            callbacks=[*job.callbacks, *callbacks, reporter],
            **job.trainer_kwargs,
        )
        try:
            trainer.train(resume_from_checkpoint=resume_from, trial=trial)
            if reporter.pruned:
                return TrainOutcome(True, _eval_history(trainer), trainer.state.num_evaluations)
            metrics = _final_metrics(trainer)  # may evaluate once more
            return TrainOutcome(
                False,
                _eval_history(trainer),
                trainer.state.num_evaluations,
                metrics,
                _final_checkpoint(trainer).name,
            )
        finally:
            if isinstance(built, _Prebuilt):
                built.model = None  # handed over: the trainer's reference is the last one
            memory.release(trainer)

    @staticmethod
    def _fail(record: runs.TrialRecord, run_dir: Path, trial: Trial, exc: BaseException) -> None:
        line = error_line(exc)
        record.finish("failed", error=line)
        # A data-parallel rank's error carries that process's traceback; ours would only show the relay.
        (run_dir / "error.log").write_text(
            getattr(exc, "rank_traceback", None) or traceback.format_exc()
        )
        # The failed frames hold the trial's tensors (an OOM's activations): free them before the next trial.
        traceback.clear_frames(exc.__traceback__)
        memory.collect()
        raise TrialFailed(f"trial {trial.number} failed: {line}") from exc


class UploadCheckpoints(TrainerCallback):
    """Sends each checkpoint to the object-store home once it is whole on disk (`on_save` reads
    the folder, so the trainer writes it before calling it); data-parallel trials run it on their
    first process only, which writes the checkpoints."""

    reads_checkpoints = True

    def __init__(self, home: runs.Home) -> None:
        self.home = home

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        checkpoint = Path(kwargs["checkpoint"])
        self.home.upload_checkpoint(checkpoint.parent, checkpoint)


def _pulled(job: SweepJob, again: runs.TrialRecord | None) -> runs.TrialRecord | None:
    """A trial to run again, with its run folder on this machine: with an object-store home, the
    folder another machine started (its records and complete checkpoints) is pulled first into
    the staging folder (a Ray node's own folder gets it back from Ray's storage instead)."""
    if again is None or job.home is None or job.output_dir != job.home.local:
        return again
    folder = job.home.pull_run(Path(again.run_dir).name)
    return dataclasses.replace(again, run_dir=str(folder))


def _upload_record(job: SweepJob, run_dir: Path) -> None:
    """How the trial ended, sent to the object-store home; a failure to send is one line, not the
    trial's end (the trial is recorded here, and the ledger has it)."""
    if job.home is None or not run_dir.is_dir():
        return
    try:
        job.home.upload_record(run_dir)
    except Exception as exc:
        print(
            f"hpsweep: warning: could not send {run_dir.name}/trial.json to {job.home.url} "
            f"({type(exc).__name__}); `hpsweep show` at the home misses it",
            file=sys.stderr,
        )


def load_datasets(job: SweepJob) -> None:
    """Run the job's dataset factories (each of several evaluation sets' too) in this process."""
    from hpsweep.train.data import is_several_datasets, resolve_dataset

    for dataset in (job.train_dataset, job.eval_dataset):
        loaded = resolve_dataset(dataset)
        for part in loaded.values() if is_several_datasets(loaded) else ():
            resolve_dataset(part)


def error_line(exc: BaseException) -> str:
    """How a failed trial's error reads in its trial.json (one line for a CUDA out-of-memory error)."""
    # a rank's error that travelled as text
    name = getattr(exc, "type_name", None) or type(exc).__name__
    line = memory.oom_line(exc) if memory.is_cuda_oom(exc) else f"{name}: {exc}"
    rank = getattr(exc, "rank", None)
    return line if rank is None else f"{line} (in data-parallel process {rank})"


def _missing_package(trial: Trial, exc: ImportError) -> UserError:
    return UserError(
        f"trial {trial.number}: {type(exc).__name__}: {exc}; install what is missing and run the "
        "same command again"
    )


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the disk is full: an OSError, or SQLite's own words."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "database or disk is full" in str(exc) or "No space left on device" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


def _finish_quietly(record: runs.TrialRecord, state: str, error: str | None) -> None:
    """Record how a trial ended, if the disk lets us; if not, the ledger's next reap does it."""
    try:
        record.finish(state, error=error)
    except OSError:
        record.state = state


class _Prebuilt:
    """``model_init`` for a trial whose model was built already: hands it over once, with the
    random state that building it left, so training is the same as if the trainer built it. A
    second call (``auto_find_batch_size`` training again with a smaller batch after running out of
    memory) builds a fresh model the same way, not the one the failed attempt trained."""

    def __init__(self, model: Any, rng: Any, rebuild: Callable[[], _Prebuilt]) -> None:
        self.model, self.rng, self.rebuild = model, rng, rebuild

    @classmethod
    def build(cls, model_init: Callable[..., Any], trial: Trial, seed: int) -> _Prebuilt:
        from hpsweep.train.model_init import call_model_init, set_seed

        set_seed(seed)
        model = call_model_init(model_init, trial)
        return cls(model, runs.rng_state(), lambda: cls.build(model_init, trial, seed))

    def __call__(self, trial: Any = None) -> Any:
        model, self.model = self.model, None
        if model is None:
            return self.rebuild()()
        runs.set_rng_state(self.rng)
        return model


def _call_hp_name(hp_name: Callable[[Trial], str], trial: Trial) -> str:
    try:
        name = hp_name(trial)
    except Exception as exc:
        raise UserError(
            f"hp_name(trial) raised {type(exc).__name__}: {exc}; fix hp_name in the space file"
        ) from None
    if not isinstance(name, str) or not name.strip():
        raise UserError(
            f"hp_name(trial) returned {name!r}; return a non-empty string naming the run folder"
        )
    return name


def _resume_point(run_dir: Path, checkpoint: str | None) -> str | None:
    """``checkpoint`` if the trial can go on from it. One that holds the model alone
    (``save_only_model``) cannot: the trial starts again, and its earlier attempt's checkpoints
    go, so that the two attempts' never mix in its folder."""
    if checkpoint is None or runs.resumable(Path(checkpoint)):
        return checkpoint
    for old in runs.checkpoints(run_dir):
        shutil.rmtree(old)
    return None


def _started_with(again: runs.TrialRecord | None, latest: Path | None) -> int | None:
    """The threads (all processes') a trial had when it started, if it resumes from its ``latest``
    checkpoint: it resumes with them, bit for bit (torch's sums depend on the thread count)."""
    if again is None or latest is None or not runs.resumable(latest):
        return None
    threads, processes = again.user_attrs.get("threads"), again.user_attrs.get("processes", 1)
    return threads * processes if isinstance(threads, int) and isinstance(processes, int) else None


def _plain_attrs(attrs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attrs.items() if isinstance(v, (str, int, float, bool, type(None)))}


def _trial_args(job: SweepJob, params: Mapping[str, Any], run_dir: Path) -> TrainingArguments:
    args = apply_params(job.args, params, model_takes_trial=job.model_takes_trial)
    changes: dict[str, Any] = {"output_dir": str(run_dir), "disable_progress": True}
    if (
        args.metric_for_best_model is None
        and isinstance(job.objective, str)
        and len(job.directions) == 1
    ):
        changes.update(
            metric_for_best_model=job.objective, greater_is_better=job.directions[0] == "maximize"
        )
    return args.replace(**changes)


def _eval_history(trainer: Any) -> list[dict[str, Any]]:
    return trainer.state.evaluations()


def _final_metrics(trainer: Any) -> dict[str, float]:
    """The metrics of the model as training left it; evaluates once more if the last step was not."""
    evals = trainer.state.evaluations()
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
        raise UserError(
            f"hp_space(trial) raised {type(exc).__name__}: {exc}; fix hp_space in the space file"
        ) from None
    if not isinstance(params, Mapping):
        raise UserError(
            f"hp_space(trial) returned {type(params).__name__}; return a dict of name -> value"
        )
    return dict(params)
