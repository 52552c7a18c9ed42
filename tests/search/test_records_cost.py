"""What the files side does per trial costs the same in a sweep of 300 trials as in one of 30: the
ledger's questions, the progress display's tick and a promotion to the Pareto front look at what
changed and at the front, never at every record. Work is counted (files looked at, records
parsed, dominance comparisons), not timed; the records are real files written by the runs API."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest

from hpsweep import runs
from hpsweep.runs import _index, _records
from hpsweep.search.ledger import Ledger
from hpsweep.search.progress import SweepProgress
from hpsweep.trial import Trial

DIRECTIONS = ["minimize", "maximize"]
#: The Pareto front of every sweep below; the other trials are dominated by its first member.
FRONT = [[0.1, 0.5], [0.2, 0.7], [0.3, 0.9]]
SIZES = (30, 300)


def rounds(tmp_path: Path):
    """``(folder, n)`` for a first round that warms up what a process loads once (imports), whose
    counts the next round of the same size replaces, then for each of `SIZES`."""
    for i, n in enumerate((SIZES[0], *SIZES)):
        yield sweep_of(tmp_path / f"{i}-{n}", n), n


def finish(out: Path, number: int, objective: list[float], state: str = "complete"):
    record = runs.TrialRecord(
        id=str(number),
        number=number,
        backend="optuna",
        params={"learning_rate": 0.01},
        objective_name="eval_loss",
        directions=DIRECTIONS,
        run_dir=str(out / f"run-{number}"),
    )
    record.finish(state, objective=objective)
    return record


def sweep_of(out: Path, n: int) -> Path:
    """A sweep folder with ``n`` ended trials, whose front is `FRONT`, and its ``best_run.json``."""
    for number in range(n):
        objective = FRONT[number] if number < len(FRONT) else [0.5 + number / 1000, 0.1]
        state = (
            ("complete", "complete", "pruned", "failed")[number % 4] if number > 2 else "complete"
        )
        finish(out, number, objective, state)
    runs.settle_front(out)
    return out


@pytest.fixture
def frozen_clock(monkeypatch):
    """The indexes' clock stopped: no periodic verify falls inside what a test counts."""
    monkeypatch.setattr(_index, "monotonic", lambda: 0.0)


@contextmanager
def counting(monkeypatch):
    """Count the files looked at (``stat``, listings) and the dominance comparisons made."""
    counts: Counter[str] = Counter()
    stat, listdir, dominates = os.stat, os.listdir, _records.dominates

    def counted(name, call):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return call(*args, **kwargs)

        return wrapper

    with monkeypatch.context() as m:
        m.setattr(os, "stat", counted("stat", stat))
        m.setattr(os, "listdir", counted("listdir", listdir))
        m.setattr(_records, "dominates", counted("dominates", dominates))
        yield counts


def a_trial_through_the_ledger(ledger: Ledger, out: Path, started: float) -> int:
    """What an executor backend asks the ledger for one trial, and the trial's own records."""
    claimed = ledger.take_trial(
        lambda session: session.claim_new(numbered=True), lambda claim: Trial(claim.number)
    )
    claim, number = claimed.claim, claimed.trial.number
    finish(out, number, [0.9, 0.0], state="running")
    finish(out, number, [0.9, 0.0])
    claim.lease.release()
    assert ledger.record(str(number)).state == "complete"
    assert ledger.failures_since(started) == []  # this command's: the sweep's are older
    ledger.finished()
    return number


def test_the_ledger_answers_a_trial_from_what_changed(tmp_path, monkeypatch, frozen_clock):
    work = {}
    for out, n in rounds(tmp_path):
        ledger = Ledger(out, n_trials=None)
        ledger.finished()  # the first look lists the folder
        started = time.time()
        ledger.failures_since(started)
        with counting(monkeypatch) as counts:
            assert a_trial_through_the_ledger(ledger, out, started) == n
        work[n] = counts
        with ledger.locked() as session:
            assert session.next_number() == n + 1 and session.next_number(prefer=2) == n + 1
        failed = finish(out, n + 1, [0.9, 0.0], state="failed")
        assert [r.id for r in ledger.failures_since(started)] == [failed.id]
    assert work[30] == work[300] and work[30]["listdir"] == 0, work


