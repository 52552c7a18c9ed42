"""Where trials run: the GPUs each trial sees, how many trials run at once, CPU threads.

`plan` turns ``--n-jobs``, ``--resources-per-trial`` and ``--processes-per-trial`` into a
`Placement` before anything starts, or refuses in one `UserError` line. The search loop then
applies one slot of it in each ``--n-jobs`` worker (`placed`) before CUDA initialises there:
CUDA reads ``CUDA_VISIBLE_DEVICES`` once, when a process first touches a GPU. The rules are the
same on every backend (Ray reserves the same ``resources`` itself):

- ``gpu=F`` per trial. F < 1 packs ``floor(1/F)`` trials on one GPU (``gpu=0.5``: two share one);
  a whole F gives each trial F GPUs of its own. Default: one GPU per process of a trial where
  CUDA sees a GPU, else 0. ``gpu=0`` on a machine with GPUs hides them, as Ray does.
- ``--processes-per-trial N`` with GPUs puts each process on its own GPU (NCCL cannot share one),
  so F must be N.
- More trials than the GPUs hold (``--n-jobs 4``, ``gpu=1``, 2 GPUs): as many run at once as fit
  and the rest queue, as on Ray; one note says so. A trial that cannot fit at all (``gpu=2`` on
  one GPU) is refused.
- CPU threads: ``cpu=N`` gives each trial N threads (at most the cores); otherwise the cores are
  split between the trials that run at once. A trial's threads are split between its processes.
  torch alone would give every process one thread per core of the machine: two trials on two
  cores then run four busy threads that wait for each other (2.2x slower, bench/threads.py).
- Other load: unless ``cpu=N`` or ``OMP_NUM_THREADS`` pins them, each trial's threads are its
  share less the cores that other processes kept busy while the trials before it ran
  (`CoreShare`): beside one busy process on two cores, a trial's two threads made a digits sweep
  2.2-2.5x slower than one thread. A trial that resumes from a checkpoint keeps the threads it
  was started with, so its resume stays bit for bit (torch's sums depend on the thread count).

Tests fake the GPU count with ``HPSWEEP_FAKE_GPUS=N``: planning, placement and the records are
real; the training itself runs on the CPU.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from .errors import UserError

FAKE_GPUS_ENV = "HPSWEEP_FAKE_GPUS"
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
THREADS_ENV = "OMP_NUM_THREADS"
RESOURCE_NAMES = ("cpu", "gpu")


def visible_gpus() -> list[str]:
    """The GPUs this process may use, by the ids ``CUDA_VISIBLE_DEVICES`` names them with.

    Counted through NVML (``torch.cuda.device_count``), which does not initialise CUDA, so
    processes forked afterwards can still use the GPUs.
    """
    fake = os.environ.get(FAKE_GPUS_ENV)
    if fake is not None:
        if not fake.isdigit():
            raise UserError(
                f"{FAKE_GPUS_ENV}={fake!r}: give a whole number of GPUs to pretend (tests only), or unset it"
            )
        count = int(fake)
    else:
        import torch

        count = torch.cuda.device_count()
    if count <= 0:
        return []
    visible = os.environ.get(VISIBLE_ENV)
    if visible is None:
        return [str(i) for i in range(count)]
    # A scheduler (Slurm, Ray, a user) restricted us already: hand out from its list, in its terms.
    return [v.strip() for v in visible.split(",") if v.strip()][:count]


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


@dataclass(frozen=True)
class Placement:
    """Where the trials of one search run.

    Attributes:
        slots: trials that run at once here (the ``--n-jobs`` workers; fewer when the GPUs hold fewer).
        gpus: per slot, the GPU ids its trials see; None where no GPU is in play (a CPU machine).
        threads: torch threads for each trial (its data-parallel processes share them).
        processes_per_trial: data-parallel processes per trial.
        resources: ``--resources-per-trial`` with the GPU default filled in (what Ray reserves).
        note: one line for the user when fewer trials run at once than ``--n-jobs`` asked.
        pinned: ``threads`` hold whatever the load (``cpu=N``, or ``OMP_NUM_THREADS`` set by the
            user or a scheduler); otherwise a trial gets fewer while other processes keep cores busy.
    """

    slots: int
    gpus: tuple[tuple[str, ...], ...] | None
    threads: int
    processes_per_trial: int = 1
    resources: dict[str, float] = field(default_factory=dict)
    note: str | None = None
    pinned: bool = False

    def env(self, slot: int) -> dict[str, str]:
        """The environment a worker of ``slot`` runs its trials with."""
        env = {THREADS_ENV: str(self.threads)}  # for the processes it starts (loader workers)
        if self.gpus is not None:
            env[VISIBLE_ENV] = ",".join(self.gpus[slot % len(self.gpus)])
        return env


def plan(
    *,
    n_jobs: int,
    resources: Mapping[str, float] | None,
    processes_per_trial: int = 1,
    gpus: list[str],
    cores: int,
    local: bool = True,
) -> Placement:
    """Check a search's device request and place its trials; any request the machine cannot
    meet is one `UserError` line.

    Args:
        n_jobs: trials asked to run at once.
        resources: ``--resources-per-trial`` as given (``{"cpu": 2, "gpu": 0.5}``), or None.
        processes_per_trial: data-parallel processes per trial.
        gpus: the GPU ids this machine offers (`visible_gpus`).
        cores: the CPU cores this process may use (`usable_cores`).
        local: False when trials run on a cluster elsewhere (Ray ``--address``): only the shape
            of the request is checked, the cluster's scheduler places the trials.

    >>> plan(n_jobs=4, resources={"gpu": 0.5}, gpus=["0", "1"], cores=8).gpus
    (('0',), ('1',), ('0',), ('1',))
    """
    given = dict(resources or {})
    unknown = sorted(set(given) - set(RESOURCE_NAMES))
    if unknown:
        raise UserError(
            f"--resources-per-trial {','.join(unknown)}: give cpu=N,gpu=F (e.g. cpu=2,gpu=0.5)"
        )
    for name, value in given.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise UserError(f"--resources-per-trial {name}={value}: give a number >= 0")
    ppt = processes_per_trial
    gpu = float(given.get("gpu", ppt if gpus else 0))
    if gpu > 1 and gpu != int(gpu):
        raise UserError(
            f"--resources-per-trial gpu={gpu:g}: a trial takes a share of one GPU (gpu=0.5) or whole "
            f"GPUs (gpu=1, gpu=2); give gpu={math.floor(gpu)} or gpu={math.ceil(gpu)}"
        )
    if ppt > 1 and gpu > 0 and gpu != ppt:
        raise UserError(
            f"--processes-per-trial {ppt} runs each process on a GPU of its own, but "
            f"--resources-per-trial gpu={gpu:g}; give gpu={ppt} (or gpu=0 to train on CPU processes)"
        )
    resolved = {**given, "gpu": gpu}
    cpu = given.get("cpu")
    # without gpu=, the cluster's GPUs (not this machine's) decide: see the Ray backend
    if not local:
        return Placement(
            slots=n_jobs,
            gpus=None,
            threads=1,
            processes_per_trial=ppt,
            resources=resolved if "gpu" in given else given,
        )

    slots, note, per_slot = n_jobs, None, None
    if gpu > 0:
        have = len(gpus)
        if have == 0:
            why = "" if "gpu" in given else f" (--processes-per-trial {ppt})"
            raise UserError(
                f"--resources-per-trial gpu={gpu:g}{why}: CUDA sees no GPU on this machine; "
                "give gpu=0 to train on the CPU, or run where GPUs are"
            )
        if gpu > have:
            why = f" (one per process of --processes-per-trial {ppt})" if ppt > 1 else ""
            raise UserError(
                f"each trial needs {gpu:g} GPUs{why}, but this machine has {have} "
                f"({VISIBLE_ENV}={','.join(gpus)}); give --resources-per-trial gpu={have} or less"
            )
        per_slot = _gpu_slots(gpus, gpu)
        if len(per_slot) < n_jobs:
            slots = len(per_slot)
            note = (
                f"--n-jobs {n_jobs} with gpu={gpu:g} per trial on {have} GPU{'s' if have > 1 else ''}: "
                f"{slots} trial{'s run' if slots > 1 else ' runs'} at once, the others wait their turn"
            )
        per_slot = per_slot[:slots]
    elif gpus:
        per_slot = [()]  # gpu=0 on a machine with GPUs: hide them, as Ray does
    # cpu=N beyond the cores is a reservation (Ray starts a local cluster with that many), not more threads.
    threads_per_trial = (
        max(1, min(math.floor(cpu), cores)) if cpu is not None else max(1, cores // slots)
    )
    return Placement(
        slots=slots,
        gpus=tuple(per_slot) if per_slot is not None else None,
        threads=threads_per_trial,
        processes_per_trial=ppt,
        resources=resolved,
        note=note,
        pinned=cpu is not None or bool(os.environ.get(THREADS_ENV)),
    )


def _gpu_slots(gpus: list[str], gpu: float) -> list[tuple[str, ...]]:
    """Every place a trial asking ``gpu`` fits: whole groups of GPUs, or shares of each GPU
    dealt round-robin so that a few trials spread over the GPUs before any two share one."""
    if gpu >= 1:
        size = int(gpu)
        return [tuple(gpus[i : i + size]) for i in range(0, len(gpus) - size + 1, size)]
    per_gpu = math.floor(1 / gpu + 1e-9)
    return [(gpus[i % len(gpus)],) for i in range(len(gpus) * per_gpu)]


def plan_for(settings: object) -> Placement:
    """`plan` for a search's `SearchSettings`, on this machine."""
    return plan(
        n_jobs=settings.n_jobs,
        resources=settings.resources_per_trial,  # type: ignore[attr-defined]
        processes_per_trial=settings.processes_per_trial,  # type: ignore[attr-defined]
        gpus=visible_gpus(),
        cores=usable_cores(),
        local=settings.address is None,
    )  # type: ignore[attr-defined]


