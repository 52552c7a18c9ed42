"""What runs on the Ray workers for the Ray Tune backend: the Tune trainable, and the `Trial` it
hands the trainer. A private helper of the Ray Tune backend `hpsweep.search.backends._ray`.

Each Tune trial is one call of `train_trial`, on whichever node Tune placed it. Before training
it takes a lease from the sweep's ledger (`hpsweep.search.ledger`) with the claim the search
layer's loop runs (`Ledger.take_trial`: under the lock, reap, claim, number, bind), so counting,
running again and two commands on one folder work on Ray alike:

- a trial of a round of new trials claims a new trial and its number (`FolderSession.claim_new`,
  preferring the number the driver put in its name, `trial_name`); when the ledger has enough
  (finished, running and waiting to run again), the timeout passed or ``--max-failed-trials``
  trials of this command failed, it returns without a record;
- a trial of a round of re-runs (its config names the trial, `AGAIN_KEY`) claims that trial
  (`FolderSession.claim_trial`) and continues it in its folder from its latest checkpoint;
- a trial Tune starts once more itself claims its own trial again: after its worker died (Tune's
  ``FailureConfig`` retry) from its run folder's latest checkpoint, as any trial run again; after
  a scheduler paused it (HyperBand, PBT's exploit) from the checkpoint Tune hands it.

On a node that does not see ``--output-dir`` there is no ledger to lock: the trial runs without
a lease in a node-local folder shipped through Ray's storage (`NodeLocalRuns`), with the number
the driver gave it, and the driver's round size alone keeps the count.

Tune stops a trial without waiting for its function (``session.finish(timeout=0)``) and, at the
end of a round, ends the actor: the trial's own ending (its record, the lease, a node-local folder
shipped) runs on a daemon thread the actor's exit would cut short. The trainable Tune gets
(`trainable`) waits for that ending in its ``stop``; `_InFlight` also holds the actor's exit.
None of that outlives the command: a trial ends, unrecorded, the moment the command dies
(`die_with`), and runs again from its latest checkpoint.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import math
import os
import select
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import ray
from ray import tune

from hpsweep import runs
from hpsweep.errors import TrialFailed, TrialPruned, UserError
from hpsweep.search.backends._ray._cluster import (
    WORKER_ENV,
    NodeLocalRuns,
    sees_output_dir,
    stop_file,
)
from hpsweep.search.ledger import AGAIN, FolderSession, Ledger
from hpsweep.search.ledger_base import Claim, Claimed, Hold, Verdict
from hpsweep.trial import Trial

METRIC = "objective"
#: In the config of a trial of a round of re-runs: the id of the trial to run again.
AGAIN_KEY = "hpsweep_again"
#: Reported instead of a result: the sweep cannot go on (the driver raises it), or the trial failed.
USER_ERROR_KEY = "hpsweep_user_error"
FAILED_KEY = "hpsweep_failed"


@dataclass(frozen=True)
class RoundPlan:
    """What every trial of one Tune round needs besides its config (sent once, with the trainable)."""

    marker: str  # the token in --output-dir by which a node knows it sees the driver's folder
    n_trials: int | None
    started: float  # when the command started: failures since then count toward the limit
    max_failed_trials: int
    deadline: float | None  # wall-clock time after which no new trial starts (--timeout)
    # evaluations of a full trial, when known (a scheduler's stop then is no prune)
    budget: int | None
    #: In a round of re-runs: the records of the trials to run again, by id (for nodes without the folder).
    again: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: What a trial without a result reports besides the objective: the worst value of the metric a
    #: user's scheduler or search algorithm was made with (PBT raises on a result without it).
    worst_extra: dict[str, float] = field(default_factory=dict)
    #: The command's process, (pid, start time): a trial on its machine dies with it (`die_with`).
    driver: tuple[int, float] | None = None


class RayTrial(Trial):
    """A Ray Tune trial as the trainer sees it.

    Tune stops or pauses a trial by raising ``SystemExit(0)`` inside `ray.tune.report`; that is
    turned into `should_prune` so the trainer ends the run cleanly and records it as pruned
    (a paused trial is resumed later from its checkpoint and runs on; a trial the driver stopped
    is set to run again when Tune's round ends).
    """

    backend = "ray"
    # each result carries its checkpoint: PBT and paused trials resume from it
    reads_checkpoints = True

    def __init__(
        self, number: int, params: dict[str, Any], *, id: str, budget: int | None = None
    ) -> None:
        super().__init__(number, params, id=id)
        self._budget = budget
        self._stopped = False
        # Tune has let go of this trial: reporting again would block for ever
        self._detached = False
        self.stop_file: Path | None = None  # see `._cluster.stop_file`

    def report(
        self, step: int, metrics: Any, objective: Any, checkpoint: str | None = None
    ) -> None:
        if self._detached:
            return
        result = {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        result.update(objective_metrics(objective))
        result["evaluation"] = step
        try:
            tune.report(
                result,
                checkpoint=tune.Checkpoint.from_directory(checkpoint) if checkpoint else None,
            )
        except SystemExit:
            # Tune stopped the trial and reads no more of its results: any later report would wait
            # for ever on Tune's lock (see train_trial's ending).
            self._detached = True
            if self.stop_file is not None and self.stop_file.exists():
                raise SweepStopped(
                    "the sweep stopped while the trial ran"
                ) from None  # recorded as stopped
            # A stop at the last evaluation of the budget is the scheduler ending a finished trial.
            self._stopped = self._budget is None or step < self._budget
        except SweepStopped:  # the stop file's (`_StopWatch`), raised as Tune let go of this report
            self._detached = True
            raise

    def should_prune(self) -> bool:
        return self._stopped

    @property
    def detached(self) -> bool:
        return self._detached


class SweepStopped(KeyboardInterrupt):
    """Tune stopped the trial because the driver stopped the sweep: the trial runs again later."""


class _StopWatch:
    """Stops a training trial when the driver writes the sweep's stop file, as a signal stops a
    local worker: `SweepStopped` is raised in the training thread at its next Python instruction.

    Tune's own stop reaches a trial only inside `ray.tune.report` (at an evaluation), and Tune
    kills the actor 10 s after asking it to stop: a trial with long epochs would die with its
    record still ``running``. The stop file is looked at every `POLL_S` seconds while armed.
    """

    POLL_S = 0.5

    def __init__(self, stop_file: Path | None) -> None:
        self.stop_file = stop_file
        self._target = threading.get_ident()
        self._armed = threading.Lock()
        self._done = threading.Event()

    @contextlib.contextmanager
    def armed(self) -> Any:
        if self.stop_file is None:
            yield
            return
        watcher = threading.Thread(target=self._watch, name="hpsweep-stop-watch", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            with self._armed:
                self._done.set()

    def _watch(self) -> None:
        assert self.stop_file is not None
        while not self._done.wait(self.POLL_S):
            if self.stop_file.exists():
                with self._armed:
                    if not self._done.is_set():
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(
                            ctypes.c_ulong(self._target), ctypes.py_object(SweepStopped)
                        )
                return


def worst(directions: list[str]) -> dict[str, float]:
    """The objective a trial without a result reports: Tune's schedulers need one in every result
    (PBT raises without it) and rank this one last; hpsweep's searcher ignores it (`FAILED_KEY`)."""
    values = [math.inf if d == "minimize" else -math.inf for d in directions]
    return objective_metrics(values if len(values) > 1 else values[0])


def objective_metrics(objective: Any) -> dict[str, float]:
    if isinstance(objective, (list, tuple)):
        return {f"{METRIC}_{i}": float(v) for i, v in enumerate(objective)}
    return {METRIC: float(objective)}


class _InFlight:
    """The trial functions still running in this actor process; at the actor's exit (Tune's
    ``__ray_terminate__`` runs ``atexit`` handlers) waits up to `ENDING_WAIT_S` for them to end.
    Tune force-kills an actor 10 s after it asked it to stop: the waits stay under that. The raylet
    kills the process ~200 ms after the actor leaves, so the wait that counts is `trainable`'s,
    in the actor's ``stop``; this one is for an exit without it."""

    ENDING_WAIT_S = 8.0

    def __init__(self) -> None:
        self._count = 0
        self._changed = threading.Condition()
        self._registered = False

    @contextlib.contextmanager
    def running(self) -> Any:
        with self._changed:
            self._count += 1
            if not self._registered:
                atexit.register(self.wait)
                self._registered = True
        try:
            yield
        finally:
            with self._changed:
                self._count -= 1
                self._changed.notify_all()

    def wait(self) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._count == 0, timeout=self.ENDING_WAIT_S)


