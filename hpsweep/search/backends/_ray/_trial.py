"""What runs on the Ray workers: the Tune trainable (`trainable`) and the `Trial` it trains.

Each Tune trial is one call of `train_trial`. On a node that sees ``--output-dir`` it takes its
place with the claim every backend runs (`Ledger.take_trial`): a new trial with the number the
driver put in its config (`NUMBER_KEY`, if still free), the trial of a round of re-runs
(`AGAIN_KEY`), or, when Tune starts it once more (a retry, a paused trial resumed), its own. On a
node without it the trial runs unleased in a folder of its own, shipped through Ray's storage
(`NodeLocalRuns`), numbered as the driver numbered it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import math
import os
import select
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import ray
from ray import tune
from ray.tune.experiment import Trial as TuneTrial

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
from hpsweep.search.trial_runner import TrialRunner
from hpsweep.trial import Trial

METRIC = "objective"
#: In a Tune trial's config: the id of the trial a round of re-runs runs again.
AGAIN_KEY = "hpsweep_again"
#: In a Tune trial's config: the number the driver gave it (Tune hands a worker nothing else of
#: the driver's per trial).
NUMBER_KEY = "hpsweep_number"
#: Reported instead of a result: the sweep cannot go on (the driver raises it), or the trial failed.
USER_ERROR_KEY = "hpsweep_user_error"
FAILED_KEY = "hpsweep_failed"


@dataclass(frozen=True)
class RoundPlan:
    """What every trial of one Tune round needs besides its config (sent once, with the trainable)."""

    marker: str  # the token in --output-dir by which a node knows it sees the driver's folder
    storage: str  # Ray's storage: a path or a URI
    n_trials: int | None
    started: float  # failures since then count toward --max-failed-trials
    max_failed_trials: int
    deadline: float | None  # no new trial starts after it (--timeout)
    budget: int | None  # evaluations of a full trial, when known (a stop at its end is no prune)
    #: In a round of re-runs: the records of the trials to run again, by id.
    again: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: The worst value of a user's scheduler's own metric, for a trial without a result.
    worst_extra: dict[str, float] = field(default_factory=dict)
    #: The command's process, (pid, start time): a trial on its machine dies with it (`die_with`).
    driver: tuple[int, float] | None = None


def config_params(config: dict[str, Any]) -> dict[str, Any]:
    """A Tune config's params: without hpsweep's own keys."""
    return {k: v for k, v in config.items() if k not in (AGAIN_KEY, NUMBER_KEY)}


def record_id(tune_trial: TuneTrial) -> str:
    """The id of the sweep's trial a Tune trial runs: the trial it runs again, or its own."""
    return str(tune_trial.config.get(AGAIN_KEY) or tune_trial.trial_id)


class RayTrial(Trial):
    """A Tune trial as the trainer sees it. Tune stops or pauses a trial by raising
    ``SystemExit(0)`` inside `ray.tune.report`: the trial then says `should_prune`, so the trainer
    ends the run and records it pruned (a paused one resumes later from its checkpoint)."""

    backend = "ray"
    reads_checkpoints = True  # each result carries its checkpoint: PBT and paused trials resume

    def __init__(self, number: int, params: dict[str, Any], *, id: str, budget: int | None) -> None:
        super().__init__(number, params, id=id)
        self._budget = budget
        self._stopped = False
        self.detached = False  # Tune let go of the trial: a report would block for ever
        self.stop_file: Path | None = None

    def report(
        self, step: int, metrics: Any, objective: Any, checkpoint: str | None = None
    ) -> None:
        if self.detached:
            return
        result = numbers_of(metrics) | objective_metrics(objective) | {"evaluation": step}
        try:
            tune.report(
                result,
                checkpoint=tune.Checkpoint.from_directory(checkpoint) if checkpoint else None,
            )
        except SystemExit:
            self.detached = True
            if self.stop_file is not None and self.stop_file.exists():
                raise SweepStopped("the sweep stopped while the trial ran") from None
            # a stop at the budget's last evaluation is the scheduler ending a finished trial
            self._stopped = self._budget is None or step < self._budget
        except SweepStopped:  # `_StopWatch`'s, raised as Tune let go of this report
            self.detached = True
            raise

    def should_prune(self) -> bool:
        return self._stopped


