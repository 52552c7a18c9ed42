"""The ledger's second home: the study's own database, for a sweep that runs on many machines.

With ``--storage postgresql://...`` (or ``mysql://``, or Optuna's storage proxy) the machines of a
sweep share no folder they could lock, and their clocks need not agree. The study itself is then
the ledger (docs/many-machines.md), with the same guarantees as the files of
`hpsweep.search.ledger` on one machine:

- **Counting.** A trial counts once it is COMPLETE or PRUNED in the study. There is no lock
  across machines; instead a new trial is first created (``study.ask``) and then admitted only if
  fewer than ``n_trials`` of the trials created before it may still count (are not FAIL). Optuna
  numbers a study's trials densely in creation order (creating one locks the study's row), so a
  trial numbered k had exactly k trials created before it: one numbered below ``n_trials`` is
  admitted without a read, and one numbered k >= ``n_trials`` only if at least
  k - ``n_trials`` + 1 of those k are FAIL. A FAIL trial stays FAIL, so the failures this process
  has seen in any earlier read still hold (`StudyTally`); when they are too few it reads the
  study once more. A trial created too late goes back to WAITING, where it holds its place until
  a trial before it fails. Every admitted trial had fewer than ``n_trials`` trials before it that
  could still count, so the study never ends with more than ``n_trials`` finished trials: of
  ``n_trials`` + 1 finished ones, the one created last had ``n_trials`` before it that never
  failed. A trial put back to WAITING runs again under its own number, so each of its runs is
  admitted by the same rule: however many trials after it finished meanwhile, they were admitted
  with it among those before them. Near the end (when the next trial this process asks for may
  find no room, judged from the numbers it was given: `StudyLedger._near_end`) a worker reads
  the study before asking, and asks for nothing once the finished and running trials fill the
  sweep (`StudyLedger.next_trial`).
- **Liveness.** A running trial's process records Optuna's heartbeat (`Heartbeat`, in the
  database's own time, so no two clocks are compared); through Optuna's storage proxy, which has
  none, it counts up the trial's `BEAT` instead, and a machine judges the count by its own clock.
  The first beat comes `HEARTBEAT_S` after the trial is taken, not at once: a trial shorter than
  that never writes one. Until its first beat, a trial's run is judged by how long a machine has
  seen it without a `BEAT`, by that machine's own clock, against `GRACE_S` (longer than
  `HEARTBEAT_S`); so a process killed between taking a trial and its first beat is noticed too.
  Any machine that looks for work puts a trial whose process stopped beating back to WAITING
  (`StudySession.reap`, `run_again`): the same Optuna trial, with its params, number and folder, is taken by the next
  machine that asks, and resumes from its latest checkpoint. A trial stopped by Ctrl-C or SIGTERM
  goes back to WAITING the same way. No trial is failed for its machine's death, and the study
  never keeps a trial RUNNING that no process runs.
- **One runner per trial.** Optuna can move a trial from WAITING to RUNNING for one process only,
  but not "back to WAITING if still stale": two machines may judge one trial dead at the same
  moment. Each checks, just before, that the trial is still in the run it judged (its start
  time, an opaque token, and its beat), which leaves a window of one call; a process whose trial
  was taken over finds out at its next beat (`Heartbeat.found`), stops training it at its next
  report and records nothing, and only the run that tells the trial's end is counted.
- **Ended from outside.** A trial failed by hand while it runs (optuna-dashboard, the ``optuna``
  command line) is finished in the run it was in, which hpsweep never does to a trial it runs
  (`standing`): hpsweep first puts a run back to WAITING, which clears its `BEAT`, and a trial it
  closes unneeded says so. A finished trial still in our run is therefore ended from outside if
  it has our `BEAT`, or if it has none and this process has not beaten yet and took the trial
  less than `GRACE_S` - `HEARTBEAT_S` ago: no other machine can have judged an unbeaten run dead
  sooner. Otherwise it may have been put back (a process paused past the grace, or one that beat
  and lost its `BEAT`) and ended meanwhile, and it is taken as no longer ours. A trial ended
  from outside stops at its next report, is recorded failed and is not run again;
  it does not count, so another takes its place.
- **Pauses.** When the database goes away (a restart, a failover), every call waits for it
  (`hpsweep.search.backends._optuna._retrying_storage`); a machine that waited does not judge others' heartbeats
  until they had time to beat again.
- **Stopping.** With ``--stop-when``, the rule is judged before a new trial is asked, when a
  trial finished since this process last judged, and its decision is kept in the study (the
  user attribute `hpsweep.search.stopping.STUDY_ATTR`): every machine reads it before it asks,
  so none starts a new trial after it. Trials running then finish and count; a trial waiting
  to run again still runs; one asked meanwhile is closed unneeded (`StudyLedger._after_stop`).
- **Home.** The study remembers the sweep's home (``--output-dir``); a command that names
  another is refused before anything is written (`check_home`).

Per trial, far from the end of a sweep, the ledger reads nothing and costs the same at the
10,000th trial as at the first: each machine's progress display gets the study's counts from
`COUNTS_FILE`, which a worker rewrites at most every `PUBLISH_S` from a `StudyTally` that looks
only at the trials that changed since its last read.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import time
import warnings
from bisect import bisect_left, insort
from collections.abc import Sequence
from contextlib import suppress
from itertools import chain
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import optuna
from optuna.storages._heartbeat import is_heartbeat_enabled
from optuna.trial import FrozenTrial, TrialState

from hpsweep import runs
from hpsweep.errors import UserError
from hpsweep.search import stopping
from hpsweep.search.ledger_base import Claim, Claimed, LedgerSession, TrialSource, Verdict
from hpsweep.search.progress import Counts
from hpsweep.search.warm_start import WARM_ATTR
from hpsweep.trial import Trial

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
#: The system attribute in which Optuna says why a trial failed; hpsweep's closures use it too.
FAIL_REASON = "fail_reason"
#: Why a trial asked after the sweep had its trials was closed without running (`close_unneeded`).
UNNEEDED = (
    "not run: the sweep had its n_trials finished trials, or its stopping rule had ended it, "
    "when this trial came up"
)
#: In the sweep's folder on each machine: the study's counts as its workers last read them.
COUNTS_FILE = ".study-counts.json"
#: How old `COUNTS_FILE` may get before a worker on the machine reads the study to rewrite it.
PUBLISH_S = 2.0


class Standing(enum.Enum):
    """How a trial that this process runs stands in the study (`standing`)."""

    #: It still runs in this process's run.
    OURS = "ours"
    #: hpsweep put it back to WAITING (another process may run it now) or closed it unneeded.
    ELSEWHERE = "elsewhere"
    #: Someone outside the sweep ended it: optuna-dashboard's Fail button, the ``optuna`` CLI.
    OUTSIDE = "outside"


class Heartbeat:
    """A running trial's sign of life in the study, renewed every `HEARTBEAT_S` by a thread until
    `release`, the first time `HEARTBEAT_S` after the trial was taken; it takes the place of a
    file lease. Optuna's heartbeat row where the storage has one (SQL databases); through Optuna's
    storage proxy, which has none, a counter in the trial's system attribute `BEAT` (see
    `StudySession.reap`).

    ``started`` is the trial's start time when this process took it: each beat first checks that
    the trial is still RUNNING from that start, and otherwise stops, having noted in `found` how
    it left (and in `ended_outside` the state it was given, when that was from outside)."""

    def __init__(self, storage: Any, trial_id: int, started: Any = None) -> None:
        import threading

        self._storage = storage
        self._trial_id = trial_id
        self.started = started
        #: When this process took the trial, by its own clock (`standing`).
        self.taken_at = time.monotonic()
        self._optuna = is_heartbeat_enabled(storage)
        #: The beats written so far.
        self.beats = 0
        #: How the trial stood at the last beat's check.
        self.found = Standing.OURS
        #: The state the trial was given from outside the sweep, once a beat found it ended so.
        self.ended_outside: TrialState | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="hpsweep-heartbeat", daemon=True)
        self._thread.start()

    def bind(self, trial_id: str, ref: object = None, *, number: int | None = None) -> None:
        """Nothing to bind: the heartbeat belongs to its Optuna trial from the start."""

    def release(self) -> None:
        self._stop.set()

    def _record(self) -> None:
        if self._optuna:
            self._storage.record_heartbeat(self._trial_id)
            if self.beats:
                self.beats += 1
                return
        self._storage.set_trial_system_attr(self._trial_id, BEAT, self.beats + 1)
        self.beats += 1

    def _ours(self) -> bool:
        """Whether the trial still runs in this process's run; if not, note how it left."""
        trial = self._storage.get_trial(self._trial_id)
        self.found = standing(trial, self)
        if self.found == Standing.OUTSIDE:
            self.ended_outside = trial.state
        return self.found == Standing.OURS

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if self.started is not None and not self._ours():
                    return
                self._record()
            except Exception:  # noqa: BLE001 - the next beat tries again; the trial says why it stops
                pass


