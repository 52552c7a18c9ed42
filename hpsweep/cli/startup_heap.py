"""``hpsweep run``'s start-up heap, kept out of the garbage collector's way.

CPython runs a full collection each time the heap has grown by a quarter since the last one, and
a full collection scans every object the collector tracks: importing torch makes hundreds of
thousands of them, each scanned again by every full collection while the libraries load and the
sweep runs. So ``hpsweep run`` follows the recipe of the documentation of CPython's `gc.freeze`:

1. The command imports its libraries (torch, with hpsweep's trainer) with the collector off and
   freezes them: no collection ever scans those objects again. Nothing of the user's exists yet.
2. The space file loads with the collector on, so what it leaves behind is collected as usual.
3. When the sweep begins, with the collector off again: where trials train in forks of this
   process (``--n-jobs`` workers, ``--processes-per-trial`` ranks), what a process's first trial
   imports is imported here once, for every fork to inherit instead of importing it again
   (accelerate, and torch._dynamo, which torch imports when a process builds its first
   optimizer). One full collection then frees what the space file left (it scans what step 1
   did not freeze), and the heap is frozen. Where trials train in this process only, its first
   optimizer imports torch._dynamo when it needs it, as in any torch program: imported earlier,
   it would cost as much and only delay the first trial.
4. When the command ends in a program that called it (`hpsweep.cli.main` with its arguments),
   the heap is unfrozen and the collector left as the program had it. The command's own process
   (the ``hpsweep`` script, ``python -m hpsweep.cli``) ends with the command and keeps the heap
   frozen: the interpreter's shutdown then leaves the libraries' objects out of its collections,
   to the operating system, which reclaims the process's memory at once.

The price: the cyclic garbage the libraries' imports leave in step 1 (a few MB) is kept until
the sweep ends (in the command's own process, until it exits); and step 3's one collection. The
Python API (``Trainer.hyperparameter_search``) leaves the collector of the user's process alone.
"""

from __future__ import annotations

import gc
import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: Backends whose trials train in processes of their own (Ray's workers): nothing to warm here.
TRIALS_ELSEWHERE = frozenset({"ray"})


@contextmanager
def collector_off(*, process_ends: bool = False) -> Iterator[None]:
    """The collector off until `freeze_libraries`; on the way out, the collector as it was, and
    the heap unfrozen unless ``process_ends`` (the command's own process, which exits next)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if not process_ends:
            gc.unfreeze()
        (gc.enable if was_on else gc.disable)()


def import_libraries() -> None:
    """Step 1's imports: torch, through hpsweep's trainer, which every backend's command builds."""
    importlib.import_module("hpsweep.train.trainer")


def freeze_libraries() -> None:
    """Step 1's end: freeze what the command has imported, and turn the collector on."""
    gc.freeze()
    gc.enable()


class FreezeAtSweepBegin:
    """Step 3, as a `hpsweep.SweepCallback` (this module imports nothing heavy, so that the
    command can turn the collector off before its imports)."""

    def on_sweep_begin(self, settings: Any) -> None:
        gc.disable()
        if forks_train(settings):
            warm_trial_imports()
        gc.collect()
        gc.freeze()
        gc.enable()

    def trial_callbacks(self, trial: Any, record: Any) -> list[Any]:
        return []

    def on_trial_end(self, record: Any) -> None: ...

    def on_sweep_end(self, best: Any, records: Any, interrupted: bool) -> None: ...


def forks_train(settings: Any) -> bool:
    """Whether trials train in processes forked from this one: ``--n-jobs`` workers, or a
    ``--processes-per-trial`` trial's ranks (forked for every trial); not where they train in
    this process alone, nor in a backend's own processes (Ray's workers)."""
    if settings.backend in TRIALS_ELSEWHERE:
        return False
    return settings.n_jobs > 1 or settings.processes_per_trial > 1


def warm_trial_imports() -> None:
    """Import what a process's first trial imports: accelerate (the device layer), and what the
    first torch optimizer built in a process imports, torch._dynamo (`Optimizer.__init__` and
    `Optimizer.step` are wrapped to keep torch.compile out of them), by building a throwaway
    one."""
    import torch

    importlib.import_module("accelerate")
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
