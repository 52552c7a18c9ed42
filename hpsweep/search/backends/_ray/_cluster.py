"""Where Ray trials run, for the Ray Tune backend: joining a cluster or starting a local Ray, and
carrying run folders from nodes that do not see ``--output-dir``.

A private helper of the Ray Tune backend `hpsweep.search.backends._ray` (with `._trial`, the code
that runs on the workers); nothing here decides what to try.

- `connected` joins ``--address`` (checked first, so a wrong address is one line within seconds,
  not minutes of Ray's retries) or starts a local Ray, with Ray's token authentication (its
  processes listen on every interface), that dies with the command: a ``kill -9`` of the
  command takes its Ray processes along (see `_WATCHDOG`).
- `NodeLocalRuns`: a trial on a node that does not see the driver's ``--output-dir`` writes a
  node-local run folder and ships it through Ray's storage; `collect_shipped_runs` copies it into
  ``--output-dir`` on the driver when the Tune round ends.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import math
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray

from hpsweep import runs
from hpsweep.errors import UserError

CONNECT_TIMEOUT_S = 3.0
#: Ray's switch for token authentication (see `_restore_auth_mode`).
AUTH_MODE_ENV = "RAY_AUTH_MODE"
# In --output-dir: a file per command, named by a token, by which a worker tells whether it sees the
# driver's folder (one per command: two commands may share the folder).
MARKER_PREFIX = ".hpsweep-ray-marker-"
# A trial's run folder, shipped from a node without --output-dir, in the trial's folder in Ray's storage.
SHIPPED_RUN_DIR = "hpsweep-run"
# On a worker: write run folders under this node-local folder even when --output-dir is visible
# (a node without the shared mount, as tests simulate it).
LOCAL_RUNS_ENV = "HPSWEEP_RAY_LOCAL_RUNS"
# Set on the workers: with reuse_actors, how long reset_config() waits for a stopped trial to record itself.
WORKER_ENV = {"TUNE_FUNCTION_THREAD_TIMEOUT_S": "60", "RAY_DEDUP_LOGS": "1"}

# Quiet Ray's console and skip work hpsweep does not need (per-trial CSV/JSON/TensorBoard
# loggers, usage reporting); users may still override each of these in their environment.
# Tune's strict metric check is off because hpsweep itself reports results without the objective
# (a failed trial, a user error), on purpose.
QUIET_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "TUNE_DISABLE_AUTO_CALLBACK_LOGGERS": "1",
    "RAY_AIR_NEW_OUTPUT": "0",
    "TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S": "100000",
    "RAY_DEDUP_LOGS": "1",
    "RAY_TRAIN_V2_ENABLED": "0",
    "TUNE_DISABLE_STRICT_METRIC_CHECKING": "1",
}


# --- connecting -------------------------------------------------------------------------------------


@contextlib.contextmanager
def connected(address: str | None, cpus: float) -> Iterator[None]:
    """Join ``address`` (auto, HOST:PORT, ray://HOST:10001) or start a local Ray with at least
    ``cpus`` CPUs; a Ray the caller connected already is used as it is and left running."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    if ray.is_initialized():  # a Python API user connected already
        yield
        return
    kwargs: dict[str, Any] = dict(
        logging_level=logging.ERROR,
        log_to_driver=False,
        configure_logging=True,
        runtime_env={"env_vars": dict(WORKER_ENV)},
    )
    if address is not None:
        _join(address, kwargs)
        try:
            yield
        finally:
            ray.shutdown()
        return
    auth_mode, watchdog = os.environ.get(AUTH_MODE_ENV), None
    try:
        watchdog = _start_local(cpus, kwargs, auth_mode)
        yield
    finally:
        ray.shutdown()
        _restore_auth_mode(auth_mode)
        if watchdog is not None:
            watchdog.stdin.close()  # type: ignore[union-attr]  # the watchdog reaps what shutdown left
            watchdog.wait()


def _join(address: str, kwargs: dict[str, Any]) -> None:
    """Join the cluster at ``address``, checked first; a failure is one line."""
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
    """Start a Ray on this machine; returns its watchdog (`_WATCHDOG`).

    Its GCS, raylet and workers listen on every interface, whatever node address they are
    given, so it runs with Ray's token authentication, Ray's own default for a new local
    cluster, also where ``RAY_AUTH_MODE=disabled`` is set (for another cluster): a request
    without the token (``~/.ray/auth_token``, which Ray writes if missing, or ``RAY_AUTH_TOKEN``)
    is refused. `_restore_auth_mode` puts the setting back after the sweep."""
    if (auth_mode or "").lower() != "token":
        os.environ.pop(AUTH_MODE_ENV, None)  # unset: Ray switches it on for a new local cluster
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, math.ceil(cpus)),
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        **kwargs,
    )
    return _start_watchdog()


