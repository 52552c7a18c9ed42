"""`TrainingArguments`: the base arguments each trial's params are applied to.

Field names follow Hugging Face's ``TrainingArguments`` so that code moves over unchanged.

    >>> args = TrainingArguments(output_dir="out", num_train_epochs=3, learning_rate=1e-3)
    >>> apply_params(args, {"learning_rate": 0.01}).learning_rate
    0.01
"""
from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .errors import UserError, did_you_mean

STRATEGIES = ("no", "steps", "epoch")
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup", "polynomial", "cosine_with_restarts")
OPTIMIZERS = ("adamw", "adam", "sgd")
PRECISIONS = ("no", "fp16", "bf16")


@dataclass
class TrainingArguments:
    """Arguments of one training run. Invalid values raise `UserError` on construction."""

    output_dir: str = "hpsweep-output"
    # length of training
    num_train_epochs: float = 3.0
    max_steps: int = -1
    # batches
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    dataloader_drop_last: bool = False
    dataloader_num_workers: int = 0
    dataloader_pin_memory: bool = True
    # optimizer
    optim: str = "adamw"
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    momentum: float = 0.0
    max_grad_norm: float = 1.0
    # schedule
    lr_scheduler_type: str = "linear"
    warmup_ratio: float = 0.0
    warmup_steps: int = 0
    # evaluation, checkpoints and logging
    eval_strategy: str = "epoch"
    eval_steps: Optional[int] = None
    save_strategy: str = "epoch"
    save_steps: Optional[int] = None
    save_total_limit: Optional[int] = None
    logging_strategy: str = "epoch"
    logging_steps: int = 50
    metric_for_best_model: Optional[str] = None
    greater_is_better: Optional[bool] = None
    load_best_model_at_end: bool = False
    # reproducibility and hardware
    seed: int = 42
    mixed_precision: str = "no"
    fp16: bool = False
    bf16: bool = False
    use_cpu: bool = False
    disable_progress: bool = False
    run_name: Optional[str] = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, _cast(f.name, getattr(self, f.name), _FIELD_TYPES[f.name]))
        if self.fp16 or self.bf16:
            if self.fp16 and self.bf16:
                raise UserError("fp16=True and bf16=True: choose one mixed precision")
            self.mixed_precision = "fp16" if self.fp16 else "bf16"
        self._check()

    def _check(self) -> None:
        _choice("eval_strategy", self.eval_strategy, STRATEGIES)
        _choice("save_strategy", self.save_strategy, STRATEGIES)
        _choice("logging_strategy", self.logging_strategy, STRATEGIES)
        _choice("lr_scheduler_type", self.lr_scheduler_type, SCHEDULERS)
        _choice("optim", self.optim, OPTIMIZERS)
        _choice("mixed_precision", self.mixed_precision, PRECISIONS)
        if self.max_steps <= 0 and not self.num_train_epochs > 0:
            raise UserError(f"num_train_epochs={self.num_train_epochs}: train for > 0 epochs or set max_steps > 0")
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                     "logging_steps"):
            _positive(name, getattr(self, name))
        for name in ("learning_rate", "adam_epsilon"):
            _positive(name, getattr(self, name))
        for name in ("weight_decay", "max_grad_norm", "momentum", "warmup_steps", "dataloader_num_workers"):
            if getattr(self, name) < 0:
                raise UserError(f"{name}={getattr(self, name)} is negative; give a value >= 0")
        for name in ("adam_beta1", "adam_beta2", "warmup_ratio"):
            if not 0 <= getattr(self, name) < 1:
                raise UserError(f"{name}={getattr(self, name)} must lie in [0, 1)")
        for strategy, steps in (("eval", self.eval_steps), ("save", self.save_steps)):
            if getattr(self, f"{strategy}_strategy") == "steps" and (steps is None or steps < 1):
                raise UserError(f"{strategy}_strategy='steps' needs {strategy}_steps >= 1; set {strategy}_steps")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise UserError(f"save_total_limit={self.save_total_limit}: keep at least 1 checkpoint, or None for all")
        if self.load_best_model_at_end:
            if self.eval_strategy == "no" or self.save_strategy == "no":
                raise UserError("load_best_model_at_end=True needs eval_strategy and save_strategy other than 'no'")
            if self.eval_strategy != self.save_strategy or (
                self.eval_strategy == "steps" and self.save_steps % self.eval_steps  # type: ignore[operator]
            ):
                raise UserError("load_best_model_at_end=True needs checkpoints where evaluations are: "
                                "match save_strategy to eval_strategy (and save_steps to a multiple of eval_steps)")

    # --- construction from files and overrides ---------------------------------------------------

    @classmethod
    def from_file(cls, path: str | Path, base: TrainingArguments | None = None) -> TrainingArguments:
        """Read a YAML or JSON mapping of fields; its values override ``base``."""
        data = load_mapping(path)
        return (base or cls()).replace(**data, _source=str(path))

    def replace(self, _source: str = "arguments", **changes: Any) -> TrainingArguments:
        """A copy with ``changes`` applied, each cast to its field's type and validated."""
        unknown = [name for name in changes if name not in _FIELD_TYPES]
        if unknown:
            name = unknown[0]
            raise UserError(f"{_source}: {name!r} is not a TrainingArguments field{did_you_mean(name, _FIELD_TYPES)}")
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.update(changes)
        if "mixed_precision" in changes and not {"fp16", "bf16"} & set(changes):
            values["fp16"] = values["bf16"] = False
        return type(self)(**values)

    def with_overrides(self, assignments: list[str]) -> TrainingArguments:
        """Apply ``--set key=value`` strings; values are read as YAML scalars (``1e-3``, ``true``)."""
        import yaml

        changes: dict[str, Any] = {}
        for item in assignments:
            key, sep, raw = item.partition("=")
            if not sep or not key.strip():
                raise UserError(f"--set {item!r}: write it as key=value, e.g. --set learning_rate=1e-3")
            key = key.strip()
            if _FIELD_TYPES.get(key) in (str, Optional[str]) and raw.strip():
                changes[key] = raw  # YAML would read save_strategy=no as False
                continue
            try:
                changes[key] = yaml.safe_load(raw) if raw.strip() else None
            except yaml.YAMLError:
                changes[key] = raw
        return self.replace(_source="--set", **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # --- derived values used by the trainer ---------------------------------------------------

    def warmup_for(self, total_steps: int) -> int:
        return self.warmup_steps if self.warmup_steps > 0 else math.ceil(total_steps * self.warmup_ratio)


_FIELD_TYPES: dict[str, Any] = {
    name: hint for name, hint in typing.get_type_hints(TrainingArguments).items()
    if name in {f.name for f in dataclasses.fields(TrainingArguments)}
}
FIELD_NAMES = frozenset(_FIELD_TYPES)


def load_mapping(path: str | Path) -> dict[str, Any]:
    """A YAML or JSON file holding a mapping, with clear errors for a missing or broken file."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; check the path given to --config") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", getattr(exc, "lineno", 0) - 1)
        raise UserError(f"{path}:{line + 1}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}; "
                        "fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise UserError(f"{path}: expected a mapping of field: value, got a {type(data).__name__}")
    return dict(data)


def apply_params(args: TrainingArguments, params: Mapping[str, Any], *, model_takes_trial: bool = True,
                 source: str = "trial params") -> TrainingArguments:
    """A copy of ``args`` with the params that name fields set (cast to the field's type).

    Params that are not fields are model hyperparameters, read by ``model_init(trial)``. When
    ``model_init`` takes no trial nobody could read them, so they are an error.
    """
    field_params = {k: v for k, v in params.items() if k in FIELD_NAMES}
    others = [k for k in params if k not in FIELD_NAMES]
    if others and not model_takes_trial:
        name = others[0]
        raise UserError(
            f"{source}: {name!r} is not a TrainingArguments field{did_you_mean(name, FIELD_NAMES)}, and "
            "model_init() takes no trial to read it; fix the name or define model_init(trial)"
        )
    if "output_dir" in field_params:
        raise UserError(f"{source}: 'output_dir' cannot be searched; set it with --output-dir")
    return args.replace(_source=source, **field_params) if field_params else args


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UserError(f"{name}={value!r} is not one of {', '.join(allowed)}{did_you_mean(str(value), allowed)}")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise UserError(f"{name}={value} must be > 0")


def _cast(name: str, value: Any, hint: Any) -> Any:
    """Cast ``value`` to the field type ``hint`` (int, float, bool, str, Optional[...])."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [h for h in typing.get_args(hint) if h is not type(None)]
        optional, hint = True, members[0]
    if value is None:
        if optional:
            return None
        raise UserError(f"{name}=None: give a {hint.__name__}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, (int, float)) and value in (0, 1):
            return bool(value)
    elif hint is int:
        if isinstance(value, bool):
            pass
        elif isinstance(value, int):
            return value
        elif isinstance(value, float) and value.is_integer():
            return int(value)
        elif isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise UserError(f"{name}={value!r} is not a valid {hint.__name__}")