@runtime_checkable
class StudyBackend(Protocol):
    """What the study's ledger needs of the backend whose study it keeps
    (`hpsweep.search.backends._optuna._backend.OptunaBackend`), besides asking and abandoning trials."""

    #: The study this worker process opened (None before `open`).
    study: optuna.Study | None

    def wrap(self, asked: optuna.Trial, again: runs.TrialRecord | None = None) -> Trial:
        """The `Trial` of the Optuna trial ``asked`` (``again``: the record it runs again)."""

    def exhausted(self) -> bool:
        """Whether the sampler has nothing more to try (a finished grid)."""


def _study_of(backend: TrialSource) -> tuple[StudyBackend, optuna.Study]:
    """``backend`` as the study's ledger serves it, with its open study."""
    if not isinstance(backend, StudyBackend) or backend.study is None:
        raise TypeError(f"the study's ledger serves an opened Optuna backend, not {backend!r}")
    return backend, backend.study


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
        self.judge = stopping.StopJudge(output_dir, n_trials)
        # each running trial's run as last seen (its beat, its start) and since when, by our clock
        self._seen: dict[int, tuple[Any, float]] = {}
        self._reaped_at = -float("inf")
        self._tally: StudyTally | None = None
        # the highest trial number this process knows of (None: it has not read the study yet),
        # and by how much the study grew between its last two asks: where its next trial may land
        self._highest: int | None = None
        self._growth = 1
        # `COUNTS_FILE`'s modification time as last seen, and since when by our clock
        self._counts_seen: tuple[int, float] = (-1, 0.0)

    def locked(self) -> StudySession:
        """No lock: the database orders the trials (see the module's docstring); the session
        that a lock would hold all the same, for what a files ledger does under its lock."""
        return StudySession(self)

    def failures_since(self, since: float) -> list[runs.TrialRecord]:
        self.index.refresh()
        return self.index.failed_since(since)

    # --- handing out trials -------------------------------------------------------------------------

    def next_trial(self, backend: TrialSource) -> Claimed[Trial] | Verdict:
        """The next trial for this worker with its `Heartbeat`, or `Verdict.WAIT` (trials still
        run elsewhere; one may have to run again) or `Verdict.DONE`."""
        optuna_backend, study = _study_of(backend)
        with self.locked() as session:
            session.reap(study)
        fresh = self._read(study, publish=True) if self._publish_due() else None
        if self.n_trials is not None and self._near_end():
            # Look before asking: a trial asked with no room would only wait.
            trials, tally = fresh or self._read(study)
            if tally.finished >= self.n_trials:
                if close_unneeded(study._storage, tally.unfinished(trials)):
                    self._read(study)
                publish_counts(self.output_dir, tally)  # what the last progress line reads
                return Verdict.DONE
            if tally.finished + tally.running >= self.n_trials:
                return Verdict.WAIT  # no room for one more; a running one may fail or die
        if optuna_backend.exhausted():
            return Verdict.DONE  # a finished grid
        if self._stopped_by_rule(study):
            return self._after_stop(study, optuna_backend)
        asked = study.ask()  # a trial put back to WAITING first, else a new one
        if not self._admitted(study, asked.number):
            # it holds its place in case a trial ahead fails; once the sweep has its trials, the
            # machine that sees it so closes it (`close_unneeded`), perhaps before this line
            with suppress(optuna.exceptions.UpdateFinishedTrialError):
                study._storage.set_trial_state_values(asked._trial_id, TrialState.WAITING)
            return Verdict.WAIT
        return self._claim(study, asked, optuna_backend)

    def _claim(
        self, study: optuna.Study, asked: optuna.Trial, backend: StudyBackend
    ) -> Claimed[Trial]:
        """The admitted trial ``asked``, wrapped by ``backend``, with its running `Heartbeat`."""
        started = asked._cached_frozen_trial.datetime_start
        beat = Heartbeat(study._storage, asked._trial_id, started)
        try:
            again = self._again_record(asked)
            trial = backend.wrap(asked, again)
        except BaseException:
            beat.release()
            raise
        trial.fence = beat  # type: ignore[attr-defined]  # an OptunaTrial's
        return Claimed(Claim(beat, again), trial)

    def _stopped_by_rule(self, study: optuna.Study) -> bool:
        """Whether the sweep's stopping rule ended it: its decision in the study (any machine's),
        or the rule firing now on the study's finished trials (`stopping.StopJudge`). A decision
        is copied to this machine's folder, for the sweep's last line."""
        storage, study_id = study._storage, study._study_id

        def load() -> stopping.StopState:
            attrs = storage.get_study_user_attrs(study_id)
            return stopping.StopState.from_dict(attrs.get(stopping.STUDY_ATTR))

        def save(state: stopping.StopState) -> None:
            storage.set_study_user_attr(study_id, stopping.STUDY_ATTR, dataclasses.asdict(state))

        stopped = self.judge.stopped(
            load, save, lambda: self._read(study)[1].finished, lambda: finished_in_order(study)
        )
        if stopped:
            stopping.write_state(self.output_dir, load())
        return stopped

    def _after_stop(self, study: optuna.Study, backend: StudyBackend) -> Claimed[Trial] | Verdict:
        """Once the stopping rule ended the sweep: a trial waiting to run again still runs (it
        began before the decision, and counts); no new trial starts, and a placeholder asked
        meanwhile (`_admitted`) is closed unneeded."""
        _, tally = self._read(study, publish=True)
        if tally.waiting:
            asked = study.ask()
            if AGAIN_ID in asked.user_attrs and self._admitted(study, asked.number):
                return self._claim(study, asked, backend)
            with suppress(optuna.exceptions.UpdateFinishedTrialError):
                if AGAIN_ID in asked.user_attrs:
                    study._storage.set_trial_state_values(asked._trial_id, TrialState.WAITING)
                else:
                    study._storage.set_trial_system_attr(asked._trial_id, FAIL_REASON, UNNEEDED)
                    study._storage.set_trial_state_values(asked._trial_id, TrialState.FAIL)
        return Verdict.WAIT if tally.running or tally.waiting else Verdict.DONE

    def _near_end(self) -> bool:
        """Whether the next trial this process asks for may find no room: then it reads the study
        first. Judged from what it knows without reading: the number its next trial may get (its
        last one's, and how much the study grew between its last two asks), the failures and the
        unfinished trials of its last read (each may make another machine ask before it does,
        twice over); so far from the end it reads nothing. A guess too low costs a trial asked
        that waits (`_admitted`), and is closed when the sweep ends (`close_unneeded`)."""
        assert self.n_trials is not None
        tally = self._tally
        if self._highest is None or tally is None:
            return True
        ahead = self._highest + self._growth - tally.failed_before(self._highest + 1)
        return ahead + 2 * (tally.running + tally.waiting) >= self.n_trials

    def _admitted(self, study: optuna.Study, number: int) -> bool:
        """Whether trial ``number`` may run: fewer than ``n_trials`` of the ``number`` trials
        created before it may still count (see the module's docstring). Reads the study only when
        the failures this process knows of are too few to admit it."""
        if self._highest is not None and number > self._highest:
            self._growth = number - self._highest
        self._highest = max(-1 if self._highest is None else self._highest, number)
        if self.n_trials is None or number < self.n_trials:
            return True
        tally = self._tally
        if tally is None or number - tally.failed_before(number) >= self.n_trials:
            _, tally = self._read(study)  # failures this process has not seen yet may make room
        return number - tally.failed_before(number) < self.n_trials

    def _read(
        self, study: optuna.Study, *, publish: bool = False
    ) -> tuple[Sequence[FrozenTrial], StudyTally]:
        """All the study's trials, read once (Optuna's cache reads only what changed), and the
        tally brought up to date with them; published for this machine's display when
        ``publish``, or when its counts are `PUBLISH_S` old."""
        trials = study._storage.get_all_trials(study._study_id, deepcopy=False)
        if self._tally is None:
            maximize = study.directions == [optuna.study.StudyDirection.MAXIMIZE]
            self._tally = StudyTally(maximize)
        self._tally.update(trials)
        self._highest = max(-1 if self._highest is None else self._highest, len(trials) - 1)
        if publish or self._publish_due():
            publish_counts(self.output_dir, self._tally)
        return trials, self._tally

    def _publish_due(self) -> bool:
        """Whether `COUNTS_FILE` is missing or has not changed for `PUBLISH_S` by this process's
        clock (no other clock is compared with it). The workers of a machine, and the machines
        that share a home folder, share the file: whichever finds it stale first rewrites it."""
        try:
            mtime = (self.output_dir / COUNTS_FILE).stat().st_mtime_ns
        except OSError:
            return True
        now = time.monotonic()
        if mtime != self._counts_seen[0]:
            self._counts_seen = (mtime, now)
        return now - self._counts_seen[1] >= PUBLISH_S

    def _again_record(self, asked: optuna.Trial) -> runs.TrialRecord | None:
        """The record of the trial ``asked`` runs again (its folder and checkpoints), if any: on
        this machine, or at an object-store home (the trial runner pulls its folder from there)."""
        attrs = asked.user_attrs
        if AGAIN_ID not in attrs:
            return None
        wanted = str(attrs[AGAIN_ID])
        if self.home is not None and self.home.remote:
            return next((r for r in self.home.records() if r.id == wanted), None)
        found = self.index.lookup(wanted)  # its own file, read now: another host may have run it
        return None if found is None else dataclasses.replace(found)

    def stopped(self, backend: TrialSource, trial: Trial) -> bool:
        """A trial stopped by a signal goes back to WAITING, to run again on the next machine that
        asks; its backend is told nothing (True)."""
        fence = getattr(trial, "fence", None)
        storage = _study_of(backend)[1]._storage
        run_again(storage, storage.get_trial(trial.ref), getattr(fence, "started", None))
        return True


