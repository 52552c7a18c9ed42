"""The trial ledger: what every backend must do alike, done once, over the run folders on disk.

Guarantees (docs/guarantees.md), whatever process or command runs the trials:

- **Counting.** ``--n-trials`` counts the trials recorded ``complete`` or ``pruned``. A trial
  starts only under the ledger lock (``DIR/.ledger.lock``) and only while the finished trials
  plus the live leases are fewer than ``n_trials``, so any number of workers and commands that
  share ``DIR`` finish exactly ``n_trials``. Failed trials do not count: another runs instead.
- **Numbering.** A new trial that its backend does not number itself takes
  `FolderSession.next_number` under the lock, and its lease carries the number until the trial
  is recorded, so two processes never give one number to two trials.
- **Leases.** A running trial holds a lease: a file in ``DIR/.leases`` that its process keeps
  locked with ``flock``. The kernel drops the lock when the process dies (``kill -9``, an OOM
  kill), so the next claim on this machine knows at once that the trial is orphaned. A lease
  held on another host is alive while its heartbeat (the file's mtime, touched every
  `HEARTBEAT_S`) is younger than `STALE_S`.
- **Running again.** A trial recorded ``running`` whose lease is dead, or ``stopped`` (Ctrl-C,
  SIGTERM), is claimed before any new trial: the same trial (number, params, folder) runs again
  from its latest checkpoint, and its ``trial.json`` records ``resumed_from``.
- **Stopping.** With ``--stop-when``, a new trial is claimed only while the sweep's rule has not
  ended it (`FolderSession.stopped_by_rule`): judged under the lock when a trial finished since
  the last claim, and recorded in ``DIR/stopping.json`` once it fires, so every worker and
  command that shares ``DIR`` stops on that one decision; trials already running finish and
  count, and trials waiting to run again still run.
- **Failures.** `Ledger.failures_since` counts failed trials, so ``--max-failed-trials`` ends a
  command that keeps failing, while a later command (after the cause is fixed) runs what is missing.
- **Reading.** The ledger keeps the records in memory (`runs.TrialIndex`), so a claim costs the
  same at the 10,000th trial as at the first: it reads the records the journal names (every
  ``trial.json`` write, by any process, appends one line) and the ``running``/``stopped`` ones, and
  lists the whole folder when a lease died and now and then, for records edited by hand (at most
  a small fixed share of the time: see `runs.TrialIndex`). A trial's number and one trial's record
  are answered from what the index keeps, not by reading every record.

Who calls what. Every claim runs one sequence, `Ledger.take_trial`: under the lock, reap, claim
a place, number the trial where the ledger gives its number, make the trial and bind the lease to
it. The search layer's loop (`hpsweep.search.sweep_loop`) runs it through `Ledger.next_trial` for the
ask/tell backends (Optuna, W&B without a server); an executor backend, whose trials start
somewhere else (a Ray Tune worker, W&B's agent), runs it where its trials start, choosing what
it claims (`FolderSession.claim_new`, `FolderSession.claim_trial`). The trial runner records the
trial; `Lease.release` ends it. A driver that runs trials in batches (Ray Tune's rounds) asks
`FolderSession.needed` and `FolderSession.next_number` before a batch, and after it tells the
ledger what it saw of trials that could not record it themselves (`Ledger.wait_for_endings`,
then `FolderSession.settle`; `FolderSession.restate` for one trial;
`FolderSession.fail_unrecorded` for one that failed before it could record anything). What needs
the lock is a method of the `FolderSession` that ``with ledger.locked() as session:`` yields, not
of the ledger. No backend counts, leases or rewrites a record itself, nor numbers a trial unless
its own records number it (Optuna's study).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpsweep import runs
from hpsweep.search import stopping
from hpsweep.search.ledger_base import (
    Claim,
    Claimed,
    LedgerNumbered,
    LedgerSession,
    T,
    TrialSource,
    Verdict,
)
from hpsweep.trial import Trial

LEASE_DIR = ".leases"
LOCK_FILE = ".ledger.lock"
HEARTBEAT_S = 10.0
STALE_S = 60.0  # a lease on another host with no heartbeat for this long belongs to a dead process
FINISHED = ("complete", "pruned")
AGAIN = "stopped"  # the state of a trial that waits to run again
# batches in which an executor saw a trial's process die, in one command, before the trial fails
LOST_TO_FAIL = 2


class Lease:
    """A running trial's claim: an ``flock``-ed file that dies with its process.

    The holder keeps the file descriptor open; a thread touches the file every `HEARTBEAT_S`
    for processes on other hosts. `bind` writes which trial the lease is for, its number (taken
    before the trial is recorded: see `FolderSession.next_number`) and the backend's own
    reference to it, so an orphaned trial can be closed in the backend's records too.
    """

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_hex(8)
        self.path = folder / f"{self.token}.lease"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.info: dict[str, Any] = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "trial": None,
            "number": None,
            "ref": None,
        }
        self._write()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="hpsweep-lease", daemon=True)
        self._beat.start()

    def bind(self, trial_id: str, ref: object = None, *, number: int | None = None) -> None:
        self.info.update(trial=trial_id, number=number, ref=ref)
        self._write()

    def release(self) -> None:
        """Give the lease up: the trial is recorded as ended (or never started)."""
        if self._fd < 0:
            return
        self._stop.set()
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = -1

    def _write(self) -> None:
        data = json.dumps(self.info).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return


@dataclass
class LeaseFile:
    """Another process's lease, as read from disk."""

    path: Path
    info: dict[str, Any]

    @property
    def trial(self) -> str | None:
        return self.info.get("trial")

    @property
    def number(self) -> int | None:
        number = self.info.get("number")
        return number if isinstance(number, int) else None

    @property
    def ref(self) -> object:
        """The backend's own reference to the trial (`Lease.bind`), to close it there."""
        return self.info.get("ref")

    @property
    def on_this_host(self) -> bool:
        return self.info.get("host") in (None, socket.gethostname())

    def alive(self) -> bool:
        """Whether the process holding it still runs (see the module's docstring)."""
        if not self.on_this_host:
            try:
                return time.time() - self.path.stat().st_mtime < STALE_S
            except OSError:
                return False
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return True
            raise
        finally:
            os.close(fd)
        return False


