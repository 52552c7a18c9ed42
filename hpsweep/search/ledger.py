"""The trial ledger: what every backend must do alike, done once, over the run folders on disk.

Guarantees (DESIGN.md, section 5), whatever process or command runs the trials:

- **Counting.** ``--n-trials`` counts the trials recorded ``complete`` or ``pruned``. A trial
  starts only under the ledger lock (``DIR/.ledger.lock``) and only while the finished trials
  plus the live leases are fewer than ``n_trials``, so any number of workers and commands that
  share ``DIR`` finish exactly ``n_trials``. Failed trials do not count: another runs instead.
- **Leases.** A running trial holds a lease: a file in ``DIR/.leases`` that its process keeps
  locked with ``flock``. The kernel drops the lock when the process dies (``kill -9``, an OOM
  kill), so the next claim on this machine knows at once that the trial is orphaned. A lease
  held on another host is alive while its heartbeat (the file's mtime, touched every
  `HEARTBEAT_S`) is younger than `STALE_S`.
- **Running again.** A trial recorded ``running`` whose lease is dead, or ``stopped`` (Ctrl-C,
  SIGTERM), is claimed before any new trial: the same trial (number, params, folder) runs again
  from its latest checkpoint, and its ``trial.json`` records ``resumed_from``.
- **Failures.** `Ledger.failures_since` counts failed trials, so ``--max-failed-trials`` ends a
  command that keeps failing, while a later command (after the cause is fixed) runs what is missing.
- **Reading.** The ledger keeps the records in memory (`runs.TrialIndex`), so a claim costs the
  same at the 2,000th trial as at the first: it reads the records the journal names (every
  ``trial.json`` write, by any process, appends one line) and the ``running``/``stopped`` ones, and
  lists the whole folder when a lease died and every few seconds, for records edited by hand.

A backend never counts, leases or re-runs anything itself: it is asked for a trial (new, or a
record to run again) and told how each ended.
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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpsweep import runs

LEASE_DIR = ".leases"
LOCK_FILE = ".ledger.lock"
HEARTBEAT_S = 10.0
STALE_S = 60.0  # a lease on another host with no heartbeat for this long belongs to a dead process
FINISHED = ("complete", "pruned")
AGAIN = "stopped"  # the state of a trial that waits to run again


class Lease:
    """A running trial's claim: an ``flock``-ed file that dies with its process.

    The holder keeps the file descriptor open; a thread touches the file every `HEARTBEAT_S`
    for processes on other hosts. `bind` writes which trial the lease is for (and the backend's
    own reference to it, so an orphaned trial can be closed in the backend's records too).
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
            "ref": None,
        }
        self._write()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="hpsweep-lease", daemon=True)
        self._beat.start()

    def bind(self, trial_id: str, ref: Any = None) -> None:
        self.info.update(trial=trial_id, ref=ref)
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


@dataclass
class Claim:
    """What `Ledger.claim` hands a worker: a lease, and the record of a trial to run again (or None
    for a new trial)."""

    lease: Lease
    again: runs.TrialRecord | None = None