class StudySession(LedgerSession):
    """The study's ledger where a files ledger would hold its lock. There is no lock (the
    database orders the trials), but what a lock would guard is reached only through this
    session all the same, as `StudyLedger.locked` yields it."""

    def __init__(self, ledger: StudyLedger) -> None:
        super().__init__()
        self.ledger = ledger

    def reap(self, study: optuna.Study) -> None:
        """Put the trials whose process stopped beating back to WAITING (`run_again`).

        A trial is judged by the run it is in (its start time and its `BEAT`): by Optuna's
        heartbeat (database time) once that run has beaten, otherwise by how long this process
        has seen the run's `BEAT` unchanged (a counter through the proxy; unset before the first
        beat), by its own clock. Skipped while this process's storage came back from an outage
        less than a grace period ago: the others' heartbeats were as cut off as ours, and need time
        to beat again. Looks once per `HEARTBEAT_S` at most: a heartbeat cannot go stale faster."""
        self._held()
        ledger, storage, now = self.ledger, study._storage, time.monotonic()
        back_at = getattr(storage, "back_at", None)
        if back_at is not None and now - back_at < GRACE_S + HEARTBEAT_S:
            return
        if now - ledger._reaped_at < HEARTBEAT_S:
            return
        ledger._reaped_at = now
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
            last = ledger._seen.get(trial._trial_id)
            seen[trial._trial_id] = last if last is not None and last[0] == run else (run, now)
            if optuna_heartbeat and run[0] is not None:
                dead = trial._trial_id in stale
            else:
                dead = now - seen[trial._trial_id][1] > GRACE_S
            if dead:
                run_again(storage, trial, trial.datetime_start)
        ledger._seen = seen


