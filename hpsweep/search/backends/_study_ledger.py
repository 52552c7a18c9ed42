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
  database's own time, so no two clocks are compared). Any machine that looks for work fails the
  trials whose heartbeat is older than `GRACE_S` (``optuna.storages.fail_stale_trials``; the
  database lets one machine win each), and the winner enqueues the same trial again: its record
  id and number ride along as user attributes, so whichever machine picks it up resumes it in its
  own folder from its latest checkpoint. A trial stopped by Ctrl-C or SIGTERM is enqueued again
  the same way. A process killed between creating its trial and its first beat left no heartbeat
  for Optuna to judge: its first beat also sets the trial's `BEAT`, and a running trial seen
  without one for `GRACE_S` (this machine's own clock) is failed and run again the same way.
  The cut-short Optuna trial is FAIL (with ``hpsweep_stopped`` when its process could say so);
  the study never keeps a trial RUNNING that no process runs.
- **Pauses.** When the database goes away (a restart, a failover), every call waits for it
  (`hpsweep.search.backends._patient`); a machine that waited does not judge others' heartbeats
  until they had time to beat again.
- **Home.** The study remembers the sweep's home (``--output-dir``); a command that names
  another is refused before anything is written (`check_home`).
"""

from __future__ import annotations

import time
import warnings
from contextlib import nullcontext
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
#: User attributes of an enqueued trial that runs a cut-short one again: its record id, its number.
AGAIN_ID = "hpsweep_again"
AGAIN_NUMBER = "hpsweep_number"
#: The trial's system attribute its process counts up while it runs, where Optuna has no heartbeat;
#: with Optuna's heartbeat, set once, at the first beat.
BEAT = "hpsweep_beat"
#: The study's user attribute naming the sweep's home.
HOME = "hpsweep_home"

_COUNTED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)


class Heartbeat:
    """A running trial's sign of life in the study, renewed every `HEARTBEAT_S` by a thread until
    `release`; it takes the place of a file lease. Optuna's heartbeat row where the storage has
    one (SQL databases); through Optuna's storage proxy, which has none, a counter in the trial's
    system attribute `BEAT` (see `StudyLedger.reap`)."""

    def __init__(self, storage: Any, trial_id: int) -> None:
        import threading

        self._storage = storage
        self._trial_id = trial_id
        self._optuna = is_heartbeat_enabled(storage)
        self._count = 0
        self._stop = threading.Event()
        self._record()
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

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
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
        # for storages without Optuna's heartbeat: each running trial's last beat seen, and when
        self._beats: dict[int, tuple[Any, float]] = {}
        self._reaped_at = -float("inf")

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
        trials = study._storage.get_all_trials(study._study_id, deepcopy=False, states=_COUNTED)
        finished = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
        if self.n_trials is not None and finished >= self.n_trials:
            return "done"
        running = sum(t.state == TrialState.RUNNING for t in trials)
        if self.n_trials is not None and finished + running >= self.n_trials:
            return "wait"  # no room for one more; a running one may fail or die
        if backend.exhausted():
            return "done"  # a finished grid
        asked = study.ask()
        if not self._admitted(study, asked._trial_id):
            study._storage.set_trial_state_values(asked._trial_id, TrialState.WAITING)
            return "wait"
        beat = Heartbeat(study._storage, asked._trial_id)
        try:
            again = self._again_record(asked)
            trial = backend.wrap(asked, again)
        except BaseException:
            beat.release()
            raise
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

    def stopped(self, backend: Any, trial: Any) -> None:
        """A trial stopped by a signal runs again: enqueue it before its Optuna trial is told."""
        enqueue_again(backend.study, trial.id, trial.number, trial.params)

    # --- dead machines --------------------------------------------------------------------------------

    def reap(self, study: optuna.Study) -> None:
        """Fail the trials whose process stopped beating; each runs again (`run_again_callback`).

        Skipped while this process's storage came back from an outage less than a grace period
        ago: the others' heartbeats were as cut off as ours, and need time to beat again. Looks
        once per `HEARTBEAT_S` at most: a heartbeat cannot go stale faster."""
        storage, now = study._storage, time.monotonic()
        back_at = getattr(storage, "back_at", None)
        if back_at is not None and now - back_at < GRACE_S + HEARTBEAT_S:
            return
        if now - self._reaped_at < HEARTBEAT_S:
            return
        self._reaped_at = now
        optuna_heartbeat = is_heartbeat_enabled(storage)
        if optuna_heartbeat:
            optuna.storages.fail_stale_trials(study)
        for trial in self._silent(study, unbeaten_only=optuna_heartbeat):
            try:
                if storage.set_trial_state_values(trial._trial_id, TrialState.FAIL):
                    run_again_callback(study, trial)
            except optuna.exceptions.UpdateFinishedTrialError:
                pass  # another machine failed it first, and runs it again

    def _silent(self, study: optuna.Study, unbeaten_only: bool = False) -> list[FrozenTrial]:
        """The running trials whose `BEAT` this process has seen unchanged for `GRACE_S` of its
        own clock: no two machines' clocks are compared. ``unbeaten_only``: those that never beat
        (Optuna's heartbeat judges the others)."""
        now = time.monotonic()
        running = study._storage.get_all_trials(
            study._study_id, deepcopy=False, states=(TrialState.RUNNING,)
        )
        seen, silent = {}, []
        for trial in running:
            beat = trial.system_attrs.get(BEAT)
            if unbeaten_only and beat is not None:
                continue
            last = self._beats.get(trial._trial_id)
            seen[trial._trial_id] = last if last is not None and last[0] == beat else (beat, now)
            if now - seen[trial._trial_id][1] > GRACE_S:
                silent.append(trial)
        self._beats = seen
        return silent


def run_again_callback(study: optuna.Study, failed: FrozenTrial) -> None:
    """Optuna's stale-trial callback: the trial whose process died runs again, once. (Its FAIL
    cannot take a user attribute any more; the copy names it.)"""
    trial_id = str(failed.user_attrs.get(AGAIN_ID, failed.number))
    number = int(failed.user_attrs.get(AGAIN_NUMBER, failed.number))
    enqueue_again(study, trial_id, number, failed.params)


def enqueue_again(study: optuna.Study, trial_id: str, number: int, params: dict) -> None:
    """Enqueue the trial ``trial_id`` to run again with ``params``, unless it already waits or
    runs (a process that died between enqueueing and failing its trial)."""
    pending = study._storage.get_all_trials(
        study._study_id, deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING)
    )
    if any(str(t.user_attrs.get(AGAIN_ID)) == trial_id for t in pending):
        return
    study.enqueue_trial(
        dict(params), user_attrs={AGAIN_ID: trial_id, AGAIN_NUMBER: number}, skip_if_exists=False
    )


def check_home(study_attrs: dict[str, Any], home: str, study_name: str, storage_label: str) -> None:
    """Refuse a command whose ``--output-dir`` is not the home its study was begun with."""
    kept = study_attrs.get(HOME)
    if kept is not None and kept != home:
        raise UserError(
            f"study {study_name!r} in {storage_label} keeps its sweep at {kept}, not {home}; "
            f"give --output-dir {kept} (every machine of a sweep names the same home), "
            "or another --study-name"
        )