_IN_FLIGHT = _InFlight()


def trainable(runner: Any, plan: RoundPlan) -> type:
    """The Tune trainable of a round: the function trainable Tune makes of `train_trial`, whose
    ``cleanup`` (what its ``stop`` runs) gives a trial Tune stopped up to `_InFlight.ENDING_WAIT_S`
    to end before Tune's own ``session.finish(timeout=0)``.

    A trial told to stop inside `ray.tune.report` (a scheduler's decision, the sweep's stop) still
    has its ending to run. Without the wait, a stopped trial still ending when the round ended
    (slow callbacks, a slow MLflow server, a folder to ship) was killed with its actor, recorded
    ``stopped`` and trained again in the next round.
    """
    from ray.train._internal.session import get_session
    from ray.tune.trainable.function_trainable import wrap_function

    base = wrap_function(
        tune.with_parameters(train_trial, runner=runner, plan=plan), name="train_trial"
    )

    class Trainable(base):  # type: ignore[misc, valid-type]
        def cleanup(self) -> None:
            # lets the trial leave report() and end
            get_session().finish(timeout=_InFlight.ENDING_WAIT_S)
            super().cleanup()

    return Trainable


def train_trial(config: dict[str, Any], runner: Any, plan: RoundPlan) -> None:
    """The Tune function trainable: one trial of the sweep (see the module's docstring)."""
    die_with(plan.driver)
    with _IN_FLIGHT.running():
        _train_trial(config, runner, plan)


