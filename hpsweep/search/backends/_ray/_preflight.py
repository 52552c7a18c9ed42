"""What a Ray cluster must offer before any trial, checked once per command: some live node can
hold a trial (`check_resources`; Tune would wait for ever), and on several nodes each reaches
Ray's storage (`check_storage`; a node that cannot fails its trials in Tune's storage check, out
of the ledger's sight). A refusal is one line naming the node and the fix, and leaves nothing.
"""

from __future__ import annotations

import contextlib
import secrets
from pathlib import Path
from typing import Any

import pyarrow.fs
import ray

from hpsweep.errors import UserError
from hpsweep.redaction import redact_url
from hpsweep.runs.home import SCHEMES

PROBE_PREFIX = ".hpsweep-storage-check-"
# How long a node's probe may take: a worker process to start on a busy node, pyarrow to import.
PROBE_TIMEOUT_S = 60.0
STORAGE_FIX = "give --storage a path every node mounts, or s3://bucket/prefix"


def live_nodes() -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n.get("Alive")]


def autoscaling() -> bool:
    """Whether an autoscaler may add nodes: the cluster launcher leaves its config on the head."""
    return Path("~/ray_bootstrap_config.yaml").expanduser().exists()


def fits(node: dict[str, Any], resources: dict[str, float]) -> bool:
    offers = node.get("Resources", {})
    return offers.get("CPU", 0) >= resources["cpu"] and offers.get("GPU", 0) >= resources["gpu"]


def describe(resources: dict[str, float]) -> str:
    return f"cpu={resources['cpu']:g},gpu={resources['gpu']:g}"


def offers(nodes: list[dict[str, Any]]) -> str:
    return ", ".join(
        f"{n['NodeManagerAddress']} "
        + describe({"cpu": n["Resources"].get("CPU", 0), "gpu": n["Resources"].get("GPU", 0)})
        for n in nodes
    )


def check_resources(resources: dict[str, float]) -> None:
    nodes = live_nodes()
    if any(fits(n, resources) for n in nodes) or autoscaling():
        return
    raise UserError(
        f"each trial reserves {describe(resources)} (--resources-per-trial) and no node of the Ray "
        f"cluster has that much ({offers(nodes)}); add a node that has (`ray start "
        "--num-cpus N`), or give --resources-per-trial what a node offers"
    )


def check_storage(storage_path: str, given: bool) -> None:
    """On several nodes, each node runs a task pinned to it that reads a probe file the driver
    wrote there and writes its own beside it, which the driver must see; through pyarrow's
    filesystem for the path, as Tune resolves it. ``given``: the path came from ``--storage``."""
    nodes = live_nodes()
    if len(nodes) < 2:
        return
    where = (
        f"--storage {redact_url(storage_path)}"
        if given
        else f"Ray's storage {storage_path} (--output-dir/.ray, as no --storage was given)"
    )
    scheme = storage_path.split("://", 1)[0].lower() if "://" in storage_path else "file"
    if scheme not in SCHEMES:  # a node without --output-dir ships its runs through it (runs.home)
        raise UserError(
            f"{where}: hpsweep cannot ship a node's runs through {scheme}://; {STORAGE_FIX}"
        )
    try:
        fs, root = pyarrow.fs.FileSystem.from_uri(storage_path)
    except Exception as exc:  # pyarrow: an unknown scheme, a malformed URI
        raise UserError(
            f"{where}: not a path or URI Ray can use ({_line(exc)}); {STORAGE_FIX}"
        ) from None
    root = root.rstrip("/")
    token = secrets.token_hex(8)
    probe = f"{root}/{PROBE_PREFIX}{token}"
    files = [probe, *(f"{probe}-{n['NodeID']}" for n in nodes)]
    created = _missing_top(fs, root)
    try:
        try:
            fs.create_dir(root, recursive=True)
            _write(fs, probe, token)
        except Exception as exc:
            raise UserError(f"{where}: cannot write there ({_line(exc)}); {STORAGE_FIX}") from None
        bad = _probe_nodes(nodes, storage_path, probe, token, fs)
    except BaseException:
        _remove(fs, files, created)
        raise
    _remove(fs, files, created if bad else None)
    if bad:
        unreached = "; ".join(
            f"Ray node {n['NodeManagerAddress']} (id {n['NodeID'][:8]}) does not reach it ({why})"
            for n, why in bad
        )
        raise UserError(
            f"{where}: {unreached}; its trials could not keep their checkpoints; {STORAGE_FIX}"
        )


def _probe_nodes(
    nodes: list[dict[str, Any]], storage_path: str, probe: str, token: str, fs: Any
) -> list[tuple[dict[str, Any], str]]:
    """The nodes that do not reach the storage, each with why."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(reach_storage)
    refs = {
        task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(storage_path, probe, token, n["NodeID"]): n
        for n in nodes
    }
    ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
    bad = []
    for ref in late:
        ray.cancel(ref, force=True)
        bad.append((refs[ref], f"it did not answer within {PROBE_TIMEOUT_S:.0f} s"))
    for ref in ready:
        node = refs[ref]
        try:
            why = ray.get(ref)
        except Exception as exc:  # its worker could not start, or died
            why = f"its check failed: {_line(exc)}"
        if why is None and not _exists(fs, f"{probe}-{node['NodeID']}"):
            why = "what it writes there, this machine does not see"
        if why is not None:
            bad.append((node, why))
    return bad


def reach_storage(storage_path: str, probe: str, token: str, node_id: str) -> str | None:
    """On one node: read the driver's probe, write this node's beside it; why it cannot, or None."""
    try:
        fs, _ = pyarrow.fs.FileSystem.from_uri(storage_path)
        with fs.open_input_stream(probe) as f:
            seen = f.read().decode()
    except FileNotFoundError:
        return "it does not see the file this machine wrote there"
    except Exception as exc:
        return f"it cannot read what this machine wrote there: {_line(exc)}"
    if seen != token:
        return "it sees another folder at that path"
    try:
        _write(fs, f"{probe}-{node_id}", token)
    except Exception as exc:
        return f"it cannot write there: {_line(exc)}"
    return None


def _write(fs: pyarrow.fs.FileSystem, path: str, text: str) -> None:
    with fs.open_output_stream(path) as f:
        f.write(text.encode())


def _exists(fs: pyarrow.fs.FileSystem, path: str) -> bool:
    try:
        return fs.get_file_info(path).type != pyarrow.fs.FileType.NotFound
    except OSError:
        return False


def _missing_top(fs: pyarrow.fs.FileSystem, path: str) -> str | None:
    """The outermost missing folder of ``path`` (None: it exists), removed again after the check."""
    top = None
    while path and not _exists(fs, path):
        top, parent = path, path.rsplit("/", 1)[0]
        if parent == path or not parent:
            break
        path = parent
    return top


def _remove(fs: pyarrow.fs.FileSystem, files: list[str], folder: str | None) -> None:
    for path in files:
        with contextlib.suppress(OSError):  # never written
            fs.delete_file(path)
    if folder is not None:
        with contextlib.suppress(OSError):
            fs.delete_dir(folder)


def _line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
