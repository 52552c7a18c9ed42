"""The Optuna backend: Optuna's samplers and pruners over a study in ``DIR/study.journal``.

The study lives in an Optuna storage (by default Optuna's journal file in the sweep folder, see
`._journal`; any storage URL with ``--storage``), so a sweep stopped and started again continues
the same study. The search layer's loop asks this backend for trials (``study.ask``)
and tells it how they ended (``study.tell``); counting, ``--n-jobs`` worker processes and
running interrupted trials again are the ledger's (`hpsweep.search.ledger`). On one machine a
trial that runs again is a new Optuna trial with the same params (enqueued), while the cut-short
one is told FAIL with the user attribute ``hpsweep_stopped``, so the study never keeps a trial
RUNNING that no process runs. In a database that machines share, the cut-short trial itself goes
back to WAITING and runs again (`._study_ledger`).

The study is an ordinary Optuna study that others read and write while the sweep runs
(docs/watching.md, "The dashboard"): it names its objectives (``set_metric_names``), and each
trial carries its run folder, latest checkpoint and MLflow run id as user attributes (`LINKS`).
A trial ended from outside (optuna-dashboard's Fail button, the ``optuna`` command line) stops at
its next report and is recorded failed (`EndedOutside`); another runs in its place.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from hpsweep.errors import EndedOutside, TakenOver, UserError
from hpsweep.runs import TrialRecord
from hpsweep.search.ask_tell import AskTellSearcher, ObjectiveValue, TrialEnd
from hpsweep.search.backends._base import Backend
from hpsweep.search.backends._optuna._storages import (
    OPEN_TRIES,
    StorageSpec,
    cause,
    open_storage,
    parse_storage,
    retryable,
    storage_error,
)
from hpsweep.search.backends._optuna._study_ledger import (
    AGAIN_ID,
    AGAIN_NUMBER,
    GRACE_S,
    HEARTBEAT_S,
    HOME,
    Standing,
    StudyCounts,
    StudyLedger,
    check_home,
    standing,
)
from hpsweep.search.ledger_base import TrialLedger
from hpsweep.search.options import SearchOptions
from hpsweep.search.space import Distribution, Float, Int
from hpsweep.search.trial_reporter import CHECKPOINT, MLFLOW_RUN_ID, RUN_DIR
from hpsweep.search.warm_start import (
    WARM_ATTR,
    WARM_BEST,
    WARM_NUMBER,
    WarmStart,
    WarmTrial,
)
from hpsweep.trial import Trial, training_step

#: What a trial learns while it runs (`Trial.user_attrs`, from `hpsweep.search.trial_reporter` and the
#: MLflow tracker) and the study's user attribute each is shown under: what optuna-dashboard, the
#: ``optuna`` command line and ``load_study`` show of where the trial's files and runs are.
LINKS = {
    RUN_DIR: "hpsweep_run_dir",
    CHECKPOINT: "hpsweep_checkpoint",
    MLFLOW_RUN_ID: "hpsweep_mlflow_run_id",
}
#: Who may have ended a trial that hpsweep did not end (what a trial's error names).
OUTSIDE = "optuna-dashboard, the optuna CLI or another writer of its study"


class OptunaTrial(Trial):
    """An Optuna trial as the trainer sees it; ``suggest_*`` samples define-by-run.

    Each report first checks that the trial still runs here: another machine may have taken it
    over (`TakenOver`), or someone ended it from outside the sweep (`EndedOutside`); it then
    forwards the trial's new `LINKS` to the study."""

    backend = "optuna"
    define_by_run = True
    reads_checkpoints = False

    def __init__(
        self, trial: optuna.Trial, multi_objective: bool, number: int | None = None
    ) -> None:
        super().__init__(trial.number if number is None else number, trial.params)
        self._trial = trial
        #: The trial's `._study_ledger.Heartbeat` in a shared database: a report raises
        #: `TakenOver` once another machine runs the trial.
        self.fence: Any = None
        self._multi = multi_objective
        self.ref = trial._trial_id
        #: How a path the trial links reads in the study (its home's URL for an object store).
        self.at_home: Callable[[str], str] = str
        #: The state someone outside the sweep gave the trial, once seen.
        self.ended_outside: TrialState | None = None
        self._linked: dict[str, Any] = {}

    def report(
        self, step: int, metrics: Any, objective: Any, checkpoint: str | None = None
    ) -> None:
        self.check_running()
        try:
            self.forward_links()
            if not self._multi and objective is not None:  # Optuna prunes single-objective only
                self._trial.report(float(objective), training_step(step, metrics))
        except optuna.exceptions.UpdateFinishedTrialError:
            self.check_running(fresh=True)  # ended since the check (or the last heartbeat)
            raise

    def check_running(self, *, fresh: bool = False) -> None:
        """Raise if the trial no longer runs here: `TakenOver` (another machine runs it) or
        `EndedOutside`. In a shared database the heartbeat's last reading is used, unless
        ``fresh``; elsewhere (one machine) the study is read, which costs a journal's new lines."""
        fence = self.fence
        if fence is not None and not fresh:
            how, state = fence.found, fence.ended_outside
        else:
            frozen = self._trial.storage.get_trial(self.ref)
            how, state = standing(frozen, fence), frozen.state
        if how == Standing.ELSEWHERE:
            raise TakenOver(
                f"trial {self.number} was judged dead (its heartbeat stopped) and runs on "
                "another machine; this run of it stops and is not recorded"
            )
        if how == Standing.OUTSIDE:
            self.ended_outside = state
            raise EndedOutside(ended_outside(self.number, state))

    def forward_links(self) -> None:
        """Set the study's user attributes of the `LINKS` that changed since the last time; no
        other user attribute is written (notes and attributes others write stay theirs)."""
        for key, attr in LINKS.items():
            value = self.user_attrs.get(key)
            if value is None or self._linked.get(key) == value:
                continue
            self._trial.set_user_attr(attr, self.at_home(value) if key != MLFLOW_RUN_ID else value)
            self._linked[key] = value

    def should_prune(self) -> bool:
        return not self._multi and self._trial.should_prune()

    def suggest_float(
        self, name: str, low: float, high: float, *, log: bool = False, step: float | None = None
    ) -> float:
        return self._keep(name, self._trial.suggest_float(name, low, high, log=log, step=step))

    def suggest_int(
        self, name: str, low: int, high: int, *, log: bool = False, step: int = 1
    ) -> int:
        return self._keep(name, self._trial.suggest_int(name, low, high, log=log, step=step))

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        return self._keep(name, self._trial.suggest_categorical(name, list(choices)))

    def _keep(self, name: str, value: Any) -> Any:
        self.params[name] = value
        return value