def _train_trial(config: dict[str, Any], runner: Any, plan: RoundPlan) -> None:
    for (
        key,
        value,
        # read by this actor's reset_config(), also when the user called ray.init
    ) in WORKER_ENV.items():
        os.environ.setdefault(key, value)
    ctx = tune.get_context()
    params = {k: v for k, v in config.items() if k != AGAIN_KEY}
    again_id, hint = config.get(AGAIN_KEY), number_in_name(ctx.get_trial_name())
    local = None
    if sees_output_dir(runner.job.output_dir, plan.marker):
        wanted = _Wanted(ctx.get_trial_id(), hint, params, again_id)
        claimed = _claim(Ledger(runner.job.output_dir, plan.n_trials), wanted, plan)
        if claimed is None:
            return  # nothing to run: the ledger has enough, the time is up, or another process runs it
        trial, lease = claimed.trial, claimed.claim.lease
        trial.stop_file = stop_file(runner.job.output_dir, plan.marker)
    else:
        local = NodeLocalRuns(runner, plan.marker, ctx)
        runner, lease = local.runner, None
        trial = _unleased(local, ctx.get_trial_id(), hint, params, plan.again.get(again_id), plan)
    # which Tune trial ran it last, for the driver
    trial.user_attrs["ray_trial_id"] = ctx.get_trial_id()
    _train(runner, trial, lease, local, plan.worst_extra)


def this_process() -> tuple[int, float]:
    """This process as `die_with` finds it: its pid, and its start time against a reused pid."""
    return os.getpid(), psutil.Process().create_time()


def die_with(driver: tuple[int, float] | None) -> None:
    """End this worker process the moment the command's process (the driver) dies, if it runs
    on the command's machine: a dead command's trial writes nothing more into the sweep (its
    next run resumes from its latest checkpoint). Once per worker process and command.

    A local Ray's GCS and raylet may die with the command (a ``kill -9`` of its process group):
    nothing then tells the worker, which finds its raylet gone seconds later, and a SIGTERM
    runs the ``atexit`` wait of `_InFlight` while the trial trains on. A worker on another
    machine needs none of this: Ray force-kills an actor whose owner, the driver, died (no
    ``atexit``) as soon as the driver's connection drops. A process with another start time
    at the driver's pid is another machine's, or another PID namespace's: not watched.
    """
    if driver is None or driver in _WATCHED:
        return
    _WATCHED.add(driver)
    try:
        command = psutil.Process(driver[0])
        if command.create_time() != driver[1]:
            return
    except psutil.Error:
        return
    threading.Thread(target=_exit_with, args=(command,), name="hpsweep-driver", daemon=True).start()


_WATCHED: set[tuple[int, float]] = set()


def _exit_with(command: psutil.Process) -> None:
    """Exit once ``command`` has ended: a pidfd wakes at once; elsewhere, a look every 0.2 s."""
    try:
        pidfd = os.pidfd_open(command.pid)
    except (AttributeError, OSError):  # not Linux 5.3+
        while _alive(command):
            time.sleep(0.2)
    else:
        waiting = select.poll()  # no limit on the fd's number, unlike select.select
        waiting.register(pidfd, select.POLLIN)
        if command.is_running():  # the driver's pid, not one reused meanwhile
            waiting.poll()
    os._exit(1)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def trial_name(number: int, tune_id: str) -> str:
    """The name the driver gives a Tune trial, ``trial-<number>-<id>``: Tune's folder and display
    name, and the one string of the driver's own that Tune hands a worker (`number_in_name`)."""
    return f"trial-{number}-{tune_id}"


