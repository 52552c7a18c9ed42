"""Pushing to the Hugging Face Hub through the real `huggingface_hub` client, against tests/fake_hub.py."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
from support import ROOT, free_port, hpsweep_cli, write_space
from support.fake_hub import FakeHub

TOKEN = "hf_testTOKENtestTOKENtestTOKEN1234"


def _env(hub: FakeHub, tmp_path: Path, token: str = TOKEN) -> dict[str, str]:
    return {
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": token,
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }


def _metadata(readme: bytes) -> dict:
    import yaml

    text = readme.decode()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


@pytest.fixture
def hub():
    with FakeHub(token=TOKEN) as h:
        yield h


def test_run_pushes_the_best_run_and_push_republishes_it(hub: FakeHub, tmp_path: Path) -> None:
    space = write_space(
        tmp_path, epochs=2, extra_args=', eval_strategy="epoch", save_strategy="epoch"'
    )
    env = _env(hub, tmp_path)
    run = hpsweep_cli(
        "run",
        space,
        "--n-trials",
        "3",
        "--seed",
        "0",
        "--push-to-hub",
        "tester/tiny-mlp",
        "--hub-revision",
        "sweep-1",
        env=env,
        check=True,
    )
    out = tmp_path / "out"
    best = json.loads((out / "best_run.json").read_text())

    files = hub.files("tester/tiny-mlp", "sweep-1")
    # the model folder best/ is: no training state (optimizer, schedule, RNG, trainer_state.json)
    assert set(files) == {"README.md", "model.safetensors", "training_args.json"}
    assert sorted(p.name for p in (out / "best").iterdir()) == sorted(files)
    assert files["model.safetensors"] == (out / "best" / "model.safetensors").read_bytes()
    # both cards name the space file's class and load it with safetensors
    for readme in (files["README.md"], (out / "best" / "README.md").read_bytes()):
        data = _metadata(readme)
        assert data["library_name"] == "pytorch" and "hpsweep" in data["tags"]
        [result] = data["model-index"][0]["results"]
        assert result["metrics"][0]["value"] == best["objective"]
        assert (
            "from space import Net" in readme.decode() and "load_model(model, " in readme.decode()
        )
    meta = _metadata(files["README.md"])["hpsweep"]
    assert meta["objective"] == {
        "name": "eval_accuracy",
        "value": best["objective"],
        "direction": "maximize",
    }
    assert meta["hyperparameters"] == best["hyperparameters"]
    assert meta["n_trials"] == 3 and meta["backend"] == "optuna"
    # the model's metrics, not how fast this machine evaluated it
    assert meta["metrics"]["eval_accuracy"] == best["objective"] and "eval_loss" in meta["metrics"]
    assert "eval_runtime" in best["run_summary"]["metrics"] and not any(
        "_per_second" in k or "_runtime" in k for k in meta["metrics"]
    )
    card = files["README.md"].decode()
    assert "### Top 3 trials" in card and "## Evaluations" in card and "| 16 | 2" in card
    assert 'hf_hub_download("tester/tiny-mlp", "model.safetensors")' in card

    push = hpsweep_cli(
        "push", out, "--repo-id", "tester/published", "--private", env=env, check=True
    )
    assert hub.repos["tester/published"]["private"] is True
    assert set(hub.files("tester/published")) == set(files)
    assert push.stdout.strip().startswith(f"{hub.url}/tester/published/commit/")

    everything = (
        run.stdout
        + run.stderr
        + push.stdout
        + push.stderr
        + "".join(
            f.decode(errors="replace")
            for f in [*files.values(), *hub.files("tester/published").values()]
        )
    )
    assert TOKEN not in everything


def test_a_pushed_model_loads_back(hub: FakeHub, tmp_path: Path) -> None:
    space = write_space(tmp_path, epochs=1)
    env = _env(hub, tmp_path)
    hpsweep_cli("run", space, "--n-trials", "1", env=env, check=True)
    hpsweep_cli("push", tmp_path / "out", "--repo-id", "tester/load-me", env=env, check=True)
    script = tmp_path / "load.py"
    script.write_text(
        textwrap.dedent(f"""
        import importlib.util, sys, torch
        from huggingface_hub import hf_hub_download
        from safetensors.torch import load_model
        spec = importlib.util.spec_from_file_location("space", {str(tmp_path / "space.py")!r})
        space = importlib.util.module_from_spec(spec); spec.loader.exec_module(space)
        params = __import__("json").load(open({str(tmp_path / "out" / "best_run.json")!r}))["hyperparameters"]
        model = space.Net(hidden=params["hidden"])
        load_model(model, hf_hub_download("tester/load-me", "model.safetensors"))
        print("loaded", sum(p.numel() for p in model.parameters()))
    """)
    )
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("loaded")


def test_a_wrong_token_is_one_line_without_the_token(hub: FakeHub, tmp_path: Path) -> None:
    space = write_space(tmp_path, epochs=1)
    hpsweep_cli("run", space, "--n-trials", "1", check=True)
    wrong = "hf_wrongWRONGwrongWRONGwrong5678"
    proc = hpsweep_cli(
        "push", tmp_path / "out", "--repo-id", "tester/x", env=_env(hub, tmp_path, wrong)
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "rejected the token (401" in lines[0] and "HF_TOKEN" in lines[0]
    assert wrong not in proc.stderr + proc.stdout


def test_an_unreachable_hub_is_one_line(tmp_path: Path) -> None:
    space = write_space(tmp_path, epochs=1)
    hpsweep_cli("run", space, "--n-trials", "1", check=True)
    env = {
        "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}",
        "HF_TOKEN": TOKEN,
        "HF_HOME": str(tmp_path / "hf-home"),
    }
    proc = hpsweep_cli("push", tmp_path / "out", "--repo-id", "tester/x", env=env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and "cannot reach the Hugging Face Hub" in lines[0]
        and TOKEN not in proc.stderr
    )


def test_no_token_is_said_before_the_sweep_trains(hub: FakeHub, tmp_path: Path) -> None:
    space = write_space(tmp_path, epochs=1)
    env = {**_env(hub, tmp_path), "HF_TOKEN": ""}
    proc = hpsweep_cli("run", space, "--n-trials", "2", "--push-to-hub", "tester/x", env=env)
    assert proc.returncode == 2 and "no Hugging Face token found" in proc.stderr
    assert not list((tmp_path).glob("out/run-*"))


TRAIN_WITH_PUSHES = """
import json, sys, time, torch
sys.path.insert(0, {folder!r})
import space
from hpsweep import Trainer, TrainingArguments
from hpsweep.integrations.hub import PushToHubCallback