def standing(trial: FrozenTrial, run: Heartbeat | None) -> Standing:
    """How ``trial``, which this process runs, stands in the study as read now. ``run`` is the
    `Heartbeat` of this process's run of it; None in a study that machines do not share, where
    only this process changes a trial while it runs it.

    hpsweep never finishes a trial another process runs: a run it ends it first puts back to
    WAITING, which clears its `BEAT` (`run_again`), and a trial it closes unneeded says so
    (`close_unneeded`). So a trial finished in our run was ended from outside if it has our beat;
    without one, if this process never beat and took it too recently for any machine to have
    judged the run dead (the module's docstring, "Ended from outside")."""
    if run is None or run.started is None:
        return Standing.OUTSIDE if trial.state.is_finished() else Standing.OURS
    if trial.datetime_start != run.started:
        return Standing.ELSEWHERE
    if trial.state == TrialState.RUNNING:
        return Standing.OURS
    if not trial.state.is_finished() or trial.system_attrs.get(FAIL_REASON) == UNNEEDED:
        return Standing.ELSEWHERE
    if trial.system_attrs.get(BEAT) is not None:
        return Standing.OUTSIDE
    unjudged = not run.beats and time.monotonic() - run.taken_at < GRACE_S - HEARTBEAT_S
    return Standing.OUTSIDE if unjudged else Standing.ELSEWHERE


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


