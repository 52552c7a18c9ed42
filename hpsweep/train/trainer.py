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

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from hpsweep.errors import UserError
from hpsweep.train import optim
from hpsweep.train.arguments import TrainingArguments
from hpsweep.train.batch_size_finder import train_finding_batch_size
from hpsweep.train.callbacks import (
    CallbackHandler,
    EvalPrediction,
    NEFTune,
    ProgressCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)
from hpsweep.train.data import (
    Collator,
    batched,
    check_trainable,
    default_data_collator,
    is_hf_dataset,
    remove_unused_columns,
    resolve_dataset,
    signature_columns,
    split_labels,
    train_sampler,
)
from hpsweep.train.evaluation import Evaluation, check_batch_metrics
from hpsweep.train.hf_compat.api import TransformersTrainerAPI
from hpsweep.train.hf_compat.args import as_training_arguments
from hpsweep.train.hf_compat.components import default_collator, trainer_components
from hpsweep.train.log_levels import apply_log_level
from hpsweep.train.model_init import call_model_init, model_init_arity
from hpsweep.train.predictions import (
    call_model,
    describe,
    label_smoothed_loss,
    loss_of,
    smooths_labels,
)
from hpsweep.train.run_state import RunState
from hpsweep.train.trainer_checkpoints import Checkpointing
from hpsweep.train.training_loop import TrainingLoop, TrainOutput


