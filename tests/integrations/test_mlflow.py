"""`hpsweep run --mlflow URI` against a real `mlflow server` (SQLite backend) on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from support import free_port, hpsweep_cli, write_space

SECRET_PARAM = "hf_paramSECRETparamSECRET123456"
SECRET_ENV = "hf_envSECRETenvSECRETenvSECRET99"
SPACE = (
    '{"learning_rate": hpsweep.Float(1e-5, 3e-1, log=True), "hidden": hpsweep.Int(8, 32, step=8), '
    f'"hub_token": hpsweep.Categorical([{SECRET_PARAM!r}])}}'
)
EVAL_EACH_EPOCH = ', eval_strategy="epoch", save_strategy="epoch"'


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination",
            str(root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(
                    f"mlflow server did not start:\n{(root / 'server.log').read_text()[-3000:]}"
                )
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def tracked_sweep(mlflow_server: str, tmp_path_factory: pytest.TempPathFactory):
    """Six trials, three evaluations each, median pruning, logged to the server. Random sampling
    over a wide learning-rate range (seed 1) makes some trials bad enough to be pruned before
    their last evaluation, which is never offered for pruning."""
    folder = tmp_path_factory.mktemp("sweep")
    space = write_space(folder, space=SPACE, epochs=3, extra_args=EVAL_EACH_EPOCH)
    proc = hpsweep_cli(
        "run",
        space,
        "--n-trials",
        "6",
        "--seed",
        "1",
        "--sampler",
        "random",
        "--mlflow",
        mlflow_server,
        "--mlflow-log-best",
        env={"HF_TOKEN": SECRET_ENV, "MY_SERVICE_PASSWORD": SECRET_ENV + "pw"},
        check=True,
    )
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("space")
    assert experiment is not None, proc.stdout + proc.stderr
    all_runs = client.search_runs([experiment.experiment_id], max_results=100)
    return folder / "out", client, all_runs, proc


def _records(out: Path) -> dict[str, dict]:
    return {
        json.loads(p.read_text())["id"]: json.loads(p.read_text())
        for p in out.glob("run-*/trial.json")
    }


def test_one_parent_with_a_nested_child_per_trial(tracked_sweep) -> None:
    out, client, all_runs, _ = tracked_sweep
    parents = [r for r in all_runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in all_runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 6
    parent = parents[0]
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parent.info.run_id}
    assert parent.info.status == "FINISHED"
    assert parent.data.params["backend"] == "optuna"
    assert parent.data.params["study_name"] == "space"
    assert parent.data.params["n_trials"] == "6"
    assert (
        parent.data.params["objective"] == "eval_accuracy"
        and parent.data.params["direction"] == "maximize"
    )
    assert parent.data.params["space.learning_rate"].startswith("Float(low=1e-05")
    assert "space.hub_token" not in parent.data.params
    # every trial's record knows its MLflow run
    records = _records(out)
    assert {r["user_attrs"]["mlflow_run_id"] for r in records.values()} == {
        c.info.run_id for c in children
    }


def test_children_hold_params_metrics_by_step_state_and_number(tracked_sweep) -> None:
    out, client, all_runs, _ = tracked_sweep
    records = _records(out)
    by_run = {r["user_attrs"]["mlflow_run_id"]: r for r in records.values()}
    states = set()
    for child in (r for r in all_runs if "mlflow.parentRunId" in r.data.tags):
        record = by_run[child.info.run_id]
        tags, params, metrics = child.data.tags, child.data.params, child.data.metrics
        assert tags["hpsweep.trial_number"] == str(record["number"])
        assert tags["hpsweep.state"] == record["state"]
        states.add(record["state"])
        assert float(params["learning_rate"]) == pytest.approx(record["params"]["learning_rate"])
        assert int(params["hidden"]) == record["params"]["hidden"]
        assert metrics["duration_s"] == pytest.approx(record["duration_s"])
        history = client.get_metric_history(child.info.run_id, "eval_accuracy")
        assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [
            (h["step"], pytest.approx(h["eval_accuracy"])) for h in record["history"]
        ]
        assert len(client.get_metric_history(child.info.run_id, "loss")) >= 1  # training loss too
        if record["state"] == "complete":
            assert metrics["objective"] == pytest.approx(record["objective"])
            assert child.info.status == "FINISHED"
        else:
            assert "objective" not in metrics
    assert {"complete", "pruned"} <= states


def test_best_trial_is_tagged_and_its_checkpoint_uploaded(tracked_sweep) -> None:
    out, client, all_runs, _ = tracked_sweep
    best = json.loads((out / "best_run.json").read_text())
    best_run_id = _records(out)[best["run_id"]]["user_attrs"]["mlflow_run_id"]
    tagged = [r.info.run_id for r in all_runs if r.data.tags.get("hpsweep.best") == "true"]
    assert tagged == [best_run_id]
    parent = next(r for r in all_runs if "mlflow.parentRunId" not in r.data.tags)
    assert parent.data.tags["hpsweep.best_run_id"] == best_run_id
    assert parent.data.metrics["best_objective"] == pytest.approx(best["objective"])
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "best")}
    assert "best/model.safetensors" in artifacts


def test_no_secret_reaches_mlflow(tracked_sweep) -> None:
    out, client, all_runs, proc = tracked_sweep
    for run in all_runs:
        logged = json.dumps(
            {"params": run.data.params, "tags": run.data.tags, "metrics": run.data.metrics}
        )
        assert SECRET_PARAM not in logged and SECRET_ENV not in logged
        assert "hub_token" not in run.data.params and "HF_TOKEN" not in logged
    assert SECRET_ENV not in proc.stdout + proc.stderr


def test_a_dead_server_warns_once_and_the_sweep_goes_on(tmp_path: Path) -> None:
    space = write_space(tmp_path, epochs=1)
    dead = f"http://127.0.0.1:{free_port()}"
    # no minutes of HTTP retries: the command ends well within the time 3 trials take plus one warning
    proc = hpsweep_cli("run", space, "--n-trials", "3", "--seed", "0", "--mlflow", dead, timeout=90)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "MLflow" in line]
    assert (
        len(warnings) == 1
        and "connection refused" in warnings[0]
        and "--mlflow-fatal" in warnings[0]
    )
    assert "Traceback" not in proc.stderr
    states = [r["state"] for r in _records(tmp_path / "out").values()]
    assert states == ["complete"] * 3


def test_a_dead_server_is_fatal_when_asked(tmp_path: Path) -> None:
    space = write_space(tmp_path, epochs=1)
    proc = hpsweep_cli(
        "run",
        space,
        "--n-trials",
        "2",
        "--mlflow",
        f"http://127.0.0.1:{free_port()}",
        "--mlflow-fatal",
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and lines[0].startswith("hpsweep: error: MLflow tracking at")
        and "--mlflow-fatal" in lines[0]
    )
    assert not (tmp_path / "out").exists()


def test_a_trial_whose_ending_never_reached_mlflow_gets_its_records_state(
    mlflow_server: str, tmp_path: Path
) -> None:
    """A worker whose call at the trial's end was lost (its tracking turned off by one slow request,
    a dropped connection) leaves the child RUNNING; the sweep's end sets it from the record on
    disk, not to "stopped"."""
    from mlflow.tracking import MlflowClient

    space = write_space(tmp_path, name="lost_end.py", epochs=1)
    command = ("run", space, "--n-trials", "2", "--pruner", "none", "--mlflow", mlflow_server)
    hpsweep_cli(*command, check=True)
    client = MlflowClient(mlflow_server)
    record = next(r for r in _records(tmp_path / "out").values() if r["number"] == 0)
    lost = record["user_attrs"]["mlflow_run_id"]
    # as the child stands until the trial's end is logged
    client.set_tag(lost, "hpsweep.state", "running")
    client.update_run(lost, status="RUNNING")

    hpsweep_cli(*command, check=True)  # the same command: nothing left to run, the sweep ends again
    child = client.get_run(lost)
    assert record["state"] == "complete"
    assert (child.data.tags["hpsweep.state"], child.info.status) == ("complete", "FINISHED")
    assert child.data.metrics["objective"] == pytest.approx(record["objective"])


LATE_PARAM_MODEL_INIT = """
def model_init(trial):
    return Net(hidden=trial.suggest_int("hidden", 8, 32, step=8) if trial is not None else 16)
