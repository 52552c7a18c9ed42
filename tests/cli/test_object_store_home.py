"""A sweep whose home is an S3 bucket (moto's server on 127.0.0.1): ``hpsweep run --output-dir
s3://...`` leaves its runs, checkpoints, best/ and best_run.json there, and ``show`` / ``report``
read the whole study from any machine (another working folder, another HOME); ``push`` sends
its best/ to the Hub (the local stand-in)."""

from __future__ import annotations

import html
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import hpsweep_cli, slow_space, write_space
from support.fake_hub import FakeHub
from support.s3 import SECRET, s3_server
from support.sweep_invariants import wait_for


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


def a_machine(tmp_path: Path, name: str, s3) -> tuple[Path, dict[str, str]]:
    """A working folder and the environment of a machine of its own (HOME, and so its cache)."""
    folder = tmp_path / name
    (folder / "home").mkdir(parents=True)
    home = folder / "home"
    return folder, {**s3.env, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}


def read(s3, bucket: str, key: str):
    return json.loads(s3.client().get_object(Bucket=bucket, Key=key)["Body"].read())


def home_records(s3, bucket: str, prefix: str) -> list[dict]:
    keys = [k for k in s3.keys(bucket, prefix + "/") if k.endswith("/trial.json")]
    return [read(s3, bucket, k) for k in keys]


def assert_best_of_all(s3, bucket: str, prefix: str) -> None:
    """best_run.json and best/ hold the best finished trial of every machine, whole and loadable."""
    from safetensors.torch import load

    records = [r for r in home_records(s3, bucket, prefix) if r["state"] == "complete"]
    winner = max(records, key=lambda r: r["objective"])
    best = read(s3, bucket, f"{prefix}/best_run.json")
    assert best["objective"] == winner["objective"]
    chosen = next(r for r in records if r["id"] == best["run_id"])
    source = f"{prefix}/{Path(chosen['run_dir']).name}/{chosen['checkpoint']}"
    assert f"{source}/.complete" in s3.keys(bucket, source)
    weights = get(s3, bucket, f"{prefix}/best/model.safetensors")
    assert weights == get(s3, bucket, f"{source}/model.safetensors")
    assert any(name.endswith("weight") for name in load(weights))  # safetensors, as it is


def get(s3, bucket: str, key: str) -> bytes:
    return s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()


def test_a_sweep_kept_in_a_bucket_is_seen_from_any_machine(s3, tmp_path):
    s3.make_bucket("sweeps")
    space = write_space(tmp_path)
    here, env = a_machine(tmp_path, "one", s3)
    hpsweep_cli(
        "run", space, "--output-dir", "s3://sweeps/tiny", "--n-trials", "3",
        cwd=here, env=env, check=True,
    )  # fmt: skip
    assert sorted(p.name for p in here.iterdir()) == ["home"]  # no local folder named s3:

    keys = s3.keys("sweeps", "tiny/")
    records = home_records(s3, "sweeps", "tiny")
    assert sorted(Path(r["run_dir"]).name for r in records) == ["run-0", "run-1", "run-2"]
    assert all(r["run_dir"].startswith("s3://sweeps/tiny/run-") for r in records)
    for record in (r for r in records if r["state"] == "complete"):
        run = Path(record["run_dir"]).name
        finished = f"tiny/{run}/{record['checkpoint']}"
        assert f"{finished}/.complete" in keys
        assert {
            f"{finished}/{name}" for name in ("model.safetensors", "trainer_state.json")
        } <= set(keys)
    assert {"tiny/best/README.md", "tiny/best_run.json"} <= set(keys)
    assert_best_of_all(s3, "sweeps", "tiny")
    winner = max(records, key=lambda r: r["objective"])

    there, other = a_machine(tmp_path, "two", s3)
    shown = json.loads(
        hpsweep_cli("show", "s3://sweeps/tiny", "--json", cwd=there, env=other, check=True).stdout
    )
    assert sorted(r["number"] for r in shown) == [0, 1, 2]
    assert [r["id"] for r in shown if r["best"]] == [winner["id"]]
    page = hpsweep_cli("report", "s3://sweeps/tiny", cwd=there, env=other, check=True)
    assert page.stdout.strip() == "s3://sweeps/tiny/report.html"
    assert "tiny/report.html" in s3.keys("sweeps", "tiny/")
    with FakeHub(token="hf_test") as hub:
        hub_env = {**other, "HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_test"}
        hpsweep_cli(
            "push", "s3://sweeps/tiny", "--repo-id", "me/tiny", cwd=there, env=hub_env, check=True
        )
        pushed = hub.files("me/tiny")
    assert pushed["model.safetensors"] == get(s3, "sweeps", "tiny/best/model.safetensors")
    assert sorted(p.name for p in there.iterdir()) == ["home"]


