"""The Ray backend on a cluster whose nodes do not share a folder, as the deploy manifests build
it: a head that offers no CPU to trials, and a worker node that does not see the driver's folder.

Both nodes run on this machine, so the worker node is started in a mount namespace of its own
with an empty tmpfs over the driver's folder (`support.ray_nodes`): it sees that folder as a
second machine sees another's local disk, empty, while Python, the code and Ray's own temp dir
stay shared. Object storage is moto's S3 server on 127.0.0.1 (`support.s3`), which both nodes reach.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
from support import write_space
from support.ray_nodes import Cluster, joined_node, ray_nodes, ray_sweep
from support.s3 import S3Server, s3_server

from hpsweep import runs

BUCKET = "sweeps"


@dataclass
class Apart:
    cluster: Cluster
    driver: Path  # the driver's folder, which the worker node does not see
    s3: S3Server


@pytest.fixture(scope="module")
def apart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Apart]:
    driver = tmp_path_factory.mktemp("driver")
    quick_health = {  # the head notices a dead node within about a second
        "RAY_health_check_period_ms": "300",
        "RAY_health_check_timeout_ms": "300",
        "RAY_health_check_failure_threshold": "3",
    }
    with (
        s3_server() as s3,
        ray_nodes(head_cpus=0, hidden=driver, env={**s3.env, **quick_health}) as cluster,
    ):
        s3.make_bucket(BUCKET)
        yield Apart(cluster, driver, s3)


def _sweep(cluster: Cluster, folder: Path, *extra: str, timeout: float = 120):
    """A 2-trial sweep of the tiny space, one trial at a time, from ``folder``."""
    space = write_space(folder, epochs=1)
    extra = ("--n-trials", "2", "--sampler", "random", *extra)
    return ray_sweep(cluster, space, folder / "out", *extra, timeout=timeout)


def _one_error_line(stderr: str) -> str:
    [line] = stderr.strip().splitlines()
    assert line.startswith("hpsweep: error: "), stderr
    return line


def test_a_node_that_does_not_reach_rays_storage_is_refused_before_any_trial(
    apart: Apart,
) -> None:
    """No --storage: Ray's storage is <output-dir>/.ray, which the worker node does not see."""
    folder = apart.driver / "refused"
    folder.mkdir()
    proc = _sweep(apart.cluster, folder, timeout=90)  # not left waiting: it ends on its own
    assert proc.returncode == 2, proc.stderr
    line = _one_error_line(proc.stderr)
    assert f"Ray's storage {folder / 'out' / '.ray'}" in line, line
    assert re.search(r"Ray node \d+\.\d+\.\d+\.\d+ \(id [0-9a-f]{8}\) does not reach it", line)
    assert line.endswith("give --storage a path every node mounts, or s3://bucket/prefix"), line
    assert not (folder / "out").exists()  # nothing written: no study, no run folder


def test_a_storage_hpsweep_cannot_ship_runs_through_is_refused_before_any_trial(
    apart: Apart,
) -> None:
    """Ray opens Azure storage, but a node without the sweep's folder could not ship its runs
    back through it: refused in one line, not failed at the first trial's end."""
    folder = apart.driver / "azure"
    folder.mkdir()
    storage = "abfs://sweeps@account.dfs.core.windows.net/ray"
    proc = _sweep(apart.cluster, folder, "--storage", storage, timeout=90)
    assert proc.returncode == 2, proc.stderr
    line = _one_error_line(proc.stderr)
    assert "cannot ship a node's runs through abfs://" in line, line
    assert line.endswith("give --storage a path every node mounts, or s3://bucket/prefix"), line
    assert not (folder / "out").exists()


def test_trials_no_node_can_hold_are_refused_before_any_trial(apart: Apart) -> None:
    folder = apart.driver / "too-big"
    folder.mkdir()
    proc = _sweep(apart.cluster, folder, "--resources-per-trial", "cpu=2", timeout=90)
    assert proc.returncode == 2, proc.stderr
    line = _one_error_line(proc.stderr)
    assert "each trial reserves cpu=2,gpu=0 (--resources-per-trial)" in line, line
    assert "cpu=0,gpu=0" in line and "cpu=1,gpu=0" in line  # what the head and the worker offer
    assert not (folder / "out").exists()


