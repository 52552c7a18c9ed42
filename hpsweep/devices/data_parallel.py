"""Data-parallel trials: ``--processes-per-trial N`` trains each trial over N processes.

The process that runs the search loop (a ``--n-jobs`` worker, the command itself, a Ray actor)
holds the trial: it asked the backend for it, built its model (``model_init`` may suggest params,
``hp_name`` names the folder from them) and keeps its record. To train, it forks N *rank*
processes that join one ``torch.distributed`` group (NCCL on GPUs, gloo on the CPU), which
accelerate then uses as it finds it: the model is wrapped in DistributedDataParallel and each
rank takes every N-th batch, so the effective batch is ``per_device_train_batch_size x N``.

- **Params.** Every rank is forked from the process that asked the backend, after the params
  were final, so all N train the same trial (what transformers had to broadcast from rank 0 in
  #18609 holds here by construction); no rank talks to the backend itself.
- **Reports and pruning.** Rank 0 sends each evaluation, and the question whether to prune,
  through a pipe to this process, which asks the backend; rank 0 broadcasts the answer, so a
  prune stops all N at the same step.
- **Logged loss.** Each rank sums its own batches' losses; at a logging step every rank takes
  part in one all-reduce (`TrainingLoop.count_loss`), so the logged ``loss`` is the mean over
  all N processes' batches, the loss of the effective batch. Logging steps follow the arguments
  and the callbacks every rank runs, so all N reach the collective together (the callbacks only
  rank 0 gets, the sweep's trackers, never ask for a log).
- **Checkpoints.** Rank 0 alone writes them (`Trainer.save_checkpoint`); the others wait for it;
  a resumed trial's ranks all load the same checkpoint.
- **Failures.** The first rank to raise fails the trial with its error and traceback (a CUDA
  out-of-memory error reads as one, see `hpsweep.devices.memory`); the other ranks are stopped at once
  (SIGTERM, then SIGKILL), so a dead rank never leaves the others waiting in a collective, and a
  process-group timeout (``ddp_timeout``, else ``HPSWEEP_DIST_TIMEOUT_S``, default 600 s) bounds
  a rank that hangs. ``ddp_backend`` names the group's backend (default gloo on the CPU, NCCL on
  GPUs).
- **Signals.** Ctrl-C or SIGTERM of this process stops the ranks, then the trial is recorded
  ``stopped``; the ranks die with this process (``PR_SET_PDEATHSIG``) even after a ``kill -9``.
- **Memory.** This process never initialises CUDA (so forking stays safe trial after trial), and
  each trial's ranks take its memory with them when they exit.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

from hpsweep.devices.process_group import broadcast_flag, check_backend, timeout_s
from hpsweep.devices.threads import threads_per_process
from hpsweep.errors import UserError
from hpsweep.trial import Trial

# how long stopped ranks get to leave (a checkpoint being written) before SIGKILL
STOP_GRACE_S = 10.0
_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class TrialTrainer(Protocol):
    """What trains a trial in one process (the search layer's `TrialRunner`): each rank calls its
    ``train_here``; ``job.processes_per_trial`` says how many ranks there are."""

    job: Any

    def train_here(
        self, trial: Trial, built: Any, args: Any, callbacks: list[Any], resume_from: str | None
    ) -> Any: ...


class RankError(Exception):
    """A rank's error that could not travel as itself (an exception that does not pickle)."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(message)
        self.type_name = type_name


class RankDied(Exception):
    """A rank ended without a word: killed (the OOM killer, ``kill -9``) or crashed."""


def train_data_parallel(
    runner: TrialTrainer,
    trial: Trial,
    built: Any,
    args: Any,
    callbacks: list[Any],
    resume_from: str | None,
) -> Any:
    """Train ``trial`` over ``runner.job.processes_per_trial`` forked ranks; returns rank 0's
    outcome (what ``runner.train_here`` returns), or raises the first rank's error (with ``rank``
    and ``rank_traceback`` set on it). The job's datasets are loaded already: the ranks inherit
    them."""
    import torch

    if torch.cuda.is_initialized():
        raise UserError(
            "--processes-per-trial: CUDA was initialised in the process that runs the search (model_init "
            "or the space file put something on a GPU); return the model on the CPU, accelerate moves "
            "it to each process's GPU"
        )
    job = runner.job
    check_backend(args)
    _preimport()
    group = _RankGroup(job.processes_per_trial)
    try:
        group.start(runner, trial, built, args, callbacks, resume_from)
        return group.serve(trial)
    finally:
        group.stop()


#: What accelerate and DistributedDataParallel import lazily on their multi-process path (torch's
#: compiler stack, FSDP, Hugging Face datasets): 5 to 10 s in every rank of every trial on two
#: cores, or once in this process, whose ranks inherit it.
PREIMPORT = (
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "datasets",
)


def _preimport() -> None:
    import importlib

    for name in PREIMPORT:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional package (datasets): accelerate skips it too
            pass


class _RankGroup:
    """The N forked ranks of one trial, and the relay between rank 0 and the trial's backend."""

    def __init__(self, n: int) -> None:
        self.n = n
        # the job (user functions, datasets) travels unpickled
        self.ctx = multiprocessing.get_context("fork")
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.store_dir = tempfile.mkdtemp(prefix="hpsweep-ranks-")

    def start(
        self,
        runner: TrialTrainer,
        trial: Trial,
        built: Any,
        args: Any,
        callbacks: list[Any],
        resume_from: str | None,
    ) -> None:
        setup = {
            "n": self.n,
            "store": os.path.join(self.store_dir, "store"),
            "threads": threads_per_process(self.n),
            "use_cpu": bool(args.use_cpu),
            "backend": args.ddp_backend,
            "timeout_s": timeout_s(args),
        }
        # Signals wait until each rank has its own handlers: none sees the terminal's Ctrl-C half set up.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        try:
            for rank in range(self.n):
                ours, theirs = self.ctx.Pipe()
                proc = self.ctx.Process(
                    target=_rank_main,
                    name=f"hpsweep-trial{trial.number}-rank{rank}",
                    args=(
                        rank,
                        setup,
                        theirs,
                        runner,
                        trial,
                        built,
                        args,
                        callbacks if rank == 0 else [],
                        resume_from,
                    ),
                )
                proc.start()
                theirs.close()
                self.procs.append(proc)
                self.conns.append(ours)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def serve(self, trial: Trial) -> Any:
        """Relay rank 0's reports and prune questions to ``trial`` until every rank is done."""
        outcome: Any = None
        live = dict(enumerate(self.conns))
        done: set[int] = set()
        while live:
            errors: list[tuple[float, int, BaseException]] = []
            for conn in wait(list(live.values())):
                rank = self.conns.index(conn)  # type: ignore[arg-type]
                try:
                    message = conn.recv()
                except (EOFError, OSError):  # the rank is gone
                    del live[rank]
                    if rank not in done:
                        errors.append((time.monotonic(), rank, self._death(rank)))
                    continue
                kind = message[0]
                if kind == "report":
                    trial.report(*message[1:])
                elif kind == "should_prune":
                    answer = bool(trial.should_prune())
                    try:
                        conn.send(answer)
                    except OSError:  # rank 0 died meanwhile: its end of the pipe says so next
                        pass
                elif kind == "done":
                    done.add(rank)
                    outcome = message[1] if rank == 0 else outcome
                elif kind == "error":
                    _, when, exc, text = message
                    exc.rank_traceback = text
                    if rank > 0:
                        exc.rank = rank
                    errors.append((when, rank, exc))
            if errors:  # the earliest is the cause; a peer's broken collective is only its echo
                raise min(errors, key=lambda e: (e[0], e[1]))[2]
        assert outcome is not None
        return outcome

    def _death(self, rank: int) -> RankDied:
        proc = self.procs[rank]
        proc.join(timeout=5)
        code = proc.exitcode
        if code is not None and code < 0:
            how = f"was killed by signal {-code}" + (
                " (SIGKILL: out of memory?)" if code == -signal.SIGKILL else ""
            )
        else:
            how = f"exited with code {code}"
        return RankDied(f"data-parallel process {rank} of {self.n} {how} before the trial ended")

    def stop(self) -> None:
        """Stop every rank still running (SIGTERM, then SIGKILL after `STOP_GRACE_S`) and wait for it,
        so that nothing of this trial still runs when it is recorded and handed back to the ledger."""
        alive = [p for p in self.procs if p.is_alive()]
        for proc in alive:
            _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in alive:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in alive:
            if proc.is_alive():
                _signal(proc, signal.SIGKILL)
            proc.join()
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.store_dir, ignore_errors=True)


