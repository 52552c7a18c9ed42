"""A sweep whose study is in a shared database costs the same per trial at its 10,000th trial as at
its first (docs/many-machines.md, "What each trial costs"): measured by counting the database's
work (statements, transactions, rows read) and the ledger's reads of the whole study, never by
timing. Real sweeps on a real PostgreSQL server, on a small study and on one with hundreds of
trials in it."""

from __future__ import annotations

import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy
from optuna.distributions import FloatDistribution
from optuna.trial import FrozenTrial, TrialState, create_trial
from support import write_space

import hpsweep
from hpsweep.search.backends._optuna import _study_ledger
from hpsweep.search.backends._optuna._backend import OptunaBackend, shared_database
from hpsweep.search.backends._optuna._retrying_storage import RetryingStorage
from hpsweep.search.backends._optuna._storages import parse_storage
from hpsweep.search.backends._optuna._study_ledger import (
    BEAT,
    FAIL_REASON,
    UNNEEDED,
    Heartbeat,
    Standing,
    StudyTally,
    run_again,
    standing,
)
from hpsweep.search.job import SweepCallback
from hpsweep.search.options import SearchOptions
from hpsweep.search.space import Float

pytestmark = [
    pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning"),
    pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used"),
]

SPACE = '{"learning_rate": hpsweep.Float(1e-3, 3e-1, log=True)}'
LEARNING_RATE = FloatDistribution(1e-3, 3e-1, log=True)
ALREADY = {"small": 3, "large": 300}  # trials in each study before the sweep
TRIALS = 10  # this sweep's trials: the 6th fails, so one more runs in its place
FAILS_AT = 6


class DatabaseWork:
    """What every SQLAlchemy engine in this process sends while it counts: statements,
    transactions, rows read and new connections."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def __enter__(self) -> DatabaseWork:
        sqlalchemy.event.listen(sqlalchemy.engine.Engine, "after_cursor_execute", self._executed)
        sqlalchemy.event.listen(sqlalchemy.engine.Engine, "begin", self._began)
        sqlalchemy.event.listen(sqlalchemy.pool.Pool, "connect", self._connected)
        return self

    def __exit__(self, *exc: Any) -> None:
        sqlalchemy.event.remove(sqlalchemy.engine.Engine, "after_cursor_execute", self._executed)
        sqlalchemy.event.remove(sqlalchemy.engine.Engine, "begin", self._began)
        sqlalchemy.event.remove(sqlalchemy.pool.Pool, "connect", self._connected)

    def _executed(self, conn, cursor, statement, *args: Any) -> None:
        self.counts["statements"] += 1
        if statement.lstrip().upper().startswith("SELECT"):
            self.counts["rows"] += max(cursor.rowcount, 0)

    def _began(self, conn) -> None:
        self.counts["transactions"] += 1

    def _connected(self, *args: Any) -> None:
        self.counts["connections"] += 1

    def snapshot(self) -> Counter[str]:
        return Counter(self.counts)


@dataclass
class Sweep:
    """What one sweep's trials cost, from the start of one trial to the start of the next."""

    per_trial: list[Counter[str]] = field(default_factory=list)
    #: The ledger's reads of the study's trials (hpsweep's `get_all_trials` calls) in that time.
    reads: list[int] = field(default_factory=list)
    reads_at_end: int = 0
    connections: int = 0