def number_in_name(name: str) -> int:
    """The number the driver gave a trial in its name (`trial_name`)."""
    try:
        return int(name.split("-", 2)[1])
    except (IndexError, ValueError):
        return 0


def record_id(tune_trial: Any) -> str:
    """The id of the sweep's trial a Tune trial runs: the trial it runs again, or its own."""
    return str(tune_trial.config.get(AGAIN_KEY) or tune_trial.trial_id)


@dataclass(frozen=True)
class _Wanted:
    """What a Tune trial asks the ledger for: Tune's id, the number the driver gave it, its params
    and, in a round of re-runs, the id of the trial to run again."""

    tune_id: str
    hint: int
    params: dict[str, Any]
    again_id: str | None


def _claim(ledger: Ledger, wanted: _Wanted, plan: RoundPlan) -> Claimed[RayTrial] | None:
    """The trial to run with its lease (`Ledger.take_trial`); None when there is none.

    A trial Tune starts once more may find its previous run still recording its end on another
    actor (a PBT exploit, `Verdict.BUSY`): it waits for that, as long as Tune's own
    reset_config() would.
    """
    patience = time.monotonic() + float(os.environ.get("TUNE_FUNCTION_THREAD_TIMEOUT_S", 60))
    choose = functools.partial(_choose, wanted=wanted, plan=plan)
    make = functools.partial(_make, wanted=wanted, plan=plan)
    while True:
        got = ledger.take_trial(choose, make)
        if got is not Verdict.BUSY:
            return got if isinstance(got, Claimed) else None
        if time.monotonic() > patience:
            return None
        time.sleep(0.2)


def _choose(session: FolderSession, *, wanted: _Wanted, plan: RoundPlan) -> Claim | Verdict:
    """`FolderSession.claim_trial` for a round of re-runs or a trial Tune starts once more (a
    retry, a paused trial resumed), `FolderSession.claim_new` for a new one, numbered as the
    driver named it if that number is free; `Verdict.BUSY` while the trial's previous run is
    still ending, `Verdict.DONE` when there is nothing to run."""
    ledger = session.ledger
    if wanted.again_id is not None:  # a round of re-runs
        return session.claim_trial(wanted.again_id) or Verdict.DONE  # or another command runs it
    earlier = ledger.record(wanted.tune_id)
    if earlier is not None:  # Tune starts this trial once more
        if earlier.state == "running" or ledger.held(wanted.tune_id):
            # its previous run is still ending (recorded, but the lease is held)
            return Verdict.BUSY
        return session.claim_trial(wanted.tune_id, states=(AGAIN, "pruned")) or Verdict.DONE
    if plan.deadline is not None and time.time() >= plan.deadline:
        return Verdict.DONE
    if len(ledger.failures_since(plan.started)) >= plan.max_failed_trials:
        return Verdict.DONE  # the driver ends the sweep with the one line saying so
    claim = session.claim_new(numbered=True, prefer=wanted.hint)
    return Verdict.DONE if isinstance(claim, Verdict) else claim


def _make(claim: Claim, *, wanted: _Wanted, plan: RoundPlan) -> RayTrial:
    """The `RayTrial` of ``claim``: the trial as recorded in a round of re-runs, else with the
    params Tune gave it; one that waited to run again continues from its own folder (a retry
    after its worker died), others from Tune's checkpoint if any (a paused trial resumed)."""
    assert claim.number is not None  # claimed trials run again keep theirs; new ones take one
    if wanted.again_id is not None:
        assert claim.again is not None
        trial = RayTrial(claim.number, claim.again.params, id=claim.again.id, budget=plan.budget)
    else:
        trial = RayTrial(claim.number, wanted.params, id=wanted.tune_id, budget=plan.budget)
    if claim.again is not None:
        trial.user_attrs["again"] = claim.again
    return trial