def _restore_auth_mode(before: str | None) -> None:
    """Undo what a local ``ray.init()`` leaves in the process. Ray 2.60 turns token
    authentication on for a new local cluster (``RAY_AUTH_MODE=token`` in ``os.environ``, the
    token cached in the process; `_start_local` clears a ``disabled`` first), and
    ``ray.shutdown()`` keeps both. A later
    ``ray.init(address=...)`` in the same process, on a cluster without token authentication
    (the next sweep, a Ray client server), then starts a driver whose RPC server wants a token
    the cluster never sends: the cluster takes every actor the driver owns for unreferenced and
    cancels it ("The actor never ran - it was cancelled before it started running"), and each
    trial of that sweep fails."""
    if os.environ.get(AUTH_MODE_ENV) == before:
        return
    if before is None:
        os.environ.pop(AUTH_MODE_ENV, None)
    else:
        os.environ[AUTH_MODE_ENV] = before
    with contextlib.suppress(Exception):  # refreshed as Ray's own token setup does
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


# Ray's local processes mostly die with the driver: the raylet and its workers at once, but its
# dashboard and runtime-env agents wait about a minute on the dead GCS first. This watchdog, a
# child of the driver in a session of its own, remembers the driver's Ray processes and stops them
# when its pipe from the driver closes: at the end of the sweep, or when the driver died (kill -9,
# of the command or its process group, the OOM killer).
_WATCHDOG = r"""
import os, select, signal, sys
import psutil

signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C is the driver's to handle
signal.signal(signal.SIGTERM, signal.SIG_IGN)
driver, session = psutil.Process(int(sys.argv[1])), sys.argv[2]
seen = {}

def look():
    try:
        children = driver.children(recursive=True)
    except psutil.Error:
        return
    for p in children:
        try:
            name = p.name()
            ray_process = name.startswith("ray::") or name in ("raylet", "gcs_server") or \
                (session and session in " ".join(p.cmdline()))
            if ray_process and p.pid != os.getpid():
                seen.setdefault(p.pid, p)
        except psutil.Error:
            pass

while True:
    look()
    if select.select([sys.stdin], [], [], 1.0)[0] and not sys.stdin.buffer.read1(1):
        break
alive = [p for p in seen.values() if p.is_running()]
for p in alive:
    try:
        p.terminate()
    except psutil.Error:
        pass
for p in psutil.wait_procs(alive, timeout=3)[1]:
    try:
        p.kill()
    except psutil.Error:
        pass
"""


def _start_watchdog() -> subprocess.Popen | None:
    try:
        session = ray._private.worker.global_worker.node.get_session_dir_path()
    except Exception:  # a private API: without it the watchdog goes by process names alone
        session = ""
    try:
        return subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(os.getpid()), session],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a kill of the command's process group spares it
        )
    except OSError:
        return None


def check_reachable(address: str) -> None:
    """Fail within seconds when nothing listens at ``address`` (Ray itself would retry for minutes)."""
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS") or _current_cluster() or ""
        if not address:
            raise UserError(
                "--address auto: no Ray cluster runs on this machine; start one with "
                "`ray start --head`, or give --address HOST:PORT"
            )
        if address.startswith("ray://") or ":" not in address:
            return
    target = address.split("://", 1)[-1]
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--address {address!r} is not auto, HOST:PORT or ray://HOST:10001")
    try:
        speaks_grpc = _speaks_grpc(host, int(port))
    except OSError as exc:
        raise UserError(
            f"--address {address}: no Ray cluster answers there ({exc.strerror or type(exc).__name__}); "
            "check the address, that the head node runs (`ray status`) and that its port is open"
        ) from None
    if not speaks_grpc:  # ray.init would wait on it for minutes
        raise UserError(
            f"--address {address}: something listens there but it is not a Ray cluster (no gRPC "
            "answer); give the head node's GCS port (`ray status` on the head prints it, 6379 by "
            "default) or ray://HOST:10001"
        )


