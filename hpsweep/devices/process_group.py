"""The ``torch.distributed`` group a run's processes train in, and what they tell each other there.

Two kinds of group exist: the one `hpsweep.devices.data_parallel` forms for a
``--processes-per-trial`` trial, and the one a launcher formed before the script ran
(``torchrun --nproc_per_node N script.py``, ``accelerate launch``: ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK`` are set in each process). accelerate trains over whichever it finds, as its
`PartialState`: DistributedDataParallel around the model, each process one share of the batches,
the gradients all-reduced.

On a machine without CUDA, accelerate joins a launcher's processes only when it is told to run on
the CPU (``PartialState(cpu=True)``; transformers needs ``use_cpu=True`` there); otherwise each
process trains alone on all the data. `join_launched` joins them whenever the launcher started
several: over gloo on the CPU, NCCL on GPUs, as ``--processes-per-trial`` does.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
from datetime import timedelta
from typing import Any

from hpsweep.errors import UserError

TIMEOUT_ENV = "HPSWEEP_DIST_TIMEOUT_S"


def timeout_s(args: Any = None) -> float:
    """How long a process of a group hpsweep starts waits for the others in one collective:
    ``args.ddp_timeout`` when given, else ``HPSWEEP_DIST_TIMEOUT_S`` (600 s by default). What
    bounds a process whose peer hangs."""
    given = getattr(args, "ddp_timeout", None)
    if given is not None:
        return float(given)
    text = os.environ.get(TIMEOUT_ENV, "600")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UserError(
            f"{TIMEOUT_ENV}={text!r}: give the seconds a data-parallel process may wait for the others"
        )
    return value


def launched_world_size() -> int:
    """How many processes a launcher started together with this one (its ``WORLD_SIZE``); 1 when
    no launcher did."""
    if "RANK" not in os.environ or "LOCAL_RANK" not in os.environ:
        return 1
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def join_launched(args: Any = None) -> None:
    """Make accelerate's process state the launcher's whole group, when a launcher started several
    processes: on the CPU where ``args.use_cpu`` says so or CUDA is missing, else on this
    process's GPU (``LOCAL_RANK``), over ``args.ddp_backend`` (gloo on the CPU, NCCL on GPUs by
    default) with ``args.ddp_timeout`` (else ``HPSWEEP_DIST_TIMEOUT_S``). A state accelerate made
    before with one process in it (a ``PartialState()`` on a machine without CUDA) is replaced;
    the group it started is kept, with its own backend and timeout. Outside a launcher, or once
    joined, nothing happens."""
    world = launched_world_size()
    if world == 1:
        return
    from accelerate.state import AcceleratorState, GradientState, PartialState

    if PartialState._shared_state.get("num_processes") == world:
        return
    import torch
    import torch.distributed as dist

    use_cpu = bool(getattr(args, "use_cpu", False)) or not torch.cuda.is_available()
    options: dict[str, Any] = {}
    if not dist.is_initialized():
        atexit.register(_leave_group)
        if args is not None:
            check_backend(args)
        options["timeout"] = timedelta(seconds=timeout_s(args))
        backend = getattr(args, "ddp_backend", None)
        if backend is not None:
            options["backend"] = backend
    if PartialState._shared_state:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    PartialState(cpu=use_cpu, **options)


def _leave_group() -> None:
    """Leave the process group `join_launched` started, if it is still open, while the interpreter
    is still whole.

    A gloo worker thread drops the tensors of the collective it just finished (the last one: the
    best run rank 0 sent) holding the GIL. One that waits for the GIL until the interpreter
    finalises is ended there, inside that destructor, and the process aborts ("terminate called
    without an active exception") after a finished sweep. The short sleep hands the GIL to such a
    thread first."""
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
    time.sleep(_LEAVE_WAIT_S)


#: How long `_leave_group` lets gloo's worker threads take the GIL; they need microseconds.
_LEAVE_WAIT_S = 0.05


def check_backend(args: Any) -> None:
    """``ddp_backend``, when given, one this torch has, and not NCCL on the CPU: else one line
    before any process starts."""
    import torch.distributed as dist

    name = args.ddp_backend
    if name is None:
        return
    if name == "nccl" and args.use_cpu:
        raise UserError(
            "ddp_backend='nccl' runs on GPUs and use_cpu=True trains on the CPU; use 'gloo' or leave "
            "ddp_backend None"
        )
    if not dist.is_backend_available(name):
        raise UserError(
            f"ddp_backend={name!r} is not available in this torch build; leave ddp_backend None "
            "(gloo on the CPU, nccl on GPUs) or install a torch built with it"
        )


def broadcast_flag(value: bool | None) -> bool:
    """Rank 0's ``value`` on every process of the group (the others pass None): one answer, such
    as whether to prune, that all act on at the same step."""
    import torch
    import torch.distributed as dist
    from accelerate.state import PartialState

    flag = torch.zeros(1, dtype=torch.int32, device=PartialState().device)
    if value:
        flag += 1
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def broadcast_object(value: Any = None) -> Any:
    """Rank 0's ``value`` (picklable) on every process of the group; the others pass nothing and
    wait for it, until the group's timeout or rank 0's end (an error then)."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