class _Fail(hpsweep.TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        raise RuntimeError("this trial fails")


class _Probe(SweepCallback):
    """Notes the database's work and the ledger's reads at the start of each trial; fails one."""

    def __init__(self, work: DatabaseWork, reads: Counter[str], sweep: Sweep) -> None:
        self.work, self.reads, self.sweep = work, reads, sweep
        self.last: tuple[Counter[str], int] | None = None

    def trial_callbacks(self, trial: Any, record: Any) -> list[Any]:
        now = (self.work.snapshot(), self.reads["hpsweep"])
        if self.last is not None:
            self.sweep.per_trial.append(now[0] - self.last[0])
            self.sweep.reads.append(now[1] - self.last[1])
        self.last = now
        return [_Fail()] if len(self.sweep.per_trial) == FAILS_AT - 1 else []

    def on_sweep_end(self, best: Any, records: Any, interrupted: bool) -> None:
        assert self.last is not None
        self.sweep.reads_at_end = self.reads["hpsweep"] - self.last[1]


def _counting_reads(reads: Counter[str]) -> Any:
    """`RetryingStorage.get_all_trials`, counting the calls hpsweep's own code makes."""
    plain = RetryingStorage.get_all_trials

    def get_all_trials(self: RetryingStorage, *args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        reads["hpsweep" if caller.startswith("hpsweep.") else "optuna"] += 1
        return plain(self, *args, **kwargs)

    return get_all_trials


def _filled(url: str, n: int) -> None:
    """A study of ``n`` finished trials, as earlier sweeps leave it."""
    study = optuna.create_study(study_name="cost", storage=url, direction="maximize")
    study.add_trials(
        create_trial(
            params={"learning_rate": 0.01},
            distributions={"learning_rate": LEARNING_RATE},
            value=0.5,
        )
        for _ in range(n)
    )


@pytest.fixture(scope="module")
def sweeps(pg, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Sweep, str, Path]]:
    """One sweep of `TRIALS` trials on each study, to ``n_trials`` = those already in it +
    `TRIALS`; beats and looks for dead machines are set apart (an hour), so that each trial's
    work is its own, not a timer's."""
    found = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_study_ledger, "HEARTBEAT_S", 3600)
        mp.setattr(_study_ledger, "PUBLISH_S", 3600)
        reads: Counter[str] = Counter()
        mp.setattr(RetryingStorage, "get_all_trials", _counting_reads(reads))
        for name, already in ALREADY.items():
            url = pg.create_database(f"cost_{name}")
            _filled(url, already)
            tmp = tmp_path_factory.mktemp(name)
            space = write_space(tmp, space=SPACE, epochs=1, extra_args=", max_steps=1")
            sweep = Sweep()
            with DatabaseWork() as work:
                hpsweep.run(
                    space, n_trials=already + TRIALS, output_dir=tmp / "out", study_name="cost",
                    storage=url, sampler="random", pruner="none",
                    sweep_callbacks=[_Probe(work, reads, sweep)],
                )  # fmt: skip
            sweep.connections = work.counts["connections"]
            found[name] = (sweep, url, tmp / "out")
    return found


def test_each_trial_costs_the_database_the_same_in_a_large_study_as_in_a_small_one(sweeps):
    small, large = sweeps["small"][0], sweeps["large"][0]
    assert len(small.per_trial) == TRIALS  # one more than asked: the failed trial's replacement
    # statements, transactions and rows read, trial by trial: the same whatever the study holds
    assert large.per_trial == small.per_trial
    # and from one trial to the next (but for the failed one, and the look before the last)
    completed = [w for i, w in enumerate(small.per_trial) if i not in (FAILS_AT - 1, TRIALS - 1)]
    assert all(w == completed[0] for w in completed)


def test_far_from_the_end_the_ledger_reads_nothing_per_trial(sweeps):
    for name, (sweep, url, _) in sweeps.items():
        # the trials numbered below n_trials were admitted by their number alone; the failed
        # one's replacement, numbered n_trials, and the end were looked at
        assert sweep.reads[:-1] == [0] * (TRIALS - 1)
        assert sweep.reads[-1] == 1 and sweep.reads_at_end >= 1
        states = Counter(t.state for t in optuna.load_study(study_name="cost", storage=url).trials)
        assert states == {TrialState.COMPLETE: ALREADY[name] + TRIALS, TrialState.FAIL: 1}


def test_the_study_is_checked_on_the_storage_the_sweep_then_uses_with_one_trial_read(sweeps):
    _, url, out = sweeps["small"]
    with DatabaseWork() as alone:
        shared_database(parse_storage(url, out)).inner._backend.engine.dispose()
    # the whole command, check and sweep, opened one storage's connections
    assert sweeps["small"][0].connections == sweeps["large"][0].connections
    assert sweeps["small"][0].connections == alone.counts["connections"]
    rows = {}
    for name, (_, url, out) in sweeps.items():
        settings = SearchOptions(
            output_dir=out, space={"learning_rate": Float(1e-3, 3e-1, log=True)},
            directions=["maximize"], objective_name="eval_accuracy", storage=url,
            study_name="cost", n_jobs=2,
        )  # fmt: skip
        with DatabaseWork() as work:
            OptunaBackend(settings).check_study()
        rows[name] = work.counts["rows"]
    assert rows["large"] == rows["small"]


