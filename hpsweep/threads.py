"""How many threads a trial's torch may use: the cores this process may run on, shared out.

torch sizes its intra-op pool from the machine's core count, not from what the process is allowed
or from how many trials share the cores. Two trials on two cores then run four busy threads that
wait for each other at every operator; a trial under CPU contention was measured 5-10x slower with
the default than with one thread (bench/threads.py).

    >>> import torch
    >>> from hpsweep.threads import trial_threads
    >>> torch.set_num_threads(trial_threads(parallel_trials=2))
"""
from __future__ import annotations

import math
import os
from pathlib import Path


def usable_cores() -> int:
    """Cores this process may use: its CPU affinity (``taskset``, cpusets), further capped by a
    cgroup CPU quota (``docker --cpus``, Kubernetes limits) when one is set. At least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS and Windows have no affinity call
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, math.floor(quota)))
    return max(1, cores)


def trial_threads(parallel_trials: int = 1, processes_per_trial: int = 1) -> int:
    """torch intra-op threads for each of ``parallel_trials`` trials running at once on this
    machine, each with ``processes_per_trial`` processes: the usable cores divided evenly,
    rounded down, never more than that and never fewer than 1."""
    if parallel_trials < 1 or processes_per_trial < 1:
        raise ValueError(f"parallel_trials={parallel_trials}, processes_per_trial={processes_per_trial}: "
                         "give at least 1 of each")
    return max(1, usable_cores() // (parallel_trials * processes_per_trial))


def set_trial_threads(parallel_trials: int = 1, processes_per_trial: int = 1) -> int:
    """Set torch's intra-op threads with `trial_threads` and return the number set (call it in
    each worker process before its first trial)."""
    import torch

    threads = trial_threads(parallel_trials, processes_per_trial)
    torch.set_num_threads(threads)
    return threads


def _cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota in cores, or None when there is none (or no cgroup file to read)."""
    try:  # cgroup v2: "max 100000" or "150000 100000"
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None