def test_two_machines_on_one_home_leave_the_best_of_all_trials(s3, tmp_path):
    """Two commands at once, each its own working folder and HOME, one study (SQLite here, in a
    folder both see), one s3 home: best/ is the best of both machines' trials."""
    s3.make_bucket("shared")
    space = write_space(tmp_path)
    (tmp_path / "db").mkdir()
    storage = f"sqlite:///{tmp_path / 'db' / 'study.db'}"
    procs = []
    for name in ("a", "b"):
        folder, env = a_machine(tmp_path, name, s3)
        args = ["run", space, "--output-dir", "s3://shared/sweep", "--n-trials", "2"]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "hpsweep.cli", *map(str, args), "--storage", storage],
                cwd=folder,
                env={**os.environ, **env},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    records = home_records(s3, "shared", "sweep")
    assert len({r["id"] for r in records}) == len(records) >= 4  # both machines' trials are there
    assert_best_of_all(s3, "shared", "sweep")
    assert all(SECRET not in out for out in outputs)


def test_a_trial_cut_short_resumes_from_its_checkpoint_at_the_home(s3, tmp_path):
    """Ctrl-C mid-trial, then the trial's checkpoints gone from this machine (as on a machine
    other than the one it ran on): the same command pulls the complete checkpoint from the home
    and the trial goes on from it."""
    s3.make_bucket("resumes")
    space = slow_space(tmp_path, step_s=0.5)
    here, env = a_machine(tmp_path, "m", s3)
    args = ["run", space, "--output-dir", "s3://resumes/sweep", "--n-trials", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpsweep.cli", *map(str, args)],
        cwd=here,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    marker = "sweep/run-0/checkpoint-4/.complete"
    assert wait_for(lambda: marker in s3.keys("resumes", "sweep/run-0/"))
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    assert read(s3, "resumes", "sweep/run-0/trial.json")["state"] == "stopped"
    for checkpoint in (here / "home").rglob("checkpoint-*"):
        shutil.rmtree(checkpoint)

    hpsweep_cli(*args, cwd=here, env=env, check=True)
    record = read(s3, "resumes", "sweep/run-0/trial.json")
    assert record["state"] == "complete" and record["attempts"] == 2
    assert record["resumed_from"] == "s3://resumes/sweep/run-0/checkpoint-4"


@pytest.mark.parametrize(
    "home, needle",
    [
        ("ftp://host/sweep", "ftp:// is not a home"),
        ("s3://no-such-bucket/sweep", "the bucket 'no-such-bucket' does not exist"),
    ],
)
def test_a_bad_home_exits_2_and_creates_nothing(s3, tmp_path, home, needle):
    space = write_space(tmp_path)
    here, env = a_machine(tmp_path, "m", s3)
    buckets = s3.client().list_buckets()["Buckets"]
    proc = hpsweep_cli("run", space, "--output-dir", home, cwd=here, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpsweep: error: ") and needle in lines[0]
    assert SECRET not in proc.stderr + proc.stdout
    assert sorted(p.name for p in here.iterdir()) == ["home"]
    assert list((here / "home").rglob("hpsweep")) == []
    assert s3.client().list_buckets()["Buckets"] == buckets


def test_a_stopping_rules_decision_is_kept_at_the_home_and_shown_from_any_machine(s3, tmp_path):
    """``--stop-when`` on an object-store home without a shared study: the decision reaches the
    home, and ``show`` and ``report`` on another machine say why the sweep stopped."""
    s3.make_bucket("stops")
    space = write_space(tmp_path, epochs=1)
    here, env = a_machine(tmp_path, "one", s3)
    proc = hpsweep_cli(
        "run", space, "--output-dir", "s3://stops/tiny", "--n-trials", "4",
        "--stop-when", "target:0.2", cwd=here, env=env, check=True,
    )  # fmt: skip
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hpsweep: stopped by target:0.2 after 1 trials"), proc.stderr
    assert read(s3, "stops", "tiny/stopping.json")["stopped"]["after"] == 1

    there, other = a_machine(tmp_path, "two", s3)
    shown = hpsweep_cli("show", "s3://stops/tiny", cwd=there, env=other, check=True)
    assert shown.stdout.strip().splitlines()[-1] == last
    hpsweep_cli("report", "s3://stops/tiny", cwd=there, env=other, check=True)
    page = get(s3, "stops", "tiny/report.html").decode()
    assert last.removeprefix("hpsweep: ") in html.unescape(page)