def check_fork_safe(placement: Placement) -> None:
    """Workers and data-parallel ranks are forked; CUDA initialised before the fork is unusable
    in them (the driver's state does not survive it), so say so before anything starts."""
    if os.environ.get(FAKE_GPUS_ENV) is not None or not placement.gpus or not any(placement.gpus):
        return
    if placement.slots == 1 and placement.processes_per_trial == 1:
        return
    import torch

    if torch.cuda.is_initialized():
        raise UserError(
            "CUDA was initialised in this process before the search (a tensor or model was put on a GPU); "
            "--n-jobs and --processes-per-trial fork processes that then cannot use it: leave the GPU "
            "untouched until the search starts, or use n_jobs=1 and processes_per_trial=1"
        )


def apply(placement: Placement, slot: int) -> None:
    """Place this process (a fresh ``--n-jobs`` worker) in ``slot``: its GPUs and threads."""
    import torch

    global _share
    os.environ.update(placement.env(slot))
    torch.set_num_threads(placement.threads)
    _share = CoreShare(placement.threads) if not placement.pinned else None


@contextmanager
def placed(placement: Placement, slot: int = 0) -> Iterator[None]:
    """`apply` for the duration of an in-process search, then put the process back as it was
    (an API user's own environment and thread count)."""
    import torch

    global _share
    env = placement.env(slot)
    previous = {name: os.environ.get(name) for name in env}
    threads, share = torch.get_num_threads(), _share
    apply(placement, slot)
    try:
        yield
    finally:
        _share = share
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        torch.set_num_threads(threads)


def trial_devices(processes: int = 1) -> dict[str, object]:
    """What a trial's ``trial.json`` records about where it ran (``user_attrs``)."""
    gpus = visible_gpus()
    return {
        "devices": gpus or ["cpu"],
        "threads": threads_per_process(processes),
        "processes": processes,
    }


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


#: The counters at this module's import, a command's start: its first trial measures the load since.
_STARTED = _sample(None, os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None)
