"""The per-step operations of the training loop: accelerate's wrappers, or what they wrap.

`TrainingLoop` (`Trainer.train`) calls `step_ops` once per run and then only the operations it
returns, so the loop reads the same in both cases.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from hpsweep.train.arguments import TrainingArguments


class StepOps(NamedTuple):
    """How the loop iterates, steps and syncs: accelerate's wrappers, or the objects they wrap."""

    plain: bool
    batches: Callable[[Any], Any]
    accumulate: Callable[[Any], Any]
    backward: Callable[[torch.Tensor], Any]
    synced: Callable[[], bool]
    clip: Callable[[Any, float], Any]
    optimizer_step: Callable[[], Any]
    scheduler_step: Callable[[], Any]


def step_ops(
    acc: Any, args: TrainingArguments, optimizer: Any, scheduler: Any, train_dl: Any
) -> StepOps:
    """The per-step operations of one run (``acc`` and the objects it prepared).

    On one process, without mixed precision or gradient accumulation, accelerate's wrappers do
    nothing but bookkeeping: its optimizer and scheduler call the wrapped ones, ``backward``
    divides the loss by 1, ``clip_grad_norm_`` is torch's, ``accumulate`` always syncs and the
    prepared loader only looks one batch ahead. That bookkeeping was 13% of the CPU time of a step
    of a small MLP (bench/step_overhead.py), so the plain objects are used directly, with the same
    look-ahead, and the weights come out bit-identical (tests/test_perf_equivalence.py).
    Everything else (several processes, fp16/bf16, accumulation, a custom loader) keeps the
    wrappers; so does ``HPSWEEP_ACCELERATE_WRAPPERS=always``, for comparing the two.
    """
    from contextlib import nullcontext

    from accelerate.data_loader import DataLoaderShard
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler
    from accelerate.utils import DistributedType

    plain = (
        os.environ.get("HPSWEEP_ACCELERATE_WRAPPERS", "").lower() != "always"
        and acc.distributed_type == DistributedType.NO
        and acc.num_processes == 1
        and acc.mixed_precision == "no"
        and acc.scaler is None
        and args.gradient_accumulation_steps == 1
        and type(optimizer) is AcceleratedOptimizer
        and type(scheduler) is AcceleratedScheduler
        and type(train_dl) is DataLoaderShard
        and not train_dl.skip_batches
        and not getattr(train_dl, "use_stateful_dataloader", False)
    )
    if not plain:
        return StepOps(
            False,
            iter,
            acc.accumulate,
            acc.backward,
            lambda: acc.sync_gradients,
            acc.clip_grad_norm_,
            optimizer.step,
            scheduler.step,
        )
    # OneCycleLR raises past its total steps; accelerate's scheduler guards that, keep it there.
    scheduler_step = (
        scheduler.step if hasattr(scheduler.scheduler, "total_steps") else scheduler.scheduler.step
    )
    return StepOps(
        True,
        _one_ahead,
        lambda model: nullcontext(),
        torch.Tensor.backward,
        lambda: True,
        torch.nn.utils.clip_grad_norm_,
        optimizer.optimizer.step,
        scheduler_step,
    )


def _one_ahead(loader: Any) -> Any:
    """Batches of a prepared one-process loader as its own iterator yields them: fetched one batch
    ahead (a dataset that draws random numbers draws them in the same order) and moved to its
    device, without the per-batch bookkeeping for accumulation and loader state."""
    from accelerate.utils import send_to_device

    device, non_blocking = loader.device, getattr(loader, "_non_blocking", False)
    batches = iter(loader.base_dataloader)
    try:
        current = next(batches)
    except StopIteration:
        return
    while True:
        if device is not None:
            current = send_to_device(current, device, non_blocking=non_blocking)
        try:
            upcoming = next(batches)
        except StopIteration:
            yield current
            return
        yield current
        current = upcoming
