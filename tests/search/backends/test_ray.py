"""The Ray backend on a real two-node Ray cluster on this machine: a user's session with
``hpsweep run --backend ray --address HOST:PORT``, then a look at what is on disk; and the Ray
a sweep without ``--address`` starts: who may talk to it, and that it dies with the command."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from support import RANK_LOG, free_port, hpsweep_cli, rank_steps, slow_space, write_space
from support.ray_nodes import Cluster, answers_without_token, listening, ray_nodes, ray_sweep
from support.s3 import S3Server, s3_server
from support.sweep_invariants import start, violations, wait_for

from hpsweep import runs


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


@pytest.fixture(scope="module")
def staging(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where this machine stages an object-store home's runs ($HPSWEEP_CACHE): the worker node
    of `cluster` sees it empty, as another machine sees this one's disk."""
    return tmp_path_factory.mktemp("staging")


@pytest.fixture(scope="module")
def cluster(s3: S3Server, staging: Path) -> Iterator[Cluster]:
    """A head node and a worker node that share this machine's disk (a shared --output-dir),
    but for `staging`, and reach moto's S3 server."""
    with ray_nodes(env=s3.env, hidden=staging) as c:
        yield c


def _ray_sweep(cluster: Cluster, space: Path, out: Path, *extra: str, timeout: float = 240):
    return ray_sweep(cluster, space, out, "--resources-per-trial", "cpu=1", *extra, timeout=timeout)


# A model that trains slowly while the flag file next to the space file exists: the first command
# is stopped mid-trial, the rerun (flag gone) finishes quickly.
SLOW_MODEL_INIT = """
import pathlib, time

class SlowNet(Net):
    def forward(self, x, labels):
        if pathlib.Path(__file__).with_name("slow").exists():
            time.sleep(0.15)
        return super().forward(x, labels)

def model_init(trial):
    return SlowNet(hidden=trial.params["hidden"])
"""


def test_asha_sweep_runs_on_both_nodes_and_leaves_the_optuna_layout(
    cluster: Cluster, tmp_path: Path
) -> None:
    space = write_space(tmp_path, epochs=3)
    out = tmp_path / "ray-out"
    proc = _ray_sweep(
        cluster,
        space,
        out,
        "--n-trials",
        "6",
        "--n-jobs",
        "2",
        "--scheduler",
        "asha",
        "--sampler",
        "random",
        "--seed",
        "0",
    )
    assert proc.returncode == 0, proc.stderr

    records = runs.read_trials(out)
    assert [r.number for r in records] == list(range(6))
    assert {r.backend for r in records} == {"ray"}
    assert {r.state for r in records} <= {"complete", "pruned"}
    # ASHA stopped some early
    assert any(r.state == "pruned" for r in records), [r.state for r in records]
    pruned = [r for r in records if r.state == "pruned"]
    assert all(len(r.history) < 3 for r in pruned)
    assert len({r.user_attrs["ray_node_id"] for r in records}) == 2  # trials ran on both nodes
    # Actors are reused (the default), also after ASHA stopped the trial an actor ran before.
    assert len({(r.user_attrs["ray_node_id"], r.user_attrs["pid"]) for r in records}) < len(records)

    best = runs.read_best(out)
    assert best is not None and best.run_summary["backend"] == "ray"
    assert best.objective == max(r.objective for r in records if r.state == "complete")
    assert (out / "best" / "model.safetensors").exists() and (out / "best" / "README.md").exists()

    # The same layout as an Optuna sweep of the same space file.
    optuna_out = tmp_path / "optuna-out"
    hpsweep_cli("run", space, "--n-trials", "2", "--output-dir", optuna_out, check=True)

    def visible(d):
        return {
            p.name if not p.name.startswith("run-") else "run-*"
            for p in d.iterdir()
            if not p.name.startswith(".")
        }

    assert visible(out) == visible(optuna_out) - {"study.journal"}
    # as the Optuna trial: no pruner stopped it
    complete = next(r for r in records if r.state == "complete")
    ray_run, optuna_run = Path(complete.run_dir), Path(runs.read_trials(optuna_out)[0].run_dir)
    assert {p.name for p in ray_run.iterdir()} == {p.name for p in optuna_run.iterdir()}
    assert {p.name for p in runs.latest_checkpoint(ray_run).iterdir()} == {
        p.name for p in runs.latest_checkpoint(optuna_run).iterdir()
    }
    assert set(runs.read_json(ray_run / "trial.json")) == set(
        runs.read_json(optuna_run / "trial.json")
    )