def _unleased(
    local: NodeLocalRuns,
    tune_id: str,
    hint: int,
    params: dict[str, Any],
    again: dict[str, Any] | None,
    plan: RoundPlan,
) -> RayTrial:
    """The trial on a node without ``--output-dir``: its folder comes back from Ray's storage."""
    if again is None:
        earlier = local.fetch()  # this Tune trial ran here before (a retry, a PBT exploit)
        return RayTrial(earlier.number if earlier else hint, params, id=tune_id, budget=plan.budget)
    record = runs.TrialRecord(**again)
    fetched = local.fetch(record.user_attrs.get("ray_shipped_to"))
    if fetched is None:  # it ran on a node that sees --output-dir: its checkpoints are not here
        record.run_dir = str(local.folder / Path(record.run_dir).name)
    trial = RayTrial(record.number, record.params, id=record.id, budget=plan.budget)
    trial.user_attrs["again"] = fetched or record
    return trial


def _train(
    runner: Any,
    trial: RayTrial,
    lease: Hold | None,
    local: NodeLocalRuns | None,
    worst_extra: dict[str, float],
) -> None:
    again: runs.TrialRecord | None = trial.user_attrs.get("again")
    # A trial run again continues from its own latest checkpoint; otherwise Tune's (a resume, PBT).
    checkpoint = tune.get_checkpoint() if again is None else None
    node = ray.get_runtime_context().get_node_id()
    run_dir = _run_dir(runner, trial, again)
    failed, user_error = False, None
    try:
        with checkpoint.as_directory() if checkpoint else contextlib.nullcontext(None) as folder:
            if folder is not None:
                trial.user_attrs["resume_from"] = folder
            earlier = runs.TrialRecord.load(run_dir / runs.TRIAL_FILE)
            try:
                with _StopWatch(trial.stop_file).armed():
                    runner(trial)
            except (TrialPruned, SweepStopped):
                pass
            except TrialFailed:
                failed = True
            except UserError as exc:  # the whole sweep cannot go on: tell the driver, do not retry
                if trial.detached:
                    raise  # Tune reads no more results from this trial; fail it instead
                user_error = str(exc)
            finally:
                # hp_name may read params model_init suggested
                run_dir = _run_dir(runner, trial, again)
                _note_ray_attrs(run_dir, trial, earlier, node, folder, runner.job.home)
    finally:
        if lease is not None:
            lease.release()
        if local is not None:  # every ending: complete, pruned, failed, stopped by Tune or Ctrl-C
            local.ship(run_dir)
    if trial.detached:
        # Tune stopped the trial inside tune.report and we caught that to record it. Returning now
        # would let Tune's function wrapper report once more ({"__duplicate__": True}) to a session
        # nobody reads: the thread would hang, reset_config() would time out, and with reuse_actors
        # the actor's next trial would fail ("Could not re-use actor"). Leave as Tune's stop expects.
        raise SystemExit(0)
    if user_error is not None:
        tune.report({USER_ERROR_KEY: user_error, **worst(runner.job.directions), **worst_extra})
    elif failed:
        tune.report({FAILED_KEY: 1.0, **worst(runner.job.directions), **worst_extra})


def _run_dir(runner: Any, trial: RayTrial, again: runs.TrialRecord | None) -> Path:
    if again is not None:
        return Path(again.run_dir)
    job = runner.job
    name = None
    if job.hp_name is not None:
        with contextlib.suppress(Exception):  # the runner reports a broken hp_name
            name = job.hp_name(trial)
    return runs.run_dir_for(job.output_dir, trial.id, name if isinstance(name, str) else None)


def _note_ray_attrs(
    run_dir: Path,
    trial: RayTrial,
    earlier: runs.TrialRecord | None,
    node: str,
    restored_from: str | None,
    home: runs.Home | None,
) -> None:
    """Keep in trial.json (here, and at an object-store ``home``) which Ray nodes ran the trial
    and how often Tune restored it from a checkpoint (``user_attrs``: ``ray_node_id``,
    ``ray_node_ids``, ``ray_restores``, ``ray_restored_from``)."""
    record = runs.TrialRecord.load(run_dir / runs.TRIAL_FILE)
    if record is None or record.id != trial.id:
        return
    before = earlier.user_attrs if earlier is not None and earlier.id == trial.id else {}
    nodes = list(before.get("ray_node_ids", []))
    record.user_attrs.update(
        ray_node_id=node,
        ray_node_ids=nodes + [node] if node not in nodes else nodes,
        ray_restores=before.get("ray_restores", 0) + (restored_from is not None),
    )
    if restored_from is not None:
        record.user_attrs["ray_restored_from"] = restored_from
    record.save()
    if home is not None:
        # best effort, after the trial's own upload: its record is at the home either way
        with contextlib.suppress(Exception):
            home.upload_record(run_dir)
