"""The sweep folder's Optuna study: Optuna's journal file, under the lock Optuna's own writers take.

A journal is an append-only log of the study's changes, which every process replays into memory
(`optuna.storages.JournalStorage`); Optuna recommends it for several processes on one machine.
It opens without SQLAlchemy's and Alembic's set-up, and a trial's ask, reports and tell append a
few lines instead of running transactions (the figures are in docs/backends.md).

Others write to the same file while a sweep runs: optuna-dashboard (its buttons and notes), the
``optuna`` command line, a user's own ``JournalFileBackend``. They all take Optuna's default lock,
a symlink ``<journal>.lock``, so hpsweep takes it too (`JournalLock`).
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
import uuid
from pathlib import Path

from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend

#: How long Optuna's writers wait on a symlink lock whose journal does not change before they
#: judge its holder dead and break it (``JournalFileSymlinkLock``'s default grace period).
GRACE_S = 30.0
#: The longest sleep between two tries at a held symlink lock.
POLL_S = 0.05
#: What the flock file holds while its holder has the symlink: the symlink's identity.
_MARK = struct.Struct("<QQQ")


def journal_storage(path: Path) -> JournalStorage:
    """The Optuna storage of the journal at ``path`` (created if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(path), lock_obj=JournalLock(path)))


class JournalLock:
    """The lock of every append to the journal: Optuna's own lock, and an ``flock`` beside it.
    It has the interface of Optuna's unexported ``BaseJournalFileLock`` (``acquire``/``release``).

    - **Optuna's lock**, the symlink ``<journal>.lock`` that ``JournalFileBackend`` creates by
      default: held, hpsweep's appends and the dashboard's, the CLI's and any script's are
      serialised on the one file.
    - **An flock** on ``.<journal>.lock``, taken first, serialises hpsweep's own writers, and the
      kernel drops it when its holder dies. A symlink outlives a writer killed while holding it,
      and Optuna's writers wait out `GRACE_S` before they break it. Ours does not: while holding
      it, a writer keeps the symlink's identity in the flock file. Whoever takes the flock next
      and finds the same symlink there knows its holder is dead (it would still hold the flock)
      and removes it at once. A symlink of another identity belongs to another program's writer,
      and is waited for as Optuna's writers wait.
    - **A torn tail.** An append cut short (a full disk, a writer killed mid-write) leaves a last
      line without its newline; Optuna's reader refuses every line after such a line, so the next
      append would break the journal for good. Holding both locks, no writer can be in the middle
      of an append, so such a line is a dead writer's and never acknowledged to it: it is cut.

    A writer killed in the instant between creating the symlink and noting it (or between the
    two at release) leaves a symlink no one can prove dead: the next writer waits `GRACE_S`.
    Appends from threads of one process are serialised by the journal storage's own lock.
    """

    def __init__(self, journal: Path) -> None:
        self._journal = journal
        self._path = journal.with_name(f".{journal.name}.lock")  # hidden, like the ledger's lock
        self._symlink = journal.with_name(f"{journal.name}.lock")  # Optuna's LOCK_FILE_SUFFIX
        self._fd: int | None = None
        self._mark: tuple[int, int, int] | None = None  # the symlink we hold

    def acquire(self) -> bool:
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._mark = fd, None
        try:
            self._take_symlink(fd)
            drop_torn_tail(self._journal)
        except BaseException:  # a signal while waiting, a full disk: let go of what we hold
            self.release()
            raise
        return True

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)  # first: a mark never names a symlink that is not ours
            if self._mark is not None and _identity(self._symlink) == self._mark:
                _remove(self._symlink)  # ours (unless another writer broke it after GRACE_S)
        finally:
            os.close(fd)  # releases the flock

    def _take_symlink(self, fd: int) -> None:
        """Create Optuna's symlink lock (holding the flock), and note its identity in ``fd``."""
        marked = os.pread(fd, _MARK.size, 0)
        if len(marked) == _MARK.size and _identity(self._symlink) == _MARK.unpack(marked):
            _remove(self._symlink)  # its hpsweep holder died holding it
        wait_for_symlink(self._journal, self._symlink)
        self._mark = mark = _identity(self._symlink)
        assert mark is not None, "the symlink lock is ours until we remove it"
        os.ftruncate(fd, 0)
        os.pwrite(fd, _MARK.pack(*mark), 0)


def wait_for_symlink(journal: Path, symlink: Path) -> None:
    """Create ``symlink`` (pointing at ``journal``), waiting while another writer holds it, as
    Optuna's ``JournalFileSymlinkLock.acquire`` waits: a holder whose journal has not changed
    for `GRACE_S` is judged dead and its symlink is broken."""
    delay, seen, since = 0.001, None, time.monotonic()
    while True:
        try:
            os.symlink(journal.name, symlink)  # relative: it resolves wherever it is read from
            return
        except FileExistsError:
            pass
        stamp = _stamp(symlink)
        if stamp is None:
            continue  # released meanwhile
        now = time.monotonic()
        if stamp != seen:
            seen, since = stamp, now
        elif now - since > GRACE_S:
            _remove(symlink)
            continue
        time.sleep(delay)
        delay = min(delay * 2, POLL_S)


def _stamp(symlink: Path) -> int | None:
    """When the journal a held symlink lock points at last changed, as Optuna's lock judges its
    holder alive; the symlink's own time where it points nowhere (a writer that named the journal
    by a relative path from another folder); None once it is gone."""
    for stat in (os.stat, os.lstat):
        try:
            return stat(symlink).st_mtime_ns
        except FileNotFoundError:
            continue
    return None


def _identity(path: Path) -> tuple[int, int, int] | None:
    """The file at ``path`` itself (not what it points to): device, inode and change time."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


def _remove(symlink: Path) -> None:
    """Remove a symlink lock as Optuna releases one: renamed away first, so that of two writers
    removing it at once only one does."""
    gone = symlink.with_name(f"{symlink.name}{uuid.uuid4()}.rename")
    try:
        os.rename(symlink, gone)
    except FileNotFoundError:
        return
    os.unlink(gone)


def drop_torn_tail(journal: Path) -> None:
    """Truncate ``journal`` after its last newline, if it does not end with one."""
    try:
        f = open(journal, "r+b")
    except FileNotFoundError:
        return
    with f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        end = size
        while end > 0:  # find the last newline, reading backwards a block at a time
            start = max(0, end - 65536)
            f.seek(start)
            block = f.read(end - start)
            cut = block.rfind(b"\n")
            if cut >= 0:
                end = start + cut + 1
                break
            end = start
        f.truncate(end)
        f.flush()
        os.fsync(f.fileno())
