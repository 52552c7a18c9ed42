"""A search in a script that a launcher started several times: ``torchrun --nproc_per_node N
script.py``, where every process builds the same `Trainer` and calls ``hyperparameter_search``.

The sweep is one, and every trial is trained by all N processes together (accelerate's
DistributedDataParallel: each process one share of the batches, the gradients all-reduced), as in
transformers' DDP flow:

- **Rank 0 leads.** It alone runs the backend's searcher (the loop asks an ask/tell searcher
  for trials and tells it how they ended; a driver that trains in its own process, W&B's agent,
  runs there) and writes the records, the checkpoints and the best run, as a search in one
  process does: its `TrialRunner` is a `LeadingRunner`. Before training a trial it sends the others the trial's number, its final params
  (``model_init`` may have suggested some), its arguments and the checkpoint it resumes from.
- **The others follow.** Each builds the trial's model from those params (``model_init(trial)``
  reads them back) and trains it beside rank 0; they never talk to the searcher nor write a record.
- **Pruning.** Rank 0 asks the searcher's trial after each evaluation and sends the answer to all, so every
  process stops at the same step.
- **The end.** Rank 0 sends the best run, and every process returns it; a sweep that stops with an
  error on rank 0 stops with the same error everywhere (a `UserError` as the same line).
- **Failures.** A trial that fails on every process at the same point (a model that raises) is
  recorded failed by rank 0 and the sweep goes on, as in one process; the others print their
  error line and wait for the next trial. A process that waits for one that is gone (killed,
  stopped) fails in its collective: torchrun stops the whole group when any process dies, and
  the group's timeout (``HPSWEEP_DIST_TIMEOUT_S`` where hpsweep starts it) bounds the rest.

What cannot follow is refused in one line: a driver that starts processes of its own for trials
(Ray's), ``n_jobs`` workers and ``processes_per_trial`` (the launcher already gave the processes),
``auto_find_batch_size`` (one process running out of memory cannot restart the others).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hpsweep.devices import process_group
from hpsweep.errors import UserError
from hpsweep.search.job import SweepJob, trainer_parts
from hpsweep.search.objective import DefaultObjective
from hpsweep.search.options import SearchOptions
from hpsweep.search.trial_runner import TrainOutcome, TrialRunner, error_line
from hpsweep.trial import Trial


def launched_rank(args: Any) -> int | None:
    """This process's rank among those a launcher started together (joining them, see
    `hpsweep.devices.process_group.join_launched`); None where it started one or none."""
    if process_group.launched_world_size() == 1:
        return None
    import torch.distributed as dist

    process_group.join_launched(args)
    return dist.get_rank()


def search_launched(
    rank: int,
    trainer: Any,
    request: SearchOptions,
    sweep: Callable[[Callable[..., TrialRunner]], Any],
) -> Any:
    """The best run(s) of the sweep that the launched processes run together. Rank 0 runs
    ``sweep(make_runner)``, the search of one process with its trials trained by all; the others
    follow it."""
    if rank != 0:
        return _follow(trainer, request)
    try:
        _refuse(request.backend, request.n_jobs, request.processes_per_trial, trainer.args)
        best = sweep(LeadingRunner)
    except Exception as exc:  # the others are waiting for the next trial: they stop too
        with contextlib.suppress(Exception):  # unless they are gone already
            process_group.broadcast_object(("error", _Stopped.of(exc)))
        raise
    process_group.broadcast_object(("best", best))
    return best


@dataclass
class TrialOrder:
    """What rank 0 sends the others before it trains a trial: all they need to train it too."""

    number: int
    id: str
    params: dict[str, Any]
    args: Any
    resume_from: str | None
    backend: str
    reads_checkpoints: bool
    #: The objective, where it travels (a metric name, Hugging Face's default); None: the
    #: user's own function, which every process has.
    objective: Any
    directions: list[str]


@dataclass
class _Stopped:
    """Rank 0's error, as the others raise it."""

    user_error: bool
    line: str

    @classmethod
    def of(cls, exc: BaseException) -> _Stopped:
        if isinstance(exc, UserError):
            return cls(True, str(exc))
        return cls(False, f"{type(exc).__name__}: {exc}")

    def exception(self) -> Exception:
        if self.user_error:
            return UserError(self.line)
        return RuntimeError(f"the search stopped in process 0: {self.line}")


