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
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from hpsweep.devices import threads
from hpsweep.errors import UserError

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
    given = _checked_resources(resources)
    ppt = processes_per_trial
    gpu = _gpu_per_trial(given, ppt, has_gpus=bool(gpus))
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
    slots, per_slot, note = n_jobs, None, None
    if gpu > 0:
        per_slot, note = _gpu_placement(gpus, gpu, n_jobs, ppt, asked="gpu" in given)
        slots = len(per_slot)
    elif gpus:
        per_slot = [()]  # gpu=0 on a machine with GPUs: hide them, as Ray does
    # cpu=N beyond the cores is a reservation (Ray starts a local cluster with that many), not
    # more threads.
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


def _checked_resources(resources: Mapping[str, float] | None) -> dict[str, float]:
    """``--resources-per-trial`` with known names and numbers >= 0, or one `UserError` line."""
    given = dict(resources or {})
    unknown = sorted(set(given) - set(RESOURCE_NAMES))
    if unknown:
        raise UserError(
            f"--resources-per-trial {','.join(unknown)}: give cpu=N,gpu=F (e.g. cpu=2,gpu=0.5)"
        )
    for name, value in given.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise UserError(f"--resources-per-trial {name}={value}: give a number >= 0")
    return given


def _gpu_per_trial(given: Mapping[str, float], ppt: int, *, has_gpus: bool) -> float:
    """The GPUs each trial takes: as given, else one per process where there are GPUs."""
    gpu = float(given.get("gpu", ppt if has_gpus else 0))
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
    return gpu


def _gpu_placement(
    gpus: list[str], gpu: float, n_jobs: int, ppt: int, *, asked: bool
) -> tuple[list[tuple[str, ...]], str | None]:
    """The GPUs of each slot (as many slots as fit, at most ``n_jobs``), and a note when fewer
    trials than ``--n-jobs`` fit at once; a trial that cannot fit at all is refused."""
    have = len(gpus)
    if have == 0:
        why = "" if asked else f" (--processes-per-trial {ppt})"
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
    if len(per_slot) >= n_jobs:
        return per_slot[:n_jobs], None
    slots = len(per_slot)
    note = (
        f"--n-jobs {n_jobs} with gpu={gpu:g} per trial on {have} GPU{'s' if have > 1 else ''}: "
        f"{slots} trial{'s run' if slots > 1 else ' runs'} at once, the others wait their turn"
    )
    return per_slot, note


def _gpu_slots(gpus: list[str], gpu: float) -> list[tuple[str, ...]]:
    """Every place a trial asking ``gpu`` fits: whole groups of GPUs, or shares of each GPU
    dealt round-robin so that a few trials spread over the GPUs before any two share one."""
    if gpu >= 1:
        size = int(gpu)
        return [tuple(gpus[i : i + size]) for i in range(0, len(gpus) - size + 1, size)]
    per_gpu = math.floor(1 / gpu + 1e-9)
    return [(gpus[i % len(gpus)],) for i in range(len(gpus) * per_gpu)]


def plan_for(settings: object) -> Placement:
    """`plan` for a search's `SearchOptions`, on this machine."""
    return plan(
        n_jobs=settings.n_jobs,
        resources=settings.resources_per_trial,  # type: ignore[attr-defined]
        processes_per_trial=settings.processes_per_trial,  # type: ignore[attr-defined]
        gpus=visible_gpus(),
        cores=threads.usable_cores(),
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

    os.environ.update(placement.env(slot))
    torch.set_num_threads(placement.threads)
    threads.share_cores(placement.threads if not placement.pinned else None)


@contextmanager
def placed(placement: Placement, slot: int = 0) -> Iterator[None]:
    """`apply` for the duration of an in-process search, then put the process back as it was
    (an API user's own environment and thread count)."""
    import torch

    env = placement.env(slot)
    previous = {name: os.environ.get(name) for name in env}
    n_threads, share = torch.get_num_threads(), threads.share_cores(None)
    apply(placement, slot)
    try:
        yield
    finally:
        threads.restore_share(share)
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        torch.set_num_threads(n_threads)


def trial_devices(processes: int = 1) -> dict[str, object]:
    """What a trial's ``trial.json`` records about where it ran (``user_attrs``)."""
    gpus = visible_gpus()
    return {
        "devices": gpus or ["cpu"],
        "threads": threads.threads_per_process(processes),
        "processes": processes,
    }
