"""One sweep on many machines, with the study in a real PostgreSQL server (docs/many-machines.md). A "machine" is an `hpsweep run` process with its own working folder, HOME and temp
dir; the machines share only the database and the sweep's home, as machines with an NFS home do.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from support import slow_space, write_space
from support.machines import (
    Machine,
    postgres_proxy_and_bucket,
    study_states,
    sweep_args,
)
from support.postgres import PASSWORD
from support.sweep_invariants import wait_for

from hpsweep import runs
from hpsweep.search.backends._optuna._study_ledger import BEAT, UNNEEDED, run_again

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning"),
]


def test_machines_share_one_count_one_best_and_one_home(pg, tmp_path):
    url = pg.create_database("share")
    space = write_space(tmp_path, epochs=1)
    home = tmp_path / "home"
    args = sweep_args(space, url, "s1", home, 6)
    machines = [Machine(tmp_path, f"m{i}", *args) for i in range(3)]
    for machine in machines:
        code, output = machine.finish()
        assert code == 0, output

    study = optuna.load_study(study_name="s1", storage=url)
    finished = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(finished) == 6  # not 6 per machine
    assert not [t for t in study.trials if t.state.name == "RUNNING"]
    records = runs.read_trials(home)
    assert sorted(r.number for r in records if r.state == "complete") == sorted(
        t.number for t in finished if t.state.name == "COMPLETE"
    )
    best = runs.read_best(home)
    assert best.objective == pytest.approx(study.best_value)
    assert (home / "best" / "model.safetensors").exists()

    # A machine whose command disagrees with the study is refused before it writes anything,
    # even to the study: another home, other directions, another space.
    other = tmp_path / "elsewhere"
    assert str(home) in refused(sweep_args(space, url, "s1", other, 8))
    assert not other.exists()
    flipped = write_space(tmp_path, name="flipped.py", objective="eval_loss", direction="minimize")
    assert "maximize" in refused(sweep_args(flipped, url, "s1", home, 8))
    narrower = write_space(tmp_path, name="narrower.py", space='{"hidden": hpsweep.Int(8, 16)}')
    assert "hidden" in refused(sweep_args(narrower, url, "s1", home, 8))
    assert len(optuna.load_study(study_name="s1", storage=url).trials) == len(study.trials)


def refused(args: list[str]) -> str:
    """The one line an `hpsweep run` with ``args`` is refused with (exit 2)."""
    proc = subprocess.run(
        [sys.executable, "-m", "hpsweep.cli", "run", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert PASSWORD not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def _wait_for_checkpoint(home: Path) -> Path:
    def found() -> list[Path]:
        return [c for run in home.glob("run-*") for c in runs.checkpoints(run)]

    assert wait_for(lambda: bool(found())), "no checkpoint was written"
    return found()[0].parent


def test_a_dead_machines_trial_is_resumed_by_another_from_its_checkpoint(pg, tmp_path):
    database = pg.create_database("dead")
    _kill_one_machine_and_finish(database, database, tmp_path)


def test_on_mariadb_a_dead_machines_trial_is_resumed_by_another_from_its_checkpoint(
    mariadb, tmp_path
):
    """The same on MySQL's kin (Debian's MariaDB) through ``mysql+pymysql://``: the count, the
    heartbeat in the database's time and the trial put back work there too."""
    database = mariadb.create_database("dead")
    _kill_one_machine_and_finish(database, database, tmp_path)


def test_through_the_proxy_a_dead_machines_trial_resumes_from_the_object_store(
    pg, tmp_path, monkeypatch
):
    """The same with nothing shared but the storage proxy and an S3 bucket: the other machine
    pulls the dead one's last uploaded checkpoint from the bucket."""
    with postgres_proxy_and_bucket(pg, monkeypatch) as (url, database, s3):
        space = slow_space(tmp_path, step_s=0.15)
        args = sweep_args(space, url, "s4", "s3://sweeps/dead", 3)
        first = Machine(tmp_path, "m0", *args)
        assert wait_for(lambda: any(k.endswith("/.complete") for k in s3.keys("sweeps")))
        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait()

        code, output = Machine(tmp_path, "m1", *args).finish()
        assert code == 0, output
        records = runs.open_home("s3://sweeps/dead").records()
        assert sorted(r.state for r in records) == ["complete"] * 3
        again = [r for r in records if r.attempts == 2]
        assert len(again) == 1 and again[0].resumed_from is not None
        states = study_states(database, "s4")
        assert states == {"COMPLETE": 3}  # the dead machine's trial itself ran again