class TimedPush(PushToHubCallback):
    longest_save = 0.0
    def on_save(self, *args, **kwargs):
        t = time.perf_counter()
        super().on_save(*args, **kwargs)
        TimedPush.longest_save = max(TimedPush.longest_save, time.perf_counter() - t)

push = TimedPush("tester/live", every=4)
args = TrainingArguments(output_dir={out!r}, max_steps=48, save_strategy="steps", save_steps=2, save_total_limit=2,
                         eval_strategy="no", per_device_train_batch_size=32, disable_progress=True)
trainer = Trainer(model_init=lambda: space.Net(16), args=args, train_dataset=space.train_dataset(), callbacks=[push])
started = time.perf_counter()
trainer.train()
print(json.dumps({{"pushed": push.pushed_steps, "skipped": push.skipped, "longest_save": TimedPush.longest_save}}))
"""


def test_push_to_hub_callback_pushes_during_training_without_blocking(tmp_path: Path) -> None:
    write_space(tmp_path, epochs=1)
    script = tmp_path / "train.py"
    script.write_text(TRAIN_WITH_PUSHES.format(folder=str(tmp_path), out=str(tmp_path / "trained")))
    import subprocess
    import sys

    with FakeHub(token=TOKEN, commit_delay=1.0) as hub:
        env = {**os.environ, **_env(hub, tmp_path), "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        commits = hub.commits("tester/live")
    # pushes that came while an upload ran were skipped, not waited for
    assert result["skipped"] >= 1
    assert len(commits) == len(result["pushed"]) >= 2
    # the last one was waited for
    assert result["pushed"][-1] == 48 and commits[-1]["summary"] == "Training in progress, step 48"
    assert all(set(c["paths"]) == {"model.safetensors", "training_args.json"} for c in commits)
    # each commit takes 1 s on this hub; training never waited for one while it saved checkpoints
    assert result["longest_save"] < 0.5


SEARCH_WITH_HUB_ARGUMENTS = """
import json, os, sys
sys.path.insert(0, {folder!r})
import space, transformers
import hpsweep

