"""What a model returns, read as Hugging Face's Trainer reads it, and the predictions gathered for
``compute_metrics``.

The loss is the output itself (a tensor), its ``loss`` (a dict or ``ModelOutput``) or its first
element (a ``(loss, logits, ...)`` tuple). The predictions are everything else it returned: one
array, or a tuple of arrays when there are several, as transformers passes them to
``compute_metrics``.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hpsweep.train.callbacks import EvalPrediction


class HFEvalPrediction(EvalPrediction):
    """An `EvalPrediction` with transformers' ``inputs`` and ``losses`` (``include_for_metrics``)."""

    def __new__(
        cls, predictions: Any, label_ids: Any, inputs: Any = None, losses: Any = None
    ) -> HFEvalPrediction:
        self = super().__new__(cls, predictions, label_ids)
        self.inputs, self.losses = inputs, losses
        return self


def call_model(model: Any, batch: Any) -> Any:
    """``model(**batch)`` for a mapping, ``model(*batch)`` for a sequence, else ``model(batch)``."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(*batch)
    return model(batch)


def loss_of(outputs: Any) -> Any:
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        return outputs.get("loss")
    if isinstance(outputs, (tuple, list)):
        return outputs[0] if outputs else None
    return getattr(outputs, "loss", None)


def label_smoothed_loss(
    model: Any, outputs: Any, labels: torch.Tensor, epsilon: float, num_items_in_batch: Any = None
) -> torch.Tensor:
    """transformers' ``LabelSmoother`` (``label_smoothing_factor``): the cross-entropy of the logits
    against labels smoothed by ``epsilon`` (torch's ``label_smoothing``, the same formula), labels
    of -100 left out, over ``num_items_in_batch`` when given; a causal language model's labels are
    shifted one token left, as there."""
    logits = (
        outputs
        if isinstance(outputs, torch.Tensor)
        else outputs["logits"]
        if isinstance(outputs, Mapping)
        else outputs[0]
    )  # called without labels: no loss first
    if _kind(model) == "causal_lm":
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    mean = num_items_in_batch is None
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=-100,
        label_smoothing=epsilon,
        reduction="mean" if mean else "sum",
    )
    return loss if mean else loss / num_items_in_batch


def smooths_labels(args: Any, model: Any) -> bool:
    """Whether ``label_smoothing_factor`` applies to ``model``: not to multi-label classification,
    where transformers leaves it out too (with the same warning, once per model)."""
    return bool(args.label_smoothing_factor) and _kind(model) != "multi_label"


#: model -> what label smoothing needs to know of it; asked every step, answered once per model
_KINDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _kind(model: Any) -> str:
    if model not in _KINDS:
        _KINDS[model] = _model_kind(model)
    return _KINDS[model]


def _model_kind(model: Any) -> str:
    """``causal_lm`` for transformers' causal language models (its rule: the class name is in its
    causal-LM mapping), ``multi_label`` for a multi-label classifier, else ``""``; a model is
    first unwrapped from data-parallel or compiled wrappers."""
    from hpsweep.train.accelerator import bare_model

    model = bare_model(model)
    if (
        getattr(getattr(model, "config", None), "problem_type", None)
        == "multi_label_classification"
    ):
        warnings.warn(
            "label_smoothing_factor does not apply to multi-label classification; this model trains "
            "without it, as on transformers' Trainer",
            UserWarning,
            stacklevel=4,
        )
        return "multi_label"
    if not any(c.__module__.startswith("transformers.") for c in type(model).__mro__):
        return ""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return "causal_lm" if model._get_name() in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() else ""


def describe(outputs: Any) -> str:
    """A short account of an output, for error messages."""
    if isinstance(outputs, Mapping):
        return f"{type(outputs).__name__} with keys {', '.join(map(str, outputs)) or 'none'}"
    if isinstance(outputs, (tuple, list)):
        return f"a {type(outputs).__name__} of {len(outputs)}"
    return type(outputs).__name__


def predictions_of(outputs: Any, *, loss_inside: bool, ignore_keys: Sequence[str] = ()) -> Any:
    """Everything the model returned but the loss (None when nothing is left).

    ``loss_inside``: the output carries the loss (no ``compute_loss_func``), so a tensor output is
    the loss itself and a tuple's first element is skipped.
    """
    if isinstance(outputs, torch.Tensor):
        found: tuple = () if loss_inside else (outputs,)
    elif isinstance(outputs, Mapping):
        found = tuple(
            v for k, v in outputs.items() if k != "loss" and k not in ignore_keys and v is not None
        )
    elif isinstance(outputs, (tuple, list)):
        found = tuple(v for v in (outputs[1:] if loss_inside else outputs) if v is not None)
    else:
        found = tuple(v for v in (getattr(outputs, "logits", None),) if v is not None)
    if not found:
        return None
    return found[0] if len(found) == 1 else found


def ignore_keys_for(model: Any) -> list[str]:
    config = getattr(model, "config", None)
    return list(getattr(config, "keys_to_ignore_at_inference", None) or ["past_key_values"])


def main_input(batch: Any, model: Any) -> Any:
    """The model's main input in a batch (``include_for_metrics=["inputs"]``)."""
    if isinstance(batch, Mapping):
        return batch.get(
            getattr(model, "main_input_name", "input_ids"), next(iter(batch.values()), None)
        )
    return batch[0] if isinstance(batch, (list, tuple)) else batch


