"""``hpsweep run``'s start-up heap, kept out of the garbage collector's way.

CPython runs a full collection each time the heap has grown by a quarter since the last one, and
a full collection scans every object. Importing torch, optuna and what a trial's first optimizer
imports (torch._dynamo) grows the heap to ~300,000 objects, through five full collections that
took 0.2 s of a 1.9 s first trial here. So ``hpsweep run`` follows the recipe of CPython's `gc.freeze`
documentation: the collector is off while the command imports and loads the space file; when the
sweep begins, what exists is frozen (never scanned again) and the collector is turned back on
for what trials make. ``--n-jobs`` workers forked from that process inherit the frozen heap, and
what torch's first optimizer imports: they neither scan it nor import it again.

The price: cyclic garbage made before the sweep began (a few MB of import-time leftovers on the
shipped spaces) is kept until it ends, when the heap is unfrozen. The Python API
(``Trainer.hyperparameter_search``) leaves the collector of the user's process alone.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: Backends whose trials train in processes of their own (Ray's workers): nothing to warm here.
TRIALS_ELSEWHERE = frozenset({"ray"})


@contextmanager
def collector_off() -> Iterator[None]:
    """The collector off until `FreezeAtSweepBegin` turns it on; on the way out, the heap is
    unfrozen and the collector as it was (the command may run inside another program's process)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        (gc.enable if was_on else gc.disable)()


class FreezeAtSweepBegin:
    """A `hpsweep.sweep.SweepCallback` (this module imports nothing heavy, so that the command can
    turn the collector off before its imports): at the sweep's start, warm what a trial's first
    optimizer imports where trials train in this process or its forks, freeze the heap, turn the
    collector on."""

    def on_sweep_begin(self, settings: Any) -> None:
        if settings.backend not in TRIALS_ELSEWHERE:
            warm_optimizers()
        gc.freeze()
        gc.enable()

    def trial_callbacks(self, trial: Any, record: Any) -> list[Any]:
        return []

    def on_trial_end(self, record: Any) -> None: ...

    def on_sweep_end(self, best: Any, records: Any, interrupted: bool) -> None: ...


def warm_optimizers() -> None:
    """Build a throwaway torch optimizer: the first one built in a process imports torch._dynamo
    (0.7 s here; `Optimizer.add_param_group` is wrapped to keep torch.compile out of it), which
    every trial would otherwise do in its first optimizer, once per process."""
    import torch

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
