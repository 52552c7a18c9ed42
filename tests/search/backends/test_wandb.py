"""The W&B Sweeps backend, fully offline: W&B's own sweeps engine proposes the params and decides
hyperband stops; every trial is a real offline W&B run next to the usual run folders."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import USER_SCRIPT_PRELUDE, hpsweep_cli, offline_wandb_env, write_space
from support.sweep_invariants import SLOW_TRIALS

from hpsweep import runs


@pytest.fixture
def offline(tmp_path: Path) -> dict[str, str]:
    """An environment with no W&B login and no server: nothing reads or writes ~/.netrc or ~/.config."""
    return offline_wandb_env(tmp_path)


def _run(space: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return hpsweep_cli("run", space, "--backend", "wandb", *args, env=env)


def _offline_runs(out: Path) -> list[Path]:
    return sorted((out / "wandb").glob("offline-run-*"))


def test_random_sweep_leaves_the_optuna_layout_and_offline_wandb_runs(
    tmp_path: Path, offline: dict
) -> None:
    space = write_space(tmp_path)
    proc = _run(space, offline, "--sampler", "random", "--n-trials", "3", "--seed", "0")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    records = runs.read_trials(out)
    assert [(r.number, r.state, r.backend) for r in records] == [
        (i, "complete", "wandb") for i in range(3)
    ]
    for r in records:
        assert 1e-3 <= r.params["learning_rate"] <= 3e-1 and r.params["hidden"] in (8, 16, 24, 32)
        assert r.history and "eval_accuracy" in r.history[-1]
    best = runs.read_best(out)
    assert best.objective == max(r.objective for r in records)
    assert (out / "best" / "model.safetensors").exists() and (out / "best" / "README.md").exists()
    assert json.loads((out / "wandb_sweep.json").read_text())["config"]["method"] == "random"

    # The same files per run as an Optuna sweep of the same space.
    optuna_out = tmp_path / "optuna"
    hpsweep_cli("run", space, "--n-trials", "1", "--output-dir", optuna_out, check=True)
    assert _tree(out / "run-0") == _tree(optuna_out / "run-0")
    shared = {p.name for p in optuna_out.iterdir() if not p.name.startswith("run-")} - {
        "study.journal",
        ".study.journal.lock",
    }
    assert {p.name for p in out.iterdir() if not p.name.startswith("run-")} == shared | {
        "wandb",
        "wandb_sweep.json",
    }

    # One offline W&B run per trial, holding its logged history, ready for `wandb sync`.
    offline_runs = _offline_runs(out)
    assert len(offline_runs) == 3
    assert all(len(list(d.glob("run-*.wandb"))) == 1 for d in offline_runs)
    wandb_cli = Path(sys.executable).with_name("wandb")
    dry = subprocess.run(
        [str(wandb_cli), "sync", "--dry-run", *map(str, offline_runs)],
        capture_output=True,
        text=True,
        env={**os.environ, **offline},
        timeout=120,
    )
    assert dry.returncode == 0 and "Would sync 3 run(s)" in dry.stdout + dry.stderr, (
        dry.stdout + dry.stderr
    )

    # Resume: the finished trials on disk count towards --n-trials.
    proc = _run(space, offline, "--sampler", "random", "--n-trials", "4", "--seed", "0")
    assert proc.returncode == 0, proc.stderr
    assert [r.number for r in runs.read_trials(out)] == [0, 1, 2, 3]
    assert len(_offline_runs(out)) == 4
    proc = _run(space, offline, "--sampler", "random", "--n-trials", "4")
    assert proc.returncode == 0 and len(runs.read_trials(out)) == 4

    # A different sweep in the same folder is refused rather than mixed in.
    proc = _run(space, offline, "--sampler", "bayes", "--n-trials", "5")
    assert proc.returncode == 2 and "holds another W&B sweep" in proc.stderr


def _tree(folder: Path) -> set[str]:
    """The paths under ``folder`` with checkpoint steps blanked: sweeps differ in steps, not in layout."""
    return {
        "/".join(
            "checkpoint-N" if part.startswith("checkpoint-") else part
            for part in p.relative_to(folder).parts
        )
        for p in folder.rglob("*")
    }


def test_bayes_sweep_learns_from_finished_runs(tmp_path: Path, offline: dict) -> None:
    space = write_space(
        tmp_path,
        space='{"learning_rate": hpsweep.Float(1e-3, 3e-1, log=True), '
        '"hidden": hpsweep.Categorical([8, 16]), '
        '"weight_decay": hpsweep.Float(0.0, 0.1, step=0.05)}',
    )
    proc = _run(space, offline, "--sampler", "bayes", "--n-trials", "4", "--seed", "1")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    records = runs.read_trials(out)
    assert [r.state for r in records] == ["complete"] * 4
    for r in records:
        assert r.params["hidden"] in (8, 16) and r.params["weight_decay"] in (0.0, 0.05, 0.1)
    config = json.loads((out / "wandb_sweep.json").read_text())["config"]
    assert config["metric"] == {"name": "eval_accuracy", "goal": "maximize"}
    assert config["parameters"]["learning_rate"]["distribution"] == "log_uniform_values"
    assert config["parameters"]["weight_decay"] == {
        "distribution": "q_uniform",
        "min": 0.0,
        "max": 0.1,
        "q": 0.05,
    }
    assert runs.read_best(out).run_id in {r.id for r in records}
    assert len(_offline_runs(out)) == 4


def test_hyperband_stops_a_bad_run_early(tmp_path: Path, offline: dict) -> None:
    # A grid runs in order: a good learning rate first, then one far too small to learn in time.
    space = write_space(
        tmp_path, space='{"learning_rate": hpsweep.Categorical([0.05, 1e-6])}', epochs=6
    )
    proc = _run(space, offline, "--sampler", "grid", "--pruner", "hyperband", "--n-trials", "5")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    good, bad = runs.read_trials(out)  # the grid is done after its two points
    assert (good.state, len(good.history)) == ("complete", 6)
    assert bad.state == "pruned" and bad.objective is None and 1 <= len(bad.history) < 6
    assert runs.read_best(out).run_id == good.id
    assert (
        json.loads((out / "wandb_sweep.json").read_text())["config"]["early_terminate"]["type"]
        == "hyperband"
    )
    assert len(_offline_runs(out)) == 2


@pytest.mark.parametrize(
    "case, message",
    [
        ("hp_space", "needs a `space` dict"),
        ("grid_float", "has no step: a grid search needs"),
        ("multi", "W&B sweeps optimise one metric"),
    ],
)
def test_what_wandb_cannot_do_is_one_line_and_exit_2(
    tmp_path: Path, offline: dict, case: str, message: str
) -> None:
    if case == "hp_space":
        space = write_space(
            tmp_path,
            space="None",
            extra='def hp_space(trial):\n    return {"learning_rate": trial.suggest_float("learning_rate", 1e-3, 1e-1)}\n',
        )
    elif case == "grid_float":
        space = write_space(tmp_path)
    else:
        space = write_space(
            tmp_path,
            objective=None,
            direction=["maximize", "minimize"],
            extra="def objective(m):\n    return [m['eval_accuracy'], m['eval_loss']]\n",
        )
    proc = _run(
        space, offline, *(["--sampler", "grid"] if case == "grid_float" else []), "--n-trials", "2"
    )
    assert proc.returncode == 2, proc.stderr
    assert (
        message in proc.stderr and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    )
    assert not (tmp_path / "out").exists()


BLOCK = """
import sys