def test_verifying_takes_a_fixed_share_of_the_time_and_still_sees_a_hand_edit(
    tmp_path, monkeypatch
):
    """The full check that finds what the journal missed: on a disk where a record's ``stat``
    costs 1 ms (on the index's clock), it takes at most VERIFY_SHARE of the time in both sweeps,
    and a record edited by hand is seen within the bound the index states."""
    now = [0.0]
    monkeypatch.setattr(_index, "monotonic", lambda: now[0])
    stat = os.stat

    def slow_stat(path, *args, **kwargs):
        now[0] += 0.001 if str(path).endswith(runs.TRIAL_FILE) else 0.0
        return stat(path, *args, **kwargs)

    for n in SIZES:
        out = sweep_of(tmp_path / str(n), n)
        index = runs.TrialIndex(out)
        verifying, verify = [0.0], index.verify

        def timed_verify(verify=verify, verifying=verifying):
            started = now[0]
            verify()
            verifying[0] += now[0] - started

        monkeypatch.setattr(index, "verify", timed_verify)
        monkeypatch.setattr(os, "stat", slow_stat)
        index.refresh()
        took, began, failed = verifying[0], now[0], index.count("failed")
        path = out / "run-6" / runs.TRIAL_FILE  # pruned: a settled state, not checked per refresh
        data = json.loads(path.read_text())
        path.write_text(json.dumps({**data, "state": "failed"}))  # in place, no journal line
        while index.count("failed") == failed and now[0] - began < 3600:
            now[0] += 0.5  # the progress display's interval
            index.refresh()
        monkeypatch.setattr(os, "stat", stat)
        # by the end of the next verify
        assert now[0] - began <= max(_index.VERIFY_S, took / _index.VERIFY_SHARE) + 0.5 + took
        for _ in range(2000):  # 1,000 s more of refreshes
            now[0] += 0.5
            index.refresh()
        assert verifying[0] - took <= _index.VERIFY_SHARE * (now[0] - began), (n, verifying)


def test_a_promotion_to_the_front_reads_one_file_and_compares_with_the_front_only(
    tmp_path, monkeypatch
):
    work = {}
    for out, n in rounds(tmp_path):
        with counting(monkeypatch) as counts:
            dominated = finish(out, n, [0.6, 0.2])
            assert not runs.promote_if_best(out, dominated)
            joins = finish(out, n + 1, [0.15, 0.8])  # takes [0.2, 0.7]'s place
            assert runs.promote_if_best(out, joins)
        work[n] = counts
        front = [b.run_id for b in runs.read_best(out)]
        assert front == ["0", "2", str(n + 1)]
        assert front == [r.id for r in runs.best_records(runs.read_trials(out), DIRECTIONS)]
    assert work[30] == work[300] and work[30]["dominates"] <= 2 * (len(FRONT) + 1), work


def test_the_front_stays_right_when_a_trial_of_it_runs_again_or_dies_as_it_is_promoted(
    tmp_path,
):
    out = sweep_of(tmp_path, 30)
    hidden = finish(out, 30, [0.15, 0.45])  # dominated by trial 0 alone
    assert not runs.promote_if_best(out, hidden)
    assert runs.promote_if_best(out, runs.read_trials(out)[1])  # written again, as it was
    assert [b.run_id for b in runs.read_best(out)] == ["0", "1", "2"]
    again = dataclasses.replace(runs.read_trials(out)[0])
    again.finish("complete", objective=[0.9, 0.0])  # trial 0 ran again, and did worse
    runs.promote_if_best(out, again)
    assert [b.run_id for b in runs.read_best(out)] == ["1", "2", "30"]
    finish(out, 31, [0.05, 0.95])  # its process died before its promotion
    runs.Home(out).settle()  # as the command ends
    assert [b.run_id for b in runs.read_best(out)] == ["31"]


def test_a_progress_tick_costs_what_changed(tmp_path, monkeypatch, frozen_clock, capsys):
    for name in ("FORCE_COLOR", "TTY_INTERACTIVE", "TTY_COMPATIBLE"):
        monkeypatch.delenv(name, raising=False)  # a log file: one line per trial
    work = {}
    for out, n in rounds(tmp_path):  # the warm-up round also imports rich, for the first line
        progress = SweepProgress(
            out,
            n_trials=n + 10,
            timeout=None,
            directions=DIRECTIONS,
            objective_name="eval_loss",
            interval=3600,  # the test ticks: the display's stop, once
        )
        progress.start()
        done = sum(r.state in ("complete", "pruned") for r in runs.read_trials(out))
        with counting(monkeypatch) as counts:
            finish(out, n, [0.6, 0.2])
            finish(out, n + 1, [0.15, 0.8])
            progress.stop()
        work[n] = counts
        last = capsys.readouterr().err.splitlines()[-1]
        assert f"run-{n + 1}" in last and f"({done + 2}/{n + 10} done" in last, last
        assert "Pareto front: 3 trials" in last, last
    assert work[30] == work[300] and work[30]["listdir"] == 0, work
