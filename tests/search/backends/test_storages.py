"""``--storage`` on a real PostgreSQL and Optuna's storage proxy: sweeps run there, the password
never shows anywhere, each worker holds one connection, and a storage that cannot be opened is
one line (exit 2) with nothing written."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
import torch
from support import free_port, hpsweep_cli, write_space
from support.postgres import PASSWORD, Postgres, postgres_server
from torch import nn

import hpsweep
from hpsweep import UserError

MLFLOW_FILE_STORE = {"MLFLOW_ALLOW_FILE_STORE": "true"}  # MLflow's file store, for a cheap check


@pytest.fixture(scope="module")
def pg() -> Iterator[Postgres]:
    with postgres_server() as server:
        yield server


def hidden(url: str) -> str:
    return url.replace(PASSWORD, "***")


def files_holding(folder: Path, secret: str) -> list[str]:
    """Every file under ``folder`` whose bytes contain ``secret``."""
    return [str(p) for p in folder.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def assert_one_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpsweep: error: "), proc.stderr
    assert PASSWORD not in proc.stdout + proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def study_tables(pg: Postgres, database: str) -> int:
    query = "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'"
    return int(pg.sql(query, database))


def connections(pg: Postgres, database: str) -> int:
    return int(pg.sql(f"SELECT count(*) FROM pg_stat_activity WHERE datname = '{database}'"))


class ConnectionPeak(threading.Thread):
    """The most connections ``database`` had at once, polled while a command runs."""

    def __init__(self, pg: Postgres, database: str) -> None:
        super().__init__(daemon=True)
        self.pg, self.database = pg, database
        self.samples: list[int] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append(connections(self.pg, self.database))
            time.sleep(0.02)

    def stop(self) -> int:
        self.done.set()
        self.join()
        return max(self.samples)


def test_a_postgres_sweep_never_shows_its_password_and_holds_one_connection_per_worker(
    pg: Postgres, tmp_path: Path
) -> None:
    url = pg.create_database("audit")
    # The tables exist, as after any sweep's first process: Optuna's first set-up of the
    # tables takes a second connection for an instant, which is not what is counted here.
    optuna.storages.RDBStorage(url).engine.dispose()
    space = write_space(tmp_path, epochs=1)
    mlruns = tmp_path / "mlruns"
    peak = ConnectionPeak(pg, "audit")
    peak.start()
    proc = hpsweep_cli(
        "run", space, "--n-trials", "4", "--n-jobs", "2", "--pruner", "none", "--storage", url,
        "--mlflow", mlruns, "--mlflow-fatal", env=MLFLOW_FILE_STORE,
    )  # fmt: skip
    most = peak.stop()
    assert proc.returncode == 0, proc.stderr
    # the parent holds none; each worker one, however many trials it runs
    assert 1 <= most <= 2, peak.samples
    assert connections(pg, "audit") == 0  # closed when the workers exit
    study = optuna.load_study(study_name="space", storage=url)
    assert sum(t.state.name == "COMPLETE" for t in study.trials) == 4

    out = tmp_path / "out"
    assert (out / "best" / "README.md").exists() and (out / "best_run.json").exists()
    assert PASSWORD not in proc.stdout + proc.stderr
    assert files_holding(out, PASSWORD) == [] and files_holding(mlruns, PASSWORD) == []
    os.environ.update(MLFLOW_FILE_STORE)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(str(mlruns))
    experiment = client.get_experiment_by_name("space")
    logged = client.search_runs([experiment.experiment_id])
    assert len(logged) == 5  # the sweep's run and one per trial
    assert PASSWORD not in json.dumps([[r.data.params, r.data.tags] for r in logged])
    assert hidden(url) in {r.data.params.get("storage") for r in logged}


def test_the_password_can_come_from_pgpassword(pg: Postgres, tmp_path: Path) -> None:
    pg.create_database("fromenv")
    url = pg.url("fromenv", password=False)
    proc = hpsweep_cli(
        "run", write_space(tmp_path, epochs=1), "--n-trials", "1", "--storage", url,
        env={"PGPASSWORD": PASSWORD},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert PASSWORD not in proc.stdout + proc.stderr
    assert files_holding(tmp_path / "out", PASSWORD) == []
    study = optuna.load_study(study_name="space", storage=pg.url("fromenv"))
    assert [t.state.name for t in study.trials] == ["COMPLETE"]


@pytest.mark.parametrize(
    "case",
    ["wrong password", "missing database", "server stopped", "nothing at grpc", "host:port"],
)
def test_a_storage_that_cannot_be_opened_is_one_line_and_nothing_is_written(
    pg: Postgres, tmp_path: Path, case: str
) -> None:
    database = "refused_" + case.replace(" ", "_").replace(":", "_")
    url = pg.create_database(database)
    storage, needles = {
        "wrong password": (
            url.replace(PASSWORD, "not-" + PASSWORD[::-1]),
            ["password is wrong", "PGPASSWORD", hidden(url)],
        ),
        "missing database": (
            pg.url("nosuchdb"),
            ["'nosuchdb' does not exist", f"createdb -h 127.0.0.1 -p {pg.port} -U hp nosuchdb"],
        ),
        "server stopped": (url, ["connection refused", "start the database", hidden(url)]),
        "nothing at grpc": (
            f"grpc://127.0.0.1:{free_port()}",
            ["no Optuna storage proxy answers", "run_grpc_proxy_server"],
        ),
        "host:port": (
            f"hp:{PASSWORD}@127.0.0.1:{pg.port}",
            ["names a server but not its kind", f"postgresql://USER@127.0.0.1:{pg.port}/"],
        ),
    }[case]
    if case == "server stopped":
        pg.stop()
    started = time.monotonic()
    try:
        proc = hpsweep_cli("run", write_space(tmp_path), "--n-trials", "2", "--storage", storage)
    finally:
        if case == "server stopped":
            pg.start()
    assert_one_line(proc, *needles)
    assert time.monotonic() - started < 60  # no minutes of retries (the grpc wait is 5 s)
    assert not (tmp_path / "out").exists()
    assert study_tables(pg, database) == 0


@pytest.mark.parametrize(
    "storage, needles",
    [
        ("postgres://hp:{pw}@127.0.0.1:5432/sweeps", ["did you mean 'postgresql'"]),
        ("postgresql+psycopg2://hp:{pw}@127.0.0.1:5432/x", ["pip install psycopg2-binary"]),
        ("mysql://hp:{pw}@127.0.0.1:3306/x", ["pip install 'hpsweep[mysql]'", "mysql+pymysql://"]),
        ("grpc://hp:{pw}@127.0.0.1", ["grpc://HOST:PORT"]),
    ],
)
def test_a_storage_hpsweep_cannot_open_is_named_with_the_fix(
    tmp_path: Path, storage: str, needles: list[str]
) -> None:
    trainer = _trainer(tmp_path / "out")
    with pytest.raises(UserError) as refused:
        trainer.hyperparameter_search(
            space=SPACE, n_trials=1, storage=storage.format(pw=PASSWORD), show_progress=False
        )
    message = str(refused.value)
    assert PASSWORD not in message and "hp:***@" in message
    assert all(needle in message for needle in needles), message
    assert not (tmp_path / "out").exists()


def test_the_python_api_takes_an_optuna_storage_object(
    pg: Postgres, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpsweep.integrations.mlflow import MLflowTracker

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    url = pg.create_database("object")
    storage = optuna.storages.RDBStorage(url)  # the user's own, with its own pool
    best = _trainer(tmp_path / "out").hyperparameter_search(
        space=SPACE, n_trials=3, n_jobs=2, storage=storage, study_name="api", show_progress=False,
        sweep_callbacks=[MLflowTracker(str(tmp_path / "mlruns"), fatal=True)],
    )  # fmt: skip
    assert best.run_id is not None
    study = optuna.load_study(study_name="api", storage=url)
    assert sum(t.state.name == "COMPLETE" for t in study.trials) == 3
    params = (tmp_path / "mlruns").rglob("params/storage")
    assert [p.read_text() for p in params] == [f"RDBStorage({hidden(url)})"]


PROXY = """
import sys, optuna
optuna.logging.set_verbosity(optuna.logging.WARNING)
storage = optuna.storages.get_storage(sys.argv[1])
optuna.storages.run_grpc_proxy_server(storage, host="127.0.0.1", port=int(sys.argv[2]))
"""


def test_a_sweep_runs_through_optunas_storage_proxy(pg: Postgres, tmp_path: Path) -> None:
    url = pg.create_database("proxied")
    port = free_port()
    proxy = subprocess.Popen([sys.executable, "-c", PROXY, url, str(port)])
    try:
        _wait_for_port(port, proxy)
        proc = hpsweep_cli(
            "run", write_space(tmp_path, epochs=1), "--n-trials", "2",
            "--storage", f"grpc://127.0.0.1:{port}",
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    finally:
        proxy.terminate()
        proxy.wait(timeout=30)
    study = optuna.load_study(study_name="space", storage=url)
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"]


def _wait_for_port(port: int, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and server.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"the storage proxy did not start (exit code {server.poll()})")


SPACE = {"learning_rate": hpsweep.Float(1e-3, 1e-1, log=True)}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 2)

    def forward(self, x, labels):
        logits = self.net(x)
        return nn.functional.cross_entropy(logits, labels), logits


def data(n: int, seed: int) -> torch.utils.data.TensorDataset:
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.TensorDataset(x, (x.sum(-1) > 0).long())


def _trainer(out: Path) -> hpsweep.Trainer:
    args = hpsweep.TrainingArguments(
        str(out), num_train_epochs=1, per_device_train_batch_size=32, disable_tqdm=True
    )
    return hpsweep.Trainer(
        model_init=Net, args=args, train_dataset=data(64, 1), eval_dataset=data(32, 2)
    )
