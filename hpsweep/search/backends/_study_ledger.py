"""The ledger's second home: the study's own database, for a sweep that runs on many machines.

With ``--storage postgresql://...`` (or ``mysql://``, or Optuna's storage proxy) the machines of a
sweep share no folder they could lock, and their clocks need not agree. The study itself is then
the ledger (docs/many-machines.md), with the same guarantees as the files of
`hpsweep.search.ledger` on one machine:

- **Counting.** A trial counts once it is COMPLETE or PRUNED in the study. There is no lock
  across machines; instead a new trial is first created (``study.ask``) and then admitted only if
  the finished trials plus the unfinished ones created before it are fewer than ``n_trials``. A
  trial created too late goes back to WAITING, where it holds its place until a trial before it
  fails. Every admitted trial had fewer than ``n_trials`` trials before it that could still
  count, so the study never ends with more than ``n_trials`` finished trials, whatever the
  number of machines.
- **Liveness.** A running trial's process records Optuna's heartbeat (`Heartbeat`, in the
  database's own time, so no two clocks are compared); through Optuna's storage proxy, which has
  none, it counts up the trial's `BEAT` instead, and a machine judges the count by its own clock.
  Any machine that looks for work puts a trial whose process stopped beating back to WAITING
  (`run_again`): the same Optuna trial, with its params, number and folder, is taken by the next
  machine that asks, and resumes from its latest checkpoint. A trial stopped by Ctrl-C or SIGTERM
  goes back to WAITING the same way. No trial is failed for its machine's death, and the study
  never keeps a trial RUNNING that no process runs: a process killed between taking a trial and
  its first beat is judged by the trial's `BEAT`, which its first beat sets.
- **One runner per trial.** Optuna can move a trial from WAITING to RUNNING for one process only,
  but not "back to WAITING if still stale": two machines may judge one trial dead at the same
  moment. Each checks, just before, that the trial is still in the run it judged (its start
  time, an opaque token, and its beat), which leaves a window of one call; a process whose trial
  was taken over finds out at its next beat (`Heartbeat.taken_over`), stops training it at its
  next report and records nothing, and only the run that tells the trial's end is counted.
- **Ended from outside.** A trial failed by hand while it runs (optuna-dashboard, the ``optuna``
  command line) is finished in the run it was in, which hpsweep never does to a trial it runs:
  the beat tells it apart from a trial taken over (`standing`), and the trial stops at its next
  report, is recorded failed and is not run again; it does not count, so another takes its place.
- **Pauses.** When the database goes away (a restart, a failover), every call waits for it
  (`hpsweep.search.backends._patient`); a machine that waited does not judge others' heartbeats
  until they had time to beat again.
- **Home.** The study remembers the sweep's home (``--output-dir``); a command that names
  another is refused before anything is written (`check_home`).
"""

from __future__ import annotations

import json
import time
import warnings
from collections import Counter
from contextlib import nullcontext, suppress
from pathlib import Path
from typing import Any

import optuna
from optuna.storages._heartbeat import is_heartbeat_enabled
from optuna.trial import FrozenTrial, TrialState

from hpsweep import runs
from hpsweep.errors import UserError
from hpsweep.search.ledger import Claim

# Optuna marks its heartbeat experimental and expects it under Study.optimize; hpsweep runs the
# same calls around ask and tell.
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")

HEARTBEAT_S = 5
#: A running trial whose heartbeat is older than this (database time) belongs to a dead process.
GRACE_S = 20
#: User attributes of a trial that runs again: the id of its record (its folder) and its number
#: (a trial of an older hpsweep ran again as a copy, which names the trial it continues).
AGAIN_ID = "hpsweep_again"
AGAIN_NUMBER = "hpsweep_number"
#: The trial's system attribute its process counts up while it runs, where Optuna has no heartbeat;
#: with Optuna's heartbeat, set once, at the first beat. A trial put back to WAITING has none.
BEAT = "hpsweep_beat"
#: The study's user attribute naming the sweep's home.
HOME = "hpsweep_home"
#: Why a trial asked after the sweep had its trials was closed without running (`close_unneeded`).
UNNEEDED = "not run: the sweep had its n_trials finished trials when this trial came up"