class StudyTally:
    """The study's trials by how they stand, and its best, kept from one read of all its trials
    to the next at a cost that follows what changed, not how many trials the study holds.

    Optuna numbers a study's trials densely in creation order and lists them by number, and a
    finished trial never changes (Optuna refuses every write to it). So each trial is tallied
    once, when it is first seen finished; a read looks only at the trials created since the last
    one and at those unfinished then. Where a list is not the whole study by number (no storage of
    Optuna's gives one), it is counted afresh.

    Args:
        maximize: whether the study's one objective is maximised (the best is the highest).
    """

    def __init__(self, maximize: bool) -> None:
        self.maximize = maximize
        self._reset()

    def _reset(self) -> None:
        self._looked = 0  # trials [0, _looked) were looked at
        self._open: list[int] = []  # the numbers among them unfinished when last looked at
        self._fails: list[int] = []  # the numbers of the FAIL trials, in order
        self._whole = True  # whether the last list was the whole study by number
        #: COMPLETE or PRUNED: what ``n_trials`` counts.
        self.finished = 0
        #: FAIL, less the trials closed unneeded and those stopped by a signal.
        self.failed = 0
        #: Among the unfinished trials at the last read.
        self.running = 0
        self.waiting = 0
        #: The COMPLETE single-objective trial with the best value (the lowest number on a tie).
        self.best: FrozenTrial | None = None

    def update(self, trials: Sequence[FrozenTrial]) -> None:
        """Take in ``trials``: all the study's, by number, as just read."""
        whole = not trials or trials[-1].number == len(trials) - 1
        if not (whole and self._whole) or len(trials) < self._looked:
            self._reset()
        self._whole = whole
        numbers = chain(self._open, range(self._looked, len(trials)))
        self._open, self.running, self.waiting = [], 0, 0
        for number in numbers:
            trial = trials[number]
            if trial.state.is_finished():
                self._settle(trial)
            else:
                self._open.append(number)
                self.running += trial.state == TrialState.RUNNING
                self.waiting += trial.state == TrialState.WAITING
        self._looked = len(trials)

    def _settle(self, trial: FrozenTrial) -> None:
        if WARM_ATTR in trial.user_attrs:
            # an earlier sweep's (--warm-start): it never counts, so it is before others as a FAIL is
            insort(self._fails, trial.number)
            return
        if trial.state == TrialState.FAIL:
            insort(self._fails, trial.number)
            closed = trial.system_attrs.get(FAIL_REASON) == UNNEEDED
            if not closed and not trial.user_attrs.get("hpsweep_stopped"):
                self.failed += 1
            return
        self.finished += 1
        if trial.state == TrialState.COMPLETE and len(trial.values or ()) == 1:
            self._offer(trial)

    def _offer(self, trial: FrozenTrial) -> None:
        best = self.best
        if best is None:
            self.best = trial
            return
        value, held = trial.values[0], best.values[0]
        better = value > held if self.maximize else value < held
        if better or (value == held and trial.number < best.number):
            self.best = trial

    def failed_before(self, number: int) -> int:
        """How many of the trials numbered below ``number`` were FAIL when last read."""
        return bisect_left(self._fails, number)

    def unfinished(self, trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
        """The trials of ``trials`` (as given to the last `update`) unfinished then."""
        return [trials[number] for number in self._open]

    def counts(self) -> dict[str, Any]:
        """What `COUNTS_FILE` holds (`StudyCounts` reads it)."""
        best = self.best
        return {
            "done": self.finished,
            "failed": self.failed,
            "stopped": self.waiting,
            "running": self.running,
            "best": [best.values[0], _number(best)] if best is not None else None,
        }


def publish_counts(output_dir: Path, tally: StudyTally) -> None:
    """Write the study's counts as ``tally`` holds them to `COUNTS_FILE`."""
    with suppress(OSError):  # a display's file: never worth a trial
        runs.write_json(output_dir / COUNTS_FILE, tally.counts())


class StudyCounts:
    """The study's trials by how they stand, for the progress display of one machine among many
    (`hpsweep.search.progress.Counts`): read from `COUNTS_FILE`, which a worker on this machine
    rewrites at most every `PUBLISH_S` and when the sweep ends, and brought up to date with the
    records in the folder that ended since it was written (the trials of this machine, or of
    every machine that shares the folder). So the display adds no database connection and no
    read of its own, and each trial's line counts the trials that ended before it."""

    def __init__(self, output_dir: Path) -> None:
        self._path = output_dir / COUNTS_FILE
        self._index = runs.TrialIndex(output_dir)
        self._seen: Any = None
        self._counts: Any = None
        # the records that ended after the file's counts were written, by id
        self._late: dict[str, runs.TrialRecord] = {}

    def __call__(self) -> Counts:
        stat = self._path.stat()  # none yet: the display counts the folder's records
        if (stat.st_mtime_ns, stat.st_size) != self._seen:
            data = json.loads(self._path.read_text())
            best = data.pop("best", None)
            self._counts = Counts(**data, best=tuple(best) if best else None, as_of=stat.st_mtime)
            self._seen = (stat.st_mtime_ns, stat.st_size)
        as_of = self._counts.as_of
        self._index.refresh()
        for record in self._index.take_changed():
            self._late.pop(record.id, None)
            if record.state != "running" and (record.finished_at or 0) > as_of:
                self._late[record.id] = record
        self._late = {k: r for k, r in self._late.items() if (r.finished_at or 0) > as_of}
        late = list(self._late.values())
        newest = max((r.finished_at or 0 for r in late), default=as_of)
        return dataclasses.replace(self._counts.including(late), as_of=max(as_of, newest))


def _number(trial: FrozenTrial) -> int:
    """The trial's number as hpsweep's records name it (a copy run by an older hpsweep names the
    trial it continues)."""
    return int(trial.user_attrs.get(AGAIN_NUMBER, trial.number))


def finished_in_order(study: optuna.Study) -> list[stopping.Finished]:
    """The study's finished (complete or pruned) trials in the order they finished, as a
    stopping rule reads them; an earlier sweep's (``--warm-start``) are not this sweep's."""
    trials = study._storage.get_all_trials(
        study._study_id, deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)
    )
    ours = sorted(
        (t for t in trials if WARM_ATTR not in t.user_attrs),
        key=lambda t: (t.datetime_complete or t.datetime_start, t.number),
    )
    return [
        stopping.Finished(
            t.params,
            t.value if t.state == TrialState.COMPLETE else None,
            t.duration.total_seconds() if t.duration is not None else None,
        )
        for t in ours
    ]


