"""A ``transformers.TrainingArguments`` as ours: each field we share is copied by name, a field we
lack is taken or refused as `hpsweep.train.hf_compat.fields.FIELDS` says.
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
from hpsweep.train.arguments import TrainingArguments, field_types
from hpsweep.train.hf_compat import fields as hf_fields


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

    A field of theirs that we lack is dropped when `hf_fields.FIELDS` accepts it, and refused in
    one line when it is refused there (or unknown) and differs from transformers' default.
    """
    ours = field_types(TrainingArguments)
    reference = _reference_args(type(hf_args).__mro__, str(hf_args.output_dir))
    values: dict[str, Any] = {}
    for f in dataclasses.fields(hf_args):
        name, value = f.name, getattr(hf_args, f.name)
        default = getattr(reference, name, _field_default(f))
        if name in ours:
            if name == "report_to" and hf_fields.same(value, default):
                continue  # transformers 4 expands its default "all" to whatever is installed
            values[name] = value
        elif name in hf_fields.FIELDS:
            hf_fields.check(name, value, default, f"{where} (a transformers.TrainingArguments)")
        elif not hf_fields.same(value, default):
            shown = (
                "a token" if "token" in name else repr(value)
            )  # transformers 4's push_to_hub_token
            raise UserError(
                f"{where}: transformers.TrainingArguments sets {name}={shown}, which hpsweep "
                f"does not support; leave it at its default ({default!r}) or set the fields of "
                "hpsweep.TrainingArguments instead"
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
