"""What one training run has, apart from what callbacks and overrides read on the trainer.

`RunState` is the run's own: the per-step operations and the training batches it prepared, the
evaluation loaders its accelerator prepared, its checkpoint writer and memory tracker, the loss
it summed over its logged intervals and its last gradient norm. `TrainingLoop` makes one for each
run and hands it to the trainer as ``trainer.run_state``, where the trainer's own methods
(``training_step``, ``save_checkpoint``, the evaluations) find it; the loop alone changes the loss
and the gradient norm.

`LoopTrainer` is what the loop asks of a trainer: transformers' override points and the
attributes its callbacks and overrides read. `Trainer` is one; the loop needs no more of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hpsweep import runs
from hpsweep.train.arguments import TrainingArguments
from hpsweep.train.callbacks import CallbackHandler, TrainerControl, TrainerState
from hpsweep.train.memory_metrics import MemoryTracker
from hpsweep.train.steps import StepOps


@dataclass(eq=False)
class RunState:
    """One training run's resources and running totals; a trainer that has not trained holds an
    empty one, which evaluations and a direct ``save_checkpoint`` use.

    ``eval_loaders``: each evaluation dataset's prepared loader, by dataset, batch size and
    accelerator (preparing one anew cost every evaluation more than a small model's forward
    passes). ``memory``: the run's tracker while it runs (``skip_memory_metrics=False``), which
    counts its evaluations too. ``loss_total`` and ``loss_micro_steps``: the logged intervals'
    summed loss and their micro-steps, for ``train_loss``. ``grad_norm``: the last optimizer
    step's norm before clipping (None without clipping).
    """

    step_ops: StepOps | None = None
    train_dataloader: Any = None
    eval_dataloader: Any = None
    eval_loaders: dict[tuple[int, int, int], tuple[Any, Any]] = field(default_factory=dict)
    writer: runs.CheckpointWriter = field(default_factory=runs.CheckpointWriter)
    memory: MemoryTracker | None = None
    loss_total: float = 0.0
    loss_micro_steps: int = 0
    grad_norm: torch.Tensor | None = None

    def add_loss(self, interval_total: float, micro_steps: int) -> None:
        """Count an interval of ``micro_steps`` whose losses sum to ``interval_total``."""
        self.loss_total += interval_total
        self.loss_micro_steps += micro_steps

    def train_loss(self) -> float:
        """The mean loss of the micro-steps counted so far; NaN when there were none."""
        return self.loss_total / self.loss_micro_steps if self.loss_micro_steps else math.nan


class LoopTrainer(Protocol):
    """The trainer as `TrainingLoop` uses it: what it reads and sets, what it calls."""

    args: TrainingArguments
    model: Any
    model_wrapped: Any
    model_init: Callable[..., Any] | None
    optimizers: tuple[Any, Any]
    optimizer: Any
    lr_scheduler: Any
    accelerator: Any
    accelerate_wrappers_skipped: bool
    state: TrainerState
    control: TrainerControl
    callback_handler: CallbackHandler
    run_state: RunState

    def call_model_init(self, trial: Any = None) -> torch.nn.Module: ...

    def get_train_dataloader(self) -> Any: ...

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None: ...

    def get_decay_parameter_names(self, model: Any) -> list[str]: ...

    def training_step(
        self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None
    ) -> torch.Tensor: ...

    def evaluate(self) -> dict[str, float]: ...

    def save_checkpoint(self, wait: bool = True) -> Any: ...

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None: ...

    def last_eval_metrics(self) -> dict[str, float]: ...