def close_unneeded(storage: Any, trials: Sequence[FrozenTrial]) -> int:
    """Close the WAITING trials of ``trials`` left once the study holds its ``n_trials`` finished
    ones: trials asked at the end of a sweep by machines that raced for its last places
    (`StudyLedger._admitted`), never run and never to run; how many were closed. Optuna has no
    way to delete a trial and no state for "not needed", so each becomes FAIL with its
    `FAIL_REASON` (the attribute Optuna's own failures carry) saying so: the dashboard and
    ``optuna trials`` show no work left undone. A machine that popped one meanwhile finds it
    finished and asks no more (`StudyLedger.next_trial`)."""
    closed = 0
    for trial in trials:
        if trial.state != TrialState.WAITING:
            continue
        with suppress(optuna.exceptions.UpdateFinishedTrialError):
            storage.set_trial_system_attr(trial._trial_id, FAIL_REASON, UNNEEDED)
            closed += storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
    return closed


def check_home(study_attrs: dict[str, Any], home: str, study_name: str, storage_label: str) -> None:
    """Refuse a command whose ``--output-dir`` is not the home its study was begun with."""
    kept = study_attrs.get(HOME)
    if kept is not None and kept != home:
        raise UserError(
            f"study {study_name!r} in {storage_label} keeps its sweep at {kept}, not {home}; "
            f"give --output-dir {kept} (every machine of a sweep names the same home), "
            "or another --study-name"
        )
