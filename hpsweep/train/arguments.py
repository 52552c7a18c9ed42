"""`TrainingArguments`: the base arguments each trial's params are applied to.

Field names and meanings follow Hugging Face's ``TrainingArguments`` so that code moves over
with only the import changed; a ``transformers.TrainingArguments`` instance is converted by
`as_training_arguments` (see ``hpsweep/train/hf_compat/args.py``). A name we do not support is a `UserError`.

    >>> args = TrainingArguments(output_dir="out", num_train_epochs=3, learning_rate=1e-3)
    >>> apply_params(args, {"learning_rate": 0.01}).learning_rate
    0.01
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib.util
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpsweep.errors import UserError, did_you_mean
from hpsweep.train.hf_compat import fields as hf_fields
from hpsweep.train.hf_compat.view import TransformersView
from hpsweep.train.log_levels import LOG_LEVELS

DEFAULT_OUTPUT_DIR = "hpsweep-output"
STRATEGIES = ("no", "steps", "epoch")
SAMPLING = (
    "random",
    "sequential",
    "group_by_length",
)  # transformers' train_sampling_strategy but one
SCHEDULERS = (
    "linear",
    "cosine",
    "constant",
    "constant_with_warmup",
    "polynomial",
    "cosine_with_restarts",
)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: the ``lr_scheduler_kwargs`` each schedule takes (transformers' names and defaults, in hpsweep/train/optim.py)
SCHEDULER_KWARGS = {
    "cosine": ("num_cycles",),
    "cosine_with_restarts": ("num_cycles",),
    "polynomial": ("lr_end", "power"),
}
#: ``optim`` names: Hugging Face's, ours, and torch.optim class names in any case ("RMSprop", "SGD").
OPTIMIZERS = (
    "adamw",
    "adamw_torch",
    "adamw_torch_fused",
    "adamw_hf",
    "adam",
    "sgd",
    "adagrad",
    "rmsprop",
    "adafactor",
    "adadelta",
    "adamax",
    "nadam",
    "radam",
    "rprop",
    "asgd",
)
PRECISIONS = ("no", "fp16", "bf16")
WORKER_STARTS = ("spawn", "fork", "forkserver")  # dataloader_multiprocessing_context
TOKEN_COUNTS = ("no", "all", "non_padding")  # include_num_input_tokens_seen
METRIC_INCLUDES = ("inputs", "loss")

#: What pushing means in hpsweep, for transformers 4's push_to_hub_* names.
PUSH_FIX = (
    "hpsweep pushes the best run once the sweep ends: use push_to_hub=True with hub_model_id "
    "(and hub_token), --push-to-hub REPO_ID or `hpsweep push DIR --repo-id ID`"
)
#: transformers' hub_strategy values; with push_to_hub=True a sweep pushes its best run once
#: ("every_save", "end"), never checkpoints with their training state (the other two).
HUB_STRATEGIES = ("every_save", "end", "checkpoint", "all_checkpoints")
PUSHES_CHECKPOINTS = ("checkpoint", "all_checkpoints")
#: transformers' ``report_to`` names a sweep feeds per trial, and the package each one needs
#: (``"all"``: those installed). transformers' other names (comet_ml, clearml, ...) are refused.
REPORT_TO_PACKAGES = {"mlflow": "mlflow", "tensorboard": "tensorboard", "wandb": "wandb"}
#: transformers' ddp_backend values (torch.distributed's backends)
DDP_BACKENDS = ("nccl", "gloo", "mpi", "xccl", "hccl", "cncl", "mccl")
#: Names of transformers 4 a user may pass that we refuse, with the fix (the rest get a generic
#: one). transformers 5's fields are all in `hpsweep.train.hf_compat.fields.FIELDS`.
HF_REFUSED = {
    **dict.fromkeys(
        ("push_to_hub_model_id", "push_to_hub_organization", "push_to_hub_token"), PUSH_FIX
    ),
    "no_cuda": "use use_cpu=True",
}


class _ArgumentsMeta(type):
    """Turns an unknown keyword (a dataclass' TypeError) into a one-line `UserError`."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        names = field_types(cls)
        for name in [n for n in kwargs if n not in names and n in hf_fields.FIELDS]:
            # a transformers field hpsweep does not hold: refused unless at transformers' default
            value = kwargs.pop(name)
            hf_fields.check(name, value, hf_fields.FIELDS[name][1], "TrainingArguments")
        for name in kwargs:
            if name not in names:
                fix = HF_REFUSED.get(
                    name, "remove it (docs/huggingface.md lists what is supported)"
                )
                raise UserError(
                    f"TrainingArguments: {name!r} is not a field hpsweep supports"
                    f"{did_you_mean(name, names)}; {fix}"
                )
        return super().__call__(*args, **kwargs)


@dataclass
class TrainingArguments(TransformersView, metaclass=_ArgumentsMeta):
    """Arguments of one training run. Invalid values raise `UserError` on construction.

    Code written for transformers' arguments reads ``device``, ``world_size``, ``process_index``,
    ``should_save`` and the like, and uses ``main_process_first()`` (`hpsweep.train.hf_compat.view.TransformersView`).
    Subclasses may add fields (``@dataclass class MyArgs(TrainingArguments): a: float = 0.0``);
    a trial param naming one of them is set like any other field.
    """

    output_dir: str | None = DEFAULT_OUTPUT_DIR  # None (transformers 5's default): the same
    # length of training
    num_train_epochs: float = 3.0
    max_steps: int = -1
    # batches
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    # out of memory: halve per_device_train_batch_size, train again
    auto_find_batch_size: bool = False
    gradient_accumulation_steps: int = 1
    dataloader_drop_last: bool = False
    # "sequential"; "group_by_length": transformers' LengthGroupedSampler
    train_sampling_strategy: str = "random"
    # group_by_length reads the lengths from this column when there is one
    length_column_name: str = "length"
    dataloader_num_workers: int = 0
    dataloader_pin_memory: bool = True
    # with dataloader_num_workers > 0: workers kept between epochs, batches loaded ahead by each,
    # how they start ("spawn", "fork", "forkserver"), and whether batches keep their order
    dataloader_persistent_workers: bool = False
    dataloader_prefetch_factor: int | None = None
    dataloader_multiprocessing_context: str | None = None
    dataloader_in_order: bool = True  # False: batches as workers finish them
    remove_unused_columns: bool = True
    label_names: list | None = None
    # optimizer
    optim: str = "adamw"
    # "momentum=0.9,nesterov=true": what transformers reads for sgd, adagrad, rmsprop
    optim_args: str | None = None
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    momentum: float = 0.0
    max_grad_norm: float = 1.0
    # transformers' label-smoothed cross-entropy on the model's logits
    label_smoothing_factor: float = 0.0
    # NEFTune: noise on the input embeddings while training
    neftune_noise_alpha: float | None = None
    # schedule
    lr_scheduler_type: str = "linear"
    lr_scheduler_kwargs: dict | str | None = None  # e.g. {"num_cycles": 3}; a JSON string too
    warmup_ratio: float | None = 0.0  # None (transformers 5.0-5.14's default): 0.0
    # a value in (0, 1) is a ratio of the training steps, as in transformers 5
    warmup_steps: float = 0
    # evaluation, checkpoints and logging
    eval_strategy: str = "epoch"
    eval_steps: int | None = None
    save_strategy: str = "epoch"
    save_steps: int | None = None
    save_total_limit: int | None = None
    # checkpoints hold the model alone: a third the size, but no resume from them
    save_only_model: bool = False
    logging_strategy: str = "epoch"
    logging_steps: int = 50
    logging_first_step: bool = False
    # a NaN or inf step loss is logged as the mean of the interval's other steps, as transformers
    logging_nan_inf_filter: bool = True
    # the level of hpsweep's and transformers' logs, set when a Trainer is built: on the main
    # process (of each machine, under log_on_each_node) and on the others; "passive": unchanged
    log_level: str = "passive"
    log_level_replica: str = "warning"
    log_on_each_node: bool = True
    # False: a training run's and an evaluation's memory in their metrics (*_mem_cpu_*, *_mem_gpu_*)
    skip_memory_metrics: bool = True
    # count the input tokens trained on, logged as num_input_tokens_seen: "all" (or True),
    # "non_padding" (those the attention_mask keeps), "no"
    include_num_input_tokens_seen: str | bool = "no"
    eval_delay: float = 0  # no evaluation before this many epochs (or steps, on a steps schedule)
    eval_on_start: bool = False
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None
    load_best_model_at_end: bool = False
    include_for_metrics: list = field(default_factory=list)
    # evaluate and predict compute the loss alone, gathering no predictions
    prediction_loss_only: bool = False
    # an evaluation's gathered predictions move to the CPU every N batches (None: each batch's)
    eval_accumulation_steps: int | None = None
    # False: predictions (labels, inputs, losses) are lists of one array per batch
    eval_do_concat_batches: bool = True
    # compute_metrics(batch, compute_result=) on each batch; its last call's metrics are reported
    batch_eval_metrics: bool = False
    # reproducibility and hardware
    seed: int = 42
    data_seed: int | None = None  # the training data's order; None: from seed
    # deterministic algorithms only, as transformers' enable_full_determinism
    full_determinism: bool = False
    mixed_precision: str = "no"
    fp16: bool = False
    bf16: bool = False
    fp16_full_eval: bool = False
    bf16_full_eval: bool = False
    use_cpu: bool = False
    # TF32 matmuls on (True) or off (False) on a GPU that has them; a no-op on a CPU
    tf32: bool | None = None
    # empty the accelerator's memory cache every N optimizer steps (a no-op on a CPU)
    torch_empty_cache_steps: int | None = None
    # transformers' (its models' activation_checkpointing_enable)
    activation_checkpointing: bool | None = False  # None (transformers 5's default): False
    activation_checkpointing_kwargs: dict | None = None
    # torch.compile the model, through accelerate (backend inductor unless given)
    torch_compile: bool = False
    torch_compile_backend: str | None = None
    torch_compile_mode: str | None = None
    disable_progress: bool = False
    run_name: str | None = None
    # resuming: train() without a resume_from_checkpoint of its own resumes from this one (True:
    # the latest in output_dir); ignore_data_skip: its epoch starts again at the first batch
    resume_from_checkpoint: str | bool | None = None
    ignore_data_skip: bool = False
    # --processes-per-trial: the process group's backend (None: gloo on the CPU, nccl on GPUs)
    # and timeout in seconds (None: HPSWEEP_DIST_TIMEOUT_S, else 600), and
    # DistributedDataParallel's options (None: torch's defaults)
    ddp_backend: str | None = None
    ddp_timeout: int | None = None
    ddp_find_unused_parameters: bool | None = None
    ddp_bucket_cap_mb: int | None = None
    ddp_broadcast_buffers: bool | None = None
    ddp_static_graph: bool | None = None
    # push_to_hub=True: a sweep pushes its best run once it ends (as --push-to-hub) to
    # hub_model_id (None: the output folder's name under the token's user), created private with
    # hub_private_repo, on the branch hub_revision, with hub_token (None: the login's). The token
    # is left out of repr(), to_dict() (training_args.json) and the arguments of every trial.
    push_to_hub: bool = False
    hub_model_id: str | None = None
    hub_strategy: str = "every_save"
    hub_private_repo: bool | None = None
    hub_revision: str | None = None
    hub_token: str | None = field(default=None, repr=False)
    # Hugging Face names accepted for compatibility (docs/huggingface.md)
    disable_tqdm: bool | None = None  # the same as disable_progress
    evaluation_strategy: str | None = None  # transformers 4's name of eval_strategy
    gradient_checkpointing: bool | None = None  # transformers 4's name of activation_checkpointing
    gradient_checkpointing_kwargs: dict | None = None
    include_inputs_for_metrics: bool = False  # transformers 4's include_for_metrics=["inputs"]
    report_to: str | list | None = "none"  # a sweep's trackers, see docs/watching.md
    logging_dir: str | None = None  # accepted; TensorBoard logs go in each trial's run folder
    do_train: bool = False  # accepted and unused, as by transformers' Trainer
    do_eval: bool = False
    do_predict: bool = False
    overwrite_output_dir: bool = False

    def __post_init__(self) -> None:
        types_ = field_types(type(self))
        if self.output_dir is None:
            self.output_dir = DEFAULT_OUTPUT_DIR
        for name in ("eval_steps", "save_steps", "logging_steps"):
            value = getattr(self, name)
            if isinstance(value, float) and 0 < value < 1:
                raise UserError(
                    f"{name}={value}: a fraction of the training steps is not supported; "
                    "give a whole number of steps"
                )
        for f in dataclasses.fields(self):
            setattr(self, f.name, _cast(f.name, getattr(self, f.name), types_[f.name]))
        self._resolve_aliases()
        # as transformers reads it from a command line
        if isinstance(self.lr_scheduler_kwargs, str):
            try:
                self.lr_scheduler_kwargs = json.loads(self.lr_scheduler_kwargs)
            except json.JSONDecodeError:
                raise UserError(
                    f"lr_scheduler_kwargs={self.lr_scheduler_kwargs!r} is not JSON; "
                    'write it as {"num_cycles": 3}'
                ) from None
        if self.torch_compile_backend is not None or self.torch_compile_mode is not None:
            # transformers' rule: naming a backend or mode turns compiling on
            self.torch_compile = True
        if self.torch_compile and self.torch_compile_backend is None:
            self.torch_compile_backend = "inductor"
        if self.fp16 or self.bf16:
            if self.fp16 and self.bf16:
                raise UserError("fp16=True and bf16=True: choose one mixed precision")
            self.mixed_precision = "fp16" if self.fp16 else "bf16"
        self.optim = str(self.optim).lower()
        if self.metric_for_best_model is not None:
            # transformers' rule: "accuracy" is eval_accuracy
            if not self.metric_for_best_model.startswith("eval_"):
                self.metric_for_best_model = f"eval_{self.metric_for_best_model}"
            if self.greater_is_better is None:
                self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        self._default_steps()
        if isinstance(self.include_num_input_tokens_seen, bool):  # transformers 4's spelling
            self.include_num_input_tokens_seen = (
                "all" if self.include_num_input_tokens_seen else "no"
            )
        self._check()

    def _default_steps(self) -> None:
        """transformers' rules for a steps schedule without its steps: checkpoints every 500 steps
        (its save_strategy default is "steps"), evaluations every logging_steps."""
        if self.save_strategy == "steps" and self.save_steps is None:
            self.save_steps = 500
        if self.eval_strategy == "steps" and self.eval_steps is None:
            self.eval_steps = self.logging_steps

    def _resolve_aliases(self) -> None:
        """Fold Hugging Face's alternative names into ours; the alias then reads the same value."""
        if self.activation_checkpointing is None:
            self.activation_checkpointing = False
        if self.warmup_ratio is None:
            self.warmup_ratio = 0.0
        if self.evaluation_strategy is not None:
            self.eval_strategy, self.evaluation_strategy = self.evaluation_strategy, None
        for alias in ("disable_tqdm", "gradient_checkpointing", "gradient_checkpointing_kwargs"):
            canonical = _ALIASES[alias][0]
            if getattr(self, alias) is not None:
                setattr(self, canonical, getattr(self, alias))
            setattr(self, alias, getattr(self, canonical))
        if isinstance(self.label_names, str):
            self.label_names = [self.label_names]
        self.report_to = (
            list(map(str, self.report_to))
            if isinstance(self.report_to, (list, tuple))
            else self.report_to
        )
        self.include_for_metrics = list(self.include_for_metrics)
        if self.include_inputs_for_metrics and "inputs" not in self.include_for_metrics:
            self.include_for_metrics.append("inputs")
        self.include_inputs_for_metrics = "inputs" in self.include_for_metrics

    def _check(self) -> None:
        """Refuse values hpsweep cannot train with, one group of fields after another."""
        self._check_choices()
        self._check_optimizer()
        self._check_evaluation_and_reporting()
        self._check_numbers()
        self._check_evaluations_and_checkpoints()

    def _check_choices(self) -> None:
        """The fields that name one of a fixed set: strategies, optimizer, schedule, precision,
        compiler."""
        for name, allowed in (
            ("eval_strategy", STRATEGIES),
            ("save_strategy", STRATEGIES),
            ("optim", OPTIMIZERS),
            ("logging_strategy", STRATEGIES),
            ("train_sampling_strategy", SAMPLING),
            ("lr_scheduler_type", SCHEDULERS),
            ("mixed_precision", PRECISIONS),
        ):
            _choice(name, getattr(self, name), allowed)
        for name in ("log_level", "log_level_replica"):
            _choice(name, getattr(self, name), tuple(LOG_LEVELS))
        _choice("include_num_input_tokens_seen", self.include_num_input_tokens_seen, TOKEN_COUNTS)
        for name, allowed in (
            ("dataloader_multiprocessing_context", WORKER_STARTS),
            ("ddp_backend", DDP_BACKENDS),
        ):
            if getattr(self, name) is not None:
                _choice(name, getattr(self, name), allowed)
        if self.dataloader_prefetch_factor is not None:
            _positive("dataloader_prefetch_factor", self.dataloader_prefetch_factor)
        if self.torch_compile:
            from accelerate.utils import DynamoBackend

            _choice(
                "torch_compile_backend",
                str(self.torch_compile_backend).lower(),
                tuple(b.value.lower() for b in DynamoBackend),
            )
            if self.torch_compile_mode is not None:
                _choice("torch_compile_mode", self.torch_compile_mode, COMPILE_MODES)

    def _check_optimizer(self) -> None:
        """The schedule's keyword arguments, and the optimizer that needs transformers."""
        takes = SCHEDULER_KWARGS.get(self.lr_scheduler_type, ())
        if not isinstance(self.lr_scheduler_kwargs, (dict, type(None))):
            raise UserError(
                f"lr_scheduler_kwargs={self.lr_scheduler_kwargs!r}: give a mapping, e.g. {{'num_cycles': 3}}"
            )
        for key, value in (self.lr_scheduler_kwargs or {}).items():
            if key not in takes or isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UserError(
                    f"lr_scheduler_kwargs {key}={value!r}: the {self.lr_scheduler_type} schedule takes "
                    f"{' and '.join(takes) or 'no arguments'}" + (", as numbers" if takes else "")
                )
        if self.optim == "adafactor" and importlib.util.find_spec("transformers") is None:
            raise UserError(
                "optim='adafactor' is transformers' Adafactor; install it: pip install transformers"
            )

    def _check_evaluation_and_reporting(self) -> None:
        """What an evaluation gathers and where a run reports (precision, labels, integrations)."""
        if self.fp16_full_eval and self.bf16_full_eval:
            raise UserError("fp16_full_eval=True and bf16_full_eval=True: choose one")
        _choice("hub_strategy", self.hub_strategy, HUB_STRATEGIES)
        if self.push_to_hub and self.hub_strategy in PUSHES_CHECKPOINTS:
            raise UserError(
                f"hub_strategy={self.hub_strategy!r} with push_to_hub=True pushes checkpoints with "
                "their training state; hpsweep pushes the sweep's best model once: use 'end' (or "
                "PushToHubCallback to push one run's checkpoints)"
            )
        for name in ("label_names", "include_for_metrics"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, list) and all(isinstance(v, str) for v in value)
            ):
                raise UserError(f"{name}={value!r}: give a list of names, e.g. ['labels']")
        for name in self.include_for_metrics:
            _choice("include_for_metrics", name, METRIC_INCLUDES)
        if not (self.report_to is None or isinstance(self.report_to, (str, list))):
            raise UserError(
                f"report_to={self.report_to!r}: give 'none', 'all' or a list of integration names"
            )
        named = [self.report_to] if isinstance(self.report_to, str) else list(self.report_to or [])
        for name in named:
            _check_report_to(name)

    def _check_numbers(self) -> None:
        """The run's length, and the sizes, rates and factors that have a valid range."""
        if self.max_steps <= 0 and not self.num_train_epochs > 0:
            raise UserError(
                f"num_train_epochs={self.num_train_epochs}: train for > 0 epochs or set max_steps > 0"
            )
        for name in (
            "per_device_train_batch_size",
            "per_device_eval_batch_size",
            "gradient_accumulation_steps",
            "logging_steps",
            "learning_rate",
            "adam_epsilon",
        ):
            _positive(name, getattr(self, name))
        for name in (
            "torch_empty_cache_steps",
            "eval_accumulation_steps",
            "ddp_timeout",
            "ddp_bucket_cap_mb",
        ):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        for name in (
            "weight_decay",
            "max_grad_norm",
            "momentum",
            "warmup_steps",
            "dataloader_num_workers",
            "eval_delay",
        ):
            if getattr(self, name) < 0:
                raise UserError(f"{name}={getattr(self, name)} is negative; give a value >= 0")
        for name in ("adam_beta1", "adam_beta2", "warmup_ratio", "label_smoothing_factor"):
            if not 0 <= getattr(self, name) < 1:
                raise UserError(f"{name}={getattr(self, name)} must lie in [0, 1)")

    def _check_evaluations_and_checkpoints(self) -> None:
        """When evaluations and checkpoints happen, how many are kept, and the best model's."""
        for strategy, steps in (("eval", self.eval_steps), ("save", self.save_steps)):
            if getattr(self, f"{strategy}_strategy") == "steps" and (steps is None or steps < 1):
                raise UserError(
                    f"{strategy}_strategy='steps' needs {strategy}_steps >= 1; set {strategy}_steps"
                )
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise UserError(
                f"save_total_limit={self.save_total_limit}: keep at least 1 checkpoint, or None for all"
            )
        if self.load_best_model_at_end:
            if self.eval_strategy == "no" or self.save_strategy == "no":
                raise UserError(
                    "load_best_model_at_end=True needs eval_strategy and save_strategy other than 'no'"
                )
            # type: ignore[operator]
            if (
                self.eval_strategy != self.save_strategy
                or self.eval_strategy == "steps"
                and self.save_steps % self.eval_steps
            ):
                raise UserError(
                    "load_best_model_at_end=True needs checkpoints where evaluations are: "
                    "match save_strategy to eval_strategy (and save_steps to a multiple of eval_steps)"
                )

    # --- construction from files and overrides ---------------------------------------------------

    @classmethod
    def from_file(
        cls, path: str | Path, base: TrainingArguments | None = None
    ) -> TrainingArguments:
        """Read a YAML or JSON mapping of fields; its values override ``base``."""
        data = load_mapping(path)
        return (base or cls()).replace(**data, _source=str(path))

    def replace(self, _source: str = "arguments", **changes: Any) -> TrainingArguments:
        """A copy with ``changes`` applied, each cast to its field's type and validated."""
        names = field_types(type(self))
        # transformers' other fields are taken or refused as hf_fields says, on construction
        unknown = [name for name in changes if name not in names and name not in hf_fields.FIELDS]
        if unknown:
            name = unknown[0]
            raise UserError(
                f"{_source}: {name!r} is not a TrainingArguments field{did_you_mean(name, names)}"
            )
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.update(changes)
        if "mixed_precision" in changes and not {"fp16", "bf16"} & set(changes):
            values["fp16"] = values["bf16"] = False
        if "torch_compile" in changes and not _cast(
            "torch_compile", changes["torch_compile"], bool
        ):
            # else they turn it on again
            values["torch_compile_backend"] = values["torch_compile_mode"] = None
        for alias, (
            canonical,
            unset,
        ) in _ALIASES.items():  # a change to ours wins over the alias' old value
            if canonical in changes and alias not in changes:
                values[alias] = unset
        return type(self)(**values)

    def with_overrides(self, assignments: list[str]) -> TrainingArguments:
        """Apply ``--set key=value`` strings; values are read as YAML scalars (``1e-3``, ``true``)."""
        import yaml

        types_ = field_types(type(self))
        changes: dict[str, Any] = {}
        for item in assignments:
            key, sep, raw = item.partition("=")
            if not sep or not key.strip():
                raise UserError(
                    f"--set {item!r}: write it as key=value, e.g. --set learning_rate=1e-3"
                )
            key = key.strip()
            if _is_text(types_.get(key)) and raw.strip():
                changes[key] = raw  # YAML would read save_strategy=no as False
                continue
            try:
                changes[key] = yaml.safe_load(raw) if raw.strip() else None
            except yaml.YAMLError:
                changes[key] = raw
        return self.replace(_source="--set", **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields by name, without ``hub_token``: what is written (``training_args.json``) or
        logged never holds a token."""
        values = dataclasses.asdict(self)
        values.pop("hub_token", None)
        return values

    # --- derived values used by the trainer ---------------------------------------------------

    def warmup_for(self, total_steps: int) -> int:
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        ratio = self.warmup_steps if self.warmup_steps > 0 else self.warmup_ratio
        return math.ceil(total_steps * ratio)


#: alias -> (our field, the alias' unset value): Hugging Face names for the same setting.
_ALIASES = {
    "disable_tqdm": ("disable_progress", None),
    "evaluation_strategy": ("eval_strategy", None),
    "include_inputs_for_metrics": ("include_for_metrics", False),
    "gradient_checkpointing": ("activation_checkpointing", None),
    "gradient_checkpointing_kwargs": ("activation_checkpointing_kwargs", None),
}


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Field name -> type hint of a `TrainingArguments` class (subclasses' extra fields included)."""
    names = [f.name for f in dataclasses.fields(cls)]
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # a subclass annotating with names we cannot resolve: cast what we can
        hints = {}
    return {name: hints.get(name, Any) for name in names}


_FIELD_TYPES = field_types(TrainingArguments)
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
        raise UserError(
            f"{path}:{line + 1}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}; "
            "fix the syntax"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise UserError(f"{path}: expected a mapping of field: value, got a {type(data).__name__}")
    return dict(data)


def apply_params(
    args: TrainingArguments,
    params: Mapping[str, Any],
    *,
    model_takes_trial: bool = True,
    source: str = "trial params",
) -> TrainingArguments:
    """A copy of ``args`` with the params that name fields set (cast to the field's type).

    Params that are not fields are model hyperparameters, read by ``model_init(trial)``. When
    ``model_init`` takes no trial nobody could read them, so they are an error.
    """
    names = field_types(type(args))
    field_params = {k: v for k, v in params.items() if k in names}
    others = [k for k in params if k not in names]
    if others and not model_takes_trial:
        name = others[0]
        raise UserError(
            f"{source}: {name!r} is not a TrainingArguments field{did_you_mean(name, names)}, and "
            "model_init() takes no trial to read it; fix the name or define model_init(trial)"
        )
    if "output_dir" in field_params:
        raise UserError(f"{source}: 'output_dir' cannot be searched; set it with --output-dir")
    return args.replace(_source=source, **field_params) if field_params else args


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UserError(
            f"{name}={value!r} is not one of {', '.join(allowed)}{did_you_mean(str(value), allowed)}"
        )


def _check_report_to(name: str) -> None:
    """One ``report_to`` name: one a sweep feeds per trial, with its package installed."""
    if name in ("none", "all"):
        return
    if name not in REPORT_TO_PACKAGES:
        raise UserError(
            f"report_to={name!r}: a sweep reports each trial to 'tensorboard', 'wandb' or "
            f"'mlflow'; name those ('all': every one installed) or 'none'"
            f"{did_you_mean(name, tuple(REPORT_TO_PACKAGES))}"
        )
    package = REPORT_TO_PACKAGES[name]
    if importlib.util.find_spec(package) is None:
        raise UserError(f"report_to={name!r} needs {package}: pip install {package}")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise UserError(f"{name}={value} must be > 0")


def _is_text(hint: Any) -> bool:
    """Whether a field's type is ``str`` or an optional ``str`` (spelled either way)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [h for h in typing.get_args(hint) if h is not type(None)] == [str]
    return hint is str


def _cast(name: str, value: Any, hint: Any) -> Any:
    """Cast ``value`` to the field type ``hint`` (int, float, bool, str, Optional[...]); other
    types (lists, a subclass' own types) are kept as they are."""
    # transformers' IntervalStrategy.EPOCH, SchedulerType.LINEAR, ...
    if isinstance(value, enum.Enum):
        value = value.value
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [h for h in typing.get_args(hint) if h is not type(None)]
        optional = len(members) < len(typing.get_args(hint))
        hint = members[0] if len(members) == 1 else Any
    if hint not in (bool, int, float, str):
        return value
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
            return str(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise UserError(f"{name}={value!r} is not a valid {hint.__name__}")