def _kill_one_machine_and_finish(url: str, database: str, tmp_path: Path) -> None:
    space = slow_space(tmp_path, step_s=0.15)
    home = tmp_path / "home"
    args = sweep_args(space, url, "s2", home, 3)
    first = Machine(tmp_path, "m0", *args)
    run_dir = _wait_for_checkpoint(home)
    os.killpg(first.proc.pid, signal.SIGKILL)  # the machine is gone: no goodbye to anyone
    first.proc.wait()
    killed_at = time.monotonic()

    code, output = Machine(tmp_path, "m1", *args).finish()
    assert code == 0, output
    record = runs.TrialRecord.load(run_dir / "trial.json")
    assert record.state in ("complete", "pruned")
    assert record.attempts == 2 and record.resumed_from is not None
    assert (record.started_at or 0) > 0
    assert time.monotonic() - killed_at < 120
    # the dead machine's Optuna trial itself ran again: no FAIL, no copy, nothing left over
    states = study_states(database, "s2")
    assert states["COMPLETE"] + states["PRUNED"] == 3 and sum(states.values()) == 3
    study = optuna.load_study(study_name="s2", storage=database)
    assert study.trials[record.number].user_attrs["hpsweep_again"] == record.id
    assert len([r for r in runs.read_trials(home) if r.state in ("complete", "pruned")]) == 3


def test_a_database_restart_pauses_the_sweep_which_then_goes_on(pg, tmp_path):
    url = pg.create_database("restart")
    space = slow_space(tmp_path, step_s=0.1)
    home = tmp_path / "home"
    machine = Machine(tmp_path, "m0", *sweep_args(space, url, "s3", home, 3))
    _wait_for_checkpoint(home)
    pg.restart(down_s=8)

    code, output = machine.finish()
    assert code == 0, output
    assert "unreachable" in output and "is back after" in output
    assert "Traceback" not in output
    states = study_states(url, "s3")
    assert states["COMPLETE"] + states["PRUNED"] == 3
    assert states["RUNNING"] == 0 and states["FAIL"] == 0
    records = runs.read_trials(home)
    assert sorted(r.state for r in records) == sorted(
        r.state for r in records if r.state in ("complete", "pruned")
    )


def test_a_machine_killed_before_its_trials_first_heartbeat_does_not_hold_its_place(pg, tmp_path):
    """A machine killed between creating its trial in the study and the trial's first heartbeat
    leaves a RUNNING trial that Optuna's heartbeat never judges; the sweep must not wait for it
    for ever: it puts it back to WAITING, runs it and finishes."""
    url = pg.create_database("unbeaten")
    space = write_space(tmp_path, epochs=1)
    home = tmp_path / "home"
    code, output = Machine(tmp_path, "m0", *sweep_args(space, url, "s4", home, 1)).finish()
    assert code == 0, output
    # the dead machine's last act: a trial created (as `study.ask` does), then nothing
    orphan = optuna.load_study(study_name="s4", storage=url).ask()

    code, output = Machine(tmp_path, "m1", *sweep_args(space, url, "s4", home, 3)).finish()
    assert code == 0, output
    study = optuna.load_study(study_name="s4", storage=url)
    states = Counter(t.state.name for t in study.trials)
    assert states["COMPLETE"] + states["PRUNED"] == 3 and sum(states.values()) == 3
    assert study.trials[orphan.number].state.name in ("COMPLETE", "PRUNED")
    assert len([r for r in runs.read_trials(home) if r.state in ("complete", "pruned")]) == 3


def test_a_machine_whose_trial_another_machine_took_over_stops_it_and_records_nothing(pg, tmp_path):
    """Two machines may judge one dead trial at the same moment, and a machine cut off from the
    database past the grace period trains on while another takes its trial: then two processes
    run one trial. The one that lost it finds out at its next beat, stops at its next report,
    records nothing and goes on; the trial ends once, in the study and at the home."""
    url = pg.create_database("taken")
    # 8 steps, a report every 4: the trial's first beat (5 s) is taken over, its second (10 s)
    # comes before the last report (12 s)
    space = slow_space(tmp_path, step_s=1.5)
    home = tmp_path / "home"
    args = sweep_args(space, url, "s5", home, 2)
    first = Machine(tmp_path, "m0", *args)
    storage = optuna.storages.RDBStorage(url)

    def beating() -> list[optuna.trial.FrozenTrial]:
        try:
            study = optuna.load_study(study_name="s5", storage=storage)
        except KeyError:
            return []
        return [
            t for t in study.get_trials(states=[TrialState.RUNNING]) if t.system_attrs.get(BEAT)
        ]

    assert wait_for(lambda: bool(beating())), first.finish()
    taken = beating()[0]
    # what a machine that judged it dead does; the first machine is not told
    assert run_again(storage, taken, taken.datetime_start)
    code, second_output = Machine(tmp_path, "m1", *args).finish()
    assert code == 0, second_output
    code, first_output = first.finish()
    assert code == 0, first_output
    assert f"trial {taken.number} was judged dead" in first_output

    study = optuna.load_study(study_name="s5", storage=url)
    assert len(study.trials) == 2
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in study.trials)
    records = runs.read_trials(home)
    assert sorted(r.number for r in records) == [0, 1]
    assert all(r.state in ("complete", "pruned") for r in records)


