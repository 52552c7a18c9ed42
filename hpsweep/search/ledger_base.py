"""The ledger's seam: what both of its homes implement and what a claim hands out.

The ledger has two homes: files under the output folder (`hpsweep.search.ledger.Ledger`) and
the study's own database on many machines (`hpsweep.search.backends._optuna._study_ledger.StudyLedger`).
The search layer's loop, the trial runner and the backends see either through `TrialLedger`:

- `TrialLedger.next_trial` hands out the next trial as `Claimed` (the `Claim` that keeps its
  place, and the trial), or a `Verdict` when there is none to run now;
- what may run only under the ledger's lock is a method of the `LedgerSession` that
  ``with ledger.locked() as session:`` yields, never of the ledger itself, and the session
  refuses every call once its ``with`` block has ended. The files' lock is a file lock; the
  study's is none (the database orders its trials), yet it yields a session all the same.

    >>> Verdict.WAIT.value, Verdict.DONE.value
    ('wait', 'done')
"""

from __future__ import annotations

import enum
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, runtime_checkable

from hpsweep.runs import TrialRecord
from hpsweep.trial import Trial

T = TypeVar("T", bound=Trial)
S = TypeVar("S", bound="LedgerSession")


class Verdict(enum.Enum):
    """Why a claim hands out no trial."""

    #: Not now: trials still run elsewhere and one may have to run again; look again shortly.
    WAIT = "wait"
    #: Nothing to run: the sweep has its trials, or its backend nothing more to try.
    DONE = "done"
    #: The trial asked for by its id still ends its previous run (its lease is held); ask again.
    BUSY = "busy"


class Hold(Protocol):
    """What keeps a claimed trial's place while it runs: a file lease (`ledger.Lease`), or the
    trial's heartbeat in a study that machines share (`_study_ledger.Heartbeat`)."""

    def bind(self, trial_id: str, ref: object = None, *, number: int | None = None) -> None:
        """Note which trial holds the place: its id, the backend's ``ref`` to it and its number."""

    def release(self) -> None:
        """Give the place up: the trial is recorded as ended, or never started."""


@dataclass
class Claim:
    """A place for one trial, taken under the ledger's lock.

    Args:
        lease: what keeps the place while the trial runs.
        again: the record of the trial it runs again from that trial's own latest checkpoint
            (one that waited to run again); None for a new trial, or for one that its executor
            resumes from a checkpoint of its own (a trial Tune's scheduler paused).
        number: the trial's number when the ledger gave it (a trial run again keeps its own);
            None when the backend numbers the trial (Optuna's study).
    """

    lease: Hold
    again: TrialRecord | None = None
    number: int | None = None


@dataclass(frozen=True)
class Claimed(Generic[T]):
    """A trial to run: its claim, and the trial that the claim's lease is bound to."""

    claim: Claim
    trial: T


class TrialSource(Protocol):
    """What a ledger asks of an ask/tell searcher (`hpsweep.search.ask_tell.AskTellSearcher`)."""

    def ask(self, again: TrialRecord | None = None) -> Trial | None:
        """The next trial (``again``: that trial's record, to run it again); None: none left."""

    def abandon(self, ref: object) -> None:
        """Close, in the backend's own records, a trial whose process died."""


@runtime_checkable
class LedgerNumbered(Protocol):
    """An ask/tell backend with no numbering of its own (W&B's sweeps engine): the ledger numbers
    each new trial under its lock, and asks the backend for the trial with that number."""

    def ask_numbered(self, number: int) -> Trial | None:
        """A new trial numbered ``number``; None when the search has nothing more to try."""


class LedgerSession:
    """A ledger while its lock is held: each home's session (`ledger.FolderSession`,
    `_study_ledger.StudySession`) holds the methods that may run only then. It is its own
    context manager, ended with the ``with`` block that holds the lock; a call after that raises
    instead of acting without the lock."""

    def __init__(self) -> None:
        self._open = True

    def __enter__(self: S) -> S:
        return self

    def __exit__(self, *exc: object) -> None:
        self._open = False

    def _held(self) -> None:
        """Refuse a call made after the session's ``with`` block, when the lock is let go."""
        if not self._open:
            raise RuntimeError(
                f"{type(self).__name__} used after its `with ledger.locked()` block; "
                "take the lock again"
            )


@runtime_checkable
class TrialLedger(Protocol):
    """The ledger as the search layer's loop, the trial runner and every backend see it, in
    either home (see the module's docstring)."""

    def locked(self) -> AbstractContextManager[LedgerSession]:
        """The ledger's lock, held for the ``with`` block, and the session it yields."""

    def next_trial(self, backend: TrialSource) -> Claimed[Trial] | Verdict:
        """The next trial for this worker, its place kept, or `Verdict.WAIT` / `Verdict.DONE`."""

    def stopped(self, backend: TrialSource, trial: Trial) -> bool:
        """A trial stopped by a signal: whether the ledger took care of it (True: the backend is
        told nothing)."""

    def failures_since(self, since: float) -> list[TrialRecord]:
        """The trials that failed since ``since``, by number."""
