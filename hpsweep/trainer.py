"""`Trainer`: a plain PyTorch training loop over `accelerate`, with evaluation, checkpoints and
callbacks. The same loop runs on CPU, one or several GPUs and in mixed precision; the device and
precision are configuration (``args.mixed_precision``, ``args.use_cpu``), not branches.

    >>> trainer = Trainer(model_init=lambda: MyNet(), args=TrainingArguments(output_dir="out"),
    ...                   train_dataset=train, eval_dataset=val)
    >>> trainer.train()
    >>> best = trainer.hyperparameter_search(space={"learning_rate": Float(1e-4, 1e-1, log=True)},
    ...                                      n_trials=20)
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader

from . import runs
from .arguments import TrainingArguments
from .callbacks import (
    CallbackHandler,
    EvalPrediction,
    ProgressCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)
from .data import batch_labels, batch_size, resolve_dataset
from .errors import UserError
from .modelinit import call_model_init, model_init_arity
from .modelinit import set_seed as _set_seed
from .optim import create_optimizer, create_scheduler


class TrainOutput(NamedTuple):
    global_step: int
    training_loss: float
    metrics: dict[str, float]


class Trainer:
    """Train and evaluate a model; search hyperparameters with `hyperparameter_search`.

    Args:
        model: a model to train (or give ``model_init`` to build a fresh one per run).
        args: the `TrainingArguments`.
        train_dataset / eval_dataset: torch Datasets, or 0-argument factories returning one.
        data_collator: turns a list of samples into a batch (torch's ``default_collate`` if None).
        compute_metrics: ``EvalPrediction -> dict[str, float]``; keys are prefixed ``eval_``.
        callbacks: extra `TrainerCallback` instances.
        model_init: ``() -> nn.Module`` or ``(trial) -> nn.Module``, called for every run.
        optimizers: an ``(optimizer, scheduler)`` pair to use instead of building them from args.
    """

    def __init__(self, model: torch.nn.Module | None = None, args: TrainingArguments | None = None,
                 train_dataset: Any = None, eval_dataset: Any = None, data_collator: Callable | None = None,
                 compute_metrics: Callable[[EvalPrediction], Mapping[str, float]] | None = None,
                 callbacks: Sequence[TrainerCallback] | None = None,
                 model_init: Callable[..., torch.nn.Module] | None = None,
                 optimizers: tuple[Any, Any] = (None, None)) -> None:
        if model is None and model_init is None:
            raise UserError("Trainer needs a model or a model_init")
        if model_init is not None:
            model_init_arity(model_init)
        if args is not None and not isinstance(args, TrainingArguments):
            raise UserError(f"args is a {type(args).__name__}; pass hpsweep.TrainingArguments(...)")
        self.args = args or TrainingArguments()
        self.model = model
        self.model_init = model_init
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.data_collator = data_collator
        self.compute_metrics = compute_metrics
        self.user_callbacks = list(callbacks or [])
        self.optimizers = optimizers
        self.state = TrainerState()
        self.control = TrainerControl()
        self._handler = CallbackHandler(self._default_callbacks() + self.user_callbacks)
        self._handler.fire("on_init_end", self.args, self.state, self.control)

    def _default_callbacks(self) -> list[TrainerCallback]:
        return [] if self.args.disable_progress else [ProgressCallback()]

    def add_callback(self, callback: TrainerCallback) -> None:
        self._handler.add(callback)

    # --- setup -------------------------------------------------------------------------------------

    def call_model_init(self, trial: Any = None) -> torch.nn.Module:
        assert self.model_init is not None
        return call_model_init(self.model_init, trial)

    def _make_accelerator(self) -> Any:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState, GradientState, PartialState
        from accelerate.utils import DataLoaderConfiguration

        _cache_accelerate_package_probes()
        if PartialState().num_processes == 1:
            # Each run may use a different precision; accelerate keeps a process-wide state.
            AcceleratorState._reset_state()
            GradientState._reset_state()
        try:
            return Accelerator(mixed_precision=self.args.mixed_precision, cpu=self.args.use_cpu,
                               gradient_accumulation_steps=self.args.gradient_accumulation_steps,
                               dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
        except ValueError as exc:
            raise UserError(f"mixed_precision={self.args.mixed_precision!r}: {exc}; use 'no' or 'bf16' on CPU") from None

    def _dataloader(self, dataset: Any, batch_size: int, shuffle: bool) -> DataLoader:
        dataset = resolve_dataset(dataset)
        return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle,
                          collate_fn=self.data_collator, drop_last=self.args.dataloader_drop_last and shuffle,
                          num_workers=self.args.dataloader_num_workers,
                          pin_memory=self.args.dataloader_pin_memory and torch.cuda.is_available(),
                          generator=torch.Generator().manual_seed(self.args.seed) if shuffle else None)

    # --- training ----------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None) -> TrainOutput:
        """Train from scratch, or from a checkpoint (``True``: the run's latest one).

        With a ``trial``, ``model_init(trial)`` builds the model and ``trial.params`` are recorded.
        """
        args = self.args
        _set_seed(args.seed)
        if self.model_init is not None:
            self.model = self.call_model_init(trial)
        if self.train_dataset is None:
            raise UserError("no train_dataset; give the Trainer a train_dataset")
        checkpoint = self._resolve_checkpoint(resume_from_checkpoint)

        self.accelerator = acc = self._make_accelerator()
        _check_not_empty(self.train_dataset, "train_dataset")
        train_dl = self._dataloader(self.train_dataset, args.per_device_train_batch_size, shuffle=True)
        if len(train_dl) == 0:
            raise UserError("train_dataset is empty (or smaller than one batch with dataloader_drop_last)")
        # Data-parallel, each of the N processes takes every N-th batch: an epoch is N times fewer
        # optimizer steps of an N times larger batch (as in Hugging Face's Trainer).
        batches = math.ceil(len(train_dl) / acc.num_processes)
        steps_per_epoch = max(1, math.ceil(batches / args.gradient_accumulation_steps))
        max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
        optimizer, scheduler = self.optimizers
        optimizer = optimizer or create_optimizer(self.model, args)
        scheduler = scheduler or create_scheduler(optimizer, args, max_steps)
        self.model_wrapped, self.optimizer, train_dl, self.lr_scheduler = acc.prepare(
            self.model, optimizer, train_dl, scheduler)
        model = self.model_wrapped
        if acc.num_processes > 1:  # max_steps counts optimizer steps: one schedule step each, not one per process
            self.lr_scheduler.split_batches = True

        self.state = state = TrainerState(max_steps=max_steps, steps_per_epoch=steps_per_epoch,
                                          num_train_epochs=math.ceil(max_steps / steps_per_epoch),
                                          trial_number=getattr(trial, "number", None),
                                          trial_params=dict(trial.params) if trial is not None else None)
        rng_state = None
        if checkpoint is not None:
            rng_state = self._load_checkpoint(checkpoint)
        self.control = control = TrainerControl()
        handler = self._handler
        handler.fire("on_train_begin", args, state, control)

        epochs_done, skip_steps = divmod(state.global_step, steps_per_epoch)
        running_loss = torch.zeros((), device=acc.device)
        logged_steps = 0
        try:
            for epoch in range(epochs_done, state.num_train_epochs):
                if hasattr(train_dl, "set_epoch"):
                    train_dl.set_epoch(epoch)
                loader = train_dl
                skipped = skip_steps * args.gradient_accumulation_steps if epoch == epochs_done else 0
                if skipped:  # resuming mid-epoch: the same order, without its first batches
                    loader = acc.skip_first_batches(train_dl, skipped)
                batches = iter(loader)
                if rng_state is not None:  # after the iterator drew its seed, as in the original run
                    runs.set_rng_state(rng_state)
                    rng_state = None
                handler.fire("on_epoch_begin", args, state, control)
                for micro_step, batch in enumerate(batches):
                    if micro_step % args.gradient_accumulation_steps == 0:
                        handler.fire("on_step_begin", args, state, control)
                    with acc.accumulate(model):
                        loss = self.compute_loss(model, batch)
                        handler.fire("on_before_backward", args, state, control)
                        acc.backward(loss)
                        handler.fire("on_after_backward", args, state, control)
                        if acc.sync_gradients:
                            if args.max_grad_norm > 0:
                                acc.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                            handler.fire("on_before_optimizer_step", args, state, control)
                        self.optimizer.step()  # accelerate skips it while accumulating
                        self.lr_scheduler.step()
                        if acc.sync_gradients:
                            handler.fire("on_optimizer_step", args, state, control)
                            # the model's zero_grad: accelerate's optimizer inspects a signature per call
                            model.zero_grad(set_to_none=True)
                    running_loss += loss.detach()
                    logged_steps += 1
                    if not acc.sync_gradients:
                        handler.fire("on_substep_end", args, state, control)
                        continue
                    state.global_step += 1
                    state.epoch = epoch + (skipped + micro_step + 1) / len(train_dl)
                    handler.fire("on_step_end", args, state, control)
                    self._flow_on_step(control)
                    running_loss, logged_steps = self._log_save_evaluate(running_loss, logged_steps)
                    if control.should_training_stop or control.should_epoch_stop:
                        break
                control.should_epoch_stop = False
                state.epoch = float(epoch + 1) if not control.should_training_stop else state.epoch
                self._flow_on_epoch(control)
                handler.fire("on_epoch_end", args, state, control)
                running_loss, logged_steps = self._log_save_evaluate(running_loss, logged_steps)
                if control.should_training_stop:
                    break
        except BaseException as exc:
            handler.fire("on_exception", args, state, control, exception=exc)
            raise
        if args.load_best_model_at_end and state.best_model_checkpoint:
            runs.load_weights(acc.unwrap_model(model), Path(state.best_model_checkpoint))
        handler.fire("on_train_end", args, state, control)
        losses = [h["loss"] for h in state.log_history if "loss" in h]
        return TrainOutput(state.global_step, float(np.mean(losses)) if losses else float("nan"),
                           self.last_eval_metrics())

    def _flow_on_step(self, control: TrainerControl) -> None:
        args, step = self.args, self.state.global_step
        control.should_log |= args.logging_strategy == "steps" and step % args.logging_steps == 0
        control.should_evaluate |= args.eval_strategy == "steps" and step % args.eval_steps == 0  # type: ignore[operator]
        control.should_save |= args.save_strategy == "steps" and step % args.save_steps == 0  # type: ignore[operator]
        if step >= self.state.max_steps:
            control.should_training_stop = True
            control.should_log |= args.logging_strategy != "no"
            control.should_save |= args.save_strategy == "steps"

    def _flow_on_epoch(self, control: TrainerControl) -> None:
        args = self.args
        control.should_log |= args.logging_strategy == "epoch"
        control.should_evaluate |= args.eval_strategy == "epoch"
        control.should_save |= args.save_strategy == "epoch"

    def _log_save_evaluate(self, running_loss: torch.Tensor, logged_steps: int) -> tuple[torch.Tensor, int]:
        control = self.control
        if control.should_log and logged_steps:
            logs = {"loss": round(float(running_loss) / logged_steps, 6),
                    "learning_rate": self.lr_scheduler.get_last_lr()[0]}
            self.log(logs)
            running_loss, logged_steps = torch.zeros_like(running_loss), 0
        control.should_log = False
        if control.should_evaluate:
            metrics = self.evaluate()
            self._track_best(metrics)
        control.should_evaluate = False
        if control.should_save:
            self.save_checkpoint()
        control.should_save = False
        return running_loss, logged_steps

    def log(self, logs: dict[str, float]) -> None:
        entry = {**logs, "epoch": round(self.state.epoch, 4), "step": self.state.global_step}
        self.state.log_history.append(entry)
        self._handler.fire("on_log", self.args, self.state, self.control, logs=logs)

    def _track_best(self, metrics: Mapping[str, float]) -> None:
        args = self.args
        if args.metric_for_best_model is None:
            return
        from .callbacks import metric_value

        value = metric_value(metrics, args.metric_for_best_model, "metric_for_best_model")
        if not self.control.should_save:  # the best is a checkpoint: only evaluations that get one count
            return
        if runs.is_better(value, self.state.best_metric, "maximize" if args.greater_is_better else "minimize"):
            self.state.best_metric = value
            self.state.best_model_checkpoint = str(self._checkpoint_dir())

    # --- the loss -----------------------------------------------------------------------------------

    def compute_loss(self, model: torch.nn.Module, batch: Any, return_outputs: bool = False) -> Any:
        """``model(**batch)`` or ``model(*batch)``; the output is the loss, or has ``loss``."""
        outputs = model(**batch) if isinstance(batch, Mapping) else (
            model(*batch) if isinstance(batch, (list, tuple)) else model(batch))
        if isinstance(outputs, torch.Tensor):
            loss, logits = outputs, None
        elif isinstance(outputs, Mapping):
            loss, logits = outputs.get("loss"), outputs.get("logits")
        else:
            loss, logits = getattr(outputs, "loss", None), getattr(outputs, "logits", None)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise UserError(f"the model's forward returned {type(outputs).__name__} without a scalar loss; return "
                            "the loss tensor or {'loss': loss, 'logits': logits} (pass labels in the batch)")
        loss = loss.reshape(())
        return (loss, logits) if return_outputs else loss

    # --- evaluation ---------------------------------------------------------------------------------

    def evaluate(self, eval_dataset: Any = None) -> dict[str, float]:
        """Evaluate on ``eval_dataset`` (the Trainer's by default); returns ``eval_*`` metrics."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise UserError("no eval_dataset to evaluate on; give the Trainer an eval_dataset, or set "
                            "eval_strategy='no' and an objective that needs no evaluation")
        acc = getattr(self, "accelerator", None) or self._make_accelerator()
        self.accelerator = acc
        if getattr(self, "model_wrapped", None) is None:
            if self.model is None:
                self.model = self.call_model_init(None)
            self.model_wrapped = acc.prepare(self.model)
        model = self.model_wrapped
        dl = acc.prepare(self._dataloader(dataset, self.args.per_device_eval_batch_size, shuffle=False))
        want_predictions = self.compute_metrics is not None or self._handler.needs_predictions()
        total_loss, count, logits_all, labels_all = 0.0, 0, [], []
        was_training = model.training
        model.eval()
        with torch.no_grad():
            for batch in dl:
                loss, logits = self.compute_loss(model, batch, return_outputs=True)
                loss_sum, size = _loss_sum(acc, loss, batch)
                total_loss += loss_sum
                count += size
                if want_predictions and logits is not None:
                    logits_all.append(acc.gather_for_metrics(logits).float().cpu().numpy())
                    labels = batch_labels(batch)
                    if labels is not None:
                        labels_all.append(acc.gather_for_metrics(labels).cpu().numpy())
        model.train(was_training)
        metrics: dict[str, float] = {"eval_loss": total_loss / max(count, 1)}
        prediction = None
        if logits_all:
            prediction = EvalPrediction(np.concatenate(logits_all),
                                        np.concatenate(labels_all) if labels_all else None)
        if self.compute_metrics is not None:
            if prediction is None:
                raise UserError("compute_metrics needs predictions, but the model's output has no logits; "
                                "return {'loss': ..., 'logits': ...} from forward")
            computed = self.compute_metrics(prediction)
            if not isinstance(computed, Mapping):
                raise UserError(f"compute_metrics returned {type(computed).__name__}; return a dict of metric name -> "
                                "float, e.g. {'accuracy': 0.9}")
            for key, value in computed.items():
                metrics[key if key.startswith("eval_") else f"eval_{key}"] = float(value)
        self.state.num_evaluations += 1
        self._handler.fire("on_evaluate", self.args, self.state, self.control, metrics=metrics,
                           eval_prediction=prediction)
        self.state.log_history.append({**metrics, "epoch": round(self.state.epoch, 4), "step": self.state.global_step})
        return metrics

    def last_eval_metrics(self) -> dict[str, float]:
        """The metrics of the latest evaluation (of the best one after ``load_best_model_at_end``)."""
        evals = [h for h in self.state.log_history if "eval_loss" in h]
        if not evals:
            return {}
        chosen = evals[-1]
        best = self.state.best_model_checkpoint
        if self.args.load_best_model_at_end and best:
            step = int(Path(best).name[len(runs.CHECKPOINT_PREFIX):])
            chosen = next((h for h in reversed(evals) if h["step"] == step), chosen)
        return {k: v for k, v in chosen.items() if k not in ("epoch", "step")}

    # --- checkpoints -------------------------------------------------------------------------------

    def _checkpoint_dir(self) -> Path:
        return Path(self.args.output_dir) / f"{runs.CHECKPOINT_PREFIX}{self.state.global_step}"

    def save_checkpoint(self) -> Path:
        """Write ``checkpoint-<step>`` atomically, then rotate old ones (never the best)."""
        final = self._checkpoint_dir()
        self.state.callbacks = self._handler.state_dicts()
        acc = self.accelerator
        if acc.is_main_process:  # data-parallel processes hold the same weights: the first writes them
            runs.write_checkpoint(final, model=acc.unwrap_model(self.model_wrapped), optimizer=self.optimizer,
                                  scheduler=self.lr_scheduler, state=self.state.to_dict(), args=self.args.to_dict())
            best = self.state.best_model_checkpoint
            runs.rotate_checkpoints(final.parent, self.args.save_total_limit, Path(best) if best else None)
        acc.wait_for_everyone()  # the others may read it next (the best model, the final checkpoint)
        self._handler.fire("on_save", self.args, self.state, self.control, checkpoint=str(final))
        return final

    def save_model(self, output_dir: str | Path) -> None:
        """Weights only (safetensors, plus config.json for Hugging Face models)."""
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        model = self.accelerator.unwrap_model(self.model_wrapped) if hasattr(self, "accelerator") else self.model
        runs.save_weights(model, output_dir)

    def _resolve_checkpoint(self, resume: str | bool | None) -> Path | None:
        if not resume:
            return None
        if resume is True:
            found = runs.latest_checkpoint(Path(self.args.output_dir))
            if found is None:
                raise UserError(f"resume_from_checkpoint=True, but {self.args.output_dir} holds no checkpoint")
            return found
        path = Path(resume)
        if not (path / "trainer_state.json").exists():
            raise UserError(f"{path} is not a checkpoint folder (no trainer_state.json); give a checkpoint-<step> folder")
        return path

    def _load_checkpoint(self, folder: Path) -> Any:
        """Restore weights, optimizer, scheduler, trainer and callback state; returns the RNG state."""
        state, rng_state = runs.read_checkpoint(folder, model=self.accelerator.unwrap_model(self.model_wrapped),
                                                optimizer=self.optimizer, scheduler=self.lr_scheduler)
        saved = TrainerState.from_dict(state)
        for name in ("global_step", "epoch", "num_evaluations", "log_history", "best_metric", "best_model_checkpoint",
                     "callbacks"):
            setattr(self.state, name, getattr(saved, name))
        self._handler.load_state_dicts(saved.callbacks)
        return rng_state

    # --- search --------------------------------------------------------------------------------------

    def hyperparameter_search(self, space: Mapping[str, Any] | None = None, n_trials: int | None = 20,
                              direction: str | Sequence[str] = "minimize",
                              objective: str | Callable[[Mapping[str, float]], Any] | None = None,
                              backend: str = "optuna", hp_name: Callable[[Any], str] | None = None,
                              hp_space: Callable[[Any], dict[str, Any]] | None = None,
                              compute_objective: Callable[[Mapping[str, float]], Any] | None = None,
                              **backend_options: Any) -> Any:
        """Search ``space`` (or define-by-run ``hp_space``) with ``backend``; returns the `BestRun`
        (the Pareto front, a list, for several directions). Keyword options: ``timeout``,
        ``n_jobs``, ``sampler``, ``pruner``, ``scheduler``, ``storage``, ``study_name``, ``seed``,
        ``resume``, ``address``, ``resources_per_trial``, ``processes_per_trial``, ``sweep_callbacks``."""
        from .sweep import search

        if self.model_init is None:
            raise UserError("hyperparameter_search needs Trainer(model_init=...) to build a fresh model per trial")
        return search(self, space=space, hp_space=hp_space, n_trials=n_trials, direction=direction,
                      objective=objective if objective is not None else compute_objective,
                      backend=backend, hp_name=hp_name, **backend_options)


# --- helpers -------------------------------------------------------------------------------------------

def _cache_accelerate_package_probes() -> None:
    """accelerate's optimizer asks `is_lomo_available()` twice per step, and each answer is a
    filesystem search (importlib find_spec + package metadata): ~0.3 ms a step, a third of a small
    model's step here. Installed packages do not change while we train, so ask once."""
    import functools

    import accelerate.optimizer as acc_optimizer

    probe = acc_optimizer.is_lomo_available
    if not hasattr(probe, "cache_info"):
        acc_optimizer.is_lomo_available = functools.cache(probe)


def _loss_sum(acc: Any, loss: torch.Tensor, batch: Any) -> tuple[float, int]:
    """A batch's loss times its size, and its size; data-parallel, over every process's batch
    (without the samples accelerate repeats to even out the last batches, as for predictions)."""
    if acc.num_processes == 1:
        size = batch_size(batch)
        return float(loss) * size, size
    losses = acc.gather_for_metrics(loss.detach().float().repeat(batch_size(batch)))
    return float(losses.sum()), losses.numel()


def _check_not_empty(dataset: Any, name: str) -> None:
    """An empty dataset fails every trial the same way: say so, instead of torch's sampler error."""
    resolved = resolve_dataset(dataset)
    if hasattr(resolved, "__len__") and len(resolved) == 0:
        raise UserError(f"{name} is empty (0 samples); give it data")