class _TrialTogether(Trial):
    """The trial as every launched process trains it: the params rank 0 sent. Rank 0's reports go
    to the backend's trial (``lead``); its answer whether to prune goes to all."""

    def __init__(self, order: TrialOrder, lead: Trial | None = None) -> None:
        super().__init__(order.number, order.params, id=order.id)
        self.backend = order.backend
        self.reads_checkpoints = order.reads_checkpoints  # every process asks at the same point
        self.lead = lead

    def report(
        self, step: int, metrics: Mapping[str, float], objective: Any, checkpoint: Any = None
    ) -> None:
        if self.lead is not None:
            self.lead.report(step, metrics, objective, checkpoint)

    def should_prune(self) -> bool:
        return process_group.broadcast_flag(
            self.lead.should_prune() if self.lead is not None else None
        )


class LeadingRunner(TrialRunner):
    """Rank 0's `TrialRunner`: it records each trial as in one process, and has the others train
    it beside it."""

    def __init__(self, job: SweepJob, settings: SearchOptions) -> None:
        # n_jobs again: transformers' keywords for Optuna may have set it
        _refuse(settings.backend, settings.n_jobs, settings.processes_per_trial, job.args)
        super().__init__(job, settings.backend)

    def train_here(
        self,
        trial: Trial,
        built: Any,
        args: Any,
        callbacks: list[Any],
        resume_from: str | None,
    ) -> TrainOutcome:
        objective = self.job.objective
        order = TrialOrder(
            number=trial.number,
            id=trial.id,
            params=dict(trial.params),
            args=args,
            resume_from=resume_from,
            backend=trial.backend,
            reads_checkpoints=trial.reads_checkpoints,
            objective=objective if isinstance(objective, (str, DefaultObjective)) else None,
            directions=list(self.job.directions),
        )
        process_group.broadcast_object(("trial", order))
        return super().train_here(
            _TrialTogether(order, lead=trial), built, args, callbacks, resume_from
        )


def _refuse(backend: str, n_jobs: int, processes_per_trial: int, args: Any) -> None:
    """What the launched processes cannot do together, in one line, before anything is written."""
    if backend == "ray":
        raise UserError(
            "backend='ray' in a script started by torchrun: Ray runs trials in processes of its own, "
            "which the launched processes cannot train with; use backend='optuna', or run the "
            "script without torchrun and set processes_per_trial"
        )
    if n_jobs > 1 or processes_per_trial > 1:
        raise UserError(
            "n_jobs / processes_per_trial in a script started by torchrun: its processes already "
            "train every trial together; drop n_jobs and processes_per_trial"
        )
    if args.auto_find_batch_size:
        raise UserError(
            "auto_find_batch_size in a script started by torchrun: a process that runs out of memory "
            "cannot restart the others; set per_device_train_batch_size to a size that fits instead"
        )


def _follow(trainer: Any, request: SearchOptions) -> Any:
    """A follower's search: train each trial rank 0 sends, until it sends the best run."""
    while True:
        kind, body = process_group.broadcast_object()
        if kind == "best":
            return body
        if kind == "error":
            raise body.exception()
        _train_order(trainer, request, body)


def _train_order(trainer: Any, request: SearchOptions, order: TrialOrder) -> None:
    """Train the trial rank 0 sent, beside it. A trial that fails here failed there too, most
    likely (rank 0 records it); its line goes to stderr, and the next trial comes."""
    runner = _FollowingRunner(_following_job(trainer, request, order), order.backend)
    try:
        runner.follow(order)
    except UserError:
        pass  # rank 0 stops the sweep with the same error, and sends it
    except Exception as exc:
        import torch.distributed as dist

        print(
            f"hpsweep: trial {order.number} failed in process {dist.get_rank()}: {error_line(exc)}",
            file=sys.stderr,
            flush=True,
        )


class _FollowingRunner(TrialRunner):
    """A follower's `TrialRunner`: it trains, and keeps no record (rank 0 does)."""

    def follow(self, order: TrialOrder) -> TrainOutcome:
        trial = _TrialTogether(order)
        built = self._build(trial)  # the same params, so the same model as rank 0's
        if isinstance(built, BaseException):
            raise built
        return self.train_here(trial, built, order.args, [], order.resume_from)


def _following_job(trainer: Any, request: SearchOptions, order: TrialOrder) -> SweepJob:
    """What a follower needs to train one trial: the trainer's own parts, rank 0's objective."""
    return SweepJob(
        **trainer_parts(trainer),
        args=trainer.args,
        objective=order.objective if order.objective is not None else request.objective,
        directions=order.directions,
    )
