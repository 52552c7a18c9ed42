"""Real Ray nodes on this machine for the tests, started as a user starts them (``ray start``),
bound to 127.0.0.1, and stopped by their temp dir, so that nobody else's Ray is touched."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from support import free_port

RAY = str(Path(sys.executable).parent / "ray")


@dataclass
class Cluster:
    address: str
    env: dict[str, str]


def stop_processes_under(marker: str) -> None:
    """Stop the Ray processes whose command line names ``marker`` (a cluster's temp dir), and their children."""
    mine = [
        p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])
    ]
    everything = {p.pid: p for p in mine}
    for p in mine:
        try:
            everything.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
    for p in everything.values():
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    # some of Ray's ignore SIGTERM
    _, alive = psutil.wait_procs(list(everything.values()), timeout=3)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _ray_start(args: list[str], env: dict[str, str], temp: str) -> None:
    """``ray start ARGS``, tried twice. Ray waits a hard-coded 30 s for a new node to register, which
    two cores busy with the rest of the suite sometimes exceed; the second try starts clean."""
    for attempt in (1, 2):
        proc = subprocess.run(
            [RAY, "start", *args], env=env, capture_output=True, text=True, timeout=120
        )
        if proc.returncode == 0:
            return
        if attempt == 2 or "timed out during startup" not in proc.stdout + proc.stderr:
            raise RuntimeError(f"ray start {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
        if "--head" in args:
            stop_processes_under(temp)


@contextlib.contextmanager
def ray_nodes(
    *,
    workers: int = 1,
    token: bool = True,
    worker_env: dict[str, str] | None = None,
    worker_args: tuple[str, ...] = (),
) -> Iterator[Cluster]:
    """A head node and ``workers`` worker nodes, 1 CPU each, bound to 127.0.0.1; with token
    authentication unless ``token=False``. ``worker_env`` is added to the worker nodes' environment
    (their Ray workers inherit it), and ``worker_args`` to their ``ray start``."""
    temp = tempfile.mkdtemp(prefix="hpr", dir="/tmp")  # short: Ray's Unix sockets live under it
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    if token:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    env.pop("RAY_ADDRESS", None)
    common = ["--num-cpus", "1", "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
    try:
        _ray_start(
            [
                "--head",
                "--port",
                str(port),
                "--include-dashboard=false",
                "--temp-dir",
                temp,
                *common,
            ],
            env,
            temp,
        )
        for _ in range(workers):
            _ray_start(
                ["--address", f"127.0.0.1:{port}", *common, *worker_args],
                {**env, **(worker_env or {})},
                temp,
            )
        yield Cluster(f"127.0.0.1:{port}", env)
    finally:
        stop_processes_under(temp)
        shutil.rmtree(temp, ignore_errors=True)