class Ledger:
    """The trials of one output folder, shared by every worker and command that runs there.

    Args:
        output_dir: the sweep's folder (``--output-dir``).
        n_trials: how many finished (complete or pruned) trials the sweep wants; None: no limit.
    """

    def __init__(self, output_dir: Path, n_trials: int | None) -> None:
        self.output_dir = output_dir
        self.n_trials = n_trials
        self.lease_dir = output_dir / LEASE_DIR
        self.index = runs.TrialIndex(output_dir)

    @contextmanager
    def locked(self) -> Iterator[None]:
        from filelock import FileLock

        with FileLock(str(self.output_dir / LOCK_FILE)):
            yield

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

    def records(self, *states: str) -> list[runs.TrialRecord]:
        """The trials in ``states`` (default: all) by number, as the ledger knows them now. They are
        the ledger's own: copy one (`dataclasses.replace`) before changing it."""
        self.index.refresh()
        return self.index.records(*states)

    def finished(self, records: list[runs.TrialRecord] | None = None) -> int:
        if records is not None:
            return sum(1 for r in records if r.state in FINISHED)
        self.index.refresh()
        return self.index.count(*FINISHED)

    def failures_since(self, since: float) -> list[runs.TrialRecord]:
        return [r for r in self.records("failed") if (r.finished_at or 0) >= since]

    def done(self) -> bool:
        return self.n_trials is not None and self.finished() >= self.n_trials

    # --- reaping and claiming -----------------------------------------------------------------------

    def reap(self) -> list[LeaseFile]:
        """Turn trials whose process is gone into trials that wait to run again (``stopped``).

        Call it holding `locked`. Returns the dead leases, so the caller can close the trials in
        the backend's own records (an Optuna trial left RUNNING by a ``kill -9``).
        """
        live: set[str] = set()
        dead: list[LeaseFile] = []
        for lease in self.leases():
            if lease.alive():
                if lease.trial is not None:
                    live.add(str(lease.trial))
            else:
                dead.append(lease)
        # a process killed between its two writes left no journal line
        self.index.refresh(verify=bool(dead))
        for record in self.index.records("running"):
            if record.id not in live:
                who = record.user_attrs.get("pid"), record.user_attrs.get("host")
                dataclasses.replace(record).finish(
                    AGAIN, error=f"its process (pid {who[0]} on {who[1]}) ended while the trial ran"
                )
        for lease in dead:
            lease.path.unlink(missing_ok=True)
        return dead

    def claim(self) -> Claim | str:
        """A lease for the next trial to run, or ``"wait"`` (trials still run elsewhere and one may
        have to run again) or ``"done"``. Call it holding `locked`.

        A trial waiting to run again comes first; it is marked ``running`` at once, so no other
        worker claims it too.
        """
        again = self.records(AGAIN)
        if again:
            return self._lease_again(again[0])
        return self.claim_new()

    def claim_new(self) -> Claim | str:
        """A lease for a new trial only, or ``"wait"`` / ``"done"`` as `claim` says. Call it holding
        `locked`.

        For a backend whose own scheduler hands out the trials to run again (Ray Tune runs them in
        a round of their own, so its searcher never sees a result for params it did not suggest):
        trials waiting to run again keep their places in the count, so they still run.
        """
        live = sum(1 for lease in self.leases() if lease.alive())
        self.index.refresh()
        waiting = self.index.count(AGAIN)
        if (
            self.n_trials is not None
            and self.index.count(*FINISHED) + live + waiting >= self.n_trials
        ):
            return "wait" if live or waiting else "done"
        return Claim(Lease(self.lease_dir))

    def claim_trial(self, trial_id: str, states: tuple[str, ...] = (AGAIN,)) -> Claim | None:
        """A lease to run the trial ``trial_id`` again, if its record is in one of ``states``;
        None when it is unknown, runs under a live lease or is in another state. Call it holding
        `locked` (after `reap`, so a ``running`` record has a live lease).

        For a backend that picks which trial runs again itself: Ray Tune retries a trial whose
        worker died (``stopped``) and resumes trials its scheduler paused (recorded ``pruned``).
        Running again takes the trial out of the finished count until it ends again.
        """
        # Read from disk, not the index: Ray's driver and workers on other hosts rewrite a trial's
        # record between its rounds, and the record claimed here is written back whole.
        record = next((r for r in runs.read_trials(self.output_dir) if r.id == str(trial_id)), None)
        if record is None or record.state not in states:
            return None
        return self._lease_again(record)

    def _lease_again(self, record: runs.TrialRecord) -> Claim:
        # the index's own stays as read until the journal names it
        record = dataclasses.replace(record)
        lease = Lease(self.lease_dir)
        lease.bind(record.id)
        record.state = "running"
        record.save()
        return Claim(lease, record)