class Trainer(Checkpointing, Evaluation, TransformersTrainerAPI):
    """Train and evaluate a model; search hyperparameters with `hyperparameter_search`.

    The parameters are transformers' own, in its order, so a ``transformers.Trainer(...)`` call
    works with the import changed (docs/huggingface.md).

    Args:
        model: the model to train (with ``model_init`` too, ``train`` uses ``model_init``).
        args: our `TrainingArguments`, or a ``transformers.TrainingArguments`` (converted).
        data_collator: list of samples -> batch; by default ``DataCollatorWithPadding`` when
            ``processing_class`` is a tokenizer, else transformers' ``default_data_collator`` rule.
        train_dataset: a torch or ``datasets`` Dataset, or a 0-argument factory returning one.
        eval_dataset: the same, or a dict of them by name (``eval_<name>_*`` metrics).
        processing_class: a tokenizer or processor, saved beside the weights in every checkpoint
            (``tokenizer=`` is the same).
        model_init: ``() -> nn.Module`` or ``(trial) -> nn.Module``, building a fresh model for
            every run.
        compute_loss_func: ``(outputs, labels, num_items_in_batch=None) -> loss``.
        compute_metrics: ``EvalPrediction -> dict[str, float]``; keys are prefixed ``eval_``.
        callbacks: extra `TrainerCallback` instances.
        optimizers: an ``(optimizer, scheduler)`` pair to use instead of building them from args.
        preprocess_logits_for_metrics: ``(logits, labels) -> logits`` per evaluation batch.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        args: Any = None,
        data_collator: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        model_init: Callable[..., torch.nn.Module] | None = None,
        compute_loss_func: Callable[..., Any] | None = None,
        compute_metrics: Callable[[EvalPrediction], Mapping[str, float]] | None = None,
        callbacks: Sequence[TrainerCallback] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None = None,
        *,
        tokenizer: Any = None,
        optimizer_cls_and_kwargs: Any = None,
    ) -> None:
        if model is None and model_init is None:
            raise UserError("Trainer needs a model or a model_init")
        if model_init is not None:
            model_init_arity(model_init)
        self.args = (
            as_training_arguments(args, "Trainer(args=...)")
            if args is not None
            else TrainingArguments()
        )
        apply_log_level(self.args)
        self.model = model
        self.model_init = model_init
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.compute_metrics = compute_metrics
        check_batch_metrics(self.args, compute_metrics)
        self.optimizers = optimizers
        self.optimizer, self.lr_scheduler = optimizers
        # They ride with the callbacks, so that every trial's trainer gets them (HFComponents).
        self._components, self.user_callbacks = trainer_components(
            list(callbacks or []),
            processing_class=processing_class,
            tokenizer=tokenizer,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            compute_loss_func=compute_loss_func,
            model_init=model_init,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
        )
        self.data_collator = (
            data_collator or default_collator(self.processing_class) or default_data_collator
        )
        self._columns_removed: dict[tuple[int, tuple[str, ...]], tuple[Any, Any]] = {}
        self.state = TrainerState()
        self.control = TrainerControl()
        # each training run hands its own (`TrainingLoop`); evaluations before any use this one
        self.run_state = RunState()
        self.callback_handler = CallbackHandler(
            self._default_callbacks() + self.user_callbacks, _context_of(weakref.ref(self))
        )
        self.callback_handler.fire("on_init_end", self.args, self.state, self.control)

    @property
    def processing_class(self) -> Any:
        return self._components.processing_class

    tokenizer = processing_class  # transformers 4's name

    @property
    def preprocess_logits_for_metrics(self) -> Callable[[Any, Any], Any] | None:
        return self._components.preprocess_logits_for_metrics

    @property
    def compute_loss_func(self) -> Callable[..., Any] | None:
        return self._components.compute_loss_func

    def _callback_context(self) -> dict[str, Any]:
        """What every event hands the callbacks, as transformers' handler does."""
        return {
            "model": self.model,
            "processing_class": self.processing_class,
            "optimizer": self.optimizer,
            "lr_scheduler": self.lr_scheduler,
            "train_dataloader": self.run_state.train_dataloader,
            "eval_dataloader": self.run_state.eval_dataloader,
        }

    def _default_callbacks(self) -> list[TrainerCallback]:
        return [NEFTune()] + ([] if self.args.disable_progress else [ProgressCallback()])

    # --- setup -------------------------------------------------------------------------------------

    def call_model_init(self, trial: Any = None) -> torch.nn.Module:
        assert self.model_init is not None
        return call_model_init(self.model_init, trial)

    def _dataloader(self, dataset: Any, batch_size: int, train: bool) -> DataLoader:
        """Batches of what the model takes (``remove_unused_columns``); training's in its sampling order."""
        dataset = given = resolve_dataset(dataset)
        what = "train_dataset" if train else "eval_dataset"
        columns = (
            signature_columns(self.model, self.args.label_names)
            if self.args.remove_unused_columns
            else None
        )
        if columns is not None and self.compute_loss_func is not None:
            columns.append("labels")  # compute_loss_func takes them, even when the forward does not
        if is_hf_dataset(dataset):
            key = (id(dataset), tuple(columns or ()))
            # a datasets.Dataset without them, made once per dataset
            if key not in self._columns_removed:
                self._columns_removed[key] = (
                    dataset,
                    remove_unused_columns(dataset, columns, self.model, what),
                )
            dataset, columns = self._columns_removed[key][1], None
        # the order of the data
        seed = self.args.seed if self.args.data_seed is None else self.args.data_seed
        sampler = train_sampler(given, self.args, seed, self.processing_class) if train else None
        shuffled, args = train and sampler is None, self.args
        return DataLoader(
            batched(dataset, self.data_collator),
            batch_size=batch_size,
            shuffle=shuffled,
            sampler=sampler,
            collate_fn=Collator(self.data_collator, columns, what),
            num_workers=args.dataloader_num_workers,
            drop_last=args.dataloader_drop_last and train,
            pin_memory=args.dataloader_pin_memory and torch.cuda.is_available(),
            generator=torch.Generator().manual_seed(seed) if shuffled else None,
            **_worker_options(args),
        )

    # --- transformers' override points: what a subclass replaces -------------------------------------
    # A sweep builds every trial's trainer from the class of the one it was given, so a subclass's
    # methods run in every trial.

    def get_train_dataloader(self) -> DataLoader:
        """The training batches: ``train_dataset`` in ``per_device_train_batch_size`` batches, shuffled (by
        ``data_seed`` or ``seed``) unless ``train_sampling_strategy`` says otherwise. An override may return
        any ``DataLoader``, prepared by ``self.accelerator`` or not; `train` prepares it if it is not."""
        if self.train_dataset is None:
            raise UserError("no train_dataset; give the Trainer a train_dataset")
        check_trainable(self.train_dataset, "train_dataset")
        return self._dataloader(
            self.train_dataset, self.args.per_device_train_batch_size, train=True
        )

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        """Set ``self.optimizer`` and ``self.lr_scheduler`` for a run of ``num_training_steps``
        optimizer steps; each is built only when the ``optimizers=`` pair did not give it. With
        ``model_init``, where each run has a new model, this is where a custom optimizer goes."""
        self.create_optimizer()
        self.create_scheduler(num_training_steps, optimizer=self.optimizer)

    def create_optimizer(self) -> torch.optim.Optimizer:
        """``self.optimizer``, built from ``args`` (``optim``, ``learning_rate``, ``weight_decay``,
        ...) over ``self.model`` when it is None."""
        if self.optimizer is None:
            self.optimizer = optim.create_optimizer(self.model, self.args)
        return self.optimizer

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        """``self.lr_scheduler`` (``args.lr_scheduler_type`` with warmup), built when it is None."""
        if self.lr_scheduler is None:
            self.lr_scheduler = optim.create_scheduler(
                optimizer or self.optimizer, self.args, num_training_steps
            )
        return self.lr_scheduler

    def training_step(
        self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """One batch forward and backward (``compute_loss``, then ``accelerator.backward``, with
        the ``on_before_backward`` / ``on_after_backward`` events around it); returns the loss,
        detached. The loop clips, steps the optimizer and zeroes the gradients afterwards."""
        loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        self.callback_handler.fire("on_before_backward", self.args, self.state, self.control)
        self.run_state.step_ops.backward(loss)
        self.callback_handler.fire("on_after_backward", self.args, self.state, self.control)
        return loss.detach()

    # --- training ----------------------------------------------------------------------------------

    def train(
        self, resume_from_checkpoint: str | bool | None = None, trial: Any = None
    ) -> TrainOutput:
        """Train from scratch, or from a checkpoint (``True``: the run's latest one; None: the
        arguments' ``resume_from_checkpoint``, outside a sweep's trial).

        With a ``trial``, ``model_init(trial)`` builds the model and ``trial.params`` are recorded.
        Checkpoints are written in the background; every one is on disk when this returns. With
        ``auto_find_batch_size``, a run that runs out of memory starts again with half the batch
        (`train_finding_batch_size`). The loop itself, step by step, is `TrainingLoop`.
        """
        if trial is None:  # a run of its own, not a sweep's trial
            _refuse_push(self.args)
            if resume_from_checkpoint is None:
                resume_from_checkpoint = self.args.resume_from_checkpoint
        if self.args.auto_find_batch_size:
            return train_finding_batch_size(self, resume_from_checkpoint, trial)
        return TrainingLoop(self, trial).run(resume_from_checkpoint)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Hand ``logs`` with the epoch to the ``on_log`` callbacks and append them, with the step too,
        to ``state.log_history``, as transformers does; with ``include_num_input_tokens_seen``, the
        input tokens trained on so far too. ``start_time`` is transformers' parameter (its tokens per
        second), accepted and unused."""
        logs = {**logs, "epoch": self.state.epoch}
        if self.args.include_num_input_tokens_seen != "no":
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.callback_handler.fire("on_log", self.args, self.state, self.control, logs=logs)

    def release_run(self) -> None:
        """Drop what the last run holds (model, optimizer, scheduler, accelerator, its prepared
        loaders and per-step operations) so that its memory can go, as a sweep's worker does
        between trials (`hpsweep.devices.memory.release`); ``state`` stays readable."""
        self.model = self.model_wrapped = self.model_init = None
        self.optimizer = self.lr_scheduler = self.optimizers = None
        self.accelerator = None
        self.run_state = RunState()

    # --- the loss -----------------------------------------------------------------------------------

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: Any,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """The loss of one batch, as transformers reads it: the model's output itself (a tensor), its
        ``loss`` (a dict or ``ModelOutput``) or its first element (a tuple); or
        ``compute_loss_func(outputs, labels, num_items_in_batch=...)`` with the labels taken out of
        the batch first, or with ``label_smoothing_factor`` transformers' label-smoothed loss. With
        ``return_outputs``, ``(loss, outputs)``."""
        labels, smoothing = None, smooths_labels(self.args, model)
        if self.compute_loss_func is not None or smoothing:
            inputs, labels = split_labels(inputs)
        outputs = call_model(model, inputs)
        if self.compute_loss_func is not None:
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        elif smoothing and labels is not None:
            loss = label_smoothed_loss(
                model, outputs, labels, self.args.label_smoothing_factor, num_items_in_batch
            )
        else:
            loss = loss_of(outputs)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise UserError(
                f"the model returned {describe(outputs)} without a scalar loss; put the labels in the batch "
                "(a 'labels' column, or name them with label_names), return the loss first, or pass "
                "compute_loss_func="
            )
        loss = loss.reshape(())
        return (loss, outputs) if return_outputs else loss

    # --- search --------------------------------------------------------------------------------------

    def hyperparameter_search(
        self,
        space: Mapping[str, Any] | None = None,
        n_trials: int | None = 20,
        direction: str | Sequence[str] = "minimize",
        objective: str | Callable[[Mapping[str, float]], Any] | None = None,
        backend: str | None = "optuna",
        hp_name: Callable[[Any], str] | None = None,
        hp_space: Callable[[Any], dict[str, Any]] | None = None,
        compute_objective: Callable[[Mapping[str, float]], Any] | None = None,
        **backend_options: Any,
    ) -> Any:
        """Search ``space`` (or define-by-run ``hp_space``) with ``backend``; returns the `BestRun`
        (the Pareto front, a list, for several directions). Keyword options: ``timeout``,
        ``n_jobs``, ``sampler``, ``pruner``, ``scheduler``, ``storage``, ``study_name``, ``seed``,
        ``resume``, ``address``, ``resources_per_trial``, ``processes_per_trial``,
        ``max_failed_trials``, ``sweep_callbacks``, ``show_progress``, ``warm_start``,
        ``warm_start_best``, ``stop_when`` (``hpsweep.search.options`` says what each means); any other keyword
        is an option of the backend.

        transformers' keywords work too (``hp_space=``, ``compute_objective=``, ``backend=None`` for
        Optuna, ``directions=[...]`` as its docs write it), and so does its first positional
        parameter, ``hp_space``; so do those it hands each backend's library (the README's
        "Coming from Hugging Face's Trainer")."""
        from hpsweep.search.sweep import SearchOptions, search

        if callable(space) and hp_space is None:  # transformers' first parameter is hp_space
            space, hp_space = None, space
        if self.model_init is None:
            raise UserError(
                "hyperparameter_search needs Trainer(model_init=...) to build a fresh model per trial"
            )
        options = SearchOptions.from_keywords(
            space=space,
            hp_space=hp_space,
            n_trials=n_trials,
            direction=direction,
            objective=objective if objective is not None else compute_objective,
            backend=backend or "optuna",
            hp_name=hp_name,
            **backend_options,
        )
        return search(self, options)


def _refuse_push(args: TrainingArguments) -> None:
    """``push_to_hub`` on a ``train()`` of its own: one line, as hpsweep pushes a sweep's best run
    (a sweep's trials train with it off)."""
    if args.push_to_hub:
        raise UserError(
            "push_to_hub=True pushes a sweep's best run when hyperparameter_search ends; a single "
            "train() does not push: add PushToHubCallback(REPO_ID) to callbacks, or leave "
            "push_to_hub=False"
        )


def _context_of(trainer: weakref.ref) -> Callable[[], dict[str, Any]]:
    """The trainer's `_callback_context`, through a weak reference: its callback handler must not
    keep it (and its model) alive in a cycle."""

    def context() -> dict[str, Any]:
        owner = trainer()
        return owner._callback_context() if owner is not None else {}

    return context


def _worker_options(args: TrainingArguments) -> dict[str, Any]:
    """The ``DataLoader`` options that only worker processes take, as transformers passes them:
    with ``dataloader_num_workers > 0`` only (torch refuses them otherwise)."""
    if args.dataloader_num_workers == 0:
        return {}
    return {
        "persistent_workers": args.dataloader_persistent_workers,
        "prefetch_factor": args.dataloader_prefetch_factor,
        "multiprocessing_context": args.dataloader_multiprocessing_context,
        # torch 2.6's option, passed only when asked for, so that older torch builds still load
        **({} if args.dataloader_in_order else {"in_order": False}),
    }
