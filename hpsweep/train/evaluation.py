"""Evaluation and prediction: a pass over a dataset without gradients, gathering its loss,
predictions and metrics, and the `Trainer` methods built on it (`evaluate`, `predict`).

`Evaluation` is a mixin of `Trainer` (as transformers' models take ``generate`` from
``GenerationMixin``): it reads the trainer's ``args``, ``state``, model, callbacks and metric
functions, and keeps its prepared loaders in the run's `RunState` (``run_state``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hpsweep.errors import UserError
from hpsweep.train.accelerator import bare_model, is_prepared_loader, make_accelerator
from hpsweep.train.batch_size_finder import not_a_smaller_train_batch
from hpsweep.train.callbacks import (
    CallbackHandler,
    EvalLoopOutput,
    MetricCallback,
    PredictionOutput,
)
from hpsweep.train.data import (
    batch_labels,
    batch_size,
    is_several_datasets,
    label_names_for,
    resolve_dataset,
)
from hpsweep.train.memory_metrics import MemoryTracker, stop_tracking
from hpsweep.train.metrics import speed_metrics
from hpsweep.train.predictions import (
    HFEvalPrediction,
    PredictionCollector,
    call_model,
    ignore_keys_for,
    loss_of,
    predictions_of,
    smooths_labels,
)
from hpsweep.train.run_state import RunState


class Evaluation:
    """`Trainer.evaluate` and `Trainer.predict`, and the pass they share. The trainer provides
    ``args``, ``state``, ``control``, the model (``model``, ``model_wrapped``, ``model_init``),
    ``compute_loss``, ``log``, ``compute_metrics``, ``preprocess_logits_for_metrics``,
    ``compute_loss_func``, its callback handler, its ``_dataloader`` and its ``run_state``.
    ``label_names`` is set for each pass, as transformers' Trainer names them: the labels
    `prediction_step` looks for."""

    callback_handler: CallbackHandler
    run_state: RunState

    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """Evaluate on ``eval_dataset`` (the Trainer's by default); returns ``eval_*`` metrics
        (``<metric_key_prefix>_*``, with every `MetricCallback`'s metric), logs them (`log`:
        ``log_history``, ``on_log``) and hands them to ``on_evaluate`` callbacks (a trial's pruner),
        in transformers' order.

        ``compute_metrics`` gets the predictions (all the model returned but the loss) and the labels
        (``label_names``, else the forward's ``*label*`` parameters), as transformers hands them.

        Several datasets, as transformers takes them (``{"val": ..., "test": ...}``, as
        ``eval_dataset`` here or in the Trainer), give ``<prefix>_<name>_*`` metrics for each, in
        one evaluation: one ``on_evaluate`` (one report to a trial's pruner) and one log entry,
        where transformers makes one per dataset. A name picks one of the Trainer's datasets."""
        dataset = resolve_dataset(eval_dataset if eval_dataset is not None else self.eval_dataset)
        if isinstance(dataset, str):
            dataset = self._named_eval_dataset(dataset)
        if dataset is None:
            raise UserError(
                "no eval_dataset to evaluate on; give the Trainer an eval_dataset, or set "
                "eval_strategy='no' and an objective that needs no evaluation"
            )
        if is_several_datasets(dataset):
            if not dataset:
                raise UserError("eval_dataset is an empty dict; give it {name: dataset} entries")
            metrics, prediction = {}, {}
            for name, part in dataset.items():
                part_metrics, prediction[name] = self._evaluation(
                    resolve_dataset(part),
                    ignore_keys,
                    f"{metric_key_prefix}_{name}",
                    predicting=False,
                )
                metrics.update(part_metrics)
        else:
            metrics, prediction = self._evaluation(
                dataset, ignore_keys, metric_key_prefix, predicting=False
            )
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, MetricCallback):
                metrics.update(callback.metrics(prediction, metric_key_prefix))
        self.log(metrics)
        self.callback_handler.fire(
            "on_evaluate",
            self.args,
            self.state,
            self.control,
            metrics=metrics,
            eval_prediction=prediction,
            metric_key_prefix=metric_key_prefix,
        )
        return metrics

    def _named_eval_dataset(self, name: str) -> Any:
        datasets = resolve_dataset(self.eval_dataset)
        if not is_several_datasets(datasets) or name not in datasets:
            known = (
                f"its datasets are {', '.join(map(repr, datasets))}"
                if is_several_datasets(datasets)
                else "its eval_dataset is not a dict of datasets"
            )
            raise UserError(f"evaluate({name!r}) names no eval dataset of the Trainer; {known}")
        return resolve_dataset(datasets[name])

    def predict(
        self,
        test_dataset: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
    ) -> PredictionOutput:
        """The model's predictions on ``test_dataset``, as transformers' ``predict`` returns them:
        ``PredictionOutput(predictions, label_ids, metrics)``. The dataset may lack labels (then
        ``label_ids`` is None, and the metrics hold neither a loss nor ``compute_metrics``'s).
        Callbacks get ``on_predict``, not ``on_evaluate``: no pruner or early stop reads it."""
        metrics, prediction = self._evaluation(
            test_dataset, ignore_keys, metric_key_prefix, predicting=True
        )
        self.callback_handler.fire(
            "on_predict", self.args, self.state, self.control, metrics=metrics
        )
        if prediction is None:
            return PredictionOutput(None, None, metrics)
        return PredictionOutput(prediction.predictions, prediction.label_ids, metrics)

    def _evaluation(
        self, dataset: Any, ignore_keys: list[str] | None, prefix: str, predicting: bool
    ) -> tuple[dict[str, float], Any]:
        """One pass over ``dataset`` without gradients: its ``<prefix>_*`` metrics and the gathered
        predictions (None when nobody needs them). The metrics end, as transformers' do, with the
        pass's ``<prefix>_runtime``, ``_samples_per_second`` and ``_steps_per_second``."""
        # skip_memory_metrics=False, outside a training run (which counts its evaluations itself)
        training = self.run_state.memory is not None
        memory = None if training else MemoryTracker.start(self.args, prefix)
        try:
            metrics, prediction = self._timed_evaluation(dataset, ignore_keys, prefix, predicting)
        finally:
            memory_metrics = stop_tracking(memory)
        return metrics | memory_metrics, prediction

    def _timed_evaluation(
        self, dataset: Any, ignore_keys: list[str] | None, prefix: str, predicting: bool
    ) -> tuple[dict[str, float], Any]:
        """`_evaluation`'s pass and its speed metrics."""
        started = time.time()
        self._prepare_for_evaluation()
        dl = self.get_test_dataloader(dataset) if predicting else self.get_eval_dataloader(dataset)
        # with batch_eval_metrics, compute_metrics reads each batch as it comes, not the whole
        metrics_read_all = self.compute_metrics is not None and not self.args.batch_eval_metrics
        wanted = (predicting or metrics_read_all) and not self.args.prediction_loss_only
        collect = wanted or self.callback_handler.needs_predictions()
        with not_a_smaller_train_batch(self.args):
            # a subclass's own loop, as transformers
            if type(self).evaluation_loop is not Evaluation.evaluation_loop:
                out = self.evaluation_loop(
                    dl,
                    "Prediction" if predicting else "Evaluation",
                    prediction_loss_only=None if collect else True,
                    ignore_keys=ignore_keys,
                    metric_key_prefix=prefix,
                )
                metrics, samples = dict(out.metrics), out.num_samples
                prediction = (
                    HFEvalPrediction(out.predictions, out.label_ids)
                    if out.predictions is not None
                    else None
                )
            else:
                metrics, prediction, samples = self._evaluation_pass(
                    dl, ignore_keys, prefix, collect=collect, metrics_need_labels=predicting
                )
        batch = (
            getattr(dl, "total_batch_size", None)
            or getattr(dl, "batch_size", None)
            or self.args.per_device_eval_batch_size
        )
        metrics.update(
            speed_metrics(prefix, started, steps=math.ceil(samples / batch), samples=samples)
        )
        return metrics, prediction

    def evaluation_loop(
        self,
        dataloader: Any,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> EvalLoopOutput:
        """transformers' loop behind `evaluate` and `predict`, for an override of either that runs
        it itself (as transformers' question-answering example does): one pass over ``dataloader``,
        returning ``EvalLoopOutput(predictions, label_ids, metrics, num_samples)``. The predictions
        are gathered unless ``prediction_loss_only``; ``compute_metrics`` runs when there are labels.
        A subclass that overrides it decides what `evaluate` and `predict` compute, as in transformers."""
        self._prepare_for_evaluation()
        metrics, prediction, samples = self._evaluation_pass(
            dataloader,
            ignore_keys,
            metric_key_prefix,
            collect=not prediction_loss_only,
            metrics_need_labels=True,
        )
        if prediction is None:
            return EvalLoopOutput(None, None, metrics, samples)
        return EvalLoopOutput(prediction.predictions, prediction.label_ids, metrics, samples)

    def _prepare_for_evaluation(self) -> None:
        """The accelerator and the prepared model, made here when no training run made them."""
        acc = getattr(self, "accelerator", None) or make_accelerator(self.args)
        self.accelerator = acc
        if getattr(self, "model_wrapped", None) is None:
            if self.model is None:
                self.model = self.call_model_init(None)
            self.model_wrapped = acc.prepare(self.model)

    def _evaluation_pass(
        self,
        dl: Any,
        ignore_keys: list[str] | None,
        prefix: str,
        *,
        collect: bool,
        metrics_need_labels: bool,
    ) -> tuple[dict[str, float], Any, int]:
        """The pass: ``<prefix>_loss`` and ``compute_metrics``' metrics, the gathered predictions
        (with ``collect``) and the number of samples. ``compute_metrics`` runs without labels too
        unless ``metrics_need_labels`` (an evaluation needs them; transformers' predict skips it)."""
        acc, model = self.accelerator, self.model_wrapped
        if not is_prepared_loader(dl):  # an override's own DataLoader
            dl = acc.prepare(dl)
        self.run_state.eval_dataloader = dl
        if hasattr(dl, "set_epoch"):
            dl.set_epoch(0)  # every evaluation reads the data as the first one did
        unwrapped = bare_model(model)
        # as transformers' Trainer names them
        self.label_names = label_names_for(unwrapped, self.args.label_names)
        args = self.args
        per_batch = (
            BatchMetrics(self.compute_metrics)
            if args.batch_eval_metrics
            and self.compute_metrics is not None
            and not args.prediction_loss_only
            else None
        )
        collector = PredictionCollector(
            acc,
            model=unwrapped,
            enabled=collect or per_batch is not None,
            keep=collect,
            preprocess=self.preprocess_logits_for_metrics,
            include=args.include_for_metrics,
            concat_batches=args.eval_do_concat_batches,
            cpu_every=args.eval_accumulation_steps,
            per_batch=per_batch,
        )
        step = functools.partial(
            self.prediction_step,
            prediction_loss_only=not collector.enabled,
            ignore_keys=ignore_keys if ignore_keys is not None else ignore_keys_for(unwrapped),
        )
        if self.callback_handler.listens("on_prediction_step"):
            step = functools.partial(_then_fire, step, self.callback_handler, self)
        loss, rows = evaluation_loop(
            model, dl, step, collector, full_eval_precision(self.args, acc.device)
        )
        metrics = {f"{prefix}_loss": loss} if loss is not None else {}
        prediction = collector.result()
        labelled = prediction is not None and prediction.label_ids is not None
        if per_batch is not None:
            metrics.update(prefixed(per_batch.metrics, prefix))
        elif (
            self.compute_metrics is not None
            and (labelled or not metrics_need_labels)
            and not args.prediction_loss_only
        ):
            metrics.update(computed_metrics(self.compute_metrics, prediction, prefix))
        data = getattr(dl, "dataset", None)
        return (
            metrics,
            prediction,
            len(data) if hasattr(data, "__len__") else rows * acc.num_processes,
        )

    # --- transformers' override points (see Trainer) --------------------------------------------------

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """The evaluation batches of ``eval_dataset`` (the Trainer's by default), in
        ``per_device_eval_batch_size`` batches, prepared by ``self.accelerator``. An override may
        return a plain ``DataLoader``; the evaluation prepares it."""
        return self._prepared_loader(
            eval_dataset if eval_dataset is not None else self.eval_dataset
        )

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        """`predict`'s batches of ``test_dataset``, as `get_eval_dataloader` makes them."""
        return self._prepared_loader(test_dataset)

    def _prepared_loader(self, dataset: Any) -> Any:
        # One prepared loader per dataset and training run: building and preparing it anew cost
        # every evaluation more than a small model's forward passes (and grew accelerate's list).
        acc = self.accelerator
        loaders = self.run_state.eval_loaders
        key = (id(dataset), self.args.per_device_eval_batch_size, id(acc))
        if key not in loaders:
            loaders[key] = (
                dataset,
                acc.prepare(
                    self._dataloader(dataset, self.args.per_device_eval_batch_size, train=False)
                ),
            )
        return loaders[key][1]

    def prediction_step(
        self,
        model: Any,
        inputs: Any,
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[Any, Any, Any]:
        """One batch without gradients: ``(loss, logits, labels)``, each None where there is none.

        A batch with labels takes its loss from ``compute_loss``; one without (a test set) goes
        through the model alone, and keeps a loss only if the model returns one anyway. The logits
        are everything the model returned but the loss and ``ignore_keys`` (None with
        ``prediction_loss_only``)."""
        labels = batch_labels(inputs, self.label_names)
        if labels is not None:
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
        else:
            outputs = call_model(model, inputs)
            loss = loss_of(outputs)
            loss = loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None
        if prediction_loss_only:
            return loss, None, None
        if ignore_keys is None:
            ignore_keys = ignore_keys_for(bare_model(model))
        # compute_loss_func and label smoothing take the loss from the logits: the output holds none
        computed = labels is not None and (
            self.compute_loss_func is not None or smooths_labels(self.args, model)
        )
        logits = predictions_of(
            outputs, loss_inside=not computed and loss is not None, ignore_keys=ignore_keys
        )
        return loss, logits, labels

    def last_eval_metrics(self) -> dict[str, float]:
        """The metrics of the latest evaluation (of the best one after ``load_best_model_at_end``)."""
        return self.state.eval_metrics(best=self.args.load_best_model_at_end)


def evaluation_loop(
    model: Any,
    dataloader: Any,
    step: Callable[[Any, Any], tuple[Any, Any, Any]],
    collector: PredictionCollector,
    precision: Any,
) -> tuple[float | None, int]:
    """The mean loss over ``dataloader`` (per sample; None when no batch had one, as a test set
    without labels) and the number of rows this process read; ``collector`` gathers what
    ``step(model, batch) -> (loss, logits, labels)`` (`Evaluation.prediction_step`) returns meanwhile."""
    total, count, rows = None, 0, 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), precision:
            for batch in dataloader:
                # the prepared loader's own look-ahead knows its last batch (gather_for_metrics reads it too)
                last = collector.accelerator.gradient_state.end_of_dataloader
                loss, logits, labels = step(model, batch)
                size = batch_size(batch)
                rows += size
                if loss is not None:
                    if collector.accelerator.num_processes > 1:
                        # Every process's batch, without the samples accelerate repeats to even out the last ones.
                        losses = collector.accelerator.gather_for_metrics(
                            loss.detach().double().repeat(size)
                        )
                        loss, size = losses.mean(), losses.numel()
                    # Summed on the device and read once: float(loss) per batch would wait for the device
                    # each time. float64 as Python's float was (MPS has none).
                    if total is None:
                        total = torch.zeros(
                            (),
                            dtype=torch.float32 if loss.device.type == "mps" else torch.float64,
                            device=loss.device,
                        )
                    total += loss.detach().to(total.dtype) * size
                    count += size
                collector.add(batch, labels, loss, size, logits, last=last)
    finally:
        model.train(was_training)
    return (float(total) / max(count, 1) if total is not None else None), rows


def _then_fire(step: Callable[..., Any], handler: Any, trainer: Any, model: Any, batch: Any) -> Any:
    """``step(model, batch)``, then ``on_prediction_step``, as transformers fires it after each batch."""
    out = step(model, batch)
    handler.fire("on_prediction_step", trainer.args, trainer.state, trainer.control)
    return out


def full_eval_precision(args: Any, device: torch.device) -> Any:
    """``fp16_full_eval`` / ``bf16_full_eval``: evaluation runs under autocast in that precision."""
    dtype = (
        torch.float16 if args.fp16_full_eval else torch.bfloat16 if args.bf16_full_eval else None
    )
    return (
        torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
    )


def computed_metrics(
    compute_metrics: Callable[[Any], Any], prediction: Any, prefix: str = "eval"
) -> dict[str, float]:
    """``compute_metrics(prediction)`` as ``<prefix>_*`` floats; a wrong use is one `UserError`."""
    if prediction is None:
        raise UserError(
            "compute_metrics needs predictions, but the model returned only the loss; "
            "return (loss, logits) or {'loss': ..., 'logits': ...} from forward"
        )
    return prefixed(compute_metrics(prediction), prefix)


def prefixed(computed: Any, prefix: str) -> dict[str, float]:
    """What ``compute_metrics`` returned, as ``<prefix>_*`` floats; anything but a mapping is one
    `UserError`."""
    if not isinstance(computed, Mapping):
        raise UserError(
            f"compute_metrics returned {type(computed).__name__}; return a dict of metric name -> "
            "float, e.g. {'accuracy': 0.9}"
        )
    return {
        key if key.startswith(f"{prefix}_") else f"{prefix}_{key}": float(value)
        for key, value in computed.items()
    }


class BatchMetrics:
    """``batch_eval_metrics``: ``compute_metrics(batch, compute_result=last)`` on each batch, as
    transformers calls it; the metrics are what its call on the last batch returned (none when the
    evaluation had no batch with predictions and labels)."""

    def __init__(self, compute_metrics: Callable[..., Any]) -> None:
        self.compute_metrics = compute_metrics
        self.metrics: Any = {}

    def __call__(self, batch: Any, last: bool) -> None:
        computed = self.compute_metrics(batch, compute_result=last)
        if last:
            self.metrics = computed


def check_batch_metrics(args: Any, compute_metrics: Callable[..., Any] | None) -> None:
    """``batch_eval_metrics=True`` with a ``compute_metrics`` that takes no ``compute_result``: one
    line, when the Trainer is built (transformers refuses it there too)."""
    if not args.batch_eval_metrics or compute_metrics is None:
        return
    try:
        parameters = inspect.signature(compute_metrics).parameters
    except (TypeError, ValueError):  # a builtin without a signature: it is called and tells
        return
    takes = "compute_result" in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )
    if not takes:
        raise UserError(
            "batch_eval_metrics=True calls compute_metrics(eval_pred, compute_result=...) on each "
            "evaluation batch; give compute_metrics a compute_result parameter (True on the last "
            "batch: return the metrics then), or leave batch_eval_metrics=False"
        )