_COUNTED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)
_READ = (*_COUNTED, TrialState.FAIL)  # the failed ones too, for the display (`publish_counts`)
#: In the sweep's folder on each machine: the study's counts as its workers last read them.
COUNTS_FILE = ".study-counts.json"


class Heartbeat:
    """A running trial's sign of life in the study, renewed every `HEARTBEAT_S` by a thread until
    `release`; it takes the place of a file lease. Optuna's heartbeat row where the storage has
    one (SQL databases); through Optuna's storage proxy, which has none, a counter in the trial's
    system attribute `BEAT` (see `StudyLedger.reap`).

    ``started`` is the trial's start time when this process took it: each beat first checks that
    the trial is still RUNNING from that start, and otherwise stops, having set `taken_over` or
    `ended_outside` (`standing`)."""

    def __init__(self, storage: Any, trial_id: int, started: Any = None) -> None:
        import threading

        self._storage = storage
        self._trial_id = trial_id
        self.started = started
        self._optuna = is_heartbeat_enabled(storage)
        self._count = 0
        #: Set once a beat found the trial back to WAITING or in another process's run.
        self.taken_over = False
        #: The state the trial was given from outside the sweep, once a beat found it ended so.
        self.ended_outside: TrialState | None = None
        self._stop = threading.Event()
        # the first beat too is the thread's: the trial starts without waiting for two writes
        self._thread = threading.Thread(target=self._beat, name="hpsweep-heartbeat", daemon=True)
        self._thread.start()

    def bind(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to bind: the heartbeat belongs to its Optuna trial from the start."""

    def release(self) -> None:
        self._stop.set()

    def _record(self) -> None:
        if self._optuna:
            self._storage.record_heartbeat(self._trial_id)
            if self._count:
                return
        self._count += 1
        self._storage.set_trial_system_attr(self._trial_id, BEAT, self._count)

    def _ours(self) -> bool:
        """Whether the trial still runs in this process's run; if not, note how it left."""
        trial = self._storage.get_trial(self._trial_id)
        how = standing(trial, self.started)
        if how == "outside":
            self.ended_outside = trial.state
        elif how == "elsewhere":
            self.taken_over = True
        return how == "ours"

    def _beat(self) -> None:
        with suppress(Exception):  # unbeaten, the trial is judged by `GRACE_S`
            self._record()
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if self.started is not None and not self._ours():
                    return
                self._record()
            except Exception:  # noqa: BLE001 - the next beat tries again; the trial says why it stops
                pass


class StudyLedger:
    """The trials of a sweep whose study is in a database shared by its machines.

    Args:
        output_dir: the sweep's folder on this machine (records, checkpoints).
        n_trials: how many finished (complete or pruned) trials the sweep wants; None: no limit.
        home: the sweep's home (`hpsweep.runs.Home`), when it is an object store that
            ``output_dir`` stages for: a trial another machine began is found there.
    """

    def __init__(self, output_dir: Path, n_trials: int | None, home: Any = None) -> None:
        self.output_dir = output_dir
        self.n_trials = n_trials
        self.home = home
        self.index = runs.TrialIndex(output_dir)
        # each running trial's run as last seen (its beat, its start) and since when, by our clock
        self._seen: dict[int, tuple[Any, float]] = {}
        self._reaped_at = -float("inf")
        # how many more trials the study had room for at this process's last admission, beyond
        # what the others may take meanwhile; while positive, `next_trial` asks without looking
        self._room = 0
        self._maximize: bool | None = None

    def locked(self) -> Any:
        """No lock: the database orders the trials (see the module's docstring)."""
        return nullcontext()

    def failures_since(self, since: float) -> list[runs.TrialRecord]:
        self.index.refresh()
        return [r for r in self.index.records("failed") if (r.finished_at or 0) >= since]

    # --- handing out trials -------------------------------------------------------------------------

    def next_trial(self, backend: Any) -> tuple[Claim, Any] | str:
        """The next trial for this worker with its `Heartbeat`, or ``"wait"`` (trials still run
        elsewhere; one may have to run again) or ``"done"``."""
        study: optuna.Study = backend.study
        self.reap(study)
        if self.n_trials is not None and self._room <= 0:
            # Near the end, look before asking: a trial asked with no room would only wait.
            # Far from it, `_admitted` alone keeps the count (one read of the study less).
            trials = self._read(study)
            finished = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
            if finished >= self.n_trials:
                close_unneeded(study._storage, trials)
                return "done"
            running = sum(t.state == TrialState.RUNNING for t in trials)
            if finished + running >= self.n_trials:
                return "wait"  # no room for one more; a running one may fail or die
        if backend.exhausted():
            return "done"  # a finished grid
        asked = study.ask()  # a trial put back to WAITING first, else a new one
        if not self._admitted(study, asked._trial_id):
            # it holds its place in case a trial ahead fails; once the sweep has its trials, the
            # machine that sees it so closes it (`close_unneeded`), perhaps before this line
            with suppress(optuna.exceptions.UpdateFinishedTrialError):
                study._storage.set_trial_state_values(asked._trial_id, TrialState.WAITING)
            return "wait"
        started = asked._cached_frozen_trial.datetime_start
        beat = Heartbeat(study._storage, asked._trial_id, started)
        try:
            again = self._again_record(asked)
            trial = backend.wrap(asked, again)
        except BaseException:
            beat.release()
            raise
        trial.fence = beat
        return Claim(beat, again), trial  # type: ignore[arg-type]

    def _admitted(self, study: optuna.Study, trial_id: int) -> bool:
        """Whether fewer than ``n_trials`` trials that may still count are ahead of ``trial_id``:
        the finished ones, and the unfinished ones created before it."""
        if self.n_trials is None:
            return True
        trials = self._read(study)
        ahead = sum(
            t.state in (TrialState.COMPLETE, TrialState.PRUNED) or t._trial_id < trial_id
            for t in trials
            if t._trial_id != trial_id
        )
        # The room left once this trial runs, less what the other machines may take before this
        # one asks again (about one trial each: as many as run now, twice over).
        running = sum(t.state == TrialState.RUNNING for t in trials)
        self._room = self.n_trials - ahead - 1 - 2 * running
        return ahead < self.n_trials

    def _read(self, study: optuna.Study) -> list[FrozenTrial]:
        """The study's trials that may still count, read once; what was read is published for
        this machine's progress display on the way (`publish_counts`)."""
        trials = study._storage.get_all_trials(study._study_id, deepcopy=False, states=_READ)
        if self._maximize is None:
            self._maximize = study.directions == [optuna.study.StudyDirection.MAXIMIZE]
        publish_counts(self.output_dir, trials, self._maximize)
        return [t for t in trials if t.state != TrialState.FAIL]

    def _again_record(self, asked: optuna.Trial) -> runs.TrialRecord | None:
        """The record of the trial ``asked`` runs again (its folder and checkpoints), if any: on
        this machine, or at an object-store home (the trial runner pulls its folder from there)."""
        attrs = asked.user_attrs
        if AGAIN_ID not in attrs:
            return None
        wanted = str(attrs[AGAIN_ID])
        if self.home is not None and self.home.remote:
            records = self.home.records()
        else:
            self.index.refresh(verify=True)
            records = self.index.records()
        return next((r for r in records if r.id == wanted), None)

    def stopped(self, backend: Any, trial: Any) -> bool:
        """A trial stopped by a signal goes back to WAITING, to run again on the next machine that
        asks; its backend is told nothing (True)."""
        fence = getattr(trial, "fence", None)
        storage = backend.study._storage
        run_again(storage, storage.get_trial(trial.ref), getattr(fence, "started", None))
        return True

    # --- dead machines --------------------------------------------------------------------------------

    def reap(self, study: optuna.Study) -> None:
        """Put the trials whose process stopped beating back to WAITING (`run_again`).

        A trial is judged by the run it is in (its start time and its `BEAT`): by Optuna's
        heartbeat (database time) once that run has beaten, otherwise by how long this process
        has seen the run's `BEAT` unchanged (a counter through the proxy; unset before the first
        beat), by its own clock. Skipped while this process's storage came back from an outage
        less than a grace period ago: the others' heartbeats were as cut off as ours, and need time
        to beat again. Looks once per `HEARTBEAT_S` at most: a heartbeat cannot go stale faster."""
        storage, now = study._storage, time.monotonic()
        back_at = getattr(storage, "back_at", None)
        if back_at is not None and now - back_at < GRACE_S + HEARTBEAT_S:
            return
        if now - self._reaped_at < HEARTBEAT_S:
            return
        self._reaped_at = now
        optuna_heartbeat = is_heartbeat_enabled(storage)
        running = storage.get_all_trials(
            study._study_id, deepcopy=False, states=(TrialState.RUNNING,)
        )
        # read after the runs above: a trial stale now was stale in the run we saw, or has a new
        # start (and `run_again` leaves it alone)
        stale = set(storage._get_stale_trial_ids(study._study_id)) if optuna_heartbeat else set()
        seen: dict[int, tuple[Any, float]] = {}
        for trial in running:
            run = (trial.system_attrs.get(BEAT), trial.datetime_start)
            last = self._seen.get(trial._trial_id)
            seen[trial._trial_id] = last if last is not None and last[0] == run else (run, now)
            if optuna_heartbeat and run[0] is not None:
                dead = trial._trial_id in stale
            else:
                dead = now - seen[trial._trial_id][1] > GRACE_S
            if dead:
                run_again(storage, trial, trial.datetime_start)
        self._seen = seen


def standing(trial: FrozenTrial, started: Any) -> str:
    """How a trial that this process runs stands in the study, as read now: ``"ours"`` (it still
    runs in this process's run, the one that began at ``started``), ``"elsewhere"`` (hpsweep put
    it back to WAITING, another process runs it, or closed it unneeded) or ``"outside"`` (someone
    outside the sweep ended it: optuna-dashboard's Fail button, the ``optuna`` command line).

    hpsweep never finishes a trial another process runs: a run it ends it first puts back to
    WAITING, which clears its `BEAT` (`run_again`), and a trial it closes unneeded says so
    (`close_unneeded`). So a trial finished in our run, with its beat, was ended from outside.
    ``started`` None: a study that machines do not share, where only this process changes a
    trial while it runs it."""
    if started is None:
        return "outside" if trial.state.is_finished() else "ours"
    if trial.datetime_start != started:
        return "elsewhere"
    if trial.state == TrialState.RUNNING:
        return "ours"
    ours_to_the_end = (
        trial.system_attrs.get(BEAT) is not None
        and trial.system_attrs.get("fail_reason") != UNNEEDED
    )
    return "outside" if trial.state.is_finished() and ours_to_the_end else "elsewhere"


def run_again(storage: Any, trial: FrozenTrial, started: Any) -> bool:
    """Put ``trial`` back to WAITING, to run again from its latest checkpoint on whichever machine
    asks next, if it is still RUNNING in the run that began at ``started`` (None: any run) with
    the beat it had; whether it was put back. It keeps its number, params and folder; its record
    id rides along as `AGAIN_ID`, and its `BEAT` is cleared for the next run."""
    trial_id = trial._trial_id
    try:
        now = storage.get_trial(trial_id)
        if now.state != TrialState.RUNNING or (
            started is not None
            and (
                now.datetime_start != started
                or now.system_attrs.get(BEAT) != trial.system_attrs.get(BEAT)
            )
        ):
            return False
        if AGAIN_ID not in now.user_attrs:
            storage.set_trial_user_attr(trial_id, AGAIN_ID, str(now.number))
            storage.set_trial_user_attr(trial_id, AGAIN_NUMBER, now.number)
        storage.set_trial_system_attr(trial_id, BEAT, None)
        return bool(storage.set_trial_state_values(trial_id, TrialState.WAITING))
    except optuna.exceptions.UpdateFinishedTrialError:
        return False  # it ended meanwhile


class StudyCounts:
    """The study's trials by how they stand, for the progress display of one machine among many
    (`hpsweep.search.progress.Counts`): read from `COUNTS_FILE`, which the ledger of each worker
    on this machine rewrites whenever it reads the study's trials anyway (each trial it asks for,
    and near the end). So the display adds no database connection and no read of its own; its
    counts are as fresh as this machine's last ask (a worker asks again as soon as its trial is
    told)."""

    def __init__(self, output_dir: Path) -> None:
        self._path = output_dir / COUNTS_FILE
        self._seen: Any = None
        self._counts: Any = None

    def __call__(self) -> Any:
        from hpsweep.search.progress import Counts

        stat = self._path.stat()  # none yet: the display counts the folder's records
        if (stat.st_mtime_ns, stat.st_size) != self._seen:
            data = json.loads(self._path.read_text())
            best = data.pop("best", None)
            self._counts = Counts(**data, best=tuple(best) if best else None, as_of=stat.st_mtime)
            self._seen = (stat.st_mtime_ns, stat.st_size)
        return self._counts


def publish_counts(output_dir: Path, trials: list[FrozenTrial], maximize: bool) -> None:
    """Write the counts of ``trials`` (all the study's, as just read) to `COUNTS_FILE`."""
    states = Counter(t.state for t in trials)
    done = [t for t in trials if t.state == TrialState.COMPLETE and len(t.values or ()) == 1]
    best = (max if maximize else min)(done, key=lambda t: t.values[0]) if done else None
    failed = sum(
        t.state == TrialState.FAIL
        and t.system_attrs.get("fail_reason") != UNNEEDED
        and not t.user_attrs.get("hpsweep_stopped")
        for t in trials
    )
    data = {
        "done": states[TrialState.COMPLETE] + states[TrialState.PRUNED],
        "failed": failed,
        "stopped": states[TrialState.WAITING],
        "running": states[TrialState.RUNNING],
        "best": [best.values[0], _number(best)] if best is not None else None,
    }
    with suppress(OSError):  # a display's file: never worth a trial
        runs.write_json(output_dir / COUNTS_FILE, data)


def _number(trial: FrozenTrial) -> int:
    """The trial's number as hpsweep's records name it (a copy run by an older hpsweep names the
    trial it continues)."""
    return int(trial.user_attrs.get(AGAIN_NUMBER, trial.number))


def close_unneeded(storage: Any, trials: list[FrozenTrial]) -> None:
    """Close the WAITING trials left once the study holds its ``n_trials`` finished ones: trials
    asked at the end of a sweep by machines that raced for its last places (`StudyLedger._admitted`),
    never run and never to run. Optuna has no way to delete a trial and no state for "not needed",
    so each becomes FAIL with its ``fail_reason`` (the attribute Optuna's own failures carry)
    saying so: the dashboard and ``optuna trials`` show no work left undone. A machine that
    popped one meanwhile finds it finished and asks no more (`next_trial`)."""
    for trial in trials:
        if trial.state != TrialState.WAITING:
            continue
        with suppress(optuna.exceptions.UpdateFinishedTrialError):
            storage.set_trial_system_attr(trial._trial_id, "fail_reason", UNNEEDED)
            storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)


def check_home(study_attrs: dict[str, Any], home: str, study_name: str, storage_label: str) -> None:
    """Refuse a command whose ``--output-dir`` is not the home its study was begun with."""
    kept = study_attrs.get(HOME)
    if kept is not None and kept != home:
        raise UserError(
            f"study {study_name!r} in {storage_label} keeps its sweep at {kept}, not {home}; "
            f"give --output-dir {kept} (every machine of a sweep names the same home), "
            "or another --study-name"
        )