# + an empty SETTINGS frame
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def _speaks_grpc(host: str, port: int) -> bool:
    """Whether ``host:port`` answers like a gRPC server (Ray's GCS and Ray Client are both gRPC):
    an HTTP/2 server's first frame is SETTINGS. Raises OSError when nothing accepts the connection."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return True  # the server waits for a TLS hello, not a preface: an open port is all we check
    with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S) as sock:
        sock.settimeout(CONNECT_TIMEOUT_S)
        header = b""
        try:
            sock.sendall(_H2_PREFACE)
            while len(header) < 9:
                chunk = sock.recv(9 - len(header))
                if not chunk:
                    break
                header += chunk
        except OSError:  # silence until the timeout, or a reset: not gRPC
            return False
    return len(header) == 9 and header[3] == 0x04


def _current_cluster() -> str | None:
    try:
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


def pickle_space_modules_by_value(user_objects: Any = ()) -> None:
    """Space files are imported under synthetic module names that workers cannot import: ship them
    (and helper modules imported from their folder) by value. So are the modules of an API user's
    own code (``user_objects``: model_init, hp_space, the args and trainer classes, ...) that are
    not installed packages: a worker's Python need not find a script's or a test's folder."""
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
        if (
            module is None
            or not file
            or module.__name__ == "__main__"
            or _installed(file)
            or module.__name__.split(".")[0] == "hpsweep"
        ):
            continue
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
    """Whether ``file`` belongs to an installed package or the standard library (workers import those)."""
    return "site-packages" in file or "dist-packages" in file or file.startswith(sys.base_prefix)


# --- nodes without --output-dir ---------------------------------------------------------------------


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
    """Whether this node sees the driver's ``--output-dir`` (and may write and lock there)."""
    return not os.environ.get(LOCAL_RUNS_ENV) and (output_dir / f"{MARKER_PREFIX}{marker}").exists()


def stop_file(output_dir: Path, marker: str) -> Path:
    """Written by the driver when it stops a round (Ctrl-C, SIGTERM, a user error): Tune stops a
    trial the same way whether its scheduler prunes it or the sweep stops, and a trial that finds
    this file knows that it was cut short, not pruned."""
    return output_dir / f"{MARKER_PREFIX}{marker}.stop"


class NodeLocalRuns:
    """A trial's run folder on a node without ``--output-dir``, shipped through Ray's storage.

    The trial trains into ``<HPSWEEP_RAY_LOCAL_RUNS or the temp dir>/hpsweep-<experiment>-<token>/<trial id>/``
    (its own ``--output-dir`` there); when it ends, its run folder replaces
    ``<trial folder in Ray's storage>/hpsweep-run/`` and the node-local copy is deleted. A trial that
    starts again on such a node (a Tune retry, a PBT exploit, a trial run again after the command
    was stopped) first gets back the folder it shipped last, if it shipped one.
    """

    def __init__(self, runner: Any, marker: str, ctx: Any) -> None:
        job = runner.job
        experiment = runs.safe_name(ctx.get_experiment_name(), "sweep")
        base = os.environ.get(LOCAL_RUNS_ENV) or tempfile.gettempdir()
        self.folder = (
            Path(base).resolve() / f"hpsweep-{experiment}-{marker[:12]}" / ctx.get_trial_id()
        )
        self.runner = copy.copy(runner)
        self.runner.job = dataclasses.replace(
            job, args=job.args.replace(output_dir=str(self.folder))
        )
        storage = ctx.get_storage()
        self.fs = storage.storage_filesystem
        self.remote = f"{storage.trial_fs_path.rstrip('/')}/{SHIPPED_RUN_DIR}"

    def fetch(self, remote: str | None = None) -> runs.TrialRecord | None:
        """Bring back the run folder shipped to ``remote`` (default: this Tune trial's), if any;
        returns its record, pointing at the node-local copy."""
        from ray.train._internal.storage import _download_from_fs_path

        shutil.rmtree(self.folder, ignore_errors=True)  # a leftover of a worker that died mid-trial
        remote = remote or self.remote
        record = remote_record(self.fs, remote)
        if record is not None:
            record.run_dir = str(
                self.folder / runs.safe_name(Path(record.run_dir).name, f"run-{record.id}")
            )
            _download_from_fs_path(self.fs, remote, record.run_dir, filelock=False)
            record.save()  # with this node's path
        return record

    def ship(self, run_dir: Path) -> None:
        from ray.train._internal import storage as ray_storage

        try:
            record = runs.TrialRecord.load(run_dir / runs.TRIAL_FILE)
            if record is None:
                return  # nothing was recorded (a UserError before training): nothing to ship
            record.user_attrs.update(ray_shipped_from=record.run_dir, ray_shipped_to=self.remote)
            record.save()
            if ray_storage._exists_at_fs_path(self.fs, self.remote):
                # drop checkpoints rotated away since the last trip
                ray_storage._delete_fs_path(self.fs, self.remote)
            # trial.json last: whoever sees it in Ray's storage sees the whole folder (`shipped_record`)
            for entry in sorted(Path(record.run_dir).iterdir()):
                if entry.name != runs.TRIAL_FILE:
                    ray_storage._upload_to_fs_path(
                        str(entry), self.fs, f"{self.remote}/{entry.name}"
                    )
            ray_storage._upload_to_fs_path(
                str(Path(record.run_dir) / runs.TRIAL_FILE),
                self.fs,
                f"{self.remote}/{runs.TRIAL_FILE}",
            )
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
            with contextlib.suppress(OSError):
                self.folder.parent.rmdir()  # the sweep's folder on this node, once its last trial ended