class Ledger:
    """The trials of one output folder, shared by every worker and command that runs there.

    What may run only under the ledger's lock is a method of the `FolderSession` that `locked`
    yields; the ledger itself reads (`records`, `live`, ...) and hands out trials (`take_trial`).

    Args:
        output_dir: the sweep's folder (``--output-dir``).
        n_trials: how many finished (complete or pruned) trials the sweep wants; None: no limit.
    """

    def __init__(self, output_dir: Path, n_trials: int | None) -> None:
        self.output_dir = output_dir
        self.n_trials = n_trials
        self.lease_dir = output_dir / LEASE_DIR
        self.index = runs.TrialIndex(output_dir)
        self.judge = stopping.StopJudge(output_dir, n_trials)
        # how often an executor saw each trial's process die, in this command (see `settle`)
        self._lost: Counter[str] = Counter()

    @contextmanager
    def locked(self) -> Iterator[FolderSession]:
        """``DIR/.ledger.lock``, held for the ``with`` block, and the session that needs it."""
        from filelock import FileLock

        with FileLock(str(self.output_dir / LOCK_FILE)), FolderSession(self) as session:
            yield session

    # --- reading ------------------------------------------------------------------------------------

    def leases(self) -> list[LeaseFile]:
        if not self.lease_dir.is_dir():
            return []
        found = []
        for path in self.lease_dir.glob("*.lease"):
            try:
                info = json.loads(path.read_text() or "{}")
            except (OSError, ValueError):
                info = {}  # written this instant: its holder is between truncate and write
            found.append(LeaseFile(path, info))
        return found

    def live(self) -> list[LeaseFile]:
        """The leases whose process still runs: trials running now, in any command."""
        return [lease for lease in self.leases() if lease.alive()]

    def held(self, trial_id: str) -> bool:
        """Whether a live lease is bound to ``trial_id``: its process still runs it, or is still
        recording its end."""
        return any(lease.trial == str(trial_id) for lease in self.live())

    def records(self, *states: str, fresh: bool = False) -> list[runs.TrialRecord]:
        """The trials in ``states`` (default: all) by number, as the ledger knows them now. They are
        the ledger's own: copy one (`dataclasses.replace`) before changing it.

        ``fresh``: list the folder and check every record first, for a caller that acts on many
        records at once, written by processes on other hosts (Ray's driver between rounds).
        """
        self.index.refresh(verify=fresh)
        return self.index.records(*states)

    def record(self, trial_id: str) -> runs.TrialRecord | None:
        """The record of ``trial_id`` as it is on disk now (a copy, to change and save), or None.

        Its own file is read again (`runs.TrialIndex.lookup`, at a cost that does not grow with
        the sweep): whoever claims it writes it back whole, so it must not be a version older than
        what another host wrote.
        """
        found = self.index.lookup(str(trial_id))
        return None if found is None else dataclasses.replace(found)

    def finished(self) -> int:
        self.index.refresh()
        return self.index.count(*FINISHED)

    def finished_in_order(self) -> list[stopping.Finished]:
        """The finished (complete or pruned) trials in the order they finished, as a stopping rule
        reads them."""
        done = sorted(self.index.records(*FINISHED), key=lambda r: (r.finished_at or 0, r.number))
        return [
            stopping.Finished(
                r.params, r.objective if r.state == "complete" else None, r.duration_s
            )
            for r in done
        ]

    def failures_since(self, since: float) -> list[runs.TrialRecord]:
        """The trials that failed since ``since``, by number (`runs.TrialIndex.failed_since`:
        what they cost, not what every failed trial of the sweep does)."""
        self.index.refresh()
        return self.index.failed_since(since)

    # --- handing out trials -------------------------------------------------------------------------

    def take_trial(
        self,
        choose: Callable[[FolderSession], Claim | Verdict],
        make: Callable[[Claim], T | None],
        *,
        abandon: Callable[[object], None] | None = None,
    ) -> Claimed[T] | Verdict:
        """The claim sequence, the one every caller runs: under the lock, reap (closing the trials
        whose process died in the backend's records too, with ``abandon``), claim a place
        (``choose``: which trial, and its number when the ledger gives it), make the trial of
        that claim (``make``) and bind the lease to it before the lock is let go.

        ``choose`` answers a `Verdict` when there is no place; ``make`` None when there is no
        trial after all (`Verdict.DONE`: a finished grid). The lease goes back if ``make`` fails.
        """
        with self.locked() as session:
            for dead in session.reap():
                if abandon is not None and dead.ref is not None:
                    abandon(dead.ref)
            claim = choose(session)
            if isinstance(claim, Verdict):
                return claim
            try:
                trial = make(claim)
            except BaseException:
                claim.lease.release()  # a claimed record goes back to waiting at the next reap
                raise
            if trial is None:
                claim.lease.release()
                return Verdict.DONE
            claim.lease.bind(trial.id, trial.ref, number=trial.number)
            return Claimed(claim, trial)

    def next_trial(self, backend: TrialSource) -> Claimed[Trial] | Verdict:
        """For the search layer's loop: a trial waiting to run again, else a new one, asked of
        ``backend`` under the lock (`take_trial`). A backend with no numbering of its own
        (`LedgerNumbered`) is asked for a new trial with the number the ledger gives it."""
        numbered = isinstance(backend, LedgerNumbered)

        def ask(claim: Claim) -> Trial | None:
            if isinstance(backend, LedgerNumbered) and claim.again is None:
                assert claim.number is not None
                return backend.ask_numbered(claim.number)
            return backend.ask(claim.again)

        return self.take_trial(
            lambda session: session.claim(numbered=numbered), ask, abandon=backend.abandon
        )

    def stopped(self, backend: TrialSource, trial: Trial) -> bool:
        """A trial stopped by a signal: nothing to do here (False: the backend is told), its record
        says ``stopped`` and the next claim runs it again (see `next_trial`)."""
        return False

    # --- after trials run elsewhere -----------------------------------------------------------------

    def wait_for_endings(self, trial_ids: Collection[str], timeout: float) -> None:
        """Wait until no process on this host holds the lease of one of ``trial_ids``, up to
        ``timeout`` seconds.

        An executor may report a batch of trials over once it asked them to stop, not once they
        are gone (Tune's ``fit()``): a trial may still be recording its end. Waiting for their
        leases lets `FolderSession.reap` (in `FolderSession.settle`) say at once, on disk, which
        trials were killed mid-way. Leases on other hosts age out on their own (`STALE_S`); they
        are not waited for.
        """
        wanted = {str(t) for t in trial_ids}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not any(str(lease.trial) in wanted and lease.on_this_host for lease in self.live()):
                return
            time.sleep(0.1)