def gather(accelerator: Any, value: Any) -> Any:
    """``value`` (tensors, possibly nested) from every process, on the device they are on."""
    if accelerator.num_processes > 1:
        value = accelerator.pad_across_processes(value, dim=1, pad_index=-100)
    return accelerator.gather_for_metrics(value)


def to_numpy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.dtype in (torch.float16, torch.bfloat16):
            value = value.float()
        return value.cpu().numpy()
    if isinstance(value, (tuple, list)):
        return type(value)(to_numpy(v) for v in value)
    if isinstance(value, Mapping):
        return {k: to_numpy(v) for k, v in value.items()}
    return value


def concat(parts: list[Any]) -> Any:
    """Batches joined along the first axis; later axes of unequal size are padded with -100."""
    first = parts[0]
    if isinstance(first, (tuple, list)):
        return type(first)(concat([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, Mapping):
        return {k: concat([p[k] for p in parts]) for k in first}
    arrays = [np.atleast_1d(np.asarray(p)) for p in parts]
    shape = tuple(max(s) for s in zip(*(a.shape[1:] for a in arrays)))
    if any(a.shape[1:] != shape for a in arrays):
        arrays = [
            np.pad(
                a, [(0, 0)] + [(0, m - n) for n, m in zip(a.shape[1:], shape)], constant_values=-100
            )
            for a in arrays
        ]
    return np.concatenate(arrays)


class PredictionCollector:
    """Gathers one evaluation's predictions, labels (and inputs / losses when asked) batch by batch.

    ``enabled``: the batches' predictions are wanted at all. ``keep``: they are kept for the whole
    evaluation (`result`), moved to the CPU every ``cpu_every`` batches (``eval_accumulation_steps``;
    None: each batch's as it ends) and joined into one array each, or left as lists of one array per
    batch without ``concat_batches`` (``eval_do_concat_batches=False``). ``per_batch`` (with
    ``batch_eval_metrics``) gets each batch's gathered tensors as an `HFEvalPrediction`, and whether
    the batch is the evaluation's last.
    """

    PARTS = ("predictions", "label_ids", "inputs", "losses")

    def __init__(
        self,
        accelerator: Any,
        *,
        model: Any,
        enabled: bool,
        preprocess: Callable[[Any, Any], Any] | None,
        include: Sequence[str],
        keep: bool = True,
        concat_batches: bool = True,
        cpu_every: int | None = None,
        per_batch: Callable[[HFEvalPrediction, bool], Any] | None = None,
    ) -> None:
        self.accelerator, self.model, self.enabled = accelerator, model, enabled
        self.preprocess, self.include = preprocess, set(include)
        self.keep, self.concat_batches, self.per_batch = keep, concat_batches, per_batch
        self.cpu_every = cpu_every or 1
        self.on_device: dict[str, list[Any]] = {part: [] for part in self.PARTS}
        self.on_cpu: dict[str, list[Any]] = {part: [] for part in self.PARTS}
        self.batches = 0

    def add(
        self,
        batch: Any,
        labels: Any,
        loss: torch.Tensor | None,
        size: int,
        logits: Any,
        last: bool = False,
    ) -> None:
        """One batch's `prediction_step` results; ``loss`` None for a batch that gave none;
        ``last``: the evaluation's last batch."""
        if not self.enabled:
            return
        if logits is not None and self.preprocess is not None:
            logits = self.preprocess(logits, labels)
        parts = {
            "predictions": logits,
            "label_ids": labels,
            "inputs": main_input(batch, self.model) if "inputs" in self.include else None,
            "losses": loss.detach().reshape(1).repeat(size)
            if "loss" in self.include and loss is not None
            else None,
        }
        acc = self.accelerator
        gathered = {name: gather(acc, v) for name, v in parts.items() if v is not None}
        if self.per_batch is not None and {"predictions", "label_ids"} <= set(gathered):
            self.per_batch(HFEvalPrediction(**{**dict.fromkeys(self.PARTS), **gathered}), last)
        if self.keep:
            for name, value in gathered.items():
                self.on_device[name].append(value)
            self.batches += 1
            if self.batches % self.cpu_every == 0:
                self._to_cpu()

    def _to_cpu(self) -> None:
        """The batches gathered on the device since the last move, to the CPU as numpy."""
        for name, values in self.on_device.items():
            self.on_cpu[name].extend(to_numpy(v) for v in values)
            values.clear()

    def result(self) -> HFEvalPrediction | None:
        self._to_cpu()
        if not self.on_cpu["predictions"]:
            return None
        join = concat if self.concat_batches else list
        return HFEvalPrediction(
            **{name: join(arrays) if arrays else None for name, arrays in self.on_cpu.items()}
        )
