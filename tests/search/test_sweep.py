"""A user's session with the embedded Optuna default: write a space file, run the CLI, look at disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import optuna
import pytest
import torch
from safetensors.torch import load_file
from support import ROOT, hpsweep_cli, load_sweep_study, write_space

from hpsweep import runs
from hpsweep.search.space_file import load_space_file


def trials(out: Path) -> list[dict]:
    return [
        json.loads(p.read_text())
        for p in sorted(out.glob("*/trial.json"), key=lambda p: p.stat().st_mtime)
    ]


def test_sweep_leaves_runs_checkpoints_and_a_loadable_best(
    tmp_path: Path, space_file: Path
) -> None:
    proc = hpsweep_cli(
        "run", space_file, "--n-trials", "4", "--pruner", "none", "--seed", "1", check=True
    )
    out = tmp_path / "out"
    assert "best run-" in proc.stdout
    records = runs.read_trials(out)
    assert [r.number for r in records] == [0, 1, 2, 3]
    assert all(r.state == "complete" for r in records)
    for r in records:
        ckpt = Path(r.run_dir) / r.checkpoint
        assert {
            "model.safetensors",
            "optimizer.pt",
            "scheduler.pt",
            "rng_state.pth",
            "trainer_state.json",
            "training_args.json",
        } <= {p.name for p in ckpt.iterdir()}
        assert len(r.history) == 2 and r.metrics["eval_accuracy"] == r.objective
    best = json.loads((out / "best_run.json").read_text())
    top = max(records, key=lambda r: r.objective)
    assert best["run_id"] == top.id and best["objective"] == top.objective
    assert best["hyperparameters"] == top.params
    # best/ is the winning checkpoint, loadable as it is
    weights = load_file(out / "best" / "model.safetensors")
    assert torch.equal(
        weights["net.0.weight"],
        load_file(Path(top.run_dir) / top.checkpoint / "model.safetensors")["net.0.weight"],
    )
    assert weights["net.0.weight"].shape[0] == top.params["hidden"]
    assert "Best run" in (out / "best" / "README.md").read_text()
    assert (out / "study.journal").exists()
    # nothing temporary left behind, and records are as readable as any file the user writes
    assert not list(out.rglob(".*tmp*"))
    mask = os.umask(0)
    os.umask(mask)
    for path in (out / "best_run.json", Path(top.run_dir) / "trial.json"):
        assert path.stat().st_mode & 0o777 == 0o666 & ~mask


def test_params_reach_the_training_arguments(tmp_path: Path) -> None:
    space = write_space(
        tmp_path,
        space='{"per_device_train_batch_size": hpsweep.Categorical([16, 64]), '
        '"num_train_epochs": hpsweep.Int(1, 3), "gradient_accumulation_steps": '
        "hpsweep.Categorical([1, 2])}",
    )
    hpsweep_cli(
        "run",
        space,
        "--n-trials",
        "5",
        "--pruner",
        "none",
        "--sampler",
        "random",
        "--seed",
        "0",
        check=True,
    )
    for r in runs.read_trials(tmp_path / "out"):
        state = json.loads((Path(r.run_dir) / r.checkpoint / "trainer_state.json").read_text())
        args = json.loads((Path(r.run_dir) / r.checkpoint / "training_args.json").read_text())
        batches = -(-256 // r.params["per_device_train_batch_size"])
        steps_per_epoch = -(-batches // r.params["gradient_accumulation_steps"])
        assert state["global_step"] == r.params["num_train_epochs"] * steps_per_epoch
        assert args["per_device_train_batch_size"] == r.params["per_device_train_batch_size"]
        assert isinstance(args["num_train_epochs"], float)  # cast to the field's type


def test_a_second_run_continues_the_same_study(tmp_path: Path, space_file: Path) -> None:
    hpsweep_cli("run", space_file, "--n-trials", "2", check=True)
    hpsweep_cli("run", space_file, "--n-trials", "4", check=True)
    out = tmp_path / "out"
    assert [r.number for r in runs.read_trials(out)] == [0, 1, 2, 3]
    study = load_sweep_study(out)
    assert len(study.trials) == 4
    # already at the target: nothing more runs
    hpsweep_cli("run", space_file, "--n-trials", "4", check=True)
    assert len(runs.read_trials(out)) == 4


def test_a_sweep_begun_in_an_sqlite_study_db_goes_on_there(
    tmp_path: Path, space_file: Path
) -> None:
    out = tmp_path / "out"
    url = f"sqlite:///{out / 'study.db'}"  # where hpsweep 0.1 kept the study
    hpsweep_cli("run", space_file, "--n-trials", "2", "--storage", url, check=True)
    hpsweep_cli("run", space_file, "--n-trials", "3", check=True)  # the same folder, no --storage
    assert not (out / "study.journal").exists()
    assert len(optuna.load_study(study_name="space", storage=url).trials) == 3
    assert [r.number for r in runs.read_trials(out)] == [0, 1, 2]


def test_median_pruning_stops_bad_trials_early(tmp_path: Path) -> None:
    space = write_space(
        tmp_path, epochs=6, space='{"learning_rate": hpsweep.Float(1e-6, 1e-1, log=True)}'
    )
    hpsweep_cli("run", space, "--n-trials", "12", "--sampler", "random", "--seed", "3", check=True)
    records = runs.read_trials(tmp_path / "out")
    pruned = [r for r in records if r.state == "pruned"]
    complete = [r for r in records if r.state == "complete"]
    assert pruned and complete
    assert all(len(r.history) < 6 for r in pruned)
    assert all(len(r.history) == 6 for r in complete)
    study = load_sweep_study(tmp_path / "out")
    assert sum(t.state == optuna.trial.TrialState.PRUNED for t in study.trials) == len(pruned)


@pytest.mark.parametrize("sampler", ["tpe", "random", "cmaes", "gp", "grid", "nsga2"])
def test_every_sampler_runs(tmp_path: Path, sampler: str) -> None:
    space = write_space(
        tmp_path,
        epochs=1,
        space='{"learning_rate": hpsweep.Float(0.01, 0.1, step=0.03), '
        '"hidden": hpsweep.Int(8, 16, step=8)}',
    )
    hpsweep_cli("run", space, "--n-trials", "3", "--sampler", sampler, "--seed", "0", check=True)
    records = runs.read_trials(tmp_path / "out")
    assert len(records) == 3 and all(r.state == "complete" for r in records)
    if sampler == "grid":
        assert len({json.dumps(r.params, sort_keys=True) for r in records}) == 3


def test_a_grid_smaller_than_n_trials_ends_once_every_point_ran(tmp_path: Path) -> None:
    space = write_space(tmp_path, epochs=1, space='{"hidden": hpsweep.Categorical([8, 16])}')
    hpsweep_cli("run", space, "--n-trials", "5", "--sampler", "grid", check=True)
    records = runs.read_trials(tmp_path / "out")
    assert sorted(r.params["hidden"] for r in records) == [8, 16]
    assert all(r.state == "complete" for r in records)


@pytest.mark.parametrize("pruner", ["hyperband", "sha", "none"])
def test_every_pruner_runs(tmp_path: Path, pruner: str) -> None:
    space = write_space(tmp_path, epochs=3)
    hpsweep_cli("run", space, "--n-trials", "4", "--pruner", pruner, "--seed", "0", check=True)
    states = [r.state for r in runs.read_trials(tmp_path / "out")]
    assert len(states) == 4 and set(states) <= {"complete", "pruned"}
    if pruner == "none":
        assert set(states) == {"complete"}


def test_failing_trial_is_recorded_and_the_sweep_goes_on(tmp_path: Path) -> None:
    space = write_space(
        tmp_path,
        space='{"hidden": hpsweep.Categorical([8, 16])}',
        model_init="""
        def model_init(trial):
            if trial.params["hidden"] == 8:
                raise RuntimeError("CUDA out of memory (simulated by the user's model_init)")
            return Net(hidden=trial.params["hidden"])
        """,
    )
    proc = hpsweep_cli("run", space, "--n-trials", "6", "--sampler", "random", "--seed", "0")
    assert proc.returncode == 0, proc.stderr
    records = runs.read_trials(tmp_path / "out")
    failed = [r for r in records if r.state == "failed"]
    assert failed and all("CUDA out of memory" in r.error for r in failed)
    assert all(r.state == "complete" for r in records if r.params["hidden"] == 16)
    assert "RuntimeError" in (Path(failed[0].run_dir) / "error.log").read_text()


def test_n_jobs_runs_trials_in_parallel_processes(tmp_path: Path) -> None:
    space = write_space(tmp_path, epochs=20)
    hpsweep_cli("run", space, "--n-trials", "4", "--n-jobs", "2", "--pruner", "none", check=True)
    records = runs.read_trials(tmp_path / "out")
    assert sorted(r.number for r in records) == [0, 1, 2, 3]
    pids = {r.user_attrs["pid"] for r in records}
    assert len(pids) == 2
    # two trials ran at the same time
    spans = sorted((r.started_at, r.finished_at) for r in records)
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:]))


def test_processes_sharing_one_storage_share_the_work(tmp_path: Path) -> None:
    # Trials long enough (~0.4 s) that the six outlast the gap between the two processes' start-ups.
    space = write_space(tmp_path, epochs=30)
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    cmd = [
        sys.executable,
        "-m",
        "hpsweep.cli",
        "run",
        str(space),
        "--n-trials",
        "6",
        "--storage",
        url,
        "--pruner",
        "none",
    ]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    study = optuna.load_study(study_name="space", storage=url)
    numbers = sorted(t.number for t in study.trials)
    assert len(numbers) >= 6 and numbers == list(range(len(numbers)))
    assert len({r.user_attrs["pid"] for r in runs.read_trials(tmp_path / "out")}) == 2


def test_multi_objective_returns_the_pareto_front(tmp_path: Path) -> None:
    space = write_space(
        tmp_path,
        direction=["maximize", "minimize"],
        objective="unused",
        extra="""
        def objective(metrics):
            return metrics["eval_accuracy"], metrics["eval_loss"]
        """,
        space='{"learning_rate": hpsweep.Float(1e-3, 3e-1, log=True), "hidden": hpsweep.Int(4, 32, step=4)}',
    )
    hpsweep_cli("run", space, "--n-trials", "6", "--sampler", "nsga2", "--seed", "0", check=True)
    front = json.loads((tmp_path / "out" / "best_run.json").read_text())
    assert isinstance(front, list) and front
    records = {r.id: r for r in runs.read_trials(tmp_path / "out")}
    for b in front:
        assert b["objective"] == records[b["run_id"]].objective and len(b["objective"]) == 2
        for other in records.values():
            assert not runs.dominates(other.objective, b["objective"], ["maximize", "minimize"])


def test_timeout_stops_starting_trials(tmp_path: Path) -> None:
    space = write_space(tmp_path, epochs=40)
    # the command must end on its own, long before the 1000 trials (or a hang) would
    hpsweep_cli(
        "run",
        space,
        "--n-trials",
        "1000",
        "--timeout",
        "4",
        "--pruner",
        "none",
        check=True,
        timeout=120,
    )
    assert 1 <= len(runs.read_trials(tmp_path / "out")) < 1000


def test_hp_name_cannot_escape_the_output_folder(tmp_path: Path) -> None:
    space = write_space(
        tmp_path,
        extra="""
        def hp_name(trial):
            return "../../escaped/" + "x" * 300 if trial.number == 0 else ".."
        """,
    )
    hpsweep_cli("run", space, "--n-trials", "2", check=True)
    out = tmp_path / "out"
    assert not (tmp_path / "escaped").exists() and not (tmp_path.parent / "escaped").exists()
    folders = sorted(p.name for p in out.iterdir() if (p / "trial.json").exists())
    assert len(folders) == 2
    assert all(len(f) <= 100 and "/" not in f and not f.startswith(".") for f in folders)
    assert "run-1" in folders  # nothing safe left of ".." -> the default name


def test_ctrl_c_records_the_running_trial_and_a_rerun_resumes_it(tmp_path: Path) -> None:
    space = write_space(
        tmp_path,
        epochs=100000,
        extra_args=', save_strategy="steps", save_steps=20, '
        'eval_strategy="steps", eval_steps=20, max_steps=100000',
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hpsweep.cli",
            "run",
            str(space),
            "--n-trials",
            "2",
            "--pruner",
            "none",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    run0 = tmp_path / "out" / "run-0"
    deadline = time.monotonic() + 120
    while len(runs.checkpoints(run0)) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    record = runs.read_trials(tmp_path / "out")[0]
    assert record.state == "stopped"
    last = runs.latest_checkpoint(run0)
    assert (last / "model.safetensors").exists()  # every listed checkpoint is whole
    study = load_sweep_study(tmp_path / "out")
    assert [t.state.name for t in study.trials] == ["FAIL"]

    # Make the rerun short: the re-queued trial resumes from the checkpoint, then stops at max_steps.
    step = int(last.name.split("-")[1])
    hpsweep_cli(
        "run",
        space,
        "--n-trials",
        "1",
        "--pruner",
        "none",
        "--set",
        f"max_steps={step + 20}",
        check=True,
    )
    [resumed] = runs.read_trials(tmp_path / "out")  # the same trial, in the same folder
    assert (resumed.number, resumed.run_dir) == (0, str(run0))
    assert resumed.state == "complete" and resumed.params == record.params
    assert resumed.resumed_from == str(last) and resumed.attempts == 2
    assert resumed.history[0]["step"] == 20  # the history came back with the checkpoint
    study = load_sweep_study(tmp_path / "out")
    assert [t.state.name for t in study.trials] == ["FAIL", "COMPLETE"]  # nothing left RUNNING
    assert study.trials[0].user_attrs["hpsweep_stopped"] is True


def test_show_lists_trials_as_table_and_json(tmp_path: Path, space_file: Path) -> None:
    hpsweep_cli("run", space_file, "--n-trials", "3", check=True)
    table = hpsweep_cli("show", tmp_path / "out", check=True).stdout
    assert "run-0" in table and "eval_accuracy" in table and "complete" in table
    rows = json.loads(hpsweep_cli("show", tmp_path / "out", "--json", check=True).stdout)
    assert [r["number"] for r in rows] == [0, 1, 2]
    assert sum(r["best"] for r in rows) == 1
    assert {"state", "objective", "params", "duration_s"} <= set(rows[0])


def test_the_shipped_digits_space_runs(tmp_path: Path) -> None:
    proc = hpsweep_cli(
        "run",
        ROOT / "search_spaces" / "digits_mlp.py",
        "--n-trials",
        "3",
        "--output-dir",
        tmp_path / "digits",
        check=True,
    )
    best = json.loads((tmp_path / "digits" / "best_run.json").read_text())
    assert 0.5 < best["objective"] <= 1.0 and "best run-" in proc.stdout


def test_the_shipped_digits_space_reads_exactly_scikit_learns_digits() -> None:
    """It reads the bundled CSV itself, so a sweep does not pay scikit-learn's import (~4 s)."""
    from sklearn.datasets import load_digits

    x, y = load_space_file(ROOT / "search_spaces" / "digits_mlp.py").module._digits()
    expected_x, expected_y = load_digits(return_X_y=True)
    assert x.shape == (1797, 64) and np.array_equal(x, expected_x)
    assert y.dtype == expected_y.dtype and np.array_equal(y, expected_y)
