"""Glue for users of Hugging Face ``transformers``: their ``TrainingArguments`` instances, and the
Trainer arguments that travel with a model (``processing_class``, ``preprocess_logits_for_metrics``,
``compute_loss_func``), and the Trainer methods that are transformers' API around the loop: the
reporting conveniences (``log_metrics``, ``save_metrics``, ``save_state``), callback management
(``add_callback``, ``pop_callback``, ...), the optimizer helpers (``get_decay_parameter_names``,
``get_optimizer_cls_and_kwargs``) and the helpers overrides call. Nothing here imports
transformers before a transformers object is handed over.

    >>> args = as_training_arguments(transformers.TrainingArguments("out", learning_rate=1e-3))
    >>> args.learning_rate, type(args).__module__
    (0.001, 'hpsweep.train.arguments')
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hpsweep.errors import UserError
from hpsweep.runs import read_json, write_json
from hpsweep.train import optim
from hpsweep.train.arguments import HF_REFUSED, TrainingArguments, field_types
from hpsweep.train.callbacks import TrainerCallback

#: transformers fields that change nothing hpsweep computes (logging, infrastructure, knobs its
#: Trainer ignores too); any value is accepted and dropped. Other fields of theirs we lack are
#: refused when set to a value other than transformers' default.
IGNORED_FIELDS = frozenset(
    {
        "log_level",
        "log_level_replica",
        "log_on_each_node",
        "logging_nan_inf_filter",
        "project",
        "trackio_space_id",
        "trackio_bucket_id",
        "trackio_static_space_id",
        "skip_memory_metrics",
        "save_on_each_node",
        "save_safetensors",
        "dataloader_persistent_workers",
        "dataloader_prefetch_factor",
        "dataloader_in_order",
        "ddp_timeout",
        "ddp_find_unused_parameters",
        "ddp_bucket_cap_mb",
        "ddp_broadcast_buffers",
        "ddp_backend",
        "local_rank",
        "resume_from_checkpoint",
        "hub_token",
        "eval_accumulation_steps",
        "tf32",
        "torch_empty_cache_steps",
        "include_num_input_tokens_seen",
        "restore_callback_states_from_checkpoint",
        "use_cache",
        "accelerator_config",
        "debug",
        "past_index",
        "use_legacy_prediction_loop",
    }
)


def is_transformers_args(obj: Any) -> bool:
    """Whether ``obj`` is a ``transformers.TrainingArguments`` (without importing transformers)."""
    return any(
        c.__name__ == "TrainingArguments" and c.__module__.startswith("transformers")
        for c in type(obj).__mro__
    )


def as_training_arguments(obj: Any, where: str = "args") -> TrainingArguments:
    """Ours as it is; a transformers instance converted by field name; anything else refused."""
    if isinstance(obj, TrainingArguments):
        return obj
    if is_transformers_args(obj):
        return from_transformers_args(obj, where)
    raise UserError(
        f"{where} is a {type(obj).__name__}; use hpsweep.TrainingArguments(...) "
        "(or a transformers.TrainingArguments)"
    )


def from_transformers_args(hf_args: Any, where: str = "args") -> TrainingArguments:
    """Our `TrainingArguments` with every field of ``hf_args`` that we share.

    A field of theirs that we lack is refused in one line when it differs from transformers'
    default (their Trainer would act on it, ours cannot), unless it is in `IGNORED_FIELDS`.
    """
    ours = field_types(TrainingArguments)
    reference = _reference_args(type(hf_args).__mro__, str(hf_args.output_dir))
    values: dict[str, Any] = {}
    for f in dataclasses.fields(hf_args):
        name, value = f.name, getattr(hf_args, f.name)
        default = getattr(reference, name, _field_default(f))
        if name in ours:
            if name == "report_to" and _same(value, default):
                continue  # transformers 4 expands its default "all" to whatever is installed
            values[name] = value
        elif name not in IGNORED_FIELDS and not _same(value, default):
            fix = HF_REFUSED.get(
                name,
                f"leave it at its default ({default!r}) or set the fields of "
                "hpsweep.TrainingArguments instead",
            )
            raise UserError(
                f"{where}: transformers.TrainingArguments sets {name}={value!r}, which hpsweep "
                f"does not support; {fix}"
            )
    try:
        return TrainingArguments(**values)
    except UserError as exc:
        raise UserError(f"{where} (a transformers.TrainingArguments): {exc}") from None


@functools.lru_cache(maxsize=4)
def _reference_args(mro: tuple[type, ...], output_dir: str) -> Any:
    """transformers' own defaults, after its __post_init__ derived what it derives."""
    base = next(
        c
        for c in mro
        if c.__name__ == "TrainingArguments" and c.__module__.startswith("transformers")
    )
    return base(output_dir=output_dir)


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return a is b