class SweepStopped(KeyboardInterrupt):
    """Tune stopped the trial because the driver stopped the sweep: the trial runs again later."""


class _StopWatch:
    """Raises `SweepStopped` in the training thread when the driver writes the stop file. Tune's
    own stop reaches a trial only inside `ray.tune.report`, and Tune kills the actor 10 s later:
    a trial with long epochs would die with its record still ``running``."""

    POLL_S = 0.5

    def __init__(self, stop_file: Path | None) -> None:
        self.stop_file = stop_file
        self._target = threading.get_ident()
        self._armed = threading.Lock()
        self._done = threading.Event()

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        if self.stop_file is not None:
            threading.Thread(target=self._watch, name="hpsweep-stop-watch", daemon=True).start()
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


def numbers_of(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def objective_metrics(objective: Any) -> dict[str, float]:
    if isinstance(objective, (list, tuple)):
        return {f"{METRIC}_{i}": float(v) for i, v in enumerate(objective)}
    return {METRIC: float(objective)}


def worst(directions: list[str]) -> dict[str, float]:
    """The objective a trial without a result reports: Tune's schedulers need one (PBT raises
    without it) and rank it last; hpsweep's searcher ignores it (`FAILED_KEY`)."""
    values = [math.inf if d == "minimize" else -math.inf for d in directions]
    return objective_metrics(values if len(values) > 1 else values[0])


class _InFlight:
    """The trial functions running in this actor process, waited for (up to `ENDING_WAIT_S`,
    under the 10 s after which Tune kills an actor it stopped) before the actor ends: in the
    trainable's ``cleanup`` and at exit."""

    ENDING_WAIT_S = 8.0

    def __init__(self) -> None:
        self._count = 0
        self._changed = threading.Condition()
        self._registered = False

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        with self._changed:
            self._count += 1
            if not self._registered:  # in the processes that run trials only
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


def _await_endings() -> None:
    """`_IN_FLIGHT.wait`, named by a module function: Tune pickles the trainable by value."""
    _IN_FLIGHT.wait()


def trainable(runner: TrialRunner, plan: RoundPlan) -> type:
    """The round's Tune trainable: Tune's function trainable of `train_trial`, whose ``cleanup``
    lets a trial Tune stopped record its ending (callbacks, a slow MLflow, a folder to ship)
    before the actor goes; killed in it, it would be trained again in the next round."""
    from ray.tune.trainable import wrap_function

    base = wrap_function(
        tune.with_parameters(train_trial, runner=runner, plan=plan), name="train_trial"
    )

    class Trainable(base):  # type: ignore[misc, valid-type]
        def cleanup(self) -> None:
            try:
                super().cleanup()  # releases a trial waiting in tune.report
            finally:
                _await_endings()

    return Trainable


def train_trial(config: dict[str, Any], runner: TrialRunner, plan: RoundPlan) -> None:
    """The Tune function trainable: one trial of the sweep (see the module's docstring)."""
    die_with(plan.driver)
    with _IN_FLIGHT.running():
        for key, value in WORKER_ENV.items():  # also where the user called ray.init
            os.environ.setdefault(key, value)
        wanted = _Wanted(
            tune.get_context().get_trial_id(),
            int(config.get(NUMBER_KEY, 0)),
            config_params(config),
            config.get(AGAIN_KEY),
            plan,
        )
        local = None
        if sees_output_dir(runner.job.output_dir, plan.marker):
            claimed = wanted.claim(Ledger(runner.job.output_dir, plan.n_trials))
            if claimed is None:
                return  # the ledger has enough, the time is up, or another process runs it
            trial, lease = claimed.trial, claimed.claim.lease
            trial.stop_file = stop_file(runner.job.output_dir, plan.marker)
        else:
            local = NodeLocalRuns(runner, plan.marker, plan.storage)
            runner, lease, trial = local.runner, None, wanted.unleased(local)
        trial.user_attrs["ray_trial_id"] = wanted.tune_id  # which Tune trial ran it last
        _train(runner, trial, lease, local, plan.worst_extra)


def this_process() -> tuple[int, float]:
    """This process as `die_with` finds it: its pid, and its start time against a reused pid."""
    return os.getpid(), psutil.Process().create_time()


_WATCHED: set[tuple[int, float]] = set()


def die_with(driver: tuple[int, float] | None) -> None:
    """End this worker the moment the command's process dies, if it runs on this machine: a
    dead command's trial writes nothing more (it resumes from its checkpoint later). A local
    Ray's raylet may die with the command and tell its workers nothing; a worker on another
    machine is killed by Ray when its owner's connection drops. A process at the driver's pid
    with another start time is another machine's (or PID namespace's): not watched."""
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


def _exit_with(command: psutil.Process) -> None:
    """Exit once ``command`` has ended: a pidfd wakes at once; elsewhere, a look every 0.2 s."""
    try:
        pidfd = os.pidfd_open(command.pid)
    except (AttributeError, OSError):  # not Linux 5.3+
        with contextlib.suppress(psutil.Error):
            while command.is_running() and command.status() != psutil.STATUS_ZOMBIE:
                time.sleep(0.2)
    else:
        waiting = select.poll()
        waiting.register(pidfd, select.POLLIN)
        if command.is_running():  # the driver's pid, not one reused meanwhile
            waiting.poll()
    os._exit(1)


@dataclass(frozen=True)
class _Wanted:
    """What a Tune trial asks the ledger for: Tune's id, the driver's number for it, its params
    and, in a round of re-runs, the id of the trial to run again."""

    tune_id: str
    number: int
    params: dict[str, Any]
    again_id: str | None
    plan: RoundPlan

    def claim(self, ledger: Ledger) -> Claimed[RayTrial] | None:
        """The trial to run with its lease; None when there is none. A trial whose previous run
        still ends on another actor (`Verdict.BUSY`, a PBT exploit) waits, as reset_config()
        would."""
        patience = time.monotonic() + float(os.environ.get("TUNE_FUNCTION_THREAD_TIMEOUT_S", 60))
        while True:
            got = ledger.take_trial(self._choose, self._make)
            if got is not Verdict.BUSY:
                return got if isinstance(got, Claimed) else None
            if time.monotonic() > patience:
                return None
            time.sleep(0.2)

    def _choose(self, session: FolderSession) -> Claim | Verdict:
        """The trial to run again (a round of re-runs), this Tune trial's own (Tune starts it once
        more), or a new one numbered as the driver asks if that number is free."""
        ledger, plan = session.ledger, self.plan
        if self.again_id is not None:
            return session.claim_trial(self.again_id) or Verdict.DONE  # or another command runs it
        earlier = ledger.record(self.tune_id)
        if earlier is not None:
            if earlier.state == "running" or ledger.held(self.tune_id):
                return Verdict.BUSY  # its previous run is still recording its end
            return session.claim_trial(self.tune_id, states=(AGAIN, "pruned")) or Verdict.DONE
        if plan.deadline is not None and time.time() >= plan.deadline:
            return Verdict.DONE
        if len(ledger.failures_since(plan.started)) >= plan.max_failed_trials:
            return Verdict.DONE  # the driver ends the sweep with the one line saying so
        claim = session.claim_new(numbered=True, prefer=self.number)
        return Verdict.DONE if isinstance(claim, Verdict) else claim

    def _make(self, claim: Claim) -> RayTrial:
        """The trial of ``claim``, numbered by it: as recorded in a round of re-runs, else with
        Tune's params; one that waited to run again continues from its own folder."""
        assert claim.number is not None
        if self.again_id is not None:
            assert claim.again is not None
            params, id_ = claim.again.params, claim.again.id
        else:
            params, id_ = self.params, self.tune_id
        trial = RayTrial(claim.number, params, id=id_, budget=self.plan.budget)
        if claim.again is not None:
            trial.user_attrs["again"] = claim.again
        return trial

    def unleased(self, local: NodeLocalRuns) -> RayTrial:
        """The trial on a node without ``--output-dir``: its folder comes back from Ray's storage."""
        budget = self.plan.budget
        again = self.plan.again.get(self.again_id) if self.again_id else None
        if again is None:
            earlier = local.fetch()  # this Tune trial ran here before (a retry, a PBT exploit)
            number = earlier.number if earlier else self.number
            return RayTrial(number, self.params, id=self.tune_id, budget=budget)
        record = runs.TrialRecord(**again)
        fetched = local.fetch(record.user_attrs.get("ray_shipped_to"))
        if fetched is None:  # it ran on a node that sees --output-dir: its checkpoints are not here
            record.run_dir = str(local.folder / Path(record.run_dir).name)
        trial = RayTrial(record.number, record.params, id=record.id, budget=budget)
        trial.user_attrs["again"] = fetched or record
        return trial


def _train(
    runner: TrialRunner,
    trial: RayTrial,
    lease: Hold | None,
    local: NodeLocalRuns | None,
    worst_extra: dict[str, float],
) -> None:
    """Train the trial, note the Ray nodes that ran it, then give its lease back or ship its
    run; report a user error or a failure to Tune as a result without an objective."""
    again: runs.TrialRecord | None = trial.user_attrs.get("again")
    # A trial run again continues from its own latest checkpoint; otherwise Tune's (a resume, PBT).
    checkpoint = tune.get_checkpoint() if again is None else None
    run_dir = _run_dir(runner, trial, again)
    try:
        with checkpoint.as_directory() if checkpoint else contextlib.nullcontext(None) as folder:
            if folder is not None:
                trial.user_attrs["resume_from"] = folder
            earlier = runs.TrialRecord.load(run_dir / runs.TRIAL_FILE)
            try:
                failed, user_error = _run(runner, trial)
            finally:
                run_dir = _run_dir(runner, trial, again)  # hp_name may read what model_init set
                _note_ray_attrs(run_dir, trial, earlier, folder, runner.job.home)
    finally:
        if lease is not None:
            lease.release()
        if local is not None:
            local.ship(run_dir)
    if trial.detached:
        # Returning would make Tune's wrapper report once more to a session nobody reads: the
        # thread would hang and a reused actor's next trial fail. Leave as Tune's stop expects.
        raise SystemExit(0)
    if user_error is not None:
        tune.report({USER_ERROR_KEY: user_error, **worst(runner.job.directions), **worst_extra})
    elif failed:
        tune.report({FAILED_KEY: 1.0, **worst(runner.job.directions), **worst_extra})


def _run(runner: TrialRunner, trial: RayTrial) -> tuple[bool, str | None]:
    """Run the trial under the stop file's watch: (whether it failed, the sweep's user error)."""
    try:
        with _StopWatch(trial.stop_file).armed():
            runner(trial)
    except (TrialPruned, SweepStopped):
        pass
    except TrialFailed:
        return True, None
    except UserError as exc:  # the whole sweep cannot go on: tell the driver, no retry
        if trial.detached:
            raise  # Tune reads no more results from this trial; fail it instead
        return False, str(exc)
    return False, None


def _run_dir(runner: TrialRunner, trial: RayTrial, again: runs.TrialRecord | None) -> Path:
    if again is not None:
        return Path(again.run_dir)
    job, name = runner.job, None
    if job.hp_name is not None:
        with contextlib.suppress(Exception):  # the runner reports a broken hp_name
            name = job.hp_name(trial)
    return runs.run_dir_for(job.output_dir, trial.id, name if isinstance(name, str) else None)


def _note_ray_attrs(
    run_dir: Path,
    trial: RayTrial,
    earlier: runs.TrialRecord | None,
    restored_from: str | None,
    home: runs.Home | None,
) -> None:
    """Keep in trial.json (here, and at an object-store ``home``) which Ray nodes ran the trial
    and how often Tune restored it from a checkpoint."""
    record = runs.TrialRecord.load(run_dir / runs.TRIAL_FILE)
    if record is None or record.id != trial.id:
        return
    node = ray.get_runtime_context().get_node_id()
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
        with contextlib.suppress(Exception):  # best effort: the trial's own upload sent it
            home.upload_record(run_dir)