# As if pip had never installed these packages: an import fails with ModuleNotFoundError, and a
# probe (importlib.util.find_spec, as accelerate's is_wandb_available) finds nothing.
for name in {blocked!r}:
    sys.modules[name] = None
from hpsweep.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("blocked", ["wandb", "sweeps"])
def test_missing_extra_names_the_install_command(
    tmp_path: Path, offline: dict, blocked: str
) -> None:
    space = write_space(tmp_path)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            BLOCK.format(blocked=[blocked]),
            "run",
            str(space),
            "--backend",
            "wandb",
            "--n-trials",
            "1",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, **offline},
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr == (
        f"hpsweep: error: the wandb backend needs the package {blocked!r}; "
        "install it with: pip install 'hpsweep[wandb]'\n"
    )


def test_ctrl_c_then_rerun_finishes_the_stopped_trial_from_its_checkpoint(
    tmp_path: Path, offline: dict
) -> None:
    # Slowed steps: the tiny trial would otherwise finish between its second checkpoint and the Ctrl-C.
    space = write_space(tmp_path, epochs=12, extra=SLOW_TRIALS.format(step_s=0.02))
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "hpsweep.cli",
        "run",
        str(space),
        "--backend",
        "wandb",
        "--sampler",
        "random",
        "--n-trials",
        "1",
    ]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **offline},
    )
    deadline = time.monotonic() + 120
    while (
        len(runs.checkpoints(out / "run-0")) < 2
        and time.monotonic() < deadline
        and proc.poll() is None
    ):
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    (stopped,) = runs.read_trials(out)
    assert stopped.state == "stopped"
    kept = runs.checkpoints(out / "run-0")[0]
    written = kept.stat().st_mtime_ns

    proc = _run(space, offline, "--sampler", "random", "--n-trials", "1")
    assert proc.returncode == 0, proc.stderr
    (done,) = runs.read_trials(out)  # the same trial, finished in place, not a new one
    assert (done.number, done.state, done.params) == (0, "complete", stopped.params)
    assert kept.stat().st_mtime_ns == written and len(done.history) == 12  # resumed, not retrained
    assert len(_offline_runs(out)) == 2  # one W&B run per attempt