def test_with_s3_storage_trials_on_the_node_without_the_folder_reach_the_driver(
    apart: Apart,
) -> None:
    folder = apart.driver / "s3"
    folder.mkdir()
    storage = f"s3://{BUCKET}/ray"
    proc = _sweep(apart.cluster, folder, "--storage", storage)
    assert proc.returncode == 0, proc.stderr

    out = folder / "out"
    records = runs.read_trials(out)
    assert [r.state for r in records] == ["complete", "complete"], [
        (r.state, r.error) for r in records
    ]
    # Both ran on the worker node (the head offers no CPU) and came back through the bucket.
    assert all("ray_shipped_from" in r.user_attrs for r in records)
    assert all(r.user_attrs["ray_shipped_to"].startswith(f"{BUCKET}/ray/") for r in records)
    keys = [
        o["Key"]
        for o in boto3.client("s3", endpoint_url=apart.s3.endpoint, **_credentials(apart.s3))
        .list_objects_v2(Bucket=BUCKET, Prefix="ray/")
        .get("Contents", [])
    ]
    assert sum(k.endswith("/hpsweep-run/trial.json") for k in keys) == 2, keys
    assert not [k for k in keys if ".hpsweep-storage-check-" in k]  # the check left nothing there
    best = runs.read_best(out)
    assert best is not None and (out / "best" / "model.safetensors").exists()
    assert not (out / ".ray").exists()


def _credentials(s3: S3Server) -> dict[str, str]:
    return {
        "aws_access_key_id": s3.env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": s3.env["AWS_SECRET_ACCESS_KEY"],
        "region_name": s3.env["AWS_DEFAULT_REGION"],
    }


# Trials that last long enough for their node to leave mid-trial.
SLOW_MODEL_INIT = """
import time

class SlowNet(Net):
    def forward(self, x, labels):
        time.sleep(0.2)
        return super().forward(x, labels)

def model_init(trial):
    return SlowNet(hidden=trial.params["hidden"])
"""


def test_when_the_only_node_that_can_run_trials_leaves_the_sweep_ends_in_one_line(
    apart: Apart,
) -> None:
    """Trials reserve a GPU, which one node has (declared to Ray, as a GPU node's ``ray start``
    does); it dies mid-trial. The trials Ray can no longer place fail with their cause, count
    towards --max-failed-trials, and the command ends."""
    folder = apart.driver / "node-leaves"
    folder.mkdir()
    space = write_space(folder, epochs=3, model_init=SLOW_MODEL_INIT)
    out = folder / "out"
    raylet = joined_node(apart.cluster, "--num-gpus", "1")
    cmd = [sys.executable, "-m", "hpsweep.cli", "run", str(space), "--backend", "ray"]
    cmd += ["--address", apart.cluster.address, "--output-dir", str(out), "--n-trials", "2"]
    cmd += ["--n-jobs", "2", "--sampler", "random", "--max-failed-trials", "1"]
    cmd += ["--resources-per-trial", "cpu=1,gpu=1", "--storage", f"s3://{BUCKET}/leaves"]
    env = {**apart.cluster.env, "HPSWEEP_RAY_PLACE_WAIT_S": "2"}
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not runs.read_trials(out):
        time.sleep(0.2)
    for p in [raylet, *raylet.children(recursive=True)]:
        p.kill()
    _, err = proc.communicate(timeout=90)  # not left waiting
    assert proc.returncode == 2, err
    line = err.strip().splitlines()[-1]
    assert "--max-failed-trials 1" in line and "Ray could not place it" in line, err
    assert "no live node has cpu=1,gpu=1 for a trial" in line, line
    # both trials may have been waiting for the node when it left: each fails with the cause
    failed = [r for r in runs.read_trials(out) if r.state == "failed"]
    assert failed and all("Ray could not place it" in r.error for r in failed)
    assert "Ray could not place it" in (Path(failed[0].run_dir) / "error.log").read_text()
