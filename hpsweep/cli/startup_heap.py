"""``hpsweep run``'s start-up heap, kept out of the garbage collector's way.

CPython runs a full collection each time the heap has grown by a quarter since the last one, and
a full collection scans every object. Importing torch, optuna and what a trial's first optimizer
imports (torch._dynamo) grows the heap to ~300,000 objects, through five full collections that
took 0.2 s of a 1.9 s first trial here. So ``hpsweep run`` follows the recipe of the
documentation of CPython's `gc.freeze`:

1. The command imports its libraries (torch, hpsweep) with the collector off and freezes them:
   no collection ever scans those objects again. Nothing of the user's exists yet.
2. The space file loads with the collector on, so what it leaves behind is collected as usual.
3. When the sweep begins: with the collector off again, what every trial would import on its
   first run (accelerate, and torch._dynamo, which torch's first optimizer imports) is imported
   once, where trials train in this process or its ``--n-jobs`` forks; one full collection then
   frees what the space file left (it scans what step 1 did not freeze), and the heap is frozen.
   Forked workers inherit that heap: they neither scan it nor import those modules again.

The price: the cyclic garbage the libraries' imports leave in step 1 (7,055 of 254,559 objects
here, a few MB) is kept until the sweep ends, when the heap is unfrozen; and step 3's collection
(0.04 s). The Python API (``Trainer.hyperparameter_search``) leaves the collector of the user's
process alone.
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
def collector_off() -> Iterator[None]:
    """The collector off until `freeze_libraries`; on the way out, the heap is unfrozen and the
    collector as it was (the command may run inside another program's process)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        (gc.enable if was_on else gc.disable)()


def freeze_libraries() -> None:
    """Step 1's end: freeze what the command has imported, and turn the collector on."""
    gc.freeze()
    gc.enable()


class FreezeAtSweepBegin:
    """Step 3, as a `hpsweep.SweepCallback` (this module imports nothing heavy, so that the
    command can turn the collector off before its imports)."""

    def on_sweep_begin(self, settings: Any) -> None:
        gc.disable()
        if settings.backend not in TRIALS_ELSEWHERE:
            warm_trial_imports()
        gc.collect()
        gc.freeze()
        gc.enable()

    def trial_callbacks(self, trial: Any, record: Any) -> list[Any]:
        return []

    def on_trial_end(self, record: Any) -> None: ...

    def on_sweep_end(self, best: Any, records: Any, interrupted: bool) -> None: ...


def warm_trial_imports() -> None:
    """Import what a process's first trial imports: accelerate (the device layer), and what the
    first torch optimizer built in a process imports, torch._dynamo (0.7 s here;
    `Optimizer.add_param_group` is wrapped to keep torch.compile out of it), by building a
    throwaway one."""
    import torch

    importlib.import_module("accelerate")
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