"""


def test_a_lost_ending_still_gets_the_params_model_init_sampled(
    mlflow_server: str, tmp_path: Path
) -> None:
    """A param that model_init samples define-by-run reaches MLflow with the trial's end. When that
    end was lost, the sweep's end logs it from the record, with the state and objective."""
    from mlflow.tracking import MlflowClient

    space = write_space(
        tmp_path,
        name="late_params.py",
        epochs=1,
        model_init=LATE_PARAM_MODEL_INIT,
        space='{"learning_rate": hpsweep.Float(1e-3, 3e-1, log=True)}',
    )
    command = ("run", space, "--n-trials", "1", "--pruner", "none", "--mlflow", mlflow_server)
    hpsweep_cli(*command, check=True)
    client = MlflowClient(mlflow_server)
    path = next((tmp_path / "out").glob("run-*/trial.json"))
    record = json.loads(path.read_text())
    child = client.get_run(record["user_attrs"]["mlflow_run_id"])
    # logged at the trial's end
    assert child.data.params["hidden"] == str(record["params"]["hidden"])

    # The child as it stood when the trial's end never reached MLflow: running, the space's params only.
    lost = client.create_run(
        child.info.experiment_id,
        run_name=child.info.run_name,
        tags={
            "mlflow.parentRunId": child.data.tags["mlflow.parentRunId"],
            "hpsweep.state": "running",
        },
    ).info.run_id
    client.log_param(lost, "learning_rate", child.data.params["learning_rate"])
    path.write_text(
        json.dumps({**record, "user_attrs": {**record["user_attrs"], "mlflow_run_id": lost}})
    )

    hpsweep_cli(*command, check=True)  # the same command: nothing left to run, the sweep ends again
    repaired = client.get_run(lost)
    assert repaired.data.params == {
        "learning_rate": child.data.params["learning_rate"],
        "hidden": str(record["params"]["hidden"]),
    }
    assert (repaired.data.tags["hpsweep.state"], repaired.info.status) == ("complete", "FINISHED")
    assert repaired.data.metrics["objective"] == pytest.approx(record["objective"])