class FolderSession(LedgerSession):
    """The files ledger while its lock (``DIR/.ledger.lock``) is held: what may run only then.
    ``with ledger.locked() as session:`` makes one; `ledger` reads as ever."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__()
        self.ledger = ledger

    # --- counting and numbering ---------------------------------------------------------------------

    def needed(self) -> int | None:
        """How many new trials the sweep still wants: ``n_trials`` less the finished trials, those
        running under a live lease and those waiting to run again (they run, and count, first);
        None without a limit. Ask it after `reap`."""
        self._held()
        live = len(self.ledger.live())
        self.ledger.index.refresh()
        needed = self._needed(live, self.ledger.index.count(AGAIN))
        if (needed is None or needed > 0) and self.stopped_by_rule():
            return 0
        return needed

    def _needed(self, live: int, waiting: int) -> int | None:
        if self.ledger.n_trials is None:
            return None
        return self.ledger.n_trials - self.ledger.index.count(*FINISHED) - live - waiting

    def stopped_by_rule(self) -> bool:
        """Whether the sweep's stopping rule ended it (`hpsweep.search.stopping.StopJudge`): a
        decision recorded in ``DIR/stopping.json``, or the rule firing now on the finished trials
        (judged only when one finished since this process last judged). Ask it after `reap`."""
        self._held()
        ledger = self.ledger
        folder = ledger.output_dir
        return ledger.judge.stopped(
            lambda: stopping.read_state(folder),
            lambda state: stopping.write_state(folder, state),
            lambda: ledger.index.count(*FINISHED),
            ledger.finished_in_order,
        )

    def next_number(self, prefer: int | None = None) -> int:
        """The number of a new trial: ``prefer`` (an executor's own numbering of its trials, such as
        the order Tune created them in) when no record and no live lease has it, else one past the
        highest number in use.

        Bind the trial's lease with the number (`Lease.bind`) before the session ends: the lease
        holds the number until the trial's record does.
        """
        self._held()
        index = self.ledger.index
        index.refresh()
        leased = {lease.number for lease in self.ledger.live() if lease.number is not None}
        if prefer is not None and prefer not in leased and not index.has_number(prefer):
            return prefer
        return max(index.max_number(), max(leased, default=-1)) + 1

    # --- reaping and claiming -----------------------------------------------------------------------

    def reap(self) -> list[LeaseFile]:
        """Turn trials whose process is gone into trials that wait to run again (``stopped``).

        Returns the dead leases, so the caller can close the trials in the backend's own records
        (an Optuna trial left RUNNING by a ``kill -9``).
        """
        self._held()
        live: set[str] = set()
        dead: list[LeaseFile] = []
        for lease in self.ledger.leases():
            if lease.alive():
                if lease.trial is not None:
                    live.add(str(lease.trial))
            else:
                dead.append(lease)
        index = self.ledger.index
        # a process killed between its two writes left no journal line
        index.refresh(verify=bool(dead))
        for record in index.records("running"):
            if record.id not in live:
                who = record.user_attrs.get("pid"), record.user_attrs.get("host")
                dataclasses.replace(record).finish(
                    AGAIN, error=f"its process (pid {who[0]} on {who[1]}) ended while the trial ran"
                )
        for lease in dead:
            lease.path.unlink(missing_ok=True)
        return dead

    def claim(self, *, numbered: bool = False) -> Claim | Verdict:
        """A lease for the next trial to run, or `Verdict.WAIT` (trials still run elsewhere and one
        may have to run again) or `Verdict.DONE`.

        A trial waiting to run again comes first; it is marked ``running`` at once, so no other
        worker claims it too. ``numbered``: a new trial takes its number from the ledger
        (`claim_new`).
        """
        self._held()
        again = self.ledger.records(AGAIN)
        if again:
            return self._lease_again(again[0])
        return self.claim_new(numbered=numbered)

    def claim_new(
        self, *, waiting_run_again: bool = True, numbered: bool = False, prefer: int | None = None
    ) -> Claim | Verdict:
        """A lease for a new trial only, or `Verdict.WAIT` / `Verdict.DONE` as `claim` says.
        ``numbered``: the claim carries the trial's number (`next_number`, ``prefer`` first);
        otherwise its backend numbers it. Bind the lease to the trial before the session ends.

        For an executor backend, whose own scheduler hands out the trials to run again (Ray Tune
        runs them in a round of their own, so its searcher never sees a result for params it did
        not suggest): trials waiting to run again keep their places in the count, so they still
        run. An executor that cannot run a trial again (W&B's agent: the server hands out the
        params) passes ``waiting_run_again=False``, and they hold no place.
        """
        self._held()
        live = len(self.ledger.live())
        index = self.ledger.index
        index.refresh()
        waiting = index.count(AGAIN) if waiting_run_again else 0
        needed = self._needed(live, waiting)
        if (needed is not None and needed <= 0) or self.stopped_by_rule():
            return Verdict.WAIT if live or waiting else Verdict.DONE
        number = self.next_number(prefer) if numbered else None
        return Claim(Lease(self.ledger.lease_dir), number=number)

    def claim_trial(self, trial_id: str, states: tuple[str, ...] = (AGAIN,)) -> Claim | None:
        """A lease to run the trial ``trial_id`` again, if its record is in one of ``states``;
        None when it is unknown, runs under a live lease or is in another state. Ask it after
        `reap`, so that a ``running`` record has a live lease.

        For a backend that picks which trial runs again itself: Ray Tune retries a trial whose
        worker died (``stopped``) and resumes trials its scheduler paused (recorded ``pruned``).
        Running again takes the trial out of the finished count until it ends again.
        """
        self._held()
        record = self.ledger.record(trial_id)
        if record is None or record.state not in states:
            return None
        return self._lease_again(record)

    def _lease_again(self, record: runs.TrialRecord) -> Claim:
        # the index's own stays as read until the journal names it
        record = dataclasses.replace(record)
        waited = record.state == AGAIN
        lease = Lease(self.ledger.lease_dir)
        lease.bind(record.id, number=record.number)
        record.state = "running"
        record.save()
        return Claim(lease, record if waited else None, number=record.number)

    # --- after trials run elsewhere -----------------------------------------------------------------

    def settle(
        self,
        trial_ids: Iterable[str],
        *,
        stopped_at: float | None = None,
        lost: Collection[str] = (),
        lost_error: str = "its process died in {times} batches of trials",
    ) -> None:
        """Record what an executor saw of a batch of its trials (a Tune round) that the trials
        could not record themselves, once the batch is over.

        - ``stopped_at``: when the sweep began to stop the batch (Ctrl-C, a user error). A trial
          recorded ``pruned`` since then was cut short, not pruned (an executor stops a trial the
          same way for both, and a trial that could not see the stop could not tell): it waits to
          run again.
        - ``lost``: the trials whose process the executor saw die. One still recorded ``running``
          or waiting runs again, unless its process died in `LOST_TO_FAIL` batches of this command:
          then it failed, with ``lost_error`` (``{times}``: how often), as a trial that kills its
          worker each time (out of memory) must not run for ever.

        Then `reap`: the trials whose process died with the batch wait to run again.
        """
        self._held()
        counts = self.ledger._lost
        for trial_id in map(str, trial_ids):
            record = self.ledger.record(trial_id)
            if record is None:
                continue
            cut_short = stopped_at is not None and (record.finished_at or 0) >= stopped_at
            if record.state == "pruned" and cut_short:
                record.finish(AGAIN, error="the sweep stopped while it ran")
            elif trial_id in lost and record.state in ("running", AGAIN):
                counts[trial_id] += 1
                if counts[trial_id] >= LOST_TO_FAIL:
                    record.finish("failed", error=lost_error.format(times=counts[trial_id]))
        self.reap()

    def restate(self, trial_id: str, state: str, *, was: str = "failed") -> None:
        """Record that ``trial_id`` ended ``state`` where its process, knowing no better, recorded
        ``was``: an executor that stops a trial by raising inside it (W&B's agent, for its server's
        hyperband or Ctrl-C) leaves the trial runner recording a failure. A failure's
        ``error.log`` goes with it."""
        self._held()
        record = self.ledger.record(trial_id)
        if record is None or record.state != was:
            return
        record.finish(state)
        if was == "failed":
            (Path(record.run_dir) / "error.log").unlink(missing_ok=True)

    def fail_unrecorded(
        self,
        trial_id: str,
        *,
        error: str,
        template: runs.TrialRecord,
        number: int | None = None,
    ) -> runs.TrialRecord | None:
        """Record as failed, with ``error`` (also in its ``error.log``), a trial that an executor saw
        fail before the trial could record anything (Ray could not place it, or Tune's own
        machinery failed it before it trained), so it counts towards ``--max-failed-trials`` as
        any failed trial does. ``template``: its params, backend and objective; ``number``: the
        executor's own numbering of it, as `next_number` takes it. A trial that has a record is
        left as it is (None)."""
        self._held()
        if self.ledger.record(trial_id) is not None:
            return None
        run_dir = runs.run_dir_for(self.ledger.output_dir, trial_id)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "error.log").write_text(error + "\n")
        record = dataclasses.replace(
            template, id=str(trial_id), number=self.next_number(prefer=number), run_dir=str(run_dir)
        )
        record.finish("failed", error=error)
        return record
