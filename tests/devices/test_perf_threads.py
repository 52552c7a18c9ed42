"""A trial's torch threads: the cores the process may use, split between the trials running at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from support import hpsweep_cli, write_space

from hpsweep import devices, runs
from hpsweep.devices import threads


def split(parallel: int) -> int:
    """The threads each of ``parallel`` ``--n-jobs`` workers gets on this machine."""
    return devices.plan(
        n_jobs=parallel, resources=None, gpus=[], cores=devices.usable_cores()
    ).threads


def test_threads_split_the_usable_cores_between_parallel_trials() -> None:
    # no CPU quota on this machine's cgroup
    cores = min(len(os.sched_getaffinity(0)), torch.get_num_threads())
    assert devices.usable_cores() == cores
    for parallel in (1, 2, 3, cores, 4 * cores):
        n = split(parallel)
        assert n == max(1, cores // parallel)
        assert n * parallel <= cores or n == 1  # never more than a fair share, never zero


def test_a_process_pinned_to_one_core_gets_one_thread() -> None:
    # What `taskset -c 0 hpsweep run ... --n-jobs 1` or a one-CPU cpuset does: torch would still see every core.
    code = (
        "import os, torch; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
        "from hpsweep import devices; "
        "devices.apply(devices.plan(n_jobs=1, resources=None, gpus=[], cores=devices.usable_cores()), 0); "
        "print(torch.get_num_threads())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["1"]


def test_a_cgroup_cpu_quota_caps_the_cores(tmp_path: Path) -> None:
    # The files a container runtime writes for `docker --cpus 1.5` (cgroup v2, then v1).
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads._cgroup_cpu_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads._cgroup_cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads._cgroup_cpu_quota(tmp_path) == 0.5
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert threads._cgroup_cpu_quota(tmp_path) is None


# --- other load: a trial's threads leave the cores other processes keep busy -------------------------

BUSY = "while True:\n    pass\n"


def _trial_threads(out: Path) -> list[int]:
    return [r.user_attrs["threads"] for r in runs.read_trials(out)]


def _busy_processes(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(n)]


def test_a_sweep_beside_busy_processes_gives_its_trials_the_free_cores(tmp_path: Path) -> None:
    # A user's sweep started while other work keeps all cores but one busy: torch alone would give
    # each trial one thread per core, which then wait for each other behind the busy processes
    # (a digits sweep: 2.2-2.5x slower, bench/other_load.py). The threads are what the trials ran with.
    cores = devices.usable_cores()
    env = {k: v for k, v in os.environ.items() if k != devices.THREADS_ENV}
    space = write_space(tmp_path, epochs=3)
    busy = _busy_processes(cores - 1)
    try:
        time.sleep(1.0)
        hpsweep_cli("run", space, "--n-trials", "4", env=env, check=True)
        pinned = tmp_path / "pinned"
        hpsweep_cli(
            "run",
            space,
            "--n-trials",
            "2",
            "--output-dir",
            pinned,
            "--resources-per-trial",
            f"cpu={cores}",
            env=env,
            check=True,
        )
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert _trial_threads(tmp_path / "out") == [1, 1, 1, 1]  # cores - (cores - 1) busy
    # cpu=N pins the threads whatever the load, as OMP_NUM_THREADS does (the user's or a scheduler's).
    assert _trial_threads(pinned) == [cores, cores]


def test_the_environment_pins_the_threads_and_a_placement_says_so() -> None:
    env = dict(os.environ)
    try:
        os.environ.pop(devices.THREADS_ENV, None)
        assert not devices.plan(n_jobs=1, resources=None, gpus=[], cores=4).pinned
        assert devices.plan(n_jobs=1, resources={"cpu": 2}, gpus=[], cores=4).pinned
        os.environ[devices.THREADS_ENV] = "3"
        assert devices.plan(n_jobs=2, resources=None, gpus=[], cores=4).pinned
    finally:
        os.environ.clear()
        os.environ.update(env)


def test_core_share_measures_the_other_processes_load() -> None:
    cores = devices.usable_cores()
    share = devices.CoreShare(cores, min_window=0.3)
    share.threads()  # the first decision, on the load before the busy processes
    busy = _busy_processes(cores - 1)
    try:
        time.sleep(0.5)
        loaded = share.threads()  # on the load since
        assert loaded == max(1, cores - (cores - 1)) == 1
        # A resumed trial keeps the threads it started with (its sums then match its first part's),
        # at most the ceiling.
        assert share.threads(resumed_with=cores) == cores
        assert share.threads(resumed_with=cores + 5) == cores
    finally:
        for p in busy:
            p.kill()
            p.wait()
    # Windows shorter than min_window keep the last decision; a long enough one decides again.
    assert share.threads() == loaded
    time.sleep(0.4)
    assert 1 <= share.threads() <= cores
    assert devices.CoreShare(1).threads() == 1  # one core's share needs no measuring


def test_the_busy_time_of_the_cores_and_of_a_cgroup_is_read(tmp_path: Path) -> None:
    # /proc/stat's counters only grow, and this process's own CPU time is part of them.
    first = threads._cores_busy(None)
    spin = time.process_time() + 0.2
    while time.process_time() < spin:
        pass
    assert first is not None and threads._cores_busy(None) - first >= 0.15
    # cgroup v2's cpu.stat (under a `docker --cpus` quota the cgroup's usage is what competes with us)
    (tmp_path / "cpu.stat").write_text(
        "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n"
    )
    assert threads._cgroup_busy(tmp_path) == 2.5
    assert threads._cgroup_busy(tmp_path / "missing") is None


def test_a_resumed_trial_starts_with_the_threads_it_had(tmp_path: Path) -> None:
    from hpsweep.search.trial_runner import _started_with

    run_dir = tmp_path / "run-0"
    record = runs.TrialRecord(
        id="0",
        number=0,
        backend="optuna",
        params={},
        objective_name="eval_loss",
        directions=["minimize"],
        run_dir=str(run_dir),
        user_attrs={"threads": 1, "processes": 2},
    )
    run_dir.mkdir()
    latest = lambda: runs.latest_checkpoint(run_dir)  # noqa: E731 - as the runner reads it
    # no checkpoint: it starts again from scratch, on today's share
    assert _started_with(record, latest()) is None
    (run_dir / "checkpoint-5").mkdir()
    # the model alone (save_only_model): it starts again too
    assert _started_with(record, latest()) is None
    (run_dir / "checkpoint-5" / "optimizer.pt").touch()
    assert _started_with(record, latest()) == 2 and _started_with(None, None) is None