def ended_outside(number: int, state: TrialState) -> str:
    """What a trial ended from outside the sweep records as its error."""
    how = "failed" if state == TrialState.FAIL else f"set {state.name}"
    return (
        f"trial {number} was {how} from outside the sweep ({OUTSIDE}); another trial runs in "
        "its place"
    )


def _ended_late(trial: OptunaTrial, state: TrialEnd) -> str:
    """What the sweep says of a trial ended from outside after its last report: it ended here as
    it ended (its record says so), and the study keeps the state it was given."""
    given = trial.ended_outside.name if trial.ended_outside is not None else "it"
    return (
        f"trial {trial.number} was ended from outside the sweep ({OUTSIDE}) after its last "
        f"evaluation: it is recorded {state}, and the study keeps it {given}"
    )


def suggest(trial: OptunaTrial, name: str, dist: Distribution) -> Any:
    if isinstance(dist, Float):
        return trial.suggest_float(name, dist.low, dist.high, log=dist.log, step=dist.step)
    if isinstance(dist, Int):
        return trial.suggest_int(name, dist.low, dist.high, log=dist.log, step=dist.step)
    return trial.suggest_categorical(name, dist.choices)


class OptunaBackend(Backend, AskTellSearcher["OptunaTrial"]):
    """Search with Optuna: an `AskTellSearcher`, its study asked and told. Samplers: tpe
    (default), random, cmaes, gp, grid, nsga2; pruners: median (default), hyperband, sha, none.
    Pruners see every evaluation's objective.

    Options: the two transformers' Optuna users pass on to ``create_study`` / ``optimize``, which
    hpsweep always does: ``load_if_exists`` (the same command continues its study) and
    ``gc_after_trial`` (each trial's memory is released after it: docs/devices.md)."""

    name = "optuna"
    samplers = ("tpe", "random", "cmaes", "gp", "grid", "nsga2")
    pruners = ("median", "hyperband", "sha", "none")
    reads = frozenset({"storage", "resources_per_trial"})
    option_names = ("load_if_exists", "gc_after_trial")
    #: ``--warm-start``'s trials, for the study this command may create (`warm_start`).
    _warm: WarmStart | None = None

    def __init__(self, settings: SearchOptions) -> None:
        super().__init__(settings)
        if settings.sampler == "grid":
            if settings.space is None:
                raise UserError(
                    "--sampler grid needs a `space` dict (a grid cannot be define-by-run)"
                )
            self._grid = {name: dist.grid() for name, dist in settings.space.items()}
        #: where the study lives (`._storages`); messages name it by its password-free label
        self.storage: StorageSpec = parse_storage(settings.storage, settings.output_dir)
        #: the journal file holding the study, or None for another storage
        self.journal: Path | None = self.storage.path if self.storage.kind == "journal" else None
        self.study: optuna.Study | None = None
        # (process id, storage): what `check_study` opened, for this process's sweep
        self._checked: tuple[int, optuna.storages.BaseStorage] | None = None
        optuna.logging.set_verbosity(optuna.logging.ERROR)  # trial.json records failures

    # --- the pieces Optuna provides -------------------------------------------------------------------

    def _takes_object(self, what: str, value: Any) -> bool:
        kinds = {"sampler": optuna.samplers.BaseSampler, "pruner": optuna.pruners.BasePruner}
        if what in kinds and not isinstance(value, kinds[what]):
            raise UserError(
                f"{what}={value!r} is neither a name nor an optuna.{what}s.Base{what.title()}; "
                f"give one of {', '.join(self.samplers if what == 'sampler' else self.pruners)}"
            )
        return what in kinds

    def _sampler(self, stream: int) -> optuna.samplers.BaseSampler:
        s = self.settings
        if isinstance(s.sampler, optuna.samplers.BaseSampler):
            return s.sampler
        seed = None if s.seed is None else s.seed + stream
        name = s.sampler or "tpe"
        if name == "tpe":
            return optuna.samplers.TPESampler(seed=seed)
        if name == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        if name == "cmaes":
            return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
        if name == "gp":
            return optuna.samplers.GPSampler(seed=seed)
        if name == "grid":
            return optuna.samplers.GridSampler(self._grid, seed=seed)
        return optuna.samplers.NSGAIISampler(seed=seed)

    def _pruner(self) -> optuna.pruners.BasePruner:
        if isinstance(self.settings.pruner, optuna.pruners.BasePruner):
            return self.settings.pruner
        name = self.settings.pruner or "median"
        if name == "median":
            # Measured, not guessed (bench/pruner_settings.py, bench/README.md): on the shipped digits
            # space these settings reached a typical sweep's accuracy in the least CPU time of six
            # candidates (startup 3 or 5, warmup 1 or 2, Hyperband, none) with the same best accuracy,
            # and spent 27% less than no pruning on a 30-trial sweep. Reports are keyed by the training
            # step, so warmup 1 allows pruning from the first evaluation after a step (not one on
            # start); a trial's last is never offered (TrialReporter).
            # A warm-started study's earlier trials count as finished but bring no curve (they
            # trained on other data): a step is then judged against three of this sweep's own
            # trials that reported there, not against the first one alone.
            least = 3 if self.settings.warm_start else 1
            return optuna.pruners.MedianPruner(
                n_startup_trials=3, n_warmup_steps=1, n_min_trials=least
            )
        if name == "hyperband":
            return optuna.pruners.HyperbandPruner(min_resource=1)
        if name == "sha":
            return optuna.pruners.SuccessiveHalvingPruner(min_resource=1)
        return optuna.pruners.NopPruner()

    def _storage(self) -> optuna.storages.BaseStorage:
        """The study's storage, opened: the one `check_study` opened in this process, else a new
        one (a shared database's with its heartbeat and patience, `shared_database`)."""
        checked, self._checked = self._checked, None
        if checked is not None and checked[0] == os.getpid():
            return checked[1]
        if not self.shared:
            return open_storage(self.storage)
        return shared_database(self.storage)

    @property
    def shared(self) -> bool:
        """Whether the study is in a database that machines share: it is then the ledger."""
        kind, obj = self.storage.kind, self.storage.obj
        if kind == "object":
            return isinstance(obj, optuna.storages.GrpcStorageProxy) or (
                isinstance(obj, optuna.storages.RDBStorage) and not obj.url.startswith("sqlite")
            )
        return kind in ("sql", "grpc")

    def ledger(self) -> TrialLedger:
        if not self.shared:
            return super().ledger()
        return StudyLedger(self.settings.output_dir, self.settings.n_trials, self.settings.home)

    def progress_counts(self) -> StudyCounts | None:
        if not self.shared:
            return None
        return StudyCounts(self.settings.output_dir)

    def load_study(self, stream: int = 0) -> optuna.Study:
        """The study, created if missing (see `_opened`)."""
        return self._opened(lambda: self._load_study(stream))

    def _opened(self, open_it: Callable[[], Any]) -> Any:
        """``open_it()`` on the storage. One that cannot be opened is one line at once; only a
        race between processes creating the tables or the study together is tried again."""
        for attempt in range(OPEN_TRIES):
            try:
                return open_it()
            except UserError:
                raise
            except Exception as exc:
                if cause(exc) is None:  # not the storage's: a bug, with its traceback
                    raise
                if attempt == OPEN_TRIES - 1 or not retryable(exc):
                    raise storage_error(self.storage, exc) from None
                time.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")

    def _load_study(self, stream: int) -> optuna.Study:
        s = self.settings
        found = {
            "storage": self._storage(),
            "study_name": s.study_name,
            "sampler": self._sampler(stream),
            "pruner": self._pruner(),
        }
        try:  # loaded first: creating appends a record to a journal even when the study exists
            study = optuna.load_study(**found)
        except KeyError:
            study = self._create_study(found)
        stored = [d.name.lower() for d in study.directions]
        if stored != s.directions:  # Optuna 5 loads a study with other directions without a word
            raise UserError(
                f"study {s.study_name!r} in {self.storage.label} was created to {', '.join(stored)}, not "
                f"{', '.join(s.directions)}; keep the direction, or use another --study-name or --output-dir"
            )
        if self.shared:
            self._keep_home(study)
        self._name_metrics(study)
        return study

    def _name_metrics(self, study: optuna.Study) -> None:
        """Name the study's objectives as the sweep does, for optuna-dashboard's axes and
        ``optuna``'s tables, once: the names are the study's from then on."""
        named = study.metric_names
        self._check_objective(named, self.storage.label)
        if named is None:
            study.set_metric_names(self.metric_names)

    @property
    def metric_names(self) -> list[str]:
        """The names of the study's objectives: the objective's, one per direction."""
        s = self.settings
        if not s.multi_objective:
            return [s.objective_name]
        return [f"{s.objective_name}_{i}" for i in range(len(s.directions))]

    def _check_objective(self, named: list[str] | None, label: str) -> None:
        """Refuse a study that optimises another objective (one begun by an hpsweep that did not
        name its objectives takes this one's names)."""
        s = self.settings
        if named is not None and named != self.metric_names:
            raise UserError(
                f"study {s.study_name!r} in {label} optimises {', '.join(named)}, not "
                f"{', '.join(self.metric_names)}; keep the objective, or use another --study-name "
                "or --output-dir"
            )

    # --- the study a sweep on many machines shares ---------------------------------------------------

    def check_study(self) -> None:
        """Refuse, before anything is written (not even to the study), a command that does not
        match the study it names: another home, other directions, another space.

        The storage is opened as the sweep opens it, and a sweep that runs in this process (one
        ``--n-jobs``) goes on with it (`_storage`): one connection and one schema check per
        command, and what the check read stays in Optuna's cache. ``--n-jobs`` workers open their
        own after the fork, so then it is closed."""
        if not self._stored():
            return  # a new study: nothing to disagree with, and nothing to create yet
        storage = self._opened(self._storage)
        try:
            self._check_stored(storage)
        except BaseException:
            _close(storage)
            raise
        if self.settings.n_jobs == 1:
            self._checked = (os.getpid(), storage)
        else:
            _close(storage)

    def _stored(self) -> bool:
        """Whether the storage may hold studies already: a database, or a file that exists
        (opening a missing journal or SQLite file would create it)."""
        kind = self.storage.kind
        if kind == "journal":
            return self.storage.path.exists()
        if kind == "sqlite":
            return Path(self.storage.url.split(":///", 1)[-1]).exists()
        return True

    def _check_stored(self, storage: optuna.storages.BaseStorage) -> None:
        s = self.settings
        try:
            study_id = storage.get_study_id_from_name(s.study_name)
        except KeyError:
            return  # a new study: nothing to disagree with
        label = self.storage.label
        check_home(storage.get_study_user_attrs(study_id), self.home, s.study_name, label)
        stored = [d.name.lower() for d in storage.get_study_directions(study_id)]
        if stored != s.directions:
            raise UserError(
                f"study {s.study_name!r} in {label} was created to {', '.join(stored)}, not "
                f"{', '.join(s.directions)}; keep the direction, or use another --study-name"
            )
        study = optuna.load_study(study_name=s.study_name, storage=storage)
        self._check_objective(study.metric_names, label)
        done = _a_complete_trial(storage, study_id, len(stored))
        for name, dist in (s.space or {}).items() if done is not None else ():
            known = done.distributions.get(name)
            if known is not None and known != _optuna_distribution(dist):
                raise UserError(
                    f"space[{name!r}] = {dist!r} differs from what study {s.study_name!r} in "
                    f"{label} recorded ({known}); keep the space, or use another --study-name"
                )

    @property
    def home(self) -> str:
        """The sweep's home as the study keeps it: a folder's path, or an object store's URL."""
        return self.settings.home_url

    def _keep_home(self, study: optuna.Study) -> None:
        attrs = study.user_attrs
        check_home(attrs, self.home, study.study_name, self.storage.label)
        if HOME not in attrs:
            study.set_user_attr(HOME, self.home)

    # --- asking and telling ------------------------------------------------------------------------------

    def open(self, worker: int = 0) -> None:
        # A seeded sampler draws a stream of its own per worker, and a rerun continues after the
        # trials the study already holds instead of drawing the first ones again.
        # The study is opened once (each open builds a storage and checks its schema: ~0.8 s).
        study = self.load_study()
        asked = study._storage.get_n_trials(study._study_id)
        study.sampler = self._sampler(stream=asked + 7919 * worker)
        self.study = study

    def close(self) -> None:
        self.study = None

    def ask(self, again: TrialRecord | None = None) -> OptunaTrial | None:
        study = self.study
        assert study is not None, "open() first"
        # the same params again, as a new Optuna trial (the cut-short one is FAIL)
        if again is not None:
            study.enqueue_trial(
                again.params, user_attrs={"hpsweep_again": again.id}, skip_if_exists=False
            )
        elif self._grid_done(study):
            return None
        return self.wrap(study.ask(), again)

    def wrap(self, asked: optuna.Trial, again: TrialRecord | None = None) -> OptunaTrial:
        """The `Trial` of the Optuna trial ``asked``, its space's params suggested; with ``again``
        (the record of the trial it runs again) that trial's number and id."""
        study, s = self.study, self.settings
        assert study is not None
        number, trial_id = _again_identity(asked, again)
        trial = OptunaTrial(asked, s.multi_objective, number=number)
        trial.at_home = self._at_home
        if trial_id is not None:
            trial.id = trial_id
        for name, dist in (s.space or {}).items():
            try:
                suggest(trial, name, dist)
            except ValueError as exc:  # the stored study knows this name with another distribution
                study.tell(trial._trial, state=TrialState.FAIL)
                raise UserError(
                    f"space[{name!r}] = {dist!r} differs from what study {s.study_name!r} recorded "
                    f"({exc}); keep the space, or use another --study-name or --output-dir"
                ) from None
        return trial

    def tell(self, trial: OptunaTrial, end: TrialEnd, value: ObjectiveValue | None = None) -> None:
        """Tell the study how ``trial`` ended here, unless it no longer runs here: ended from
        outside (the study keeps what it was given) or taken over by another machine."""
        try:
            try:
                trial.check_running(fresh=True)
                trial.forward_links()
                self._tell(trial, end, value)
            except optuna.exceptions.UpdateFinishedTrialError:
                trial.check_running(fresh=True)  # ended since it was read: say how
                raise
        except EndedOutside:
            if end is not TrialEnd.FAILED:  # a failed one's record and the progress say so
                print(f"hpsweep: {_ended_late(trial, end)}", file=sys.stderr)
        except (TakenOver, optuna.exceptions.UpdateFinishedTrialError):
            # another machine judged this trial's process dead (its heartbeat stopped while the
            # database was away) and runs it again; that run records it
            print(
                f"hpsweep: trial {trial.number} runs again elsewhere; this run's end is not counted",
                file=sys.stderr,
            )
        except RuntimeError:
            # A grid sampler stops the study once every point is asked, which Optuna allows only
            # inside study.optimize; the trial is told all the same, and `exhausted` ends the sweep.
            if not self.exhausted():
                raise

    def _tell(self, trial: OptunaTrial, end: TrialEnd, value: ObjectiveValue | None = None) -> None:
        # skip_if_finished: ended from outside since `check_running` read it, it stays so
        assert self.study is not None
        if end is TrialEnd.COMPLETE:
            self.study.tell(trial._trial, value, skip_if_finished=True)
        elif end is TrialEnd.PRUNED:
            self.study.tell(trial._trial, state=TrialState.PRUNED, skip_if_finished=True)
        else:
            if end is TrialEnd.STOPPED:
                trial._trial.set_user_attr("hpsweep_stopped", True)
            self.study.tell(trial._trial, state=TrialState.FAIL, skip_if_finished=True)

    def _at_home(self, path: str) -> str:
        """``path`` as the sweep's home names it: its URL for a file staged here for an object
        store, so that the study names a place every machine reads."""
        s = self.settings
        if s.home is None or not s.home.remote:
            return path
        try:
            inside = Path(path).relative_to(s.output_dir)
        except ValueError:
            return path
        return f"{s.home_url}/{inside.as_posix()}"

    def abandon(self, ref: Any) -> None:
        """Fail the Optuna trial a dead process left RUNNING (it runs again as a new trial)."""
        assert self.study is not None
        storage = self.study._storage
        try:
            if storage.get_trial(int(ref)).state == TrialState.RUNNING:
                storage.set_trial_user_attr(int(ref), "hpsweep_stopped", True)
                storage.set_trial_state_values(int(ref), TrialState.FAIL)
        except (KeyError, ValueError, RuntimeError):
            pass  # already finished, or another storage's trial

    def exhausted(self) -> bool:
        """Whether the sampler has nothing more to try (a grid whose every point was asked)."""
        return self.study is not None and self._grid_done(self.study)

    @staticmethod
    def _grid_done(study: optuna.Study) -> bool:
        sampler = study.sampler
        return isinstance(sampler, optuna.samplers.GridSampler) and sampler.is_exhausted(study)

    # --- an earlier sweep's trials (--warm-start) -----------------------------------------------------

    def warm_start(self, warm: WarmStart) -> None:
        """Keep ``warm`` for the study: its trials are added to it as finished ones, marked
        `WARM_ATTR` (and their earlier number), and its best configs enqueued with `WARM_BEST`,
        by the command that creates the study, once (`_create_study`): a study that exists took
        its warm start when it was made. One that took another, or began without one, is
        refused here, before anything is written."""
        self._warm = warm
        if not self._stored():
            return
        checked = self._checked
        storage = checked[1] if checked is not None else self._opened(self._storage)
        try:
            self._check_warm_taken(storage, warm)
        finally:
            if checked is None:
                _close(storage)

    def _check_warm_taken(self, storage: optuna.storages.BaseStorage, warm: WarmStart) -> None:
        s = self.settings
        try:
            study_id = storage.get_study_id_from_name(s.study_name)
        except KeyError:
            return  # a new study: it takes the warm start when it is made
        taken = storage.get_study_user_attrs(study_id).get(WARM_ATTR)
        if taken == warm.home:
            return
        began = f"began from --warm-start {taken}" if taken else "began without --warm-start"
        raise UserError(
            f"study {s.study_name!r} in {self.storage.label} {began}; a warm start is taken "
            "when a study is made: use another --study-name or --output-dir, or give the same "
            "--warm-start"
        )

    def _create_study(self, found: dict[str, Any]) -> optuna.Study:
        """Create the study (``found``: its storage, name, sampler and pruner) or, when another
        process made it meanwhile, load it; the one process that creates it adds the warm start."""
        try:
            study = optuna.create_study(**found, directions=self.settings.directions)
        except optuna.exceptions.DuplicatedStudyError:
            return optuna.load_study(**found)
        if self._warm is not None:
            add_warm_start(study, self._warm, self.settings.space or {})
        return study


