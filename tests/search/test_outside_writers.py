"""Others write to a sweep's study while it runs: optuna-dashboard's buttons and notes, the
``optuna`` command line, a user's own script (docs/watching.md, "The dashboard"). None of it stops
the sweep: a trial failed from outside ends at its next report, is recorded failed, and another
runs in its place; what they write is kept; the study names its objective and links each trial
to its files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import optuna
import pytest
from optuna.storages.journal import JournalFileBackend
from optuna.trial import FrozenTrial, TrialState
from support import free_port, hpsweep_cli, load_sweep_study, write_space
from support.postgres import PASSWORD, Postgres
from support.sweep_invariants import SLOW_ARGS

from hpsweep import runs

T = TypeVar("T")

#: Trial 0 trains on (up to 160 steps, evaluating every 4) until someone fails it from outside
#: the sweep; the trials after it stop after 8 steps.
LONG_FIRST = """
import time
class _LongFirst(hpsweep.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if args.output_dir.endswith("run-0"):
            time.sleep(0.1)
        elif state.global_step >= 8:
            control.should_training_stop = True
callbacks = [_LongFirst()]
"""
MLFLOW_FILE_STORE = {"MLFLOW_ALLOW_FILE_STORE": "true"}  # MLflow's file store, for a cheap check
FAILED_OUTSIDE = "was failed from outside the sweep"


@dataclass
class Sweep:
    out: Path
    space: Path
    returncode: int
    stdout: str
    stderr: str


def start(*args: Any, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``hpsweep ARGS`` in a fresh process, left running."""
    return subprocess.Popen(
        [sys.executable, "-m", "hpsweep.cli", *map(str, args)],
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(found: Callable[[], T | None], proc: subprocess.Popen, timeout: float = 180) -> T:
    """What ``found`` returns once it returns something, while ``proc`` still runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = found()
        except Exception:  # noqa: BLE001 - the study (or its tables) is not there yet
            value = None
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"the sweep exited {proc.returncode}:\n{proc.communicate()[1]}")
        time.sleep(0.1)
    raise AssertionError("the sweep did not get there in time")


def first_trial_reporting(storage: optuna.storages.BaseStorage) -> FrozenTrial | None:
    """Trial 0, once it runs and has reported an evaluation (which links its run folder)."""
    study_id = storage.get_study_id_from_name("space")
    trials = storage.get_all_trials(study_id, states=(TrialState.RUNNING,))
    return next((t for t in trials if t.number == 0 and "hpsweep_run_dir" in t.user_attrs), None)


def fail_by_hand(storage: optuna.storages.BaseStorage, proc: subprocess.Popen) -> FrozenTrial:
    """What optuna-dashboard's buttons do to trial 0 while it runs: an attribute, a note on the
    study, then Fail (``storage.set_trial_state_values``, as its tell API calls)."""
    trial = wait_for(lambda: first_trial_reporting(storage), proc)
    storage.set_trial_user_attr(trial._trial_id, "reviewer", "ada")
    storage.set_study_user_attr(storage.get_study_id_from_name("space"), "note", "lr too low")
    storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
    return trial


def finish(proc: subprocess.Popen, out: Path, space: Path) -> Sweep:
    stdout, stderr = proc.communicate(timeout=300)
    return Sweep(out, space, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def failed_by_hand(tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    """A 3-trial sweep (tracked in MLflow) whose trial 0 someone failed from outside."""
    tmp = tmp_path_factory.mktemp("outside")
    space = write_space(tmp, epochs=20, extra=LONG_FIRST, extra_args=SLOW_ARGS)
    proc = start(
        "run", space, "--n-trials", "3", "--pruner", "none",
        "--mlflow", tmp / "mlruns", "--mlflow-fatal", env=MLFLOW_FILE_STORE,
    )  # fmt: skip
    journal = tmp / "out" / "study.journal"
    wait_for(journal.exists, proc)
    # opened as optuna-dashboard opens a journal file: Optuna's own backend and lock
    storage = optuna.storages.JournalStorage(JournalFileBackend(str(journal)))
    fail_by_hand(storage, proc)
    return finish(proc, tmp / "out", space)


def assert_replaced(sweep: Sweep) -> None:
    """Trial 0 was recorded failed, stopped before its 160 steps, and 3 others finished."""
    assert sweep.returncode == 0, sweep.stderr
    assert "Traceback" not in sweep.stderr
    records = runs.read_trials(sweep.out)
    first = next(r for r in records if r.number == 0)
    assert first.state == "failed" and FAILED_OUTSIDE in first.error
    assert all(e["step"] < 160 for e in first.history)
    assert sorted(r.state for r in records) == ["complete"] * 3 + ["failed"]


def test_a_trial_failed_from_outside_ends_and_another_runs_in_its_place(
    failed_by_hand: Sweep,
) -> None:
    assert_replaced(failed_by_hand)
    study = load_sweep_study(failed_by_hand.out)
    assert sorted(t.state.name for t in study.trials) == ["COMPLETE"] * 3 + ["FAIL"]
    # what was written from outside meanwhile is kept
    assert study.trials[0].user_attrs["reviewer"] == "ada"
    assert study.user_attrs["note"] == "lr too low"
    # Optuna's own lock (a symlink beside the journal) is released by every writer
    assert not (failed_by_hand.out / "study.journal.lock").exists()


def test_the_study_names_its_objective_and_links_each_trial_to_its_files(
    failed_by_hand: Sweep,
) -> None:
    study = load_sweep_study(failed_by_hand.out)
    assert study.metric_names == ["eval_accuracy"]
    records = {r.number: r for r in runs.read_trials(failed_by_hand.out)}
    for trial in study.trials:
        record, attrs = records[trial.number], trial.user_attrs
        assert attrs["hpsweep_run_dir"] == record.run_dir
        assert attrs["hpsweep_mlflow_run_id"] == record.user_attrs["mlflow_run_id"]
        if trial.state == TrialState.COMPLETE:
            checkpoint = Path(attrs["hpsweep_checkpoint"])
            assert checkpoint.parent == Path(record.run_dir) and checkpoint.is_dir()
            assert checkpoint.name == record.checkpoint


SCORE = """
def compute_metrics(p):
    return {"score": float((p.predictions.argmax(-1) == p.label_ids).mean())}
"""


def test_a_refused_command_writes_nothing_not_even_to_the_study(
    failed_by_hand: Sweep, tmp_path: Path
) -> None:
    out = failed_by_hand.out
    journal, named = out / "study.journal", out / ".study"
    before = journal.read_bytes(), named.stat().st_mtime_ns
    refused = {
        "maximize": {"direction": "minimize"},
        "learning_rate": {"space": '{"learning_rate": hpsweep.Float(0.5, 0.9)}'},
        "optimises eval_accuracy, not eval_score": {"objective": "eval_score", "extra": SCORE},
    }
    for says, settings in refused.items():
        folder = tmp_path / says.split()[0]
        folder.mkdir()
        space = write_space(folder, output_dir=str(out), **settings)
        proc = hpsweep_cli("run", space, "--n-trials", "4")
        assert proc.returncode == 2, proc.stderr
        assert says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
        assert (journal.read_bytes(), named.stat().st_mtime_ns) == before


def served_study(*args: Any) -> tuple[str, dict[str, Any]]:
    """``hpsweep dashboard ARGS`` on a free port: the line it printed, and the JSON of the study
    it serves, read through optuna-dashboard's API; stopped with Ctrl-C (exit code 130)."""
    port = free_port()
    server = start("dashboard", *args, "--port", port)
    try:
        line = server.stderr.readline()
        page = f"http://127.0.0.1:{port}/dashboard/studies/"
        assert page in line, line + (server.stderr.read() if server.poll() is not None else "")
        api = f"http://127.0.0.1:{port}/api/studies"
        with urllib.request.urlopen(api, timeout=30) as response:
            studies = json.load(response)["study_summaries"]
        assert [s["study_name"] for s in studies] == ["space"]
        with urllib.request.urlopen(f"{api}/{studies[0]['study_id']}", timeout=30) as response:
            study = json.load(response)
    finally:
        server.send_signal(signal.SIGINT)
        _, err = server.communicate(timeout=30)
    assert server.returncode == 130 and "Traceback" not in err
    return line, study


def test_hpsweep_dashboard_serves_the_study_on_this_machine(failed_by_hand: Sweep) -> None:
    _, study = served_study(failed_by_hand.out)
    assert study["objective_names"] == ["eval_accuracy"]
    assert sorted(t["state"] for t in study["trials"]) == ["Complete"] * 3 + ["Fail"]
    assert all(any(a["key"] == "hpsweep_run_dir" for a in t["user_attrs"]) for t in study["trials"])


#: Trials train on, reporting every 2 steps, until the outside writer of the test is done.
UNTIL_WRITTEN = """
import os, time
class _UntilWritten(hpsweep.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(0.02)
        if state.global_step >= 4 and os.path.exists({done!r}):
            control.should_training_stop = True
callbacks = [_UntilWritten()]
"""
#: A user's script on the same journal, with Optuna's own backend: hundreds of attributes,
#: written while two workers run trials.
WRITER = """
import sys, time
from pathlib import Path
import optuna
from optuna.storages.journal import JournalFileBackend
journal, done, n = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
while not Path(journal).exists():
    time.sleep(0.05)
storage = optuna.storages.JournalStorage(JournalFileBackend(journal))
running = (optuna.trial.TrialState.RUNNING,)
while True:
    try:
        study_id = storage.get_study_id_from_name("space")
        if len(storage.get_all_trials(study_id, states=running)) == 2:
            break
    except KeyError:
        pass
    time.sleep(0.05)
for i in range(n):
    storage.set_study_user_attr(study_id, f"note_{i}", "x" * 100)
done.touch()
"""


def test_hundreds_of_attributes_written_beside_two_workers_are_all_kept(tmp_path: Path) -> None:
    done = tmp_path / "written"
    space = write_space(
        tmp_path,
        epochs=50,
        extra=UNTIL_WRITTEN.format(done=str(done)),
        extra_args=', eval_strategy="steps", eval_steps=2',
    )
    journal = tmp_path / "out" / "study.journal"
    sweep = start("run", space, "--n-trials", "4", "--n-jobs", "2", "--pruner", "none")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(journal), str(done), "300"])
    try:
        assert writer.wait(timeout=300) == 0
        result = finish(sweep, tmp_path / "out", space)
    finally:
        sweep.kill()
        writer.kill()
    assert result.returncode == 0, result.stderr
    lines = journal.read_bytes().split(b"\n")
    assert lines[-1] == b""  # every line whole, and each one Optuna's JSON
    assert all(json.loads(line) for line in lines[:-1])
    study = load_sweep_study(tmp_path / "out")
    assert all(study.user_attrs[f"note_{i}"] == "x" * 100 for i in range(300))
    assert sorted(t.state.name for t in study.trials) == ["COMPLETE"] * 4
    assert [r.state for r in runs.read_trials(tmp_path / "out")] == ["complete"] * 4