def test_with_an_object_store_home_rays_storage_is_in_the_home_every_node_reaches(
    cluster: Cluster, s3: S3Server, staging: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--output-dir s3://... and no --storage: Tune's experiments go to the home's .ray, not to
    the staging folder on the command's machine, which the worker node does not see."""
    monkeypatch.setenv("HPSWEEP_CACHE", str(staging))
    s3.make_bucket("homes")
    space = write_space(tmp_path, epochs=1)
    proc = _ray_sweep(
        cluster, space, "s3://homes/x", "--n-trials", "2", "--n-jobs", "2", "--sampler", "random"
    )
    assert proc.returncode == 0, proc.stderr

    keys = s3.keys("homes", "x/")
    records = [
        json.loads(s3.client().get_object(Bucket="homes", Key=key)["Body"].read())
        for key in keys
        if re.fullmatch(r"x/run-[^/]+/trial\.json", key)
    ]
    assert [r["state"] for r in records] == ["complete", "complete"], records
    assert len({r["user_attrs"]["ray_node_id"] for r in records}) == 2  # trials on both nodes
    assert any(key.startswith("x/.ray/") for key in keys) and "x/best_run.json" in keys
    assert not list(staging.rglob(".ray"))


# Trial 2 learns nothing (ASHA stops it at its first evaluation, the last trial of the round), and
# a stopped trial takes 2 s to end: its callbacks, a slow MLflow server, shipping its folder.
SLOW_ENDING = """
import time

class Chance(Net):
    def forward(self, x, labels):
        logits = 0 * self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels) + 0 * logits.sum(), "logits": logits}

def model_init(trial):
    return Chance() if trial.number == 2 else Net(hidden=16)

class SlowEnding(hpsweep.TrainerCallback):
    def on_train_end(self, args, state, control, **kwargs):
        if state.global_step < state.max_steps:
            time.sleep(2)

callbacks = [SlowEnding()]
"""


def test_a_trial_tune_stops_at_the_end_of_a_round_records_itself_before_its_actor_ends(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Tune ends a stopped trial's actor once the round is over; the trial must be recorded by then,
    not killed in its ending, marked stopped and trained again in another round."""
    space = write_space(
        tmp_path,
        epochs=3,
        model_init=SLOW_ENDING,
        space='{"learning_rate": hpsweep.Float(1e-2, 1e-1)}',
    )
    out = tmp_path / "out"
    proc = _ray_sweep(
        cluster,
        space,
        out,
        "--n-trials",
        "3",
        "--n-jobs",
        "1",
        "--scheduler",
        "asha",
        "--sampler",
        "random",
        "--seed",
        "0",
    )
    assert proc.returncode == 0, proc.stderr
    records = runs.read_trials(out)
    assert [r.number for r in records] == [0, 1, 2] and records[2].state == "pruned", proc.stderr
    assert len(records[2].history) == 1 and all(r.state in ("complete", "pruned") for r in records)
    # each ran once, in the first round
    assert all(r.user_attrs["ray_trial_id"] == r.id for r in records)
    # one Tune round
    assert " stopped " not in proc.stderr and len(list((out / ".ray").iterdir())) == 1


def test_pbt_restores_trials_from_checkpoints(cluster: Cluster, tmp_path: Path) -> None:
    space = write_space(tmp_path, epochs=4, model_init=SLOW_MODEL_INIT)
    (
        tmp_path / "slow"
    ).touch()  # trials long enough to run side by side, so PBT has a population to compare
    out = tmp_path / "out"
    proc = _ray_sweep(
        cluster, space, out, "--n-trials", "4", "--n-jobs", "2", "--scheduler", "pbt", "--seed", "1"
    )
    assert proc.returncode == 0, proc.stderr

    records = runs.read_trials(out)
    assert len(records) == 4 and all(r.state == "complete" for r in records), [
        (r.state, r.error) for r in records
    ]
    restored = [r for r in records if r.user_attrs.get("ray_restores", 0) > 0]
    assert restored, "PBT restored no trial from a checkpoint"
    for r in restored:
        assert (
            Path(r.user_attrs["ray_restored_from"]).name.startswith("checkpoint_")
            or "checkpoint" in r.user_attrs["ray_restored_from"]
        )
        # the evaluations before the restore came back with the checkpoint
        assert len(r.history) == 4
    assert runs.read_best(out) is not None and (out / "best" / "model.safetensors").exists()


def _start_then_stop(
    cmd: list[str], env: dict[str, str], out: Path, stop: Callable[[subprocess.Popen], None]
) -> str:
    """Run ``cmd``; once a trial has saved a checkpoint, ``stop`` the command; wait for it to end."""
    proc = subprocess.Popen(
        cmd, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not any(
        runs.checkpoints(Path(r.run_dir)) for r in runs.read_trials(out)
    ):
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    stop(proc)
    return proc.communicate(timeout=120)[1]


def _assert_finished_exactly(out: Path, n: int, cut_short: runs.TrialRecord) -> None:
    """``n`` trials finished, none left running, and the cut-short one continued from its checkpoint."""
    records = runs.read_trials(out)
    assert sum(r.state in ("complete", "pruned") for r in records) == n, [
        (r.number, r.state) for r in records
    ]
    assert not [r for r in records if r.state in ("running", "stopped")]
    assert len({r.number for r in records}) == len(records)
    again = next(r for r in records if r.id == cut_short.id)
    assert (
        again.state == "complete"
        and again.params == cut_short.params
        and again.run_dir == cut_short.run_dir
    )
    assert (
        again.attempts == 2
        and again.resumed_from
        and Path(again.resumed_from).parent == Path(cut_short.run_dir)
    )
    # the evaluations before the stop came back with the checkpoint
    assert again.history[0]["epoch"] == 1
    assert not list((out / ".leases").iterdir())
    assert (
        violations(out, n) == []
    )  # the same invariants as the contract test checks it on every backend


def _cut_short(out: Path) -> runs.TrialRecord:
    [record] = [r for r in runs.read_trials(out) if r.state not in ("complete", "pruned")]
    return record


def test_ctrl_c_then_the_same_command_finishes_the_sweep(cluster: Cluster, tmp_path: Path) -> None:
    space = write_space(tmp_path, epochs=3, model_init=SLOW_MODEL_INIT)
    out = tmp_path / "out"
    (tmp_path / "slow").touch()
    cmd = [
        sys.executable,
        "-m",
        "hpsweep.cli",
        "run",
        str(space),
        "--backend",
        "ray",
        "--address",
        cluster.address,
        "--output-dir",
        str(out),
        "--n-trials",
        "2",
        "--n-jobs",
        "1",
        "--sampler",
        "random",
    ]
    err = _start_then_stop(cmd, cluster.env, out, lambda proc: proc.send_signal(signal.SIGINT))
    assert err.strip().splitlines()[-1].startswith("hpsweep: interrupted"), err
    cut_short = _cut_short(out)
    assert cut_short.state == "stopped"  # said so on disk at once, not only at the next run

    (tmp_path / "slow").unlink()
    rerun = hpsweep_cli(*cmd[3:], env=cluster.env)
    assert rerun.returncode == 0, rerun.stderr
    _assert_finished_exactly(out, 2, cut_short)


def test_a_failing_trial_is_recorded_and_another_runs_in_its_place(
    cluster: Cluster, tmp_path: Path
) -> None:
    calls = tmp_path / "calls.txt"
    model_init = f"""
    import pathlib

    def model_init(trial):
        with open({str(calls)!r}, "a") as f:
            f.write(f"{{trial.number}}\\n")
        if trial.number == 0 or pathlib.Path({str(tmp_path / "always")!r}).exists():
            raise RuntimeError("boom")
        return Net(hidden=trial.params["hidden"])
    """
    space = write_space(tmp_path, epochs=1, model_init=model_init)
    out = tmp_path / "out"
    proc = _ray_sweep(
        cluster, space, out, "--n-trials", "2", "--n-jobs", "2", "--sampler", "random"
    )
    assert proc.returncode == 0, proc.stderr
    assert {r.number: r.state for r in runs.read_trials(out)} == {
        0: "failed",
        1: "complete",
        2: "complete",
    }
    assert "boom" in (Path(runs.read_trials(out)[0].run_dir) / "error.log").read_text()
    # an exception fails the trial; Tune does not retry it
    assert calls.read_text().split().count("0") == 1

    # When every trial fails, --max-failed-trials failures end the command, in one line.
    (tmp_path / "always").touch()
    failing = _ray_sweep(
        cluster, space, out, "--n-trials", "4", "--n-jobs", "1", "--max-failed-trials", "2"
    )
    assert failing.returncode == 2, failing.stderr
    [line] = [line for line in failing.stderr.splitlines() if line.startswith("hpsweep: error:")]
    assert (
        "--max-failed-trials 2" in line and "boom" in line and "Traceback" not in failing.stderr
    ), failing.stderr
    assert {r.number: r.state for r in runs.read_trials(out)} == {
        0: "failed",
        1: "complete",
        2: "complete",
        3: "failed",
        4: "failed",
    }


def test_two_commands_on_one_folder_finish_exactly_n_trials(
    cluster: Cluster, tmp_path: Path
) -> None:
    space = write_space(tmp_path, epochs=2)
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "hpsweep.cli",
        "run",
        str(space),
        "--backend",
        "ray",
        "--address",
        cluster.address,
        "--output-dir",
        str(out),
        "--n-trials",
        "4",
        "--n-jobs",
        "1",
        "--resources-per-trial",
        "cpu=1",
        "--sampler",
        "random",
    ]
    env = {**os.environ, **cluster.env, "PYTHONUNBUFFERED": "1"}
    procs = [
        subprocess.Popen(
            cmd + extra, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for extra in ([], ["--resume"])
    ]  # --resume is accepted and changes nothing
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    records = runs.read_trials(out)
    assert [r.state for r in records] == ["complete"] * 4, [(r.number, r.state) for r in records]
    assert sorted(r.number for r in records) == [0, 1, 2, 3]
    assert len({r.user_attrs["pid"] for r in records}) == 2  # both commands' workers trained
    assert violations(out, 4) == []


def test_a_stopping_rule_ends_a_ray_sweep_with_exact_counts(
    cluster: Cluster, tmp_path: Path
) -> None:
    """``--stop-when``: Ray's workers claim through the ledger, so a trial that reached the
    target ends the sweep; no new trial starts after it and the last line says why."""
    space = write_space(tmp_path, epochs=1)
    out = tmp_path / "out"
    proc = _ray_sweep(
        cluster, space, out, "--n-trials", "6", "--n-jobs", "1", "--sampler", "random",
        "--stop-when", "target:0.2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "hpsweep: stopped by target:0.2 after 1 trials" in proc.stderr, proc.stderr
    records = runs.read_trials(out)
    assert [r.state for r in records] == ["complete"], [(r.number, r.state) for r in records]
    assert json.loads((out / "stopping.json").read_text())["stopped"]["after"] == 1


def test_an_hp_space_of_ray_tune_domains_runs_as_hugging_face_users_write_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    extra = """
    from ray import tune

    def hp_space(trial):
        return {"learning_rate": tune.loguniform(1e-3, 3e-1), "hidden": tune.choice([8, 16]),
                "weight_decay": tune.quniform(0.0, 0.1, 0.05)}

    def hp_name(trial):
        return f"h{trial['hidden']}-lr{trial['learning_rate']:.5f}"
    """
    model_init = """
    def model_init(trial):
        return Net(hidden=trial["hidden"] if trial is not None else 16)
    """
    space = write_space(tmp_path, epochs=1, space="None", model_init=model_init, extra=extra)
    out = tmp_path / "out"
    proc = _ray_sweep(cluster, space, out, "--n-trials", "2", "--seed", "0")
    assert proc.returncode == 0, proc.stderr
    records = runs.read_trials(out)
    assert [r.state for r in records] == ["complete", "complete"]
    for r in records:
        assert set(r.params) == {"learning_rate", "hidden", "weight_decay"} and r.params[
            "hidden"
        ] in (8, 16)
        assert 1e-3 <= r.params["learning_rate"] <= 3e-1 and r.params["weight_decay"] in (
            0.0,
            0.05,
            0.1,
        )
        assert Path(r.run_dir).name == f"h{r.params['hidden']}-lr{r.params['learning_rate']:.5f}"
        args = runs.read_json(runs.latest_checkpoint(Path(r.run_dir)) / "training_args.json")
        # a TrainingArguments field reached the trainer
        assert args["weight_decay"] == r.params["weight_decay"]


# model_init writing what Ray reserved for the trial next to the space file
RESERVED_MODEL_INIT = """
import json, os
def model_init(trial):
    import ray
    with open(os.path.join(os.path.dirname(__file__), f"reserved-{os.getpid()}-{trial.number}.json"), "w") as f:
        json.dump(ray.get_runtime_context().get_assigned_resources(), f)
    return Net(hidden=trial.params["hidden"])
"""


@pytest.fixture(scope="module")
def gpu_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Path]]:
    """A head node, and a worker node that declares a GPU to Ray (as a GPU node's ``ray start``
    does; this machine has none) and writes run folders to a node-local folder, as a node
    without the shared --output-dir would. With it, the folder."""
    node_local = tmp_path_factory.mktemp("node-local")
    worker_env = {"HPSWEEP_RAY_LOCAL_RUNS": str(node_local)}
    with ray_nodes(worker_env=worker_env, worker_args=("--num-gpus", "1")) as c:
        yield c, node_local


def _reserved(folder: Path) -> list[dict]:
    """What Ray reserved for each trial (`RESERVED_MODEL_INIT`)."""
    return [json.loads(p.read_text()) for p in folder.glob("reserved-*.json")]


def test_trials_on_a_node_without_the_output_dir_ship_their_runs_through_rays_storage(
    gpu_node: tuple[Cluster, Path], tmp_path: Path
) -> None:
    """Run folders written on the worker node's node-local folder reach the driver's
    --output-dir through Ray's storage. Told gpu=0, trials reserve no GPU on a cluster that has
    one, and run on both nodes."""
    two_nodes, node_local = gpu_node
    space = write_space(tmp_path, epochs=3, model_init=RESERVED_MODEL_INIT)
    out = tmp_path / "out"
    proc = ray_sweep(
        two_nodes,
        space,
        out,
        "--resources-per-trial",
        "cpu=1,gpu=0",
        "--n-trials",
        "6",
        "--n-jobs",
        "2",
        "--sampler",
        "random",
        "--scheduler",
        "asha",
        "--seed",
        "0",
    )
    assert proc.returncode == 0, proc.stderr
    assert [r.get("GPU", 0) for r in _reserved(tmp_path)] == [0] * 6

    records = runs.read_trials(out)
    assert [r.number for r in records] == list(range(6)), [(r.number, r.state) for r in records]
    assert {r.state for r in records} <= {"complete", "pruned"} and any(
        r.state == "pruned" for r in records
    )
    shipped = [r for r in records if "ray_shipped_from" in r.user_attrs]
    direct = [r for r in records if "ray_shipped_from" not in r.user_attrs]
    assert shipped and direct, "trials did not run on both nodes"
    # Shipped trials ran on the worker node only, in its node-local folder, which they left empty.
    assert len({r.user_attrs["ray_node_id"] for r in shipped}) == 1
    assert not {r.user_attrs["ray_node_id"] for r in shipped} & {
        r.user_attrs["ray_node_id"] for r in direct
    }
    # ... and came to --output-dir through the trial's folder in Ray's storage (here out/.ray)
    for r in records:
        in_storage = list((out / ".ray").glob(f"*/trial-{r.number}-{r.id}/hpsweep-run/trial.json"))
        assert bool(in_storage) == (r in shipped), (r.number, in_storage)
    for r in shipped:
        assert Path(r.user_attrs["ray_shipped_from"]).is_relative_to(node_local)
    assert node_local.is_dir() and not list(node_local.iterdir())
    # In --output-dir every run is whole, as the trials written there directly, and its record points there.
    files = {p.name for p in runs.latest_checkpoint(Path(direct[0].run_dir)).iterdir()}
    for r in records:  # pruned ones too: ASHA stopped them inside tune.report
        run = out / f"run-{r.id}"
        assert r.run_dir == str(run) and {p.name for p in run.iterdir()} == {
            "trial.json",
            *(p.name for p in runs.checkpoints(run)),
        }
        assert len(runs.checkpoints(run)) == len(r.history) and (len(r.history) == 3) == (
            r.state == "complete"
        )
        assert all({p.name for p in c.iterdir()} == files for c in runs.checkpoints(run))
    best = runs.read_best(out)
    assert best is not None and best.objective == max(
        r.objective for r in records if r.state == "complete"
    )
    assert Path(best.run_dir).parent == out and Path(best.checkpoint).is_dir()
    assert (out / "best" / "model.safetensors").exists() and (out / "best" / "README.md").exists()
    assert {p.name for p in out.iterdir() if not p.name.startswith(".")} == {
        "best",
        "best_run.json",
    } | {f"run-{r.id}" for r in records}


def test_unreachable_address_is_one_line_and_exit_2_within_seconds(tmp_path: Path) -> None:
    space = write_space(tmp_path)
    # within seconds: the command must end before this timeout, not after Ray's minutes of retries
    proc = hpsweep_cli(
        "run", space, "--backend", "ray", "--address", f"127.0.0.1:{free_port()}", timeout=20
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--address" in lines[0] and "Ray cluster" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "reply", [b"", b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"], ids=["silent", "http"]
)
def test_an_open_port_that_is_not_ray_is_one_line_and_exit_2_within_seconds(
    tmp_path: Path, reply: bytes
) -> None:
    """A port that accepts connections but is no Ray GCS (a web server, a database) must not hang ray.init."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)
            if reply:
                conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    try:
        space = write_space(tmp_path)
        # within seconds: the command must end before this timeout (a server that is not Ray's
        # must not hold it)
        proc = hpsweep_cli(
            "run",
            space,
            "--backend",
            "ray",
            "--address",
            f"127.0.0.1:{server.getsockname()[1]}",
            timeout=20,
        )
    finally:
        server.close()
        for conn in held:
            conn.close()
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "not a Ray cluster" in lines[0] and "--address" in lines[0], (
        proc.stderr
    )
    assert not (tmp_path / "out").exists()


def test_processes_per_trial_trains_each_ray_trial_over_forked_processes_with_a_cpu_each(
    tmp_path: Path,
) -> None:
    # No --address: the command starts a local Ray. model_init runs in the trial's Tune worker, before
    # it forks the trial's two gloo processes: it records what Ray reserved for that worker.
    model_init = """
import json, os
def model_init(trial):
    import ray
    with open(os.path.join(args.output_dir, "..", f"reserved-{trial.number}.json"), "w") as f:
        json.dump({"resources": ray.get_runtime_context().get_assigned_resources(), "pid": os.getpid()}, f)
    return Net()
"""
    space = write_space(tmp_path, model_init=model_init, epochs=1, extra=RANK_LOG)
    hpsweep_cli(
        "run",
        space,
        "--backend",
        "ray",
        "--n-trials",
        "1",
        "--processes-per-trial",
        "2",
        check=True,
        timeout=240,
    )
    [record] = runs.read_trials(tmp_path / "out")
    assert record.state == "complete" and record.user_attrs["processes"] == 2
    assert rank_steps(record) == {
        "rank-0": 4,
        "rank-1": 4,
    }  # 256 samples, 32 per process x 2: 4 steps an epoch
    reserved = json.loads((tmp_path / "reserved-0.json").read_text())
    # one CPU per process, not Ray's default of one per trial
    assert reserved["resources"]["CPU"] == 2.0
    ranks = {json.loads(p.read_text())["pid"] for p in Path(record.run_dir).glob("rank-*.json")}
    assert (
        len(ranks) == 2
        and reserved["pid"] not in ranks
        and record.user_attrs["pid"] == reserved["pid"]
    )
    assert not violations(tmp_path / "out", 1)


# Holds the trial, and so the sweep's Ray, until the test has looked at Ray's sockets.
HOLD = """
import pathlib, time

class _Hold(hpsweep.TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        pathlib.Path({ready!r}).touch()
        deadline = time.monotonic() + 120
        while not pathlib.Path({looked!r}).exists() and time.monotonic() < deadline:
            time.sleep(0.05)

callbacks = [_Hold()]
"""


def _look_at_sockets(ready: Path, looked: Path, found: dict) -> None:
    """Once the trial trains: every socket this process and its children (the sweep's Ray)
    listen on, and those that answer a request without Ray's token."""
    try:
        if wait_for(ready.exists, timeout=180):
            me = psutil.Process()
            found["listening"] = listening([me, *me.children(recursive=True)])
            found["open"] = [
                (name, address, port, why)
                for name, address, port in found["listening"]
                if not ipaddress.ip_address(address).is_loopback
                and (why := answers_without_token(address, port))
            ]
    finally:
        looked.touch()


def test_the_ray_a_sweep_starts_refuses_whoever_lacks_its_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray's GCS, raylet and workers listen on every interface: each socket of the local Ray is
    loopback or refuses a request without Ray's token, also where the user switched Ray's tokens
    off (for a cluster of their own), and for a second sweep in the same process, which each
    sweep leaves as it found it."""
    import hpsweep

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ready, looked = tmp_path / "ready", tmp_path / "looked"
    space = write_space(tmp_path, epochs=1, extra=HOLD.format(ready=str(ready), looked=str(looked)))
    for sweep in ("first", "second"):
        found: dict = {}
        watcher = threading.Thread(
            target=_look_at_sockets, args=(ready, looked, found), daemon=True
        )
        watcher.start()
        hpsweep.run(
            space, backend="ray", n_trials=1, output_dir=tmp_path / sweep, show_progress=False
        )
        watcher.join()
        assert found.get("listening") and found["open"] == [], (sweep, found)
        assert os.environ["RAY_AUTH_MODE"] == "disabled"
        ready.unlink()
        looked.unlink()


# After the trial's first checkpoint, between two evaluations: the moment to kill the command.
BETWEEN_WRITES = """
import pathlib

class _BetweenWrites(hpsweep.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 5:
            pathlib.Path({flag!r}).touch()

callbacks = callbacks + [_BetweenWrites()]
"""


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    """Everything in ``folder``, with its modification time and size."""
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_size)
        for p in folder.rglob("*")
    }


def test_after_a_kill_9_of_the_command_its_trials_write_nothing_and_the_rerun_finishes(
    tmp_path: Path,
) -> None:
    """kill -9 of the command's process group takes its local Ray's GCS and raylet along:
    nothing is left to stop its trial but the trial itself, which must write nothing more."""
    flag, out = tmp_path / "between-writes", tmp_path / "out"
    space = slow_space(tmp_path, step_s=0.2, extra=BETWEEN_WRITES.format(flag=str(flag)))
    command = ["run", space, "--backend", "ray", "--n-trials", "1"]
    env = {"RAY_ADDRESS": ""}
    proc = start(*command, env=env, preexec_fn=os.setsid)
    assert wait_for(flag.exists, timeout=180), proc.communicate()
    descendants = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    after_death = _listing(out)
    time.sleep(3)  # a window to look in, in which the trial would have saved again
    assert _listing(out) == after_death
    _, left = psutil.wait_procs(descendants, timeout=30)  # its Ray goes with it
    assert not left, [(p.pid, p.name()) for p in left]

    hpsweep_cli(*command, env=env, check=True, timeout=240)
    assert violations(out, 1) == []
    [again] = runs.read_trials(out)
    assert again.attempts == 2 and again.resumed_from  # from its checkpoint before the kill


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--scheduler", "pbt", "--sampler", "tpe"], "--sampler random"),
        (["--pruner", "median"], "drop --pruner"),
        (["--scheduler", "median"], "fifo, asha, hyperband, pbt"),
        (["--resources-per-trial", "tpu=1"], "cpu=N,gpu=F"),
    ],
)
def test_settings_the_ray_backend_cannot_honour_are_user_errors(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    proc = hpsweep_cli("run", write_space(tmp_path), "--backend", "ray", *flags, timeout=60)
    assert (
        proc.returncode == 2
        and message in proc.stderr
        and len(proc.stderr.strip().splitlines()) == 1
    ), proc.stderr


def test_on_a_cluster_with_gpus_each_trial_reserves_one_unless_told(
    gpu_node: tuple[Cluster, Path], tmp_path: Path
) -> None:
    """The command runs on a machine without a GPU; the cluster's worker node has one. Without
    gpu=, trials reserve a GPU per process, as on one machine: the cluster's GPUs decide, not
    those of the machine the command runs on. (Told gpu=0: the test above.)"""
    gpu_cluster, _ = gpu_node
    space = write_space(tmp_path, epochs=1, model_init=RESERVED_MODEL_INIT)
    out = tmp_path / "out"
    proc = ray_sweep(
        gpu_cluster, space, out, "--n-trials", "2", "--n-jobs", "2", "--sampler", "random"
    )
    assert proc.returncode == 0, proc.stderr
    assert [r.state for r in runs.read_trials(out)] == ["complete", "complete"]
    assert [r.get("GPU", 0) for r in _reserved(tmp_path)] == [1.0, 1.0]


def test_tune_run_keywords_map_to_hpsweeps_settings(tmp_path: Path) -> None:
    """Ray's Hugging Face example in Ray's own terms (tests/train/test_hf_search.py runs it)."""
    import datetime

    from ray.tune import CheckpointConfig
    from ray.tune.search.basic_variant import BasicVariantGenerator

    from hpsweep import UserError
    from hpsweep.search.backends._ray._search import tune_run_keywords

    searcher = BasicVariantGenerator()
    left, settings, note = tune_run_keywords(
        {
            "search_alg": searcher,
            "storage_path": "s3://bucket/x",
            "time_budget_s": datetime.timedelta(minutes=2),
            "max_concurrent_trials": 2,
            "fail_fast": True,
            "verbose": 0,
            "metric": "eval_f1",
            "mode": "max",
            "name": "exp",
            "reuse_actors": False,
            "stop": {"training_iteration": 3},
            "keep_checkpoints_num": 3,
            "checkpoint_score_attr": "min-eval_loss",
        }
    )
    assert settings == {
        "sampler": searcher,
        "storage": "s3://bucket/x",
        "timeout": 120.0,
        "n_jobs": 2,
        "max_failed_trials": 1,
    }
    assert left == {
        "name": "exp",
        "reuse_actors": False,
        "stop": {"training_iteration": 3},
        "checkpoint_config": {
            "num_to_keep": 3,
            "score_attribute": "eval_loss",
            "score_order": "min",
        },
    }
    assert note.startswith("verbose, metric, mode: Tune's own")
    left, _, note = tune_run_keywords({"checkpoint_config": CheckpointConfig(num_to_keep=1)})
    assert left["checkpoint_config"]["num_to_keep"] == 1 and note is None
    with pytest.raises(UserError, match="set save_strategy"):
        tune_run_keywords({"checkpoint_config": CheckpointConfig(checkpoint_at_end=True)})


def test_a_users_pbt_that_mutates_the_model_is_refused_before_ray_starts(tmp_path: Path) -> None:
    """A trial PBT restores from another's checkpoint keeps that trial's model, so a mutated model
    param would not take effect (and the weights would not fit): one line, as --scheduler pbt."""
    import torch
    from ray import tune
    from ray.tune.schedulers import PopulationBasedTraining

    import hpsweep

    data = [{"x": torch.zeros(4), "labels": 0}] * 8
    trainer = hpsweep.Trainer(
        model_init=lambda trial: torch.nn.Linear(4, 2),
        train_dataset=data,
        eval_dataset=data,
        args=hpsweep.TrainingArguments(str(tmp_path / "out")),
    )
    pbt = PopulationBasedTraining(
        metric="eval_loss",
        mode="min",
        hyperparam_mutations={"learning_rate": tune.uniform(1e-3, 1e-1), "hidden": [8, 16]},
    )
    with pytest.raises(
        hpsweep.UserError,
        match="PopulationBasedTraining mutates hidden, which no TrainingArguments",
    ):
        trainer.hyperparameter_search(
            hp_space=lambda _: {"hidden": tune.choice([8, 16])},
            backend="ray",
            n_trials=2,
            scheduler=pbt,
        )
    assert not (tmp_path / "out").exists()


def test_a_ray_sweep_warm_starts_from_an_optuna_one_on_a_changed_space(
    cluster: Cluster, tmp_path: Path
) -> None:
    """``--warm-start`` on Ray: the earlier Optuna sweep's trials that fit a space with a new
    param and a narrowed range reach Tune's TPE, and ``--warm-start-best 1`` trains the earlier
    best config first, with the new param sampled; only the new trials count and get folders."""
    earlier_space = '{"learning_rate": hpsweep.Float(1e-3, 3e-1, log=True), "hidden": hpsweep.Int(8, 32, step=8)}'
    changed_space = (
        '{"learning_rate": hpsweep.Float(1e-3, 3e-2, log=True), "hidden": hpsweep.Int(8, 32, step=8),'
        ' "weight_decay": hpsweep.Float(0.0, 0.1)}'
    )
    space = write_space(tmp_path, name="earlier.py", epochs=1, space=earlier_space)
    hpsweep_cli("run", space, "--n-trials", 4, "--sampler", "random", "--seed", 1, check=True)
    earlier = tmp_path / "out"
    fits = [r for r in runs.read_trials(earlier) if r.params["learning_rate"] <= 3e-2]
    assert fits, "the seeded earlier sweep has a trial inside the narrowed range"
    best = max(fits, key=lambda r: r.objective)

    new = tmp_path / "new"
    new.mkdir()
    space = write_space(new, epochs=1, space=changed_space)
    proc = _ray_sweep(
        cluster, space, new / "out", "--n-trials", "2", "--n-jobs", "1", "--sampler", "tpe",
        "--warm-start", str(earlier), "--warm-start-best", "1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (
        f"hpsweep: warm start: {len(fits)} of 4 trials of {earlier}; {4 - len(fits)} outside the "
        "new space; weight_decay sampled fresh; its best config trains first"
    ) in proc.stderr.splitlines(), proc.stderr
    records = sorted(runs.read_trials(new / "out"), key=lambda r: r.number)
    assert [(r.number, r.state) for r in records] == [(0, "complete"), (1, "complete")]
    first = records[0].params
    assert {k: first[k] for k in ("learning_rate", "hidden")} == {
        k: best.params[k] for k in ("learning_rate", "hidden")
    }
    assert all(0.0 <= r.params["weight_decay"] <= 0.1 for r in records)
    folders = sorted(p.name for p in (new / "out").glob("run-*"))
    assert folders == sorted(Path(r.run_dir).name for r in records)


def test_each_rounds_tpe_holds_the_warm_trials_with_the_params_they_have() -> None:
    """What a Ray round's TPE starts from: the sweep's complete trials, and the warm-start trials
    without the param the space added (a pruned one with its curve); the earlier best configs are
    queued only before the sweep's first trial."""
    import optuna

    from hpsweep import Float, Int
    from hpsweep.search.backends._ray._search import SEEDED_STUDY, seeded_storage, tune_space
    from hpsweep.search.warm_start import WarmStart, WarmTrial

    param_space = tune_space(
        {
            "learning_rate": Float(1e-3, 1e-1, log=True),
            "hidden": Int(8, 32),
            "dropout": Float(0, 0.5),
        }
    )
    warm = WarmStart(
        home="/earlier",
        trials=(
            WarmTrial(0, "complete", {"learning_rate": 0.01, "hidden": 16}, 0.9),
            WarmTrial(1, "pruned", {"learning_rate": 0.05, "hidden": 8}, None, {4: 0.4}),
        ),
        of=2,
        new_params=("dropout",),
        best=({"learning_rate": 0.01, "hidden": 16},),
    )
    own = runs.TrialRecord(
        id="a", number=0, backend="ray", state="complete", objective=0.8,
        params={"learning_rate": 0.02, "hidden": 12, "dropout": 0.1},
    )  # fmt: skip

    def study(records: list[runs.TrialRecord]) -> optuna.Study:
        storage = seeded_storage(param_space, "maximize", records, warm)
        return optuna.load_study(study_name=SEEDED_STUDY, storage=storage)

    first = study([]).trials
    assert [
        (t.state.name, t.params or t.system_attrs.get("fixed_params"), t.value) for t in first
    ] == [
        ("COMPLETE", {"learning_rate": 0.01, "hidden": 16}, 0.9),
        ("PRUNED", {"learning_rate": 0.05, "hidden": 8}, None),
        (
            "WAITING",
            {"learning_rate": 0.01, "hidden": 16},
            None,
        ),  # --warm-start-best, trained first
    ]
    assert first[1].intermediate_values == {4: 0.4}
    later = study([own]).trials
    assert [(t.state.name, t.params.get("dropout")) for t in later] == [
        ("COMPLETE", 0.1), ("COMPLETE", None), ("PRUNED", None)
    ]  # fmt: skip
    assert seeded_storage(param_space, "maximize", [], None) is None  # nothing to start from
