"""`TrainingLoop`: one run of `Trainer.train`, in named steps.

    run
    ├── set_up           seed, model, accelerator, training batches, optimizer and scheduler
    ├── on_run_start     the state, the resume, on_train_begin
    ├── run_epoch        for each epoch: its batches, then on_epoch_end and its log/save/evaluate
    │   └── advance      one micro-batch: training_step, the optimizer step when gradients sync
    │       └── on_step_end   on_step_end and its log/save/evaluate (log_save_evaluate)
    └── on_run_end       the best model, the train_* summary, on_train_end

The loop calls the trainer's override points (``get_train_dataloader``,
``create_optimizer_and_scheduler``, ``training_step``, ``evaluate``, ``save_checkpoint``, ``log``,
...) where transformers' loop does, and keeps on the trainer what callbacks and overrides read
there (``model_wrapped``, ``optimizer``, ``state``, ...). What the run has besides (its prepared
batches and per-step operations, checkpoint writer, loss total, gradient norm) is one `RunState`,
made here and handed to the trainer as ``run_state``; what only the loop needs (the loss since the
last log, where a resume starts) lives on the loop, which is gone when the run ends. The loop
knows the trainer as a `LoopTrainer`: its public attributes and override points, nothing else.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from hpsweep import runs
from hpsweep.errors import UserError
from hpsweep.train.accelerator import bare_model, is_prepared_loader, make_accelerator
from hpsweep.train.callbacks import TrainerControl, TrainerState, flow_on_epoch, flow_on_step
from hpsweep.train.memory_metrics import MemoryTracker, stop_tracking
from hpsweep.train.metrics import metric_value, speed_metrics
from hpsweep.train.model_init import enable_activation_checkpointing
from hpsweep.train.model_init import set_seed as _set_seed
from hpsweep.train.run_state import LoopTrainer, RunState
from hpsweep.train.steps import step_ops
from hpsweep.train.trainer_checkpoints import checkpoint_dir, load_checkpoint


class TrainOutput(NamedTuple):
    """What `Trainer.train` returns. ``metrics``: transformers' ``train_runtime``,
    ``train_samples_per_second``, ``train_steps_per_second``, ``train_loss``, ``epoch``, and the
    last (or best) evaluation's ``eval_*``."""

    global_step: int
    training_loss: float
    metrics: dict[str, float]