def _signal(proc: Any, signum: int) -> None:
    try:
        os.kill(proc.pid, signum)
    except ProcessLookupError:
        pass


# --- inside a rank ----------------------------------------------------------------------------------


class _RankTrial(Trial):
    """The trial as a rank sees it: the params it was forked with. Rank 0 relays reports and
    prune questions to the process that holds the real trial; every rank learns the answer from
    rank 0 by broadcast, so all stop at the same evaluation."""

    def __init__(self, trial: Trial, rank: int, conn: Connection) -> None:
        super().__init__(trial.number, trial.params, id=trial.id)
        self.backend = trial.backend
        # every rank asks at the same point either way
        self.reads_checkpoints = trial.reads_checkpoints
        self.user_attrs = dict(trial.user_attrs)
        self.rank, self.conn = rank, conn

    def report(
        self, step: int, metrics: Any, objective: Any, checkpoint: str | None = None
    ) -> None:
        if self.rank == 0:
            self.conn.send(("report", step, dict(metrics), objective, checkpoint))

    def should_prune(self) -> bool:
        answer = None
        if self.rank == 0:
            self.conn.send(("should_prune",))
            answer = bool(self.conn.recv())
        return broadcast_flag(answer)


def _rank_main(
    rank: int,
    setup: dict[str, Any],
    conn: Connection,
    runner: TrialTrainer,
    trial: Trial,
    built: Any,
    args: Any,
    callbacks: list[Any],
    resume_from: str | None,
) -> None:
    from hpsweep.devices.signals import die_with_parent, raise_interrupted

    parent = os.getppid()
    die_with_parent()
    # The parent forwards Ctrl-C as one SIGTERM; the terminal's own SIGINT would hit every rank at once.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, raise_interrupted)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
    code = 0
    try:
        if os.getppid() != parent:  # the parent died before we asked to die with it
            raise KeyboardInterrupt
        _join_group(rank, setup)
        outcome = runner.train_here(
            _RankTrial(trial, rank, conn), built, args, callbacks, resume_from
        )
        conn.send(("done", outcome if rank == 0 else None))
    except KeyboardInterrupt:  # stopped: the parent records the trial
        code = 130
    except BaseException as exc:  # noqa: BLE001 - the parent fails the trial with it
        code = 1
        _send_error(conn, exc)
    sys.stdout.flush()
    sys.stderr.flush()
    # no atexit, no destructors: the parent's open study and files are not ours to close
    os._exit(code)


