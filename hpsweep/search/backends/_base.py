"""The backend seam: `Backend` (a search's options, checked, and the home of its ledger) and the
two kinds of searcher a backend hands the sweep (`Backend.searcher`):

- an `AskTellSearcher` (`hpsweep.search.ask_tell`) proposes trials when asked and is told how
  they ended; the search layer's loop runs the trials (Optuna; W&B without a server);
- a `Driver` is a library's own driver, which starts trials itself (Ray Tune's workers, W&B's
  agent) and claims each one through the ledger where it starts.

`hpsweep.search.sweep.run_searcher` runs the loop for the first and ``drive(loop)`` for the
second.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from hpsweep.errors import UserError, did_you_mean
from hpsweep.search.ask_tell import AskTellSearcher, ObjectiveValue
from hpsweep.search.ledger import Ledger
from hpsweep.search.ledger_base import TrialLedger
from hpsweep.search.options import SearchOptions
from hpsweep.search.progress import Counts
from hpsweep.search.sweep_loop import SweepLoop
from hpsweep.search.warm_start import WarmStart
from hpsweep.trial import Trial

#: What a searcher calls for every trial: trains it and returns its objective value(s).
#: Raises `hpsweep.errors.TrialPruned` when the trial was pruned, `TrialFailed` when it failed
#: (already recorded on disk), `UserError` when the sweep as a whole cannot go on.
TrialFunction = Callable[[Trial], ObjectiveValue]


#: The backend to suggest when an option only another backend reads is given.
OWNERS = {"address": "ray", "storage": "optuna"}


class Driver(abc.ABC):
    """A library's own driver: it decides what to try and starts each trial itself (a Ray Tune
    worker, W&B's agent thread), instead of being asked by the search layer's loop.

    Where a trial starts, the driver runs the ledger's claim sequence,
    ``loop.ledger.take_trial(choose, make)``, choosing what it claims (a new trial, one to run
    again, one by its id) and how the trial is made; it trains the trial with ``loop.runner``,
    which records it, and releases the claim's lease. What needs the ledger's lock is reached
    through the session ``with loop.ledger.locked() as session:`` yields: a driver that runs
    trials in batches asks ``session.needed()`` and ``session.next_number()`` before one and
    after it tells the ledger what its trials could not record (``Ledger.wait_for_endings``,
    ``session.settle``, ``session.restate``). It never counts, numbers or rewrites records.
    """

    @abc.abstractmethod
    def drive(self, loop: SweepLoop) -> None:
        """Run the sweep's trials until the ledger says done, ``loop.deadline`` passes or
        `SweepLoop.check_failures` ends the sweep; ``loop.placed()`` places this process as the
        loop places its own (for a driver that trains in this process). Raises `UserError` for
        the sweep's user errors and `KeyboardInterrupt` (or `Interrupted`) when a signal stopped it.
        """


#: What a backend hands the sweep to try its trials.
Searcher = AskTellSearcher | Driver


class Backend:
    """A search backend: the options it takes, checked, and the searcher that tries its trials.

    Counting, numbering, leases, running cut-short trials again and failures are the sweep's
    ledger's (`hpsweep.search.ledger_base.TrialLedger`), alike for every backend. A backend
    says which of the two kinds of searcher tries its trials (`searcher`): an `AskTellSearcher`,
    which the search layer's loop asks and tells (here and in ``--n-jobs`` worker processes), or
    a `Driver`, which starts its trials itself. A backend that is always one kind subclasses
    that base too and is its own searcher (Optuna, Ray): its library's state (Optuna's study,
    which the study's ledger reads too) stays in one object. One whose kind is known only when
    the sweep runs overrides `searcher` (W&B: its agent with a server, its engine without).

    `__init__` checks the search's `SearchOptions` and raises `UserError` for what the backend
    cannot do (a sampler it lacks, define-by-run, a missing extra), before anything is written
    to disk; it reads the options and never changes them (what it works out of them is its own
    attribute). A backend is one module (or package) in ``hpsweep/search/backends/`` and one
    line in ``BACKENDS`` (``backends/__init__.py``), or a class registered at run time
    (`hpsweep.search.backends.register_backend`).
    """

    name: ClassVar[str]
    #: The generic choices the backend offers; any other given explicitly is an error.
    samplers: ClassVar[Sequence[str]] = ()
    pruners: ClassVar[Sequence[str]] = ()
    schedulers: ClassVar[Sequence[str]] = ()
    #: The optional settings the backend reads (`hpsweep.search.options.OPTIONAL`); one given
    #: explicitly that it does not read is an error, not silence.
    reads: ClassVar[frozenset[str]] = frozenset()
    #: Backend-specific keyword options (``hyperparameter_search(backend=..., name=value)``).
    option_names: ClassVar[Sequence[str]] = ()
    #: Whether ``--n-jobs`` worker processes may share the backend's records (a shared storage).
    parallel: ClassVar[bool] = True

    def __init__(self, settings: SearchOptions) -> None:
        #: The search's options, as the sweep checked them: read, never changed.
        self.settings = settings
        self._check_choice("sampler", settings.sampler, self.samplers)
        self._check_choice("pruner", settings.pruner, self.pruners)
        self._check_choice("scheduler", settings.scheduler, self.schedulers)
        for name in sorted(settings.given - self.reads):
            flag = "--" + name.replace("_", "-")
            raise UserError(
                f"{flag}: the {self.name} backend does not use it; drop {flag}"
                + (f" or use --backend {OWNERS[name]}" if name in OWNERS else "")
            )
        unknown = sorted(set(settings.options) - set(self.option_names))
        if unknown:
            takes = (
                f"it takes {', '.join(self.option_names)}" if self.option_names else "it takes none"
            )
            raise UserError(
                f"unknown {self.name} option(s) {', '.join(unknown)}{did_you_mean(unknown[0], self.option_names)}; "
                f"{takes}"
            )
        if settings.n_jobs > 1 and not self.parallel:
            raise UserError(
                f"--n-jobs {settings.n_jobs}: the {self.name} backend runs one trial at a time; drop --n-jobs"
            )

    def _check_choice(self, what: str, value: Any, allowed: Sequence[str]) -> None:
        if value is None or (not isinstance(value, str) and self._takes_object(what, value)):
            return
        if not allowed:
            raise UserError(
                f"--{what} {value}: the {self.name} backend has no {what}s; drop --{what}"
            )
        if value not in allowed:
            raise UserError(
                f"--{what} {value!r} is not one of {', '.join(allowed)} for the {self.name} backend"
            )

    @staticmethod
    def transformers_keywords(
        options: dict[str, Any],
    ) -> tuple[dict[str, Any], dict[str, Any], str | None]:
        """The keywords transformers hands this backend's library, which its users pass to
        ``hyperparameter_search``, as hpsweep's: the options left, the search settings they stand
        for (``sampler``, ``storage``, ``timeout``, ``n_jobs``, ``max_failed_trials``,
        ``study_name``, ``objective``: the metric the sweep optimises) and a note on those
        ignored. Read before the settings are made."""
        return options, {}, None

    @staticmethod
    def native_options(settings: SearchOptions) -> dict[str, Any]:
        """The options that an ``hp_space`` written in the backend library's own form stands
        for, as Hugging Face's users write it (W&B: a sweep config is the space, its method the
        sampler); empty when there is none. The sweep adopts them before it makes the backend, so
        that the backend, the trials and the sweep callbacks read the same options."""
        return {}

    def _takes_object(self, what: str, value: Any) -> bool:
        """Whether ``value`` is a ready-made sampler / pruner / scheduler object the backend uses as
        it is (Hugging Face users pass ``sampler=optuna.samplers.TPESampler(...)``)."""
        return False

    def searcher(self) -> Searcher:
        """What tries the sweep's trials: the backend itself when it subclasses `AskTellSearcher`
        or `Driver`; a backend whose kind depends on what is known only as the sweep starts
        overrides it. Called once per sweep, after the output folder is made."""
        if isinstance(self, (AskTellSearcher, Driver)):
            return self
        raise TypeError(
            f"{type(self).__name__} is neither an AskTellSearcher nor a Driver: subclass one of "
            "them too, or override searcher()"
        )

    def check_study(self) -> None:
        """Refuse, in one `UserError` line and before anything is written, a sweep whose stored
        study disagrees with the command (a backend that keeps its study in a shared database)."""

    def ledger(self) -> TrialLedger:
        """The sweep's ledger: by default files under the output folder (one machine, or a folder
        machines share); a backend whose study lives in a database machines share returns the
        study's own (`hpsweep.search.backends._optuna._study_ledger.StudyLedger`)."""
        return Ledger(self.settings.output_dir, self.settings.n_trials)

    def progress_counts(self) -> Callable[[], Counts] | None:
        """A callable that returns the sweep's `hpsweep.search.progress.Counts` as its study holds
        them, for a study that machines share (each machine's display then shows the whole
        sweep); None (the default): the display counts the records in the output folder."""
        return None

    def warm_start(self, warm: WarmStart) -> None:
        """Take an earlier sweep's trials (``--warm-start``, `hpsweep.search.warm_start`), to give
        the search as evaluated ones before its first new trial, with ``warm.best``: configs to
        train first. Called once per command, before anything is written: refuse here, in one
        `UserError` line, what the backend cannot take. The trials reach the backend's study
        once, however many commands or machines run the sweep, and never count towards
        ``n_trials`` (they have no record and no run folder)."""
        raise UserError(
            f"--warm-start: the {self.name} backend cannot begin from earlier trials; "
            "drop --warm-start or use --backend optuna"
        )