def hp_space(trial):
    return {{"learning_rate": trial.suggest_float("learning_rate", 1e-3, 1e-1, log=True)}}

def search(args, n_trials):
    trainer = hpsweep.Trainer(model_init=space.model_init, args=args, train_dataset=space.train_dataset(),
                              eval_dataset=space.eval_dataset(), compute_metrics=space.compute_metrics)
    best = trainer.hyperparameter_search(hp_space, n_trials=n_trials, direction="maximize")
    return os.path.basename(best.run_dir)

# transformers' arguments, as a script written for its Trainer sets them
hf_args = transformers.TrainingArguments(
    {out!r}, num_train_epochs=1, per_device_train_batch_size=32, per_device_eval_batch_size=128,
    eval_strategy="epoch", save_strategy="epoch", report_to="none", disable_tqdm=True,
    push_to_hub=True, hub_model_id="tester/tiny-hf", hub_token={token!r}, hub_private_repo=True,
    hub_revision="sweep-1", hub_strategy="end")
first = search(hf_args, n_trials=2)
# hpsweep's, without a hub_model_id: the repo is named after the output folder
args = hpsweep.TrainingArguments({named!r}, num_train_epochs=1, per_device_train_batch_size=32,
                                 disable_progress=True, push_to_hub=True, hub_token={token!r})
print(json.dumps([first, search(args, n_trials=1)]))
"""


def test_push_to_hub_arguments_push_the_sweeps_best_run_with_their_token(tmp_path: Path) -> None:
    write_space(tmp_path, epochs=1)
    script = tmp_path / "search.py"
    out, named = tmp_path / "out", tmp_path / "my-sweep"
    script.write_text(
        SEARCH_WITH_HUB_ARGUMENTS.format(
            folder=str(tmp_path), out=str(out), named=str(named), token=TOKEN
        )
    )
    import subprocess
    import sys

    with FakeHub(token=TOKEN) as hub:
        # no token but the arguments': HF_TOKEN is empty and nobody logged in
        env = {**os.environ, **_env(hub, tmp_path), "HF_TOKEN": "", "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr
        first, second = json.loads(proc.stdout.strip().splitlines()[-1])
        files = hub.files("tester/tiny-hf", "sweep-1")
        assert hub.repos["tester/tiny-hf"]["private"] is True
        assert files["model.safetensors"] == (out / "best" / "model.safetensors").read_bytes()
        assert _metadata(files["README.md"])["hpsweep"]["best_run"] == first
        assert [c["branch"] for c in hub.commits("tester/tiny-hf")] == ["sweep-1"]  # pushed once
        default = hub.files("tester/my-sweep")
        assert default["model.safetensors"] == (named / "best" / "model.safetensors").read_bytes()
        assert _metadata(default["README.md"])["hpsweep"]["best_run"] == second
        pushed = [*files.values(), *default.values()]
    # no trial pushed or held the token: the arguments every trial saved say so
    saved = [json.loads(p.read_text()) for p in out.glob("run-*/checkpoint-*/training_args.json")]
    assert saved and all(not a["push_to_hub"] and "hub_token" not in a for a in saved)
    written = [p.read_bytes() for folder in (out, named) for p in folder.rglob("*") if p.is_file()]
    everything = b"".join([proc.stdout.encode(), proc.stderr.encode(), *pushed, *written])
    assert TOKEN.encode() not in everything