def _a_complete_trial(
    storage: optuna.storages.BaseStorage, study_id: int, objectives: int
) -> optuna.trial.FrozenTrial | None:
    """A COMPLETE trial of the study, whose distributions are the study's, or None: with one
    objective the best (one query on a database); with several the last, of all the trials
    read (into the cache the sweep goes on with, `OptunaBackend.check_study`)."""
    if objectives == 1:
        try:
            return storage.get_best_trial(study_id)
        except ValueError:  # none complete yet
            return None
    done = storage.get_all_trials(study_id, deepcopy=False, states=(TrialState.COMPLETE,))
    return done[-1] if done else None


def _close(storage: optuna.storages.BaseStorage) -> None:
    """Let go of ``storage``'s connections, so that no forked worker shares them (through the
    wrappers of a shared database: `._patient`, Optuna's cache)."""
    storage = getattr(storage, "inner", storage)
    if isinstance(storage, optuna.storages._CachedStorage):
        storage = storage._backend
    if isinstance(storage, optuna.storages.RDBStorage):
        storage.engine.dispose()
    elif isinstance(storage, optuna.storages.GrpcStorageProxy):
        storage.close()


def _optuna_distribution(dist: Distribution) -> optuna.distributions.BaseDistribution:
    """The Optuna distribution a space entry is sampled from (`suggest`)."""
    if isinstance(dist, Float):
        return optuna.distributions.FloatDistribution(
            dist.low, dist.high, log=dist.log, step=dist.step
        )
    if isinstance(dist, Int):
        return optuna.distributions.IntDistribution(
            dist.low, dist.high, log=dist.log, step=dist.step
        )
    return optuna.distributions.CategoricalDistribution(list(dist.choices))