# --- what travels with the model ----------------------------------------------------------------


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


class NEFTune(TrainerCallback):
    """transformers' ``neftune_noise_alpha``: NEFTune's noise on the model's input embeddings while it
    trains, through transformers' own hook (``transformers.integrations.neftune``), taken off when
    training ends or fails, so evaluation, checkpoints and the model afterwards see none. Every
    trainer has one; it does nothing while ``neftune_noise_alpha`` is None."""

    handle: Any = None

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        if args.neftune_noise_alpha is None:
            return
        if not hasattr(model, "get_input_embeddings"):
            raise UserError(
                f"neftune_noise_alpha={args.neftune_noise_alpha}: {type(model).__name__} has no "
                "get_input_embeddings() to add noise to (a transformers model has); unset it"
            )
        try:
            from transformers.integrations.neftune import activate_neftune
        except ImportError:
            raise UserError(
                "neftune_noise_alpha uses transformers' NEFTune hook: pip install transformers"
            ) from None
        self.handle = activate_neftune(model, args.neftune_noise_alpha)

    def on_train_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        if self.handle is not None:
            from transformers.integrations.neftune import deactivate_neftune

            deactivate_neftune(model, self.handle)
            self.handle = None

    on_exception = on_train_end


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


# --- transformers' reporting conveniences -----------------------------------------------------------
# run_glue.py-style scripts end a run with these. They are `Trainer` methods, bound in its class
# body as transformers binds its own (from trainer_pt_utils), and read only args, state and metrics.


def is_world_process_zero(self: Any) -> bool:
    """Whether this process reports for the run: the only one, or the first of a data-parallel trial."""
    from accelerate import PartialState

    return PartialState().is_main_process


def is_local_process_zero(self: Any) -> bool:
    """Whether this process is the first on its machine."""
    from accelerate import PartialState

    return PartialState().is_local_main_process


