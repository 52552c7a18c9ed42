"""CPU threads for trials: each trial's share of the cores, less what other processes keep busy.

torch alone gives every process one thread per physical core: two trials on two cores then run
four busy threads that wait for each other (2.2x slower, ``bench/threads.py``). `plan`
(`hpsweep.devices.placement`) splits the usable cores between the trials that run at once;
`CoreShare` then lowers a trial's share by the cores other processes kept busy while the trials
before it ran, and a trial that resumes keeps the threads it was started with, so that its resume
stays bit for bit (torch's sums depend on the thread count).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import NamedTuple


def usable_cores() -> int:
    """The CPU threads this process may use: its CPU affinity (``taskset``, cpusets), capped by a
    cgroup CPU quota (``docker --cpus``, Kubernetes limits) and by torch's own default (physical
    cores) or what the user set with ``torch.set_num_threads``. At least 1."""
    import torch

    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, math.floor(quota))
    return max(1, min(cores, torch.get_num_threads()))


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


def threads_per_process(processes: int) -> int:
    """A trial's share of torch threads (this process's) for each of its ``processes``."""
    import torch

    return max(1, torch.get_num_threads() // processes)


#: This process's `CoreShare` while it is placed to run trials (`apply`); None elsewhere (a Ray
#: worker, whose CPUs Ray reserves; a plain ``Trainer.train``): trials there keep their threads.
_share: CoreShare | None = None


def threads_for_trial(resumed_with: int | None = None) -> int:
    """Set and return the torch threads of the trial this process starts now (see `CoreShare`).
    ``resumed_with``: the threads (all processes') the trial had when it started, for a trial that
    resumes from its checkpoint."""
    import torch

    if _share is not None:
        torch.set_num_threads(_share.threads(resumed_with))
    return torch.get_num_threads()


class CoreShare:
    """The threads each trial of a placed process gets: its share of the cores (``ceiling``) less
    the cores other processes kept busy since the last decision.

    The load is measured, not guessed: busy CPU time of the cores this process may use (Linux's
    ``/proc/stat``; under a cgroup CPU quota, the cgroup's ``cpu.stat`` against the quota), less
    this process's own and its finished children's, over the wall time between samples. Windows
    shorter than ``min_window`` seconds (trials of a fraction of a second) are added up until they
    are long enough, the trials meanwhile keeping the last decision. The first window runs from
    the import of this module (a command's start-up) when that is recent, and lasts at least
    `FIRST_WINDOW` (0.2 s, waited for when the first trial starts sooner). A decision rounds down
    unless a core is at least three quarters free: an oversubscribed core costs more (two threads
    beside one busy process: 2.2-2.5x) than an idle one. Where nothing can be measured (no
    ``/proc``), trials get the ceiling.
    """

    def __init__(
        self, ceiling: int, *, min_window: float = 0.5, cgroup: Path = Path("/sys/fs/cgroup")
    ) -> None:
        self.ceiling, self.min_window = max(1, ceiling), min_window
        quota = _cgroup_cpu_quota(cgroup)
        self._cgroup = cgroup if quota is not None else None
        self._cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        self.capacity = (
            quota
            if quota is not None
            else float(len(self._cpus) if self._cpus else os.cpu_count() or 1)
        )
        started = _STARTED
        recent = (
            started is not None
            and self._cgroup is None
            and started.pid == os.getpid()
            and time.monotonic() - started.wall < FIRST_WINDOW_STALE
        )
        self._since = started if recent else None
        self._threads, self._decided = self.ceiling, False
        self._measurable = self._sample() is not None

    def threads(self, resumed_with: int | None = None) -> int:
        """The threads for a trial starting now; a resumed trial's own (``resumed_with``) win."""
        if resumed_with:
            return max(1, min(resumed_with, self.ceiling))
        if self.ceiling == 1 or not self._measurable:
            return self.ceiling
        since = self._since = self._since or self._sample()
        now = self._sample()
        if since is None or now is None:
            return self.ceiling
        # the first decision's shortest window
        if not self._decided and now.wall - since.wall < FIRST_WINDOW:
            time.sleep(FIRST_WINDOW - (now.wall - since.wall))
            now = self._sample() or now
        wall = now.wall - since.wall
        if not self._decided or wall >= self.min_window:  # later ones add up to min_window
            other = max(0.0, (now.busy - since.busy) - (now.own - since.own)) / wall
            self._threads = max(1, min(self.ceiling, math.floor(self.capacity - other + 0.25)))
            self._since, self._decided = now, True
        return self._threads

    def _sample(self) -> _Sample | None:
        return _sample(self._cgroup, self._cpus)


#: The first decision's window: from this module's import when that is this recent (seconds), and
#: at least this long (a sample taken then, when the trial starts sooner).
FIRST_WINDOW_STALE, FIRST_WINDOW = 30.0, 0.2


class _Sample(NamedTuple):
    wall: float  # time.monotonic()
    pid: int  # the process that took it (a forked worker's first window is its own)
    busy: float  # CPU seconds the cores (or the cgroup) were busy, whichever process ran
    own: float  # this process's CPU seconds and its finished children's


def _sample(cgroup: Path | None, cpus: set[int] | None) -> _Sample | None:
    """The counters now, or None where the busy time cannot be read."""
    busy = _cgroup_busy(cgroup) if cgroup is not None else _cores_busy(cpus)
    if busy is None:
        return None
    t = os.times()
    return _Sample(
        time.monotonic(), os.getpid(), busy, t.user + t.system + t.children_user + t.children_system
    )


def _cores_busy(cpus: set[int] | None, stat: Path = Path("/proc/stat")) -> float | None:
    """CPU seconds the ``cpus`` (all: None) spent busy since boot, whichever process ran."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if (
            name.startswith("cpu")
            and name[3:].isdigit()
            and (cpus is None or int(name[3:]) in cpus)
        ):
            # user nice system idle iowait irq softirq steal
            fields = [int(v) for v in rest.split()[:8]]
            ticks += sum(fields) - fields[3] - fields[4]
    return ticks / os.sysconf("SC_CLK_TCK")


def _cgroup_busy(root: Path) -> float | None:
    """CPU seconds every process of this cgroup (v2) used: what competes for its CPU quota."""
    try:
        for line in (root / "cpu.stat").read_text().splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e6
    except (OSError, ValueError):
        pass
    return None


#: The counters at the start of the command or search (`note_start`): its first trial measures
#: the load since then.
_STARTED: _Sample | None = None


def note_start() -> None:
    """Take the first load window's sample now: called where a command or a search starts, so
    that its first trial's threads are decided over the seconds of start-up before it (the load
    other processes kept on the cores meanwhile), not over a fresh 0.2 s window."""
    global _STARTED
    fresh = _STARTED is not None and _STARTED.pid == os.getpid()
    if not fresh or time.monotonic() - _STARTED.wall >= FIRST_WINDOW_STALE:
        _STARTED = _sample(
            None, os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        )


def share_cores(ceiling: int | None) -> CoreShare | None:
    """From now on, trials this process starts take their threads from a `CoreShare` of
    ``ceiling`` cores (None: they keep the threads they have). Returns the share it replaces."""
    global _share
    previous, _share = _share, (CoreShare(ceiling) if ceiling is not None else None)
    return previous


def restore_share(previous: CoreShare | None) -> None:
    """Put back the share `share_cores` returned."""
    global _share
    _share = previous
