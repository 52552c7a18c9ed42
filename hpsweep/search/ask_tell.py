"""The ask/tell searcher's seam: what the search layer's loop asks a searcher and tells it.

An `AskTellSearcher` decides what to try and nothing else: the loop (`hpsweep.search.sweep_loop`)
claims a place in the ledger, asks the searcher for the trial to fill it, trains the trial and
tells the searcher how it ended (a `TrialEnd`). It sits below the loop that runs it; the other
kind of searcher, a `hpsweep.search.backends.Driver` that starts trials itself, is handed the
loop and so sits above it. `hpsweep.search.backends` exports both.

    >>> TrialEnd("pruned") is TrialEnd.PRUNED, TrialEnd.PRUNED == "pruned", str(TrialEnd.PRUNED)
    (True, True, 'pruned')
"""

from __future__ import annotations

import abc
import enum
from typing import Generic, TypeVar

from hpsweep.runs import TrialRecord
from hpsweep.trial import Trial

#: A trial's objective value: one number, or one per direction of a multi-objective sweep.
ObjectiveValue = float | list[float]
#: The kind of `Trial` a searcher hands out, and so is told about.
TrialT = TypeVar("TrialT", bound=Trial)


class TrialEnd(str, enum.Enum):
    """How a trial ended, as its searcher is told; the words its ``trial.json`` records."""

    #: It trained to its end; its objective value comes with it.
    COMPLETE = "complete"
    #: It was stopped early for its results (a pruner, a scheduler): finished, with no value.
    PRUNED = "pruned"
    #: Its training raised (its ``error.log`` says why): finished, with no value.
    FAILED = "failed"
    #: A signal or a full disk cut it short: it runs again from its checkpoint, as the same
    #: trial, so it is no result yet.
    STOPPED = "stopped"

    def __str__(self) -> str:
        return self.value


class AskTellSearcher(abc.ABC, Generic[TrialT]):
    """Proposes trials when asked and learns from how they ended: Optuna's study, W&B's
    ``sweeps`` engine without a server. ``TrialT``: the `Trial` subclass it hands out (an
    ``AskTellSearcher[OptunaTrial]``), which the loop gives back to `tell` as it got it.

    The loop calls, in each process that runs trials (the command's, or each ``--n-jobs``
    worker's after the fork, so that connections are never shared): `open` once, then per trial
    `ask` (under the ledger's lock, for the place the ledger claimed) and `tell`, then `close`.
    Counting, numbering places, leases and running cut-short trials again are the ledger's; a
    searcher never sees the output folder's records unless it wants to learn from them.

    A searcher with no numbering of its own (W&B's engine, a random search) also implements
    ``ask_numbered(number) -> Trial | None`` (`hpsweep.search.ledger_base.LedgerNumbered`): the
    ledger then numbers each new trial under its lock and asks for it by that number, and `ask`
    is asked only for a trial that runs ``again``.
    """

    def open(self, worker: int = 0) -> None:  # noqa: B027 - optional: by default nothing
        """Connect to the searcher's records (a study, a sweep); ``worker`` numbers the
        ``--n-jobs`` processes, e.g. for distinct seeded streams."""

    def close(self) -> None:  # noqa: B027 - optional: by default nothing
        """Release what `open` took."""

    @abc.abstractmethod
    def ask(self, again: TrialRecord | None = None) -> TrialT | None:
        """The next trial to run, or None when there is nothing more to try (a finished grid).

        Args:
            again: the record of a trial whose run was cut short (`TrialEnd.STOPPED`, or its
                process died): return that trial again, with its number, id and params. Its
                folder and the checkpoint it resumes from are the search layer's business.
        """

    @abc.abstractmethod
    def tell(self, trial: TrialT, end: TrialEnd, value: ObjectiveValue | None = None) -> None:
        """How ``trial`` (one this searcher handed out) ended; ``value`` comes with
        `TrialEnd.COMPLETE` only. A `TrialEnd.STOPPED` trial is asked ``again`` later: it must
        not count as a result."""

    def abandon(self, ref: object) -> None:  # noqa: B027 - optional: by default nothing
        """Close, in the searcher's own records, a trial whose process died (``ref`` is what
        `Trial.ref` held for it); the ledger then has it run again."""