class TrainingLoop:
    """One training run of ``trainer``, from scratch or from a checkpoint; ``trial`` builds the
    model (``model_init(trial)``) and is recorded in the state.

    A loop runs once. Its attributes are set as `run` reaches them: the run's `RunState`
    (``run_state``), accelerator (``acc``), prepared model and loader, per-step operations (``ops``),
    state and control, where a resume starts, and the loss summed since the last log
    (``running_loss``, ``logged_steps``).
    """

    def __init__(self, trainer: LoopTrainer, trial: Any = None) -> None:
        self.trainer = trainer
        self.trial = trial

    def run(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Train (``resume_from_checkpoint``: a checkpoint folder, or ``True`` for the run's latest
        one); every checkpoint is on disk when this returns, or raises."""
        self.args, self.started = self.trainer.args, time.time()
        # skip_memory_metrics=False: the run's memory, evaluations during it included
        self.run_state = self.trainer.run_state = RunState(
            memory=MemoryTracker.start(self.args, "train")
        )
        try:
            checkpoint = self.set_up(resume_from_checkpoint)
            self.on_run_start(checkpoint)
            try:
                for epoch in range(self.epochs_done, self.state.num_train_epochs):
                    self.run_epoch(epoch)
                    if self.control.should_training_stop:
                        break
                self.run_state.writer.wait()
            except BaseException as exc:
                self.on_exception(exc)
                raise
            return self.on_run_end()
        finally:
            stop_tracking(self.run_state.memory)
            self.run_state.memory = None

    # --- before the first step ---------------------------------------------------------------------

    def set_up(self, resume_from_checkpoint: str | bool | None) -> Path | None:
        """The run's model, accelerator, training batches, optimizer and scheduler, prepared by
        accelerate; returns the checkpoint to resume from, if any."""
        trainer, args = self.trainer, self.args
        _set_seed(args.seed, args.full_determinism)
        if trainer.model_init is not None:
            trainer.model = trainer.call_model_init(self.trial)
        enable_activation_checkpointing(trainer.model, args)
        checkpoint = runs.resolve_checkpoint(Path(args.output_dir), resume_from_checkpoint)

        self.acc = trainer.accelerator = make_accelerator(trainer.args)
        train_dl = trainer.get_train_dataloader()
        # an override of get_train_dataloader may prepare it itself
        prepared = is_prepared_loader(train_dl)
        self.steps_per_epoch, self.max_steps = self._length(train_dl, prepared)
        # the user's pair, or None: a run's own from here
        trainer.optimizer, trainer.lr_scheduler = trainer.optimizers
        trainer.create_optimizer_and_scheduler(num_training_steps=self.max_steps)
        self._prepare(train_dl, prepared)
        return checkpoint

    def _length(self, train_dl: Any, prepared: bool) -> tuple[int, int]:
        """Optimizer steps per epoch, and in the run."""
        args, acc = self.args, self.acc
        if len(train_dl) == 0:
            raise UserError(
                "train_dataset is empty (or smaller than one batch with dataloader_drop_last)"
            )
        # Data-parallel, each of the N processes takes every N-th batch: an epoch is N times fewer
        # optimizer steps of an N times larger batch (as in Hugging Face's Trainer).
        batches = len(train_dl) if prepared else math.ceil(len(train_dl) / acc.num_processes)
        steps_per_epoch = max(1, math.ceil(batches / args.gradient_accumulation_steps))
        max_steps = (
            args.max_steps
            if args.max_steps > 0
            else math.ceil(args.num_train_epochs * steps_per_epoch)
        )
        return steps_per_epoch, max_steps

    def _prepare(self, train_dl: Any, prepared: bool) -> None:
        """Hand the model, optimizer, scheduler and (unless it is) the loader to accelerate, and
        choose the per-step operations (`step_ops`)."""
        trainer, acc = self.trainer, self.acc
        if prepared:
            trainer.model_wrapped, trainer.optimizer, trainer.lr_scheduler = acc.prepare(
                trainer.model, trainer.optimizer, trainer.lr_scheduler
            )
        else:
            trainer.model_wrapped, trainer.optimizer, train_dl, trainer.lr_scheduler = acc.prepare(
                trainer.model, trainer.optimizer, train_dl, trainer.lr_scheduler
            )
        self.model = trainer.model_wrapped
        self.train_dl = self.run_state.train_dataloader = train_dl
        # max_steps counts optimizer steps: one schedule step each, not one per process
        if acc.num_processes > 1:
            trainer.lr_scheduler.split_batches = True
        self.ops = self.run_state.step_ops = step_ops(
            acc, self.args, trainer.optimizer, trainer.lr_scheduler, train_dl
        )
        trainer.accelerate_wrappers_skipped = self.ops.plain

    def on_run_start(self, checkpoint: Path | None) -> None:
        """A new state (the checkpoint's, on a resume) and control, ``on_train_begin``, and where
        the steps start."""
        trainer, args = self.trainer, self.args
        self.state = trainer.state = self._new_state()
        self.rng_state = load_checkpoint(trainer, checkpoint) if checkpoint is not None else None
        self.control = trainer.control = TrainerControl()
        self.handler = trainer.callback_handler
        self.handler.fire("on_train_begin", args, self.state, self.control)
        if args.eval_on_start:  # transformers' check of the evaluation before the first step
            trainer.evaluate()

        self.first_step = self.state.global_step
        self.epochs_done, self.skip_steps = divmod(self.first_step, self.steps_per_epoch)
        if args.ignore_data_skip:  # the resumed epoch from its first batch again, as transformers
            self.skip_steps = 0
        self.batches_per_epoch = len(self.train_dl)
        self.accumulation = args.gradient_accumulation_steps
        self.running_loss = torch.zeros((), device=self.acc.device)
        self.logged_steps = 0

    def _new_state(self) -> TrainerState:
        """The state of a run from its first step (a resume then loads its checkpoint's)."""
        args, acc, trial = self.args, self.acc, self.trial
        return TrainerState(
            max_steps=self.max_steps,
            steps_per_epoch=self.steps_per_epoch,
            num_train_epochs=math.ceil(self.max_steps / self.steps_per_epoch),
            trial_number=getattr(trial, "number", None),
            trial_params=dict(trial.params) if trial is not None else None,
            logging_steps=args.logging_steps,
            eval_steps=args.eval_steps,
            save_steps=args.save_steps,
            train_batch_size=args.per_device_train_batch_size,
            is_local_process_zero=acc.is_local_main_process,
            is_world_process_zero=acc.is_main_process,
            is_hyper_param_search=trial is not None,
            trial_name=Path(args.output_dir).name if trial is not None else None,
        )

    # --- the epochs --------------------------------------------------------------------------------

    def run_epoch(self, epoch: int) -> None:
        """One epoch's batches (a resume's first epoch without those it had trained on), then
        ``on_epoch_end`` and its log/save/evaluate."""
        args, state, control = self.args, self.state, self.control
        if hasattr(self.train_dl, "set_epoch"):
            self.train_dl.set_epoch(epoch)
        skipped = self.skip_steps * self.accumulation if epoch == self.epochs_done else 0
        if skipped:  # resuming mid-epoch: the same order, without its first batches
            batches = iter(self.acc.skip_first_batches(self.train_dl, skipped))
        else:
            batches = self.ops.batches(self.train_dl)
        # after the iterator drew its seed, as in the original run
        if self.rng_state is not None:
            runs.set_rng_state(self.rng_state)
            self.rng_state = None
        self.handler.fire("on_epoch_begin", args, state, control)
        for micro_step, batch in enumerate(batches):
            if self.advance(epoch, skipped, micro_step, batch):
                break
        control.should_epoch_stop = False
        state.epoch = float(epoch + 1) if not control.should_training_stop else state.epoch
        flow_on_epoch(args, state, control)
        self.handler.fire("on_epoch_end", args, state, control)
        self.log_save_evaluate()

    def advance(self, epoch: int, skipped: int, micro_step: int, batch: Any) -> bool:
        """Train on one micro-batch, the ``micro_step``-th of ``epoch`` after the ``skipped`` ones
        a resume left out; when the gradients sync, step the optimizer and end the step. Returns
        whether the epoch stops here."""
        args, state, control, ops, model = self.args, self.state, self.control, self.ops, self.model
        if micro_step % self.accumulation == 0:
            self.handler.fire("on_step_begin", args, state, control)
        if args.include_num_input_tokens_seen != "no":
            state.num_input_tokens_seen += input_tokens(batch, args, bare_model(model), self.acc)
        with ops.accumulate(model):
            loss = self.trainer.training_step(model, batch)
            synced = ops.synced()
            if synced:
                # the norm before clipping, logged as transformers does
                if args.max_grad_norm > 0:
                    self.run_state.grad_norm = ops.clip(model.parameters(), args.max_grad_norm)
                self.handler.fire("on_pre_optimizer_step", args, state, control)
            ops.optimizer_step()  # accelerate skips it while accumulating
            ops.scheduler_step()
            if synced:
                self.handler.fire("on_optimizer_step", args, state, control)
                # the model's zero_grad: accelerate's optimizer inspects a signature per call
                model.zero_grad(set_to_none=True)
        self.running_loss += self._loggable(loss.detach())
        self.logged_steps += 1
        if not synced:
            self.handler.fire("on_substep_end", args, state, control)
            return False
        return self.on_step_end(epoch, skipped + micro_step + 1)

    def _loggable(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss as the logs count it: under ``logging_nan_inf_filter``, a NaN or inf one
        is the mean of the interval's steps so far (transformers' rule), chosen on the device, so
        that no step waits to read its loss."""
        if not self.args.logging_nan_inf_filter:
            return loss
        return torch.where(loss.isfinite(), loss, self.running_loss / max(self.logged_steps, 1))

    def on_step_end(self, epoch: int, batches_done: int) -> bool:
        """Count the optimizer step (``batches_done`` batches into ``epoch``), let the flow and
        ``on_step_end`` decide what follows it, and do it; returns whether the epoch stops here."""
        args, state, control = self.args, self.state, self.control
        state.global_step += 1
        if args.torch_empty_cache_steps and state.global_step % args.torch_empty_cache_steps == 0:
            # the allocator's cached blocks back to the device (no-op on a CPU), as transformers
            from accelerate.utils.memory import clear_device_cache

            clear_device_cache()
        state.epoch = epoch + batches_done / self.batches_per_epoch
        flow_on_step(args, state, control)
        self.handler.fire("on_step_end", args, state, control)
        if control.should_log or control.should_evaluate or control.should_save:
            self.log_save_evaluate()
        return control.should_training_stop or control.should_epoch_stop

    def log_save_evaluate(self) -> None:
        """Do what the flow and callbacks asked for at the end of a step or an epoch: log the loss
        summed since the last log, evaluate, save a checkpoint."""
        control = self.control
        if control.should_log and self.logged_steps:
            self.log_loss()
        control.should_log = False
        if control.should_evaluate:
            self.track_best(self.trainer.evaluate())
        control.should_evaluate = False
        if control.should_save:
            self.trainer.save_checkpoint(wait=False)
        control.should_save = False

    def log_loss(self) -> None:
        """Log the mean loss of the micro-steps since the last log (with the gradient norm and the
        learning rate), and start summing again."""
        interval = self.count_loss()
        loss = round(interval / self.logged_steps, 6)
        norm = self.run_state.grad_norm
        logs = {
            "loss": loss,
            **({} if norm is None else {"grad_norm": float(norm)}),
            "learning_rate": self.trainer.lr_scheduler.get_last_lr()[0],
        }
        self.trainer.log(logs)
        self.running_loss, self.logged_steps = torch.zeros_like(self.running_loss), 0

    def count_loss(self) -> float:
        """Add the loss summed since the last log (data-parallel: the processes' mean, reduced
        only here) to the run's total; returns it."""
        steps = self.logged_steps
        interval = float(self.acc.reduce(self.running_loss, "mean")) if steps else 0.0
        self.run_state.add_loss(interval, steps)
        return interval

    def track_best(self, metrics: Mapping[str, float]) -> None:
        """Remember the checkpoint this step saves as the best when ``metrics`` beat the best so
        far (``metric_for_best_model``; under ``load_best_model_at_end`` without one, the lowest
        ``eval_loss``, transformers' rule)."""
        args, state = self.args, self.state
        metric = args.metric_for_best_model or (
            "eval_loss" if args.load_best_model_at_end else None
        )
        if metric is None:
            return
        value = metric_value(metrics, metric, "metric_for_best_model")
        # the best is a checkpoint: only evaluations that get one count
        if not self.control.should_save:
            return
        greater = bool(args.greater_is_better) and args.metric_for_best_model is not None
        if runs.is_better(value, state.best_metric, "maximize" if greater else "minimize"):
            state.best_metric = value
            state.best_model_checkpoint = str(checkpoint_dir(args, state))
            state.best_global_step = state.global_step

    # --- the end ---------------------------------------------------------------------------------

    def on_exception(self, exc: BaseException) -> None:
        """An interrupted run keeps the checkpoint it was writing (a resume starts from it), then
        the callbacks hear of ``exc`` (``on_exception``)."""
        try:
            self.run_state.writer.wait()
        except Exception as write_error:  # reported with what stopped the run, not instead of it
            exc.add_note(
                f"writing a checkpoint failed too: {type(write_error).__name__}: {write_error}"
            )
        self.handler.fire("on_exception", self.args, self.state, self.control, exception=exc)

    def on_run_end(self) -> TrainOutput:
        """The best checkpoint's weights (``load_best_model_at_end``), the run's ``train_*``
        summary logged, ``on_train_end``; returns the `TrainOutput`."""
        trainer, args, state = self.trainer, self.args, self.state
        if args.load_best_model_at_end and state.best_model_checkpoint:
            runs.load_weights(bare_model(self.model), Path(state.best_model_checkpoint))
        self.count_loss()  # the steps after the last log
        # this run's steps: a resume's, since its checkpoint
        loss = self.run_state.train_loss()
        steps = state.global_step - self.first_step
        samples = steps * args.per_device_train_batch_size * self.accumulation
        summary = {
            **speed_metrics(
                "train",
                self.started,
                steps=steps,
                samples=samples * self.acc.num_processes,
            ),
            "train_loss": loss,
            **stop_tracking(self.run_state.memory),
        }
        trainer.log(summary)  # as transformers ends: its on_log, then on_train_end
        self.handler.fire("on_train_end", args, state, self.control)
        return TrainOutput(
            state.global_step,
            loss,
            {**summary, "epoch": state.epoch, **trainer.last_eval_metrics()},
        )


def input_tokens(batch: Any, args: Any, model: Any, acc: Any) -> int:
    """The tokens of ``batch``'s main input (the model's ``main_input_name``, else input_ids) on
    every process, as transformers counts them for ``include_num_input_tokens_seen``: all of
    them, or under "non_padding" those the batch's attention_mask keeps."""
    mode, name = args.include_num_input_tokens_seen, getattr(model, "main_input_name", "input_ids")
    if not isinstance(batch, Mapping) or not isinstance(batch.get(name), torch.Tensor):
        raise UserError(
            f"include_num_input_tokens_seen={mode!r} counts the tokens of the batches' {name!r}, "
            f"which these batches lack; give batches with {name!r} or leave it 'no'"
        )
    mask = batch.get("attention_mask") if mode == "non_padding" else None
    count = (
        mask.sum()
        if isinstance(mask, torch.Tensor)
        else batch[name].new_tensor(batch[name].numel())
    )
    if acc.num_processes > 1:
        count = acc.reduce(count.to(acc.device), "sum")
    return int(count)
