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
- **Pauses.** When the database goes away (a restart, a failover), every call waits for it
  (`hpsweep.search.backends._patient`); a machine that waited does not judge others' heartbeats
  until they had time to beat again.
- **Home.** The study remembers the sweep's home (``--output-dir``); a command that names
  another is refused before anything is written (`check_home`).
"""

from __future__ import annotations

import time
import warnings
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

_COUNTED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)


class Heartbeat:
    """A running trial's sign of life in the study, renewed every `HEARTBEAT_S` by a thread until
    `release`; it takes the place of a file lease. Optuna's heartbeat row where the storage has
    one (SQL databases); through Optuna's storage proxy, which has none, a counter in the trial's
    system attribute `BEAT` (see `StudyLedger.reap`).

    ``started`` is the trial's start time when this process took it: each beat first checks that
    the trial is still RUNNING from that start, and otherwise sets `taken_over` and stops."""

    def __init__(self, storage: Any, trial_id: int, started: Any = None) -> None:
        import threading

        self._storage = storage
        self._trial_id = trial_id
        self.started = started
        self._optuna = is_heartbeat_enabled(storage)
        self._count = 0
        #: Set once a beat found the trial back to WAITING or in another process's run.
        self.taken_over = False
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
        trial = self._storage.get_trial(self._trial_id)
        return trial.state == TrialState.RUNNING and trial.datetime_start == self.started

    def _beat(self) -> None:
        with suppress(Exception):  # unbeaten, the trial is judged by `GRACE_S`
            self._record()
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if self.started is not None and not self._ours():
                    self.taken_over = True
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
            trials = study._storage.get_all_trials(study._study_id, deepcopy=False, states=_COUNTED)
            finished = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
            if finished >= self.n_trials:
                return "done"
            running = sum(t.state == TrialState.RUNNING for t in trials)
            if finished + running >= self.n_trials:
                return "wait"  # no room for one more; a running one may fail or die
        if backend.exhausted():
            return "done"  # a finished grid
        asked = study.ask()  # a trial put back to WAITING first, else a new one
        if not self._admitted(study, asked._trial_id):
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
        trials = study._storage.get_all_trials(study._study_id, deepcopy=False, states=_COUNTED)
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


def check_home(study_attrs: dict[str, Any], home: str, study_name: str, storage_label: str) -> None:
    """Refuse a command whose ``--output-dir`` is not the home its study was begun with."""
    kept = study_attrs.get(HOME)
    if kept is not None and kept != home:
        raise UserError(
            f"study {study_name!r} in {storage_label} keeps its sweep at {kept}, not {home}; "
            f"give --output-dir {kept} (every machine of a sweep names the same home), "
            "or another --study-name"
        )