def test_wandb_trials_are_placed_on_gpus_as_optuna_trials_are(
    tmp_path: Path, offline: dict
) -> None:
    # Two faked GPUs: a trial sees the first slot's GPU, as an Optuna trial does, and gpu=0 hides them.
    # (The online path, wandb.agent against a W&B server, enters the same placement; no server here.)
    space = write_space(tmp_path, epochs=1)
    env = {**offline, "HPSWEEP_FAKE_GPUS": "2"}
    for flags, out, seen in (
        ([], "one", ["0"]),
        (["--resources-per-trial", "gpu=0"], "none", ["cpu"]),
    ):
        proc = _run(
            space,
            env,
            "--n-trials",
            "1",
            "--sampler",
            "random",
            "--output-dir",
            str(tmp_path / out),
            *flags,
        )
        assert proc.returncode == 0, proc.stderr
        [record] = runs.read_trials(tmp_path / out)
        assert record.state == "complete" and record.user_attrs["devices"] == seen


HF_WANDB_SCRIPT = (
    USER_SCRIPT_PRELUDE
    + """
def wandb_hp_space(trial):
    return {"method": "random", "metric": {"name": "objective", "goal": "minimize"},
            "parameters": {"learning_rate": {"distribution": "uniform", "min": 1e-3, "max": 1e-1}}}

trainer = Trainer(model_init=lambda: Net(), args=TrainingArguments(sys.argv[1], eval_strategy="epoch",
                  num_train_epochs=1, report_to="none"), train_dataset=rows(64, 1), eval_dataset=rows(32, 2))
best = trainer.hyperparameter_search(direction="minimize", backend="wandb", hp_space=wandb_hp_space, n_trials=2,
                                     project="hf-project", name="my-sweep", metric="eval/loss")
print("BEST", best.objective)
"""
)


def test_transformers_wandb_keywords_name_the_project_and_the_sweep(
    tmp_path: Path, offline: dict
) -> None:
    """transformers' W&B backend takes project=, name= (the sweep's) and metric= (what the sweep
    optimises)."""
    script = tmp_path / "hf_wandb.py"
    script.write_text(HF_WANDB_SCRIPT)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(script), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **offline},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # W&B's eval/loss is the objective the sweep optimises, and the sweep says so first
    assert proc.stdout.startswith("hpsweep: optimising eval_loss (minimize)\n"), proc.stdout
    assert [r.state for r in runs.read_trials(out)] == ["complete", "complete"]
    assert json.loads((out / "wandb_sweep.json").read_text())["config"]["name"] == "my-sweep"
    assert (
        out / ".study"
    ).read_text().strip() == "hf-project"  # W&B's project is the sweep's study name
    offline_runs = _offline_runs(out)
    assert len(offline_runs) == 2 and all(
        b"hf-project" in next(d.glob("run-*.wandb")).read_bytes() for d in offline_runs
    )
