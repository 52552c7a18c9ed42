"""A ``transformers.TrainingArguments`` as ours: each field we share is copied by name, a field we
lack is refused unless it is at transformers' default (or changes nothing hpsweep computes).
Nothing here imports transformers; its instances are recognised by their class's module.

    >>> args = as_training_arguments(transformers.TrainingArguments("out", learning_rate=1e-3))
    >>> args.learning_rate, type(args).__module__
    (0.001, 'hpsweep.train.arguments')
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from hpsweep.errors import UserError
from hpsweep.train.arguments import HF_REFUSED, TrainingArguments, field_types

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