def remote_record(fs: Any, remote: str) -> runs.TrialRecord | None:
    """The trial.json a trial shipped to ``remote`` (a folder in Ray's storage), if any."""
    try:
        with fs.open_input_stream(f"{remote}/{runs.TRIAL_FILE}") as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return None
    known = {k: v for k, v in data.items() if k in runs.TrialRecord.__dataclass_fields__}
    try:
        return runs.TrialRecord(**known)
    except TypeError:
        return None


def _freshness(record: runs.TrialRecord) -> tuple[float, bool, float]:
    """Which of two records of one trial is newer: the later run, then an ended one."""
    return record.started_at, record.state != "running", record.finished_at or 0.0


def _shipped_to(tune_trial: Any) -> tuple[Any, str] | None:
    """(filesystem, path) of the folder in Ray's storage ``tune_trial`` ships its run to."""
    storage = tune_trial.storage
    if storage is None or not storage.trial_dir_name:  # a trial that never started has no folder
        return None
    return storage.storage_filesystem, f"{storage.trial_fs_path.rstrip('/')}/{SHIPPED_RUN_DIR}"


def shipped_record(tune_trial: Any) -> runs.TrialRecord | None:
    """The record ``tune_trial`` shipped through Ray's storage from a node without ``--output-dir``, if any."""
    where = _shipped_to(tune_trial)
    return remote_record(*where) if where else None


def collect_shipped_runs(tune_trials: list[Any], output_dir: Path) -> None:
    """Copy the run folders that ``tune_trials`` on nodes without ``--output-dir`` shipped through
    Ray's storage into ``--output-dir`` (unless it holds a newer record of the trial), and promote them."""
    from ray.train._internal.storage import _download_from_fs_path

    for tune_trial in tune_trials:
        where = _shipped_to(tune_trial)
        shipped = remote_record(*where) if where else None
        if shipped is None:
            continue
        fs, remote = where
        target = runs.run_dir_for(output_dir, shipped.id, Path(shipped.run_dir).name)
        here = runs.TrialRecord.load(target / runs.TRIAL_FILE)
        if here is not None and here.id == shipped.id and _freshness(here) >= _freshness(shipped):
            continue
        with runs.atomic_dir(target) as tmp:
            _download_from_fs_path(fs, remote, str(tmp), filelock=False)
        record = runs.TrialRecord.load(target / runs.TRIAL_FILE)
        if record is None:
            continue
        record.run_dir = str(target)
        record.save()
        if record.state == "complete" and record.objective is not None:
            runs.promote_if_best(output_dir, record)