def test_report_to_mlflow_tracks_the_sweep_as_transformers_mlflowcallback_would(
    mlflow_server: str, tmp_path: Path
) -> None:
    """transformers' report_to="mlflow" with MLflow's own environment variables, no --mlflow: the
    sweep is tracked (one parent, a child per trial); with --mlflow too, still once."""
    from mlflow.tracking import MlflowClient

    space = write_space(
        tmp_path,
        epochs=2,
        extra_args=', report_to="mlflow"',
        space='{"learning_rate": hpsweep.Float(1e-3, 3e-1, log=True)}',
    )
    env = {"MLFLOW_TRACKING_URI": mlflow_server, "MLFLOW_EXPERIMENT_NAME": "hf-report-to"}
    hpsweep_cli("run", space, "--n-trials", "2", env=env, check=True)
    hpsweep_cli("run", space, "--n-trials", "3", "--mlflow", mlflow_server, env=env, check=True)
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("hf-report-to")
    assert experiment is not None
    runs_ = client.search_runs([experiment.experiment_id], max_results=100)
    parents = [r for r in runs_ if r.data.tags.get("hpsweep.role") == "sweep"]
    assert len(parents) == 1  # the rerun continues the sweep, and its run
    children = [r for r in runs_ if "mlflow.parentRunId" in r.data.tags]
    assert len(children) == 3 and {
        c.info.run_id for c in children
    } == {  # one each: --mlflow doubled nothing
        r["user_attrs"]["mlflow_run_id"] for r in _records(tmp_path / "out").values()
    }


