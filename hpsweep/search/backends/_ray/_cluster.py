"""Where Ray trials run: joining a cluster or starting a local Ray (`connected`), shipping the
user's code to the workers, and the runs of nodes that do not see ``--output-dir``, shipped
through Ray's storage with the remote-home code (`hpsweep.runs.RemoteHome`)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune.experiment import Trial as TuneTrial

from hpsweep import runs
from hpsweep.errors import UserError
from hpsweep.search.trial_runner import TrialRunner

CONNECT_TIMEOUT_S = 3.0
AUTH_MODE_ENV = "RAY_AUTH_MODE"
# A file per command in --output-dir, named by a token: a worker that sees it sees the driver's folder.
MARKER_PREFIX = ".hpsweep-ray-marker-"
# A trial's run, shipped from a node without --output-dir, in the trial's folder in Ray's storage.
SHIPPED_RUN_DIR = "hpsweep-run"
# On a worker: write runs in this node-local folder even where --output-dir is visible (tests).
LOCAL_RUNS_ENV = "HPSWEEP_RAY_LOCAL_RUNS"
# With reuse_actors, how long reset_config() waits for a stopped trial to record itself.
WORKER_ENV = {"TUNE_FUNCTION_THREAD_TIMEOUT_S": "60", "RAY_DEDUP_LOGS": "1"}
# Ray's console quiet, no per-trial loggers or usage reporting; Tune's strict metric check off, as
# a failed trial or a user error reports no objective. A user's own setting of each wins.
QUIET_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "TUNE_DISABLE_AUTO_CALLBACK_LOGGERS": "1",
    "RAY_AIR_NEW_OUTPUT": "0",
    "TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S": "100000",
    "RAY_DEDUP_LOGS": "1",
    "RAY_TRAIN_V2_ENABLED": "0",
    "TUNE_DISABLE_STRICT_METRIC_CHECKING": "1",
}


@contextlib.contextmanager
def connected(address: str | None, cpus: float) -> Iterator[None]:
    """Join ``address`` (auto, HOST:PORT, ray://HOST:10001) or start a local Ray with at least
    ``cpus`` CPUs that dies with the command; a Ray the caller connected is used as it is."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    if ray.is_initialized():
        yield
        return
    kwargs: dict[str, Any] = dict(
        logging_level=logging.ERROR,
        log_to_driver=False,
        configure_logging=True,
        runtime_env={"env_vars": dict(WORKER_ENV)},
    )
    auth_mode, watchdog = os.environ.get(AUTH_MODE_ENV), None
    try:
        if address is not None:
            _join(address, kwargs)
        else:
            watchdog = _start_local(cpus, kwargs, auth_mode)
        yield
    finally:
        ray.shutdown()
        if address is None:
            _restore_auth_mode(auth_mode)
        if watchdog is not None:
            watchdog.stdin.close()  # type: ignore[union-attr]  # it reaps what shutdown left
            watchdog.wait()


def _join(address: str, kwargs: dict[str, Any]) -> None:
    check_reachable(address)
    try:
        ray.init(address=address, **kwargs)
    except Exception as exc:  # ConnectionError, AuthenticationError, a Ray Client handshake, ...
        # a half-made connection (a Ray Client one keeps its stub) would fail the next ray.init
        with contextlib.suppress(Exception):
            ray.shutdown()
        raise UserError(
            f"--address {address}: cannot join the Ray cluster ({_reason(exc)}); "
            "check the address and that `ray status` works there"
        ) from None


def _start_local(
    cpus: float, kwargs: dict[str, Any], auth_mode: str | None
) -> subprocess.Popen | None:
    """Start a Ray on this machine, with token authentication: its processes listen on every
    interface whatever address they are given. Ray turns tokens on for a new local cluster when
    ``RAY_AUTH_MODE`` is unset, so a ``disabled`` (meant for another cluster) is cleared."""
    if (auth_mode or "").lower() != "token":
        os.environ.pop(AUTH_MODE_ENV, None)
    context = ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, math.ceil(cpus)),
        include_dashboard=False,
        # Private: ray.init takes the local node's address only as this underscored argument.
        _node_ip_address="127.0.0.1",
        **kwargs,
    )
    return _start_watchdog(str(context.address_info.get("session_dir") or ""))


def _restore_auth_mode(before: str | None) -> None:
    """Put ``RAY_AUTH_MODE`` back, and drop the token Ray cached in the process: ``ray.shutdown()``
    keeps both, and a later ``ray.init(address=...)`` here on a cluster without tokens would
    start a driver that wants a token the cluster never sends (its actors are cancelled)."""
    if os.environ.get(AUTH_MODE_ENV) == before:
        return
    if before is None:
        os.environ.pop(AUTH_MODE_ENV, None)
    else:
        os.environ[AUTH_MODE_ENV] = before
    with contextlib.suppress(Exception):
        # Private: Ray offers no public way to drop its cached token; this is how its own
        # token setup refreshes it.
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


