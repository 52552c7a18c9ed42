"""Where trials run on this machine, and what each one gets.

- `hpsweep.devices.placement`: the GPUs each trial sees and how many trials run at once
  (``--n-jobs``, ``--resources-per-trial``), planned before anything starts;
- `hpsweep.devices.threads`: each trial's share of the CPU threads;
- `hpsweep.devices.memory`: a trial's memory given back before the next one starts;
- `hpsweep.devices.data_parallel`: one trial trained over ``--processes-per-trial`` processes;
- `hpsweep.devices.process_group`: the group those processes, or torchrun's, train in;
- `hpsweep.devices.signals`: every process a sweep starts stops on SIGTERM as on Ctrl-C, and dies
  with its parent.

`memory` and `data_parallel` import torch; this package's face does not, so importing it costs nothing.
"""

from hpsweep.devices.placement import (
    FAKE_GPUS_ENV,
    THREADS_ENV,
    VISIBLE_ENV,
    Placement,
    apply,
    check_fork_safe,
    placed,
    plan,
    plan_for,
    trial_devices,
    visible_gpus,
)
from hpsweep.devices.threads import (
    CoreShare,
    note_start,
    threads_for_trial,
    threads_per_process,
    usable_cores,
)

__all__ = [
    "FAKE_GPUS_ENV",
    "THREADS_ENV",
    "VISIBLE_ENV",
    "CoreShare",
    "Placement",
    "apply",
    "check_fork_safe",
    "note_start",
    "placed",
    "plan",
    "plan_for",
    "threads_for_trial",
    "threads_per_process",
    "trial_devices",
    "usable_cores",
    "visible_gpus",
]