@pytest.mark.parametrize(
    "backend, extra_args",
    [
        ("ray", ["--scheduler", "asha", "--n-jobs", "2"]),
        ("wandb", ["--sampler", "random"]),
    ],
)
def test_every_backend_logs_nested_trial_runs(
    mlflow_server: str, tmp_path: Path, backend: str, extra_args: list[str]
) -> None:
    """The parent run id travels with each trial: Ray workers and W&B trials log into the same parent."""
    from mlflow.tracking import MlflowClient

    space = write_space(
        tmp_path,
        name=f"{backend}_sweep.py",
        epochs=3,
        extra_args=EVAL_EACH_EPOCH,
        space='{"learning_rate": hpsweep.Float(1e-3, 3e-1, log=True)}',
    )
    env = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(tmp_path),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "RAY_ADDRESS": "",
    }
    hpsweep_cli(
        "run",
        space,
        "--backend",
        backend,
        "--n-trials",
        "3",
        "--seed",
        "0",
        "--mlflow",
        mlflow_server,
        *extra_args,
        env=env,
        check=True,
        timeout=600,
    )
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name(f"{backend}_sweep")
    runs_ = client.search_runs([experiment.experiment_id], max_results=100)
    parents = [r for r in runs_ if r.data.tags.get("hpsweep.role") == "sweep"]
    assert len(parents) == 1 and parents[0].data.params.get("backend") == backend
    children = [r for r in runs_ if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    records = _records(tmp_path / "out")
    assert len(children) == len(records) == 3
    assert {c.info.run_id for c in children} == {
        r["user_attrs"]["mlflow_run_id"] for r in records.values()
    }
    for child in children:
        state = child.data.tags["hpsweep.state"]
        assert state in ("complete", "pruned")
        assert client.get_metric_history(child.info.run_id, "eval_loss")
        if state == "complete":
            assert child.data.metrics["objective"] == pytest.approx(
                next(
                    r
                    for r in records.values()
                    if r["user_attrs"]["mlflow_run_id"] == child.info.run_id
                )["objective"]
            )
    assert sum(c.data.tags.get("hpsweep.best") == "true" for c in children) == 1


def test_machines_of_one_sweep_at_an_object_store_share_one_parent_run(
    mlflow_server: str, tmp_path: Path
) -> None:
    """Each machine of a sweep whose home is an object store stages it in a folder of its own;
    the parent run is the sweep's, named by the home's URL, not by a machine's staging folder."""
    from types import SimpleNamespace

    from mlflow.tracking import MlflowClient

    from hpsweep.integrations.mlflow import MLflowTracker
    from hpsweep.search.options import SearchOptions

    parents = []
    for machine in ("m0", "m1"):
        settings = SearchOptions(
            output_dir=tmp_path / machine / "staging",
            study_name="shared",
            home=SimpleNamespace(url="s3://sweeps/shared"),
        )
        tracker = MLflowTracker(mlflow_server, experiment_name="homes")
        tracker.on_sweep_begin(settings)
        parents.append(tracker.parent_run_id)
    assert parents[0] is not None and parents[0] == parents[1]
    run = MlflowClient(mlflow_server).get_run(parents[0])
    assert run.data.tags["hpsweep.output_dir"] == "s3://sweeps/shared"


def test_a_folder_store_is_refused_in_mlflows_words_until_the_user_opts_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow 3 opens its folder store only for those who opt in: without that, the command stops
    before any trial with MLflow's whole message (its fix included), and writes nothing."""
    from mlflow.tracking import MlflowClient

    space = write_space(tmp_path, epochs=1)
    store = f"file://{tmp_path / 'mlruns'}"
    command = ("run", space, "--n-trials", "2", "--mlflow", store)
    proc = hpsweep_cli(*command, env={"MLFLOW_ALLOW_FILE_STORE": "false"})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpsweep: error: MLflow refuses")
    assert "set `MLFLOW_ALLOW_FILE_STORE=true` to opt out" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["space.py"]  # no out/, no mlruns/

    hpsweep_cli(*command, env={"MLFLOW_ALLOW_FILE_STORE": "true"}, check=True)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(store)
    runs_ = client.search_runs([client.get_experiment_by_name("space").experiment_id])
    children = {r.info.run_id: r for r in runs_ if "mlflow.parentRunId" in r.data.tags}
    records = _records(tmp_path / "out").values()
    assert len(runs_) == 3 and len(children) == 2
    for record in records:
        child = children[record["user_attrs"]["mlflow_run_id"]]
        assert child.data.tags["hpsweep.state"] == record["state"] == "complete"
        assert child.data.metrics["objective"] == pytest.approx(record["objective"])


def test_a_sweep_continued_with_mlflow_logs_the_trials_it_held_once(
    mlflow_server: str, tmp_path: Path
) -> None:
    """Two trials run untracked; the same sweep continued to five with --mlflow logs all five
    under one parent (the first two from their records), and a third run logs none twice. The
    tracking URI's password shows nowhere."""
    from mlflow.tracking import MlflowClient

    password = "mlflowPW-s3cret-71"
    with_password = mlflow_server.replace("http://", f"http://hp:{password}@")
    space = write_space(tmp_path, name="continued.py", epochs=2, extra_args=EVAL_EACH_EPOCH)
    hpsweep_cli("run", space, "--n-trials", "2", "--seed", "0", check=True)
    command = ("run", space, "--n-trials", "5", "--seed", "0", "--mlflow", with_password)
    procs = [hpsweep_cli(*command, check=True), hpsweep_cli(*command, check=True)]

    client = MlflowClient(mlflow_server)
    runs_ = client.search_runs([client.get_experiment_by_name("continued").experiment_id])
    parents = [r for r in runs_ if r.data.tags.get("hpsweep.role") == "sweep"]
    children = [r for r in runs_ if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 5
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
    by_trial = {c.data.tags["hpsweep.trial_id"]: c for c in children}
    records = _records(tmp_path / "out")
    assert set(by_trial) == set(records)
    for trial_id, record in records.items():
        child = by_trial[trial_id]
        assert child.data.tags["hpsweep.state"] == record["state"]
        assert float(child.data.params["learning_rate"]) == pytest.approx(
            record["params"]["learning_rate"]
        )
        history = client.get_metric_history(child.info.run_id, "eval_accuracy")
        assert sorted((m.step, m.value) for m in history) == [
            (h["step"], pytest.approx(h["eval_accuracy"])) for h in record["history"]
        ]
    best = json.loads((tmp_path / "out" / "best_run.json").read_text())
    tagged = [c.info.run_id for c in children if c.data.tags.get("hpsweep.best") == "true"]
    assert tagged == [by_trial[best["run_id"]].info.run_id]
    for run in runs_:
        assert password not in json.dumps([run.data.params, run.data.tags])
    assert password not in "".join(p.stdout + p.stderr for p in procs)


def test_two_machines_starting_on_one_new_sqlite_store_both_track(tmp_path: Path) -> None:
    """Two commands started at once on a store that does not exist yet: MLflow creates its tables
    on first use, and both sweeps' trials are tracked."""
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    commands = []
    for machine in ("m0", "m1"):
        (tmp_path / machine).mkdir()
        space = write_space(tmp_path / machine, epochs=1)
        argv = ["run", str(space), "--n-trials", "2", "--mlflow", store]
        commands.append(
            subprocess.Popen(
                [sys.executable, "-m", "hpsweep.cli", *argv],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for command in commands:
        out, err = command.communicate(timeout=300)
        assert command.returncode == 0, err
        assert "hpsweep: warning" not in err, err  # tracking went on
    client = MlflowClient(store)
    runs_ = client.search_runs([client.get_experiment_by_name("space").experiment_id])
    states = {r.info.run_id: r.data.tags.get("hpsweep.state") for r in runs_}
    assert len([r for r in runs_ if r.data.tags.get("hpsweep.role") == "sweep"]) == 2
    for machine in ("m0", "m1"):
        records = _records(tmp_path / machine / "out").values()
        assert len(records) == 2
        assert all(states[r["user_attrs"]["mlflow_run_id"]] == r["state"] for r in records)