# A local Ray's dashboard and runtime-env agents outlive a dead driver by about a minute. This
# watchdog, a child of the driver in a session of its own, notes the driver's Ray processes and
# stops them when its pipe from the driver closes: at the sweep's end or when the driver died.
_WATCHDOG = r"""
import contextlib, os, select, signal, sys
import psutil

signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
driver, session = psutil.Process(int(sys.argv[1])), sys.argv[2]
seen = {}
while True:
    with contextlib.suppress(psutil.Error):
        for p in driver.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                name = p.name()
                ray_process = name.startswith("ray::") or name in ("raylet", "gcs_server") or \
                    (session and session in " ".join(p.cmdline()))
                if ray_process and p.pid != os.getpid():
                    seen.setdefault(p.pid, p)
    if select.select([sys.stdin], [], [], 1.0)[0] and not sys.stdin.buffer.read1(1):
        break
alive = [p for p in seen.values() if p.is_running()]
for p in alive:
    with contextlib.suppress(psutil.Error):
        p.terminate()
for p in psutil.wait_procs(alive, timeout=3)[1]:
    with contextlib.suppress(psutil.Error):
        p.kill()
"""


def _start_watchdog(session_dir: str) -> subprocess.Popen | None:
    try:
        return subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(os.getpid()), session_dir],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a kill of the command's process group spares it
        )
    except OSError:
        return None


def check_reachable(address: str) -> None:
    """Fail within seconds when no Ray listens at ``address`` (Ray would retry for minutes)."""
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS") or _current_cluster() or ""
        if not address:
            raise UserError(
                "--address auto: no Ray cluster runs on this machine; start one with "
                "`ray start --head`, or give --address HOST:PORT"
            )
        if address.startswith("ray://") or ":" not in address:
            return
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--address {address!r} is not auto, HOST:PORT or ray://HOST:10001")
    try:
        speaks_grpc = _speaks_grpc(host, int(port))
    except OSError as exc:
        raise UserError(
            f"--address {address}: no Ray cluster answers there "
            f"({exc.strerror or type(exc).__name__}); check the address, that the head node "
            "runs (`ray status`) and that its port is open"
        ) from None
    if not speaks_grpc:
        raise UserError(
            f"--address {address}: something listens there but it is not a Ray cluster (no gRPC "
            "answer); give the head node's GCS port (`ray status` on the head prints it, 6379 by "
            "default) or ray://HOST:10001"
        )


# HTTP/2's client preface and an empty SETTINGS frame
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def _speaks_grpc(host: str, port: int) -> bool:
    """Whether ``host:port`` answers as a gRPC server does (Ray's GCS and Ray Client): its first
    frame is SETTINGS. Raises OSError when nothing accepts the connection."""
    with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S) as sock:
        if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
            return True  # the server waits for a TLS hello: an open port is all we check
        sock.settimeout(CONNECT_TIMEOUT_S)
        header = b""
        try:
            sock.sendall(_H2_PREFACE)
            while len(header) < 9 and (chunk := sock.recv(9 - len(header))):
                header += chunk
        except OSError:  # silence until the timeout, or a reset: not gRPC
            return False
    return len(header) == 9 and header[3] == 0x04


def _current_cluster() -> str | None:
    try:
        # Private: Ray offers no public way to read the address `ray start` left on this machine.
        from ray._private.utils import read_ray_address

        return read_ray_address()
    except Exception:
        return None


def _reason(exc: BaseException) -> str:
    """An error in one line: its first, and its last when the first only announces it (a Ray
    Client server's "Initialization failure from server:" and the traceback it sent)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} {lines[-1]}"
    return lines[0] if lines else type(exc).__name__


def pickle_user_code_by_value(user_objects: Iterable[object] = ()) -> None:
    """Ship by value what workers cannot import: space files (imported under synthetic names),
    the modules of ``user_objects`` that are no installed package (a script's, a test's), and
    the modules imported from those folders."""
    from ray import cloudpickle

    folders = set()
    for name, module in list(sys.modules.items()):
        if name.startswith("hpsweep_space_") and module is not None:
            cloudpickle.register_pickle_by_value(module)
            if getattr(module, "__file__", None):
                folders.add(Path(module.__file__).resolve().parent)
    for obj in user_objects:
        module = sys.modules.get(getattr(obj, "__module__", None) or "")
        file = getattr(module, "__file__", None)
        if module is None or not file or module.__name__ == "__main__" or _installed(file):
            continue
        if module.__name__.split(".")[0] != "hpsweep":
            cloudpickle.register_pickle_by_value(module)
            folders.add(Path(file).resolve().parent)
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if (
            file
            and not name.startswith("hpsweep")
            and not file.endswith("__init__.py")
            and not _installed(file)
            and Path(file).resolve().parent in folders
        ):
            cloudpickle.register_pickle_by_value(module)


def _installed(file: str) -> bool:
    return "site-packages" in file or "dist-packages" in file or file.startswith(sys.base_prefix)


# --- nodes without --output-dir ---------------------------------------------------------------


@contextlib.contextmanager
def output_dir_marker(output_dir: Path) -> Iterator[str]:
    """A token that a worker finds in ``--output-dir`` if, and only if, it sees the driver's folder."""
    token = secrets.token_hex(16)
    path = output_dir / f"{MARKER_PREFIX}{token}"
    path.touch()
    try:
        yield token
    finally:
        path.unlink(missing_ok=True)
        stop_file(output_dir, token).unlink(missing_ok=True)