#: Two objectives: Optuna takes no intermediate values, so the trial's heartbeat is what notices
#: a trial failed from outside (no checkpoints either, whose links a report would write).
TWO_OBJECTIVES = """
objective = lambda metrics: [metrics["eval_accuracy"], metrics["eval_loss"]]
direction = ["maximize", "minimize"]
"""


def test_a_trial_failed_from_outside_on_postgres_is_recorded_failed_and_not_run_again(
    pg: Postgres, tmp_path: Path
) -> None:
    url = pg.create_database("outside")
    space = write_space(
        tmp_path,
        epochs=20,
        extra=LONG_FIRST + TWO_OBJECTIVES,
        extra_args=', eval_strategy="steps", eval_steps=4, save_strategy="no"',
    )
    proc = start("run", space, "--n-trials", "3", "--pruner", "none", "--storage", url)
    # opened as optuna-dashboard opens a database, once the sweep has made its tables
    storage = wait_for(
        lambda: optuna.storages.RDBStorage(
            url, skip_compatibility_check=True, skip_table_creation=True
        ),
        proc,
    )
    try:
        failed = fail_by_hand(storage, proc)
        sweep = finish(proc, tmp_path / "out", space)
    finally:
        proc.kill()
        storage.engine.dispose()
    assert_replaced(sweep)
    assert "runs on another machine" not in sweep.stderr and PASSWORD not in sweep.stderr
    study = optuna.load_study(study_name="space", storage=url)
    assert study.metric_names == ["objective_0", "objective_1"]
    # trial 0 stays FAIL, and was not put back to run again
    assert [t.state.name for t in study.trials].count("FAIL") == 1
    assert study.trials[0].state == TrialState.FAIL and len(study.trials) == 4
    assert study.trials[failed.number].user_attrs["reviewer"] == "ada"
    # the dashboard finds the study of a sweep run with --storage from the same --storage
    line, served = served_study(tmp_path / "out", "--storage", url)
    assert len(served["trials"]) == 4 and PASSWORD not in line
