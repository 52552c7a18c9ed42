"""A trial's torch threads: the cores the process may use, split between the trials running at once."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from hpsweep import devices


def split(parallel: int) -> int:
    """The threads each of ``parallel`` ``--n-jobs`` workers gets on this machine."""
    return devices.plan(n_jobs=parallel, resources=None, gpus=[], cores=devices.usable_cores()).threads


def test_threads_split_the_usable_cores_between_parallel_trials() -> None:
    cores = min(len(os.sched_getaffinity(0)), torch.get_num_threads())  # no CPU quota on this machine's cgroup
    assert devices.usable_cores() == cores
    for parallel in (1, 2, 3, cores, 4 * cores):
        n = split(parallel)
        assert n == max(1, cores // parallel)
        assert n * parallel <= cores or n == 1  # never more than a fair share, never zero


def test_a_process_pinned_to_one_core_gets_one_thread() -> None:
    # What `taskset -c 0 hpsweep run ... --n-jobs 1` or a one-CPU cpuset does: torch would still see every core.
    code = ("import os, torch; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
            "from hpsweep import devices; "
            "devices.apply(devices.plan(n_jobs=1, resources=None, gpus=[], cores=devices.usable_cores()), 0); "
            "print(torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1"]


def test_a_cgroup_cpu_quota_caps_the_cores(tmp_path: Path) -> None:
    # The files a container runtime writes for `docker --cpus 1.5` (cgroup v2, then v1).
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert devices._cgroup_cpu_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert devices._cgroup_cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert devices._cgroup_cpu_quota(tmp_path) == 0.5
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert devices._cgroup_cpu_quota(tmp_path) is None