def sees_output_dir(output_dir: Path, marker: str) -> bool:
    return not os.environ.get(LOCAL_RUNS_ENV) and (output_dir / f"{MARKER_PREFIX}{marker}").exists()


def stop_file(output_dir: Path, marker: str) -> Path:
    """Written by the driver when it stops a round: a trial Tune stops finds it, and knows it was
    cut short, not pruned."""
    return output_dir / f"{MARKER_PREFIX}{marker}.stop"


def store_at(storage: str, path: str) -> runs.RemoteHome:
    """The folder ``path`` (as Tune names it, without a scheme) of Ray's storage ``storage``."""
    scheme = storage.split("://", 1)[0] if "://" in storage else "file"
    return runs.RemoteHome(f"{scheme}://{path}")


class NodeLocalRuns:
    """A trial on a node without ``--output-dir`` trains in a folder of its own
    (``$HPSWEEP_RAY_LOCAL_RUNS`` or the temp dir) and ships its run to its trial's folder in
    Ray's storage when it ends; starting again, it first gets back what it shipped last."""

    def __init__(self, runner: TrialRunner, marker: str, storage: str) -> None:
        ctx = tune.get_context()
        experiment = runs.safe_name(ctx.get_experiment_name(), "sweep")
        base = Path(os.environ.get(LOCAL_RUNS_ENV) or tempfile.gettempdir()).resolve()
        self.folder = base / f"hpsweep-{experiment}-{marker[:12]}" / ctx.get_trial_id()
        job = runner.job
        self.runner = copy.copy(runner)
        self.runner.job = dataclasses.replace(
            job, args=job.args.replace(output_dir=str(self.folder))
        )
        self.storage = storage
        root = storage.split("://", 1)[-1].rstrip("/")
        trial_dir = f"{ctx.get_experiment_name()}/{Path(ctx.get_trial_dir()).name}"
        self.store = store_at(storage, f"{root}/{trial_dir}")

    def fetch(self, shipped_to: str | None = None) -> runs.TrialRecord | None:
        """The run shipped to ``shipped_to`` (default: this Tune trial's), back on this node;
        its record, pointing here."""
        shutil.rmtree(self.folder, ignore_errors=True)  # a worker that died mid-trial left it
        store = self.store
        if shipped_to is not None:
            store = store_at(self.storage, shipped_to.rsplit("/", 1)[0])
        record = store.read_record(SHIPPED_RUN_DIR)
        if record is not None:
            name = runs.safe_name(Path(record.run_dir).name, f"run-{record.id}")
            record.run_dir = str(self.folder / name)
            store.get_run(SHIPPED_RUN_DIR, Path(record.run_dir))
            record.save()
        return record

    def ship(self, run_dir: Path) -> None:
        try:
            record = runs.TrialRecord.load(run_dir / runs.TRIAL_FILE)
            if record is None:
                return  # nothing was recorded (a UserError before training)
            shipped_to = f"{self.store.root}/{SHIPPED_RUN_DIR}"
            record.user_attrs.update(ray_shipped_from=record.run_dir, ray_shipped_to=shipped_to)
            record.save()
            self.store.put_run(Path(record.run_dir), SHIPPED_RUN_DIR)
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
            with contextlib.suppress(OSError):
                self.folder.parent.rmdir()  # the sweep's folder on this node, after its last trial


def trial_store(storage: str, tune_trial: TuneTrial) -> runs.RemoteHome | None:
    """The folder of ``tune_trial`` in Ray's storage; None for a trial that never got one."""
    try:
        path = tune_trial.path
    except Exception:  # Tune names the folder when the trial first starts
        return None
    return store_at(storage, path) if path else None


def shipped_record(store: runs.RemoteHome | None) -> runs.TrialRecord | None:
    return store.read_record(SHIPPED_RUN_DIR) if store is not None else None


def collect_shipped_runs(stores: list[runs.RemoteHome | None], output_dir: Path) -> None:
    """Copy the runs shipped to ``stores`` into ``--output-dir`` (unless it holds a newer record
    of the trial), and promote them."""
    for store in stores:
        shipped = shipped_record(store)
        if store is None or shipped is None:
            continue
        target = runs.run_dir_for(output_dir, shipped.id, Path(shipped.run_dir).name)
        here = runs.TrialRecord.load(target / runs.TRIAL_FILE)
        if here is not None and here.id == shipped.id and _freshness(here) >= _freshness(shipped):
            continue
        store.get_run(SHIPPED_RUN_DIR, target)
        record = runs.TrialRecord.load(target / runs.TRIAL_FILE)
        if record is None:
            continue
        record.run_dir = str(target)
        record.save()
        if record.state == "complete" and record.objective is not None:
            runs.promote_if_best(output_dir, record)


def _freshness(record: runs.TrialRecord) -> tuple[float, bool, float]:
    """Which of two records of one trial is newer: the later run, then an ended one."""
    return record.started_at, record.state != "running", record.finished_at or 0.0
