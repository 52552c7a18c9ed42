"""The one interface a search backend implements, for both kinds of backend (see `Backend`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from hpsweep.errors import UserError, did_you_mean
from hpsweep.runs import TrialRecord
from hpsweep.search.ledger import Ledger
from hpsweep.search.ledger_base import TrialLedger
from hpsweep.search.options import SearchOptions
from hpsweep.search.progress import Counts
from hpsweep.trial import Trial

#: What a backend calls for every trial: trains it and returns its objective value(s).
#: Raises `hpsweep.errors.TrialPruned` when the trial was pruned, `TrialFailed` when it failed
#: (already recorded on disk), `UserError` when the sweep as a whole cannot go on.
TrialFunction = Callable[[Trial], "float | list[float]"]


#: The backend to suggest when an option only another backend reads is given.
OWNERS = {"address": "ray", "storage": "optuna"}


class Backend:
    """Decides which params to try, and for an executor backend where trials run; nothing else.

    Counting, numbering, leases, running cut-short trials again and failures are the sweep's
    ledger's (`hpsweep.search.ledger_base.TrialLedger`), alike for every backend. Two kinds of backend
    share this interface:

    - **Ask/tell backends** (Optuna; W&B without a server) implement `ask` and `tell`. The search
      layer's loop (`hpsweep.search.sweep_loop`) runs the trials, here and in ``--n-jobs`` worker
      processes: the ledger's claim (`TrialLedger.next_trial`) reaps, claims a lease (a trial to
      run again or a new one), asks the backend and binds the lease to the trial; then the loop
      trains the trial, tells the backend how it ended and releases the lease.
    - **Executor backends** (Ray Tune; W&B with a server, whose agent runs the trials) override
      `run`: their trials start somewhere else (a Tune worker, the agent's thread), and there
      they run the same claim (`Ledger.take_trial`, choosing what to claim: a new trial, or one
      they run again); the trial runner records the trial; `Lease.release`. What needs the
      ledger's lock is reached through the session ``with ledger.locked() as session:`` yields:
      a driver that runs trials in batches asks ``session.needed()`` and
      ``session.next_number()`` before one, and after it tells the ledger what its trials could
      not record (`Ledger.wait_for_endings`, ``session.settle``, ``session.restate``). It never
      counts, numbers or rewrites records itself.

    A backend is one module (or package) in ``hpsweep/search/backends/`` and one line in
    ``backends/__init__.py``. `__init__` checks the search's `SearchOptions` and raises
    `UserError` for what it cannot do (a sampler it lacks, define-by-run, a missing extra), before
    anything is written to disk; it reads the options and never changes them (what it works out
    of them is its own attribute). `open` and `close` bracket a worker's use of an ask/tell
    backend (in each ``--n-jobs`` worker process after the fork, so connections are never shared).
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

    def open(self, worker: int = 0) -> None:
        """Connect to the backend's records (a study, a sweep); called in the process that asks
        (``worker`` numbers the ``--n-jobs`` processes, e.g. for distinct seeded streams)."""

    def close(self) -> None:
        """Release what `open` took."""

    def ask(self, again: TrialRecord | None = None) -> Trial | None:
        """The next trial to run, or None when the search has nothing more to try (a finished grid).

        With ``again``, the record of a trial whose run was cut short: return that trial again,
        with its number and params (its folder and checkpoint are the search layer's business).
        An executor backend (it overrides `run`) need not implement it.
        """
        raise NotImplementedError(f"the {self.name} backend runs its own trials (see its run())")

    def tell(self, trial: Trial, state: str, value: float | list[float] | None = None) -> None:
        """How ``trial`` ended: ``complete`` (with its objective), ``pruned``, ``failed``, or
        ``stopped`` (it will run again; the backend should not count it as a result)."""
        raise NotImplementedError(f"the {self.name} backend runs its own trials (see its run())")

    def abandon(self, ref: Any) -> None:
        """Close a trial whose process died (``ref`` is what `Trial.ref` returned for it)."""

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

    def run(self, loop: Any) -> None:
        """Run the sweep: by default the search layer's loop, here and in ``--n-jobs`` workers; an
        executor backend overrides it (see the class's docstring), with ``loop.ledger``."""
        loop.run_locally(self)
