"""Machines of one sweep, for the many-machine tests: each "machine" is an `hpsweep run` process
with its own working folder, HOME and temp dir; machines share only the study's storage (a real
PostgreSQL, or Optuna's storage proxy in front of it) and the sweep's home (a folder, as an NFS
mount is, or a bucket of the local S3 server)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna

from support import free_port
from support.postgres import PASSWORD
from support.s3 import s3_server


class Machine:
    """An `hpsweep run` on a machine of its own (working folder, HOME, TMPDIR); ``env`` adds to
    the test's environment."""

    def __init__(self, root: Path, name: str, *args: str, env: dict[str, str] | None = None):
        folder = root / name
        folder.mkdir()
        self.folder = folder
        env = {
            **os.environ,
            "HOME": str(folder),
            "TMPDIR": str(folder),
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hpsweep.cli", "run", *args],
            cwd=folder,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def finish(self, timeout: float = 240) -> tuple[int, str]:
        out, err = self.proc.communicate(timeout=timeout)
        assert PASSWORD not in out + err
        return self.proc.returncode, out + err


def sweep_args(space: Path, url: str, study: str, home: Path | str, n_trials: int) -> list[str]:
    return [str(space), "--storage", url, "--study-name", study, "--output-dir", str(home)] + [
        "--n-trials",
        str(n_trials),
    ]


def study_states(url: str, name: str) -> Counter:
    study = optuna.load_study(study_name=name, storage=url)
    return Counter(t.state.name for t in study.trials)


@contextlib.contextmanager
def storage_proxy(url: str) -> Iterator[str]:
    """Optuna's storage proxy in front of the database ``url``, as its own process."""
    port = free_port()
    serve = (
        "import optuna; optuna.storages.run_grpc_proxy_server("
        f"optuna.storages.get_storage({url!r}), host='127.0.0.1', port={port})"
    )
    proc = subprocess.Popen([sys.executable, "-c", serve], stderr=subprocess.DEVNULL)
    try:
        proxy = optuna.storages.GrpcStorageProxy(host="127.0.0.1", port=port)
        proxy.wait_server_ready(timeout=60)
        proxy.close()
        yield f"grpc://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait()


@contextlib.contextmanager
def postgres_proxy_and_bucket(
    pg, monkeypatch, name: str = "dead_s3"
) -> Iterator[tuple[str, str, Any]]:
    """(the proxy's URL, the database's URL, the S3 server with a bucket ``sweeps``)."""
    database = pg.create_database(name)
    with s3_server() as s3, storage_proxy(database) as url:
        s3.make_bucket("sweeps")
        for key, value in s3.env.items():
            monkeypatch.setenv(key, value)  # every machine reads the store's address from it
        yield url, database, s3