def test_two_machines_that_judge_one_dead_trial_put_it_back_once(pg):
    """Two machines saw the same trial stop beating. The first puts it back to WAITING and a third
    machine takes it; the second's judgement is then about a run that is over, and it must leave
    the trial running."""
    url = pg.create_database("judged")
    storage = optuna.storages.RDBStorage(url, heartbeat_interval=5, grace_period=20)
    study = optuna.create_study(storage=storage, study_name="j")
    trial = study.ask()
    storage.set_trial_system_attr(trial._trial_id, BEAT, 1)
    judged = storage.get_trial(trial._trial_id)  # what both machines saw

    assert run_again(storage, judged, judged.datetime_start)
    assert storage.get_trial(trial._trial_id).state == TrialState.WAITING
    taken = study.ask()
    assert taken._trial_id == trial._trial_id and taken.user_attrs["hpsweep_again"] == "0"
    assert not run_again(storage, judged, judged.datetime_start)
    assert storage.get_trial(trial._trial_id).state == TrialState.RUNNING


def test_a_trial_left_waiting_by_a_race_for_the_last_place_is_closed_when_the_sweep_ends(
    pg, tmp_path
):
    """Machines that ask at the same moment near the end of a sweep may create a trial with no
    room left; it waits in case a trial ahead fails. Once the sweep has its trials, the machine
    that sees it so closes the leftover: no WAITING trial stays in a finished study (the
    dashboard and ``optuna trials`` would show it as work never done)."""
    url = pg.create_database("leftover")
    space = write_space(tmp_path, epochs=1)
    home = tmp_path / "home"
    args = sweep_args(space, url, "s6", home, 2)
    code, output = Machine(tmp_path, "m0", *args).finish()
    assert code == 0, output
    # what a machine that lost the race leaves: a trial asked, then put back to WAITING
    storage = optuna.storages.RDBStorage(url)
    late = optuna.load_study(study_name="s6", storage=storage).ask()
    storage.set_trial_state_values(late._trial_id, TrialState.WAITING)

    code, output = Machine(tmp_path, "m1", *args).finish()
    assert code == 0, output
    _assert_finished_exactly(url, "s6", home, 2)


def test_machines_racing_at_the_end_of_sweeps_leave_exactly_n_trials_and_nothing_waiting(
    pg, tmp_path
):
    """Three machines with two workers each, on short trials, so that they race for the last
    places of the sweep; twice, on two studies."""
    space = write_space(tmp_path, epochs=1)
    for round_ in range(2):
        url = pg.create_database(f"race{round_}")
        home = tmp_path / f"home{round_}"
        args = [*sweep_args(space, url, "race", home, 8), "--n-jobs", "2"]
        machines = [Machine(tmp_path, f"r{round_}m{i}", *args) for i in range(3)]
        for machine in machines:
            code, output = machine.finish()
            assert code == 0, output
        _assert_finished_exactly(url, "race", home, 8)


def _assert_finished_exactly(url: str, study_name: str, home: Path, n: int) -> None:
    """Exactly ``n`` finished trials and nothing left to run: a trial closed because the sweep
    had its trials is FAIL with the reason said, never run (no record at the home)."""
    trials = optuna.load_study(study_name=study_name, storage=url).trials
    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(finished) == n
    closed = [t for t in trials if t.state == TrialState.FAIL]
    assert all(t.system_attrs.get("fail_reason") == UNNEEDED for t in closed)
    assert len(trials) == n + len(closed)  # nothing WAITING, nothing RUNNING
    records = runs.read_trials(home)
    assert sorted(r.number for r in records) == sorted(t.number for t in finished)


def test_each_machines_progress_counts_the_whole_sweep(pg, tmp_path, monkeypatch):
    """A machine's staging folder holds its own trials only; its progress lines count the
    study's: the trials other machines finished count towards ``--n-trials`` too."""
    with postgres_proxy_and_bucket(pg, monkeypatch, "progress") as (url, database, s3):
        space = write_space(tmp_path, epochs=1)
        first = sweep_args(space, url, "p", "s3://sweeps/p", 2)
        code, output = Machine(tmp_path, "m0", *first).finish()
        assert code == 0, output
        second = sweep_args(space, url, "p", "s3://sweeps/p", 4)
        code, output = Machine(tmp_path, "m1", *second).finish()
        assert code == 0, output
    lines = [
        line for line in output.splitlines() if line.lstrip().startswith(("complete", "pruned"))
    ]
    assert len(lines) == 2  # this machine's trials, each with the whole sweep's count
    assert "(3/4 done" in lines[0] and "(4/4 done" in lines[1], lines
    best = min if "minimize" in output.splitlines()[0] else max
    trials = optuna.load_study(study_name="p", storage=database).trials
    top = best(trials, key=lambda t: t.value)
    # the study's best, named by its number, or by its folder when it is this machine's own
    named = (f"(trial {top.number})", f"(run-{top.number})")
    assert any(f"best eval_accuracy={top.value:.4g} {name}" in lines[1] for name in named), lines
