"""Real Ray nodes on this machine for the tests, started as a user starts them (``ray start``),
bound to 127.0.0.1, and stopped by their temp dir, so that nobody else's Ray is touched.

Each cluster's nodes get a HOME of their own: Ray 2.60's ``ray.init()`` writes
``~/.ray/auth_token``, which a later ``ray start --address`` would send to a cluster that does not
expect it (InvalidAuthToken).

A worker node can be made not to see a folder (``hidden``), as a second machine does not see the
driver's local disk: its ``ray start`` runs in a mount namespace of its own (``unshare --mount``,
root only) with an empty tmpfs over that folder, and Ray's daemons and workers, started from it,
stay there. Everything else (Python, the code, Ray's temp dir) it sees as the head does; what the
worker writes under the folder stays in its tmpfs, as on another machine's disk.

`listening` and `answers_without_token` tell whether Ray's sockets let a stranger in.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from support import free_port, hpsweep_cli

RAY = str(Path(sys.executable).parent / "ray")


@dataclass
class Cluster:
    address: str
    env: dict[str, str]
    #: the nodes' temp dir and environment, for a node that joins later (`joined_node`)
    temp: str = ""
    nodes_env: dict[str, str] = field(default_factory=dict)
    #: the head's Ray client server, ``ray://127.0.0.1:PORT``
    client_address: str = ""


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


def _ray_start(args: list[str], env: dict[str, str], temp: str, hidden: Path | None = None) -> None:
    """``ray start ARGS``, tried twice. Ray waits a hard-coded 30 s for a new node to register, which
    two cores busy with the rest of the suite sometimes exceed; the second try starts clean.
    ``hidden``: a folder the node sees empty (see the module's docstring)."""
    command = [RAY, "start", *args]
    if hidden is not None:
        mount = 'mount -t tmpfs -o size=64m hpsweep-hidden "$0" && exec "$@"'
        command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount]
        command += [str(hidden), RAY, "start", *args]
    for attempt in (1, 2):
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
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
    head_cpus: int = 1,
    hidden: Path | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[Cluster]:
    """A head node with ``head_cpus`` CPUs and ``workers`` worker nodes with 1 CPU each, bound to
    127.0.0.1; with token authentication unless ``token=False``. ``env`` is added to every node's
    environment and the cluster's, ``worker_env`` to the worker nodes' (their Ray workers inherit
    both), and ``worker_args`` to their ``ray start``; the worker nodes see ``hidden`` empty."""
    temp = tempfile.mkdtemp(prefix="hpr", dir="/tmp")  # short: Ray's Unix sockets live under it
    port, client_port = free_port(), free_port()  # not Ray's 10001: clusters of tests side by side
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
    if token:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    else:
        # said outright: a ray.init() earlier in this test process sets RAY_AUTH_MODE=token in
        # os.environ, which every later node would inherit
        env["RAY_AUTH_MODE"] = "disabled"
        env.pop("RAY_AUTH_TOKEN", None)
    env.pop("RAY_ADDRESS", None)
    home = Path(temp) / "home"
    home.mkdir()
    nodes_env = {**env, "HOME": str(home)}
    common = ["--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
    try:
        _ray_start(
            [
                "--head",
                "--port",
                str(port),
                "--include-dashboard=false",
                "--temp-dir",
                temp,
                "--num-cpus",
                str(head_cpus),
                "--ray-client-server-port",
                str(client_port),
                *common,
            ],
            nodes_env,
            temp,
        )
        for _ in range(workers):
            _ray_start(
                ["--address", f"127.0.0.1:{port}", "--num-cpus", "1", *common, *worker_args],
                {**nodes_env, **(worker_env or {})},
                temp,
                hidden,
            )
        yield Cluster(f"127.0.0.1:{port}", env, temp, nodes_env, f"ray://127.0.0.1:{client_port}")
    finally:
        stop_processes_under(temp)
        shutil.rmtree(temp, ignore_errors=True)


def joined_node(cluster: Cluster, *args: str) -> psutil.Process:
    """One more worker node on ``cluster`` (``ray start --address ... ARGS``, 1 CPU); returns its
    raylet, whose death takes the node's workers along and the node out of the cluster. The
    cluster stops it with its other nodes."""
    port = free_port()
    common = ["--num-cpus", "1", "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
    _ray_start(
        ["--address", cluster.address, "--node-manager-port", str(port), *common, *args],
        cluster.nodes_env,
        cluster.temp,
    )
    [raylet] = [
        p
        for p in psutil.process_iter(["name", "cmdline"])
        if p.info["name"] == "raylet" and f"--node_manager_port={port}" in p.info["cmdline"]
    ]
    return raylet


def ray_sweep(
    cluster: Cluster, space: Path, out: Path, *extra: str, timeout: float = 240
) -> subprocess.CompletedProcess:
    """``hpsweep run SPACE --backend ray`` on ``cluster`` into ``out``, with ``extra`` flags."""
    return hpsweep_cli(
        "run",
        space,
        "--backend",
        "ray",
        "--address",
        cluster.address,
        "--output-dir",
        out,
        *extra,
        env=cluster.env,
        timeout=timeout,
    )


#: One method of each of Ray's gRPC services, which a request without the token is refused on
#: (UNAUTHENTICATED): the GCS, the raylet's node and object managers, a core worker (a driver too).
RAY_GRPC_METHODS = (
    "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo",
    "/ray.rpc.NodeManagerService/GetNodeStats",
    "/ray.rpc.ObjectManagerService/Pull",
    "/ray.rpc.CoreWorkerService/GetCoreWorkerStats",
)


def listening(processes: Iterable[psutil.Process]) -> list[tuple[str, str, int]]:
    """(process name, address, port) of each TCP socket ``processes`` listen on."""
    found = []
    for p in processes:
        try:
            sockets = p.net_connections("tcp")
            name = p.name()
        except psutil.Error:  # gone meanwhile
            continue
        found += [(name, s.laddr.ip, s.laddr.port) for s in sockets if s.status == "LISTEN"]
    return found


def answers_without_token(address: str, port: int) -> str | None:
    """What a request without Ray's token gets at ``address:port`` (a wildcard address is tried
    on 127.0.0.1): None when it is refused (gRPC UNAUTHENTICATED, HTTP 401), else what answered."""
    import grpc

    host = "127.0.0.1" if ipaddress.ip_address(address).is_unspecified else address
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    codes = set()
    with grpc.insecure_channel(target) as channel:
        for method in RAY_GRPC_METHODS:
            try:
                channel.unary_unary(method)(b"", timeout=10)
                return f"{method} answered"
            except grpc.RpcError as exc:
                codes.add(exc.code())
    if grpc.StatusCode.UNAUTHENTICATED in codes:
        return None
    if grpc.StatusCode.UNIMPLEMENTED in codes:
        return "a gRPC server with none of Ray's services"
    try:  # not gRPC: Ray's agents serve HTTP
        urllib.request.urlopen(
            urllib.request.Request(f"http://{target}/", method="POST"), timeout=10
        )
    except urllib.error.HTTPError as exc:
        return None if exc.code == 401 else f"HTTP {exc.code}"
    return "HTTP 200"