def _from_scratch(trials: list[FrozenTrial]) -> dict[str, Any]:
    """The counts `StudyTally` keeps, counted from every trial."""
    states = Counter(t.state for t in trials)
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    best = max(done, key=lambda t: t.value) if done else None
    return {
        "done": states[TrialState.COMPLETE] + states[TrialState.PRUNED],
        "failed": sum(
            t.state == TrialState.FAIL
            and t.system_attrs.get(FAIL_REASON) != UNNEEDED
            and not t.user_attrs.get("hpsweep_stopped")
            for t in trials
        ),
        "stopped": states[TrialState.WAITING],
        "running": states[TrialState.RUNNING],
        "best": [best.value, best.number] if best is not None else None,
    }


def test_the_kept_counts_are_those_counted_from_every_trial() -> None:
    """Trials asked, ended every way, put back to wait, closed unneeded, in a random order: after
    each step the tally, which looks only at what changed, says what counting every trial says."""
    rng = random.Random(0)
    study = optuna.create_study(direction="maximize")
    storage, tally, running = study._storage, StudyTally(maximize=True), []
    for _ in range(400):
        step = rng.random()
        if step < 0.4 or not running:
            running.append(study.ask())
        else:
            trial = running.pop(rng.randrange(len(running)))
            if step < 0.6:
                study.tell(trial, rng.choice([0.1, 0.5, 0.9]))
            elif step < 0.7:
                study.tell(trial, state=TrialState.PRUNED)
            elif step < 0.8:
                if rng.random() < 0.5:
                    trial.set_user_attr("hpsweep_stopped", True)
                study.tell(trial, state=TrialState.FAIL)
            elif step < 0.9:
                storage.set_trial_system_attr(trial._trial_id, FAIL_REASON, UNNEEDED)
                study.tell(trial, state=TrialState.FAIL)
            else:
                storage.set_trial_state_values(trial._trial_id, TrialState.WAITING)
        trials = storage.get_all_trials(study._study_id, deepcopy=False)
        tally.update(trials)
        assert tally.counts() == _from_scratch(trials)
        number = rng.randrange(len(trials) + 1)
        fails = sum(t.state == TrialState.FAIL for t in trials if t.number < number)
        assert tally.failed_before(number) == fails


def test_a_trial_ended_from_outside_before_its_first_beat_is_told_from_one_taken_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Short trials write no beat. A trial failed from outside before its first beat is still
    ended from outside; one that hpsweep put back to wait, then closed or gave to another
    process, is not this run's any more."""
    study = optuna.create_study()
    storage = study._storage

    def taken(beats: int = 0) -> tuple[optuna.Trial, Heartbeat]:
        trial = study.ask()
        run = Heartbeat(storage, trial._trial_id, storage.get_trial(trial._trial_id).datetime_start)
        while run.beats < beats:
            time.sleep(0.01)
        run.release()
        return trial, run

    trial, run = taken()
    assert standing(storage.get_trial(trial._trial_id), run) == Standing.OURS
    storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)  # optuna-dashboard's Fail
    assert BEAT not in storage.get_trial(trial._trial_id).system_attrs
    assert standing(storage.get_trial(trial._trial_id), run) == Standing.OUTSIDE

    trial, run = taken()  # put back, then closed unneeded
    assert run_again(storage, storage.get_trial(trial._trial_id), run.started)
    storage.set_trial_system_attr(trial._trial_id, FAIL_REASON, UNNEEDED)
    storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
    assert standing(storage.get_trial(trial._trial_id), run) == Standing.ELSEWHERE

    monkeypatch.setattr(_study_ledger, "HEARTBEAT_S", 0.05)
    trial, run = taken(beats=1)  # put back after its first beat, then failed while waiting
    assert run_again(storage, storage.get_trial(trial._trial_id), run.started)
    storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
    assert standing(storage.get_trial(trial._trial_id), run) == Standing.ELSEWHERE

    monkeypatch.setattr(_study_ledger, "HEARTBEAT_S", 5)
    trial, run = taken()  # put back and taken by another process
    assert run_again(storage, storage.get_trial(trial._trial_id), run.started)
    assert study.ask()._trial_id == trial._trial_id
    assert standing(storage.get_trial(trial._trial_id), run) == Standing.ELSEWHERE