def _again_identity(
    asked: optuna.Trial, again: TrialRecord | None
) -> tuple[int | None, str | None]:
    """The number and id a trial that runs another again takes: from that trial's record, or
    from what its enqueued copy carries in the study (`._study_ledger`)."""
    if again is not None:
        return again.number, again.id
    attrs = asked.user_attrs
    if AGAIN_ID in attrs:
        return int(attrs[AGAIN_NUMBER]), str(attrs[AGAIN_ID])
    return None, None


def shared_database(parsed: StorageSpec) -> optuna.storages.BaseStorage:
    """The storage of a study in a database that machines share (`._storages`), with Optuna's
    heartbeat on where the storage has one, and calls that wait out the database's absences."""
    from hpsweep.search.backends._optuna._retrying_storage import RetryingStorage

    storage = open_storage(
        parsed,
        heartbeat_interval=HEARTBEAT_S,
        grace_period=GRACE_S,
    )
    return RetryingStorage(optuna.storages.get_storage(storage), parsed.label)


def add_warm_start(study: optuna.Study, warm: WarmStart, space: dict[str, Distribution]) -> None:
    """Mark the new ``study`` as warm-started from ``warm.home``, then add its trials as finished
    ones (each with `WARM_ATTR` and its earlier number, `WARM_NUMBER`) and enqueue its best
    configs (`WARM_BEST`: their rank); a param a trial lacks is one the new space added."""
    study.set_user_attr(WARM_ATTR, warm.home)
    study.add_trials([_warm_trial(t, warm.home, space) for t in warm.trials])
    for rank, params in enumerate(warm.best):
        study.enqueue_trial(params, user_attrs={WARM_BEST: rank}, skip_if_exists=False)


def _warm_trial(
    trial: WarmTrial, home: str, space: dict[str, Distribution]
) -> optuna.trial.FrozenTrial:
    complete = trial.state == "complete"
    value = trial.value
    return optuna.trial.create_trial(
        state=TrialState.COMPLETE if complete else TrialState.PRUNED,
        params=trial.params,
        distributions={name: _optuna_distribution(space[name]) for name in trial.params},
        value=value if complete and not isinstance(value, list) else None,
        values=value if complete and isinstance(value, list) else None,
        intermediate_values=trial.intermediate,
        user_attrs={WARM_ATTR: home, WARM_NUMBER: trial.number},
    )