def _join_group(rank: int, setup: dict[str, Any]) -> None:
    """Join the trial's process group and make accelerate adopt it."""
    import torch
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState, PartialState

    n = setup["n"]
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(n),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(n),
        MASTER_ADDR="127.0.0.1",
        OMP_NUM_THREADS=str(setup["threads"]),
    )
    torch.set_num_threads(setup["threads"])
    # What the parent's own accelerate state said (one process) is not true here.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    use_cpu = setup["use_cpu"] or not torch.cuda.is_available()
    if not use_cpu:
        torch.cuda.set_device(rank)  # CUDA_VISIBLE_DEVICES holds the trial's GPUs, one per rank
    dist.init_process_group(
        setup["backend"] or ("gloo" if use_cpu else "nccl"),
        init_method=f"file://{setup['store']}",
        rank=rank,
        world_size=n,
        timeout=timedelta(seconds=setup["timeout_s"]),
    )
    PartialState(cpu=use_cpu)


def _send_error(conn: Connection, exc: BaseException) -> None:
    text = traceback.format_exc()
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - an exception that does not travel goes as its name and message
        exc = RankError(type(exc).__name__, str(exc))
    try:
        conn.send(("error", time.monotonic(), exc, text))
    except OSError:  # the parent is gone or closed the pipe: it is stopping us anyway
        pass