def metrics_format(self: Any, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``metrics`` as transformers prints them: floats to 4 decimals, ``*_runtime`` as h:mm:ss.cc."""
    return {key: _shown(key, value) for key, value in metrics.items()}


def log_metrics(self: Any, split: str, metrics: Mapping[str, Any]) -> None:
    """Print ``metrics`` under ``***** <split> metrics *****``, one aligned line each, in
    transformers' format (`metrics_format`)."""
    if not self.is_world_process_zero():
        return
    shown = self.metrics_format(metrics)
    key_width = max((len(str(k)) for k in shown), default=0)
    value_width = max((len(str(v)) for v in shown.values()), default=0)
    print(f"***** {split} metrics *****")
    for key in sorted(shown):
        print(f"  {key: <{key_width}} = {shown[key]:>{value_width}}")


def _shown(key: str, value: Any) -> Any:
    if "_runtime" in key and isinstance(value, (int, float)):
        return f"{datetime.timedelta(seconds=int(value))}.{int(abs(value - int(value)) * 100):02d}"
    return round(value, 4) if isinstance(value, float) else value


def save_metrics(self: Any, split: str, metrics: Mapping[str, Any], combined: bool = True) -> None:
    """Write ``<output_dir>/<split>_results.json`` and, with ``combined``, merge the same metrics into
    ``all_results.json``, as transformers does; each file is written whole or not at all."""
    if not self.is_world_process_zero():
        return
    folder = Path(self.args.output_dir)
    write_json(folder / f"{split}_results.json", dict(metrics), indent=4, sort_keys=True)
    if combined:
        merged = {**read_json(folder / "all_results.json"), **metrics}
        write_json(folder / "all_results.json", merged, indent=4, sort_keys=True)


def save_state(self: Any) -> None:
    """Write the trainer state to ``<output_dir>/trainer_state.json`` (what every checkpoint holds)."""
    if not self.is_world_process_zero():
        return
    write_json(Path(self.args.output_dir) / "trainer_state.json", self.state.to_dict())


# --- callbacks ------------------------------------------------------------------------------------

callback_handler = property(
    lambda self: self._handler,
    doc="The trainer's callbacks (``.callbacks``), as transformers names them.",
)


def add_callback(self: Any, callback: TrainerCallback | type[TrainerCallback]) -> None:
    """Add a callback (an instance, or a class to instantiate), here and in every trial of a sweep."""
    callback = callback() if isinstance(callback, type) else callback
    if any(type(cb) is type(callback) for cb in self._handler.callbacks):  # transformers warns too
        warnings.warn(
            f"add_callback: this Trainer already has a {type(callback).__name__}; both will run "
            "(remove_callback removes the first)",
            stacklevel=2,
        )
    self.user_callbacks.append(callback)
    self._handler.add(callback)


def pop_callback(
    self: Any, callback: TrainerCallback | type[TrainerCallback]
) -> TrainerCallback | None:
    """Remove ``callback`` (an instance, or the first one of a class) and return it; None if there is none."""
    found = next(
        (
            cb
            for cb in self._handler.callbacks
            if (isinstance(cb, callback) if isinstance(callback, type) else cb == callback)
        ),
        None,
    )
    if found is not None:
        self._handler.remove(found)
        self.user_callbacks = [cb for cb in self.user_callbacks if cb is not found]
    return found


def remove_callback(self: Any, callback: TrainerCallback | type[TrainerCallback]) -> None:
    """Remove ``callback`` (an instance, or the first one of a class), as `pop_callback` does."""
    self.pop_callback(callback)


# --- the optimizer ---------------------------------------------------------------------------------


def get_decay_parameter_names(self: Any, model: Any) -> list[str]:
    """The names of ``model``'s params that take weight decay (transformers' rule: not biases, not
    norms), for a `create_optimizer` override that builds its own param groups."""
    return optim.decay_parameter_names(model)


@staticmethod  # type: ignore[misc]
def get_optimizer_cls_and_kwargs(args: Any, model: Any = None) -> tuple[type, dict[str, Any]]:
    """The optimizer class ``args.optim`` names and its keyword arguments (learning rate, betas, ...),
    as transformers returns them; with ``model``, the default takes torch's fused kernel where the
    params have one, as the default `create_optimizer` does."""
    params = [p for p in model.parameters() if p.requires_grad] if model is not None else None
    return optim.optimizer_cls_and_kwargs(as_training_arguments(args), params)


# --- helpers transformers' overrides call ------------------------------------------------------------


def get_num_trainable_parameters(self: Any) -> int:
    """How many parameters of the model train."""
    return sum(p.numel() for p in self.model.parameters() if p.requires_grad)


def get_learning_rates(self: Any) -> list[float]:
    """The learning rate of each of the optimizer's param groups now."""
    if self.optimizer is None:
        raise UserError(
            "the trainer has no optimizer yet; call get_learning_rates during or after train()"
        )
    return [group["lr"] for group in self.optimizer.param_groups]


def num_examples(self: Any, dataloader: Any) -> int:
    """The number of samples ``dataloader`` reads: its dataset's length, else its batches times the batch size."""
    try:
        return len(dataloader.dataset)
    except (AttributeError, TypeError):
        return len(dataloader) * self.args.per_device_train_batch_size


def compute_loss_context_manager(self: Any) -> contextlib.AbstractContextManager:
    """What transformers' ``training_step`` wraps ``compute_loss`` in; a no-op, as there: accelerate
    applies mixed precision to the model's forward (a ``training_step`` copied from transformers runs)."""
    return self.autocast_smart_context_manager()


def autocast_smart_context_manager(
    self: Any, cache_enabled: bool | None = True
) -> contextlib.AbstractContextManager:
    """transformers' autocast helper: a no-op, as there, because accelerate does the autocast."""
    return contextlib.nullcontext()


def train_finding_batch_size(trainer: Any, resume_from_checkpoint: Any, trial: Any) -> Any:
    """transformers' ``auto_find_batch_size``: ``trainer.train()``, and when a step runs out of
    memory (accelerate's ``should_reduce_batch_size``: CUDA, XPU, MPS, HPU or the CPU allocator), train
    again from the start with half the ``per_device_train_batch_size``, until a batch fits.

    A resume starts at the batch size its checkpoint was written with. Each attempt starts from a
    fresh model (``model_init``; a ``model=`` is reused as the failed attempt left it, as in
    transformers), and the checkpoints of a failed attempt are removed: they hold steps of a batch
    that did not fit. ``trainer.args`` keeps the size that fitted, as ``train_batch_size`` does.
    An evaluation that runs out of memory is not retried: it names ``per_device_eval_batch_size``."""
    import shutil
    import traceback

    from accelerate.utils.memory import should_reduce_batch_size

    from hpsweep import runs
    from hpsweep.devices import memory

    args = trainer.args
    size = args.per_device_train_batch_size
    checkpoint = runs.resolve_checkpoint(Path(args.output_dir), resume_from_checkpoint)
    if checkpoint is not None:
        size = read_json(checkpoint / "trainer_state.json").get("train_batch_size") or size
    trainer._finding_batch_size = True
    try:
        while True:
            trainer.args = args.replace(per_device_train_batch_size=size)
            kept = set(runs.checkpoints(Path(args.output_dir)))
            try:
                return trainer.train(
                    resume_from_checkpoint=str(checkpoint) if checkpoint else None, trial=trial
                )
            except RuntimeError as exc:
                if size == 1 or not should_reduce_batch_size(exc):
                    raise
                traceback.clear_frames(exc.__traceback__)  # the failed step's tensors
            for folder in set(runs.checkpoints(Path(args.output_dir))) - kept:
                shutil.rmtree(folder, ignore_errors=True)
            trainer.model_wrapped = trainer.optimizer = trainer.lr_scheduler = None
            memory.reset_accelerate_state()
            memory.collect()
            warnings.warn(
                f"auto_find_batch_size: out of memory at per_device_train_batch_size={size}; "
                f"training again from the start at {size // 2}",
                stacklevel=3,
            )
            size, checkpoint = size // 2, None
    finally:
        trainer._finding_batch_size = False


@contextlib.contextmanager
def not_a_smaller_train_batch(args: Any) -> Any:
    """Under ``auto_find_batch_size``, an evaluation that runs out of memory ends the run in one line,
    as in transformers: a smaller train batch (what an out-of-memory error would get) cannot help it."""
    try:
        yield
    except RuntimeError as exc:
        from accelerate.utils.memory import should_reduce_batch_size

        if args.auto_find_batch_size and should_reduce_batch_size(exc):
            # Not the allocator's words (they stay in the error it chains): they would look retryable.
            raise RuntimeError(
                "an evaluation batch did not fit in memory; auto_find_batch_size shrinks only the "
                "training batch: set a smaller per_device_eval_batch_size"
            ) from exc
        raise
