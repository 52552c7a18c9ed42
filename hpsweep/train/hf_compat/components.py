"""The Trainer arguments Hugging Face users pass beside the model (``processing_class`` or
``tokenizer``, ``preprocess_logits_for_metrics``, ``compute_loss_func``): checked, carried to every
trial's trainer in `HFComponents`, and the defaults they imply (the collator a tokenizer pads with,
the tokenizer files saved beside the weights). Nothing here imports transformers before a
transformers object is handed over.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpsweep.errors import UserError
from hpsweep.train.callbacks import TrainerCallback


class HFComponents(TrainerCallback):
    """The Trainer arguments Hugging Face users pass beside the model.

    It rides along with the user's callbacks, so the trainer of every trial (in this process or
    on a Ray worker) gets the same ones, and it saves ``processing_class`` into each checkpoint
    right after the weights are written, so ``best/`` loads with ``AutoTokenizer.from_pretrained``.
    It is the first of the user's callbacks, so the reporter and pushers see the tokenizer there.
    """

    def __init__(
        self,
        processing_class: Any = None,
        preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None = None,
        compute_loss_func: Callable[..., Any] | None = None,
    ) -> None:
        self.processing_class = processing_class
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.compute_loss_func = compute_loss_func

    def on_save(
        self, args: Any, state: Any, control: Any, *, checkpoint: str, **kwargs: Any
    ) -> None:
        save_processing_class(self.processing_class, Path(checkpoint))


def trainer_components(
    callbacks: list[Any],
    *,
    processing_class: Any,
    tokenizer: Any,
    preprocess_logits_for_metrics: Any,
    compute_loss_func: Any,
    model_init: Any,
    optimizers: tuple[Any, Any],
    optimizer_cls_and_kwargs: Any,
) -> tuple[HFComponents, list[Any]]:
    """Check the transformers-only Trainer arguments; returns the `HFComponents` (merged with one
    found among ``callbacks``, as a trial's trainer receives it) and the callbacks to keep."""
    if model_init is not None and any(o is not None for o in optimizers):
        raise UserError(
            "optimizers=(...) with model_init: each run builds a new model the optimizer does not "
            "hold; set optim= in TrainingArguments, or subclass Trainer and build it for each run's "
            "model in create_optimizer_and_scheduler, as transformers advises"
        )
    if optimizer_cls_and_kwargs is not None:
        raise UserError(
            "optimizer_cls_and_kwargs is not supported; set optim= (e.g. 'adamw_torch', 'sgd') in "
            "TrainingArguments, or pass optimizers=(optimizer, None) with a model"
        )
    if tokenizer is not None and processing_class is not None and tokenizer is not processing_class:
        raise UserError(
            "Trainer got both tokenizer= and processing_class=; pass the tokenizer once, as "
            "processing_class="
        )
    # a class is instantiated, as there
    callbacks = [cb() if isinstance(cb, type) else cb for cb in callbacks]
    carried = next((cb for cb in callbacks if isinstance(cb, HFComponents)), HFComponents())
    components = HFComponents(
        processing_class=_first(processing_class, tokenizer, carried.processing_class),
        preprocess_logits_for_metrics=_first(
            preprocess_logits_for_metrics, carried.preprocess_logits_for_metrics
        ),
        compute_loss_func=_first(compute_loss_func, carried.compute_loss_func),
    )
    kept = [cb for cb in callbacks if not isinstance(cb, HFComponents)]
    if any(v is not None for v in vars(components).values()):
        # first: the tokenizer is in a checkpoint before others see on_save
        kept.insert(0, components)
    return components, kept


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def save_processing_class(processing_class: Any, folder: Path) -> None:
    """Write a tokenizer / processor beside the weights (its own ``save_pretrained`` files)."""
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(str(folder))


def default_collator(processing_class: Any) -> Callable[[list], Any] | None:
    """transformers' rule: a tokenizer or feature extractor pads with ``DataCollatorWithPadding``."""
    if processing_class is None:
        return None
    from transformers import (
        DataCollatorWithPadding,
        PreTrainedTokenizerBase,
        SequenceFeatureExtractor,
    )

    if isinstance(processing_class, (PreTrainedTokenizerBase, SequenceFeatureExtractor)):
        return DataCollatorWithPadding(processing_class)
    return None
