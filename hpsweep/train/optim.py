"""The optimizer and learning-rate schedule a run's `TrainingArguments` ask for.

``optim`` takes Hugging Face's names (``adamw_torch``, ``adamw_torch_fused``, ``adamw_hf``,
``adafactor``, ``sgd``, ``adagrad``, ``rmsprop``), ours (``adamw``, ``adam``) and torch.optim's
class names in any case (``"RMSprop"``, ``"SGD"``, ``"Adam"``, as Optuna's examples write them).

The default, ``adamw``, is torch's AdamW on its fused kernel wherever torch has one for the
params (floating-point tensors on CPU, CUDA, MPS, XPU), as transformers' default
``adamw_torch_fused`` is: one kernel a step instead of a dozen small ops per tensor, 0.36x the
optimizer's time on a small MLP here (bench/README.md). ``adamw_torch`` is torch's default
implementation.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import torch

from hpsweep.errors import UserError
from hpsweep.train.arguments import TrainingArguments

#: optim name -> torch.optim class name; each gets the arguments below that it takes.
_TORCH_CLASSES = {
    "adamw": "AdamW",
    "adamw_torch": "AdamW",
    "adamw_torch_fused": "AdamW",
    "adamw_hf": "AdamW",
    "adam": "Adam",
    "sgd": "SGD",
    "adagrad": "Adagrad",
    "rmsprop": "RMSprop",
    "adadelta": "Adadelta",
    "adamax": "Adamax",
    "nadam": "NAdam",
    "radam": "RAdam",
    "rprop": "Rprop",
    "asgd": "ASGD",
}
_ADAM_LIKE = {"AdamW", "Adam", "Adamax", "NAdam", "RAdam"}


def create_optimizer(model: torch.nn.Module, args: TrainingArguments) -> torch.optim.Optimizer:
    """``args.optim`` over the trainable params; no weight decay on biases and norms
    (`decay_parameter_names`, transformers' rule).

    Without weight decay (the default) the params are one group: two groups that differ in
    nothing give the same updates bit for bit, and cost a second pass of the optimizer's
    per-group work each step (~4% of a small model's step here, bench/step_overhead.py)."""
    names = set(decay_parameter_names(model))
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (decay if name in names else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if not args.weight_decay:
        groups = [{"params": decay + no_decay, "weight_decay": 0.0}]
    cls, kwargs = optimizer_cls_and_kwargs(args, decay + no_decay)
    return cls(groups, **kwargs)


def optimizer_cls_and_kwargs(
    args: TrainingArguments, params: list[torch.Tensor] | None = None
) -> tuple[type, dict]:
    """The optimizer class ``args.optim`` names and its keyword arguments from ``args``, as
    transformers' ``Trainer.get_optimizer_cls_and_kwargs``. The default, ``adamw``, takes the fused
    kernel when ``params`` are given and all have one (without them, torch's default kernel)."""
    if args.optim == "adafactor":
        return _adafactor(), {
            "lr": args.learning_rate,
            "scale_parameter": False,
            "relative_step": False,
            **_from_optim_args(args, "Adafactor"),
        }  # nothing, as in transformers: says so
    cls_name = _TORCH_CLASSES[args.optim]
    kwargs: dict[str, Any] = {"lr": args.learning_rate}
    if cls_name in _ADAM_LIKE:
        kwargs.update(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    elif cls_name in ("SGD", "RMSprop"):
        kwargs["momentum"] = args.momentum
    if args.optim == "adamw_torch_fused" or (
        args.optim == "adamw" and params is not None and _fusable(params)
    ):
        kwargs["fused"] = True
    kwargs.update(_from_optim_args(args, cls_name))
    return getattr(torch.optim, cls_name), kwargs


#: What transformers' get_optimizer_cls_and_kwargs reads from ``optim_args`` for each torch optimizer
#: hpsweep offers (the others it reads it for, GaLore, LOMO and the like, are not offered here).
_OPTIM_ARGS = {
    "SGD": ("momentum", "dampening", "weight_decay", "nesterov"),
    "Adagrad": ("lr_decay", "weight_decay", "eps"),
    "RMSprop": ("momentum", "alpha", "eps", "weight_decay", "centered"),
}


def _from_optim_args(args: TrainingArguments, cls_name: str) -> dict[str, Any]:
    """``optim_args`` ("momentum=0.9,nesterov=true") as transformers reads it: the keys its optimizer
    takes, as floats (``nesterov`` and ``centered`` as booleans); the other keys change nothing there,
    and a warning here says so."""
    if not args.optim_args:
        return {}
    pairs = dict(
        item.partition("=")[::2] for item in args.optim_args.replace(" ", "").split(",") if item
    )
    taken = _OPTIM_ARGS.get(cls_name, ())
    ignored = [key for key in pairs if key not in taken]
    if ignored:
        warnings.warn(
            f"optim_args: {', '.join(ignored)} change nothing with optim={args.optim!r}, as in transformers "
            f"(it reads {', '.join(taken) or 'nothing'} for it)",
            stacklevel=3,
        )
    try:
        return {
            key: value.lower() in ("true", "1", "yes")
            if key in ("nesterov", "centered")
            else float(value)
            for key, value in pairs.items()
            if key in taken
        }
    except ValueError:
        raise UserError(
            f"optim_args={args.optim_args!r}: write key=number pairs, e.g. 'momentum=0.9,nesterov=true'"
        ) from None


#: What transformers' ``Trainer.get_decay_parameter_names`` leaves out of weight decay, by name.
_NO_DECAY_NAMES = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def decay_parameter_names(model: torch.nn.Module) -> list[str]:
    """The names of the params that take weight decay, by transformers' rule: all but those in a
    ``LayerNorm`` and those whose name (lower-cased) says bias, layernorm, rmsnorm or norm."""
    in_layer_norm = {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        if isinstance(module, torch.nn.LayerNorm)
        for name, _ in module.named_parameters()
    }
    return [
        name
        for name, _ in model.named_parameters()
        if name not in in_layer_norm and not _NO_DECAY_NAMES.search(name.lower())
    ]


#: Where torch.optim has fused Adam kernels (torch.optim.optimizer._get_fused_kernels_supported_devices).
_FUSED_DEVICES = ("cpu", "cuda", "mps", "xpu")


def _fusable(params: list[torch.Tensor]) -> bool:
    """Every param a plain floating-point tensor on a device with fused kernels: what torch checks
    at the first step of a ``fused=True`` optimizer."""
    return bool(params) and all(
        type(p) in (torch.Tensor, torch.nn.Parameter)
        and torch.is_floating_point(p)
        and p.device.type in _FUSED_DEVICES
        for p in params
    )


def _adafactor() -> type:
    """transformers' Adafactor (the Trainer gives it an external learning rate)."""
    try:
        from transformers.optimization import Adafactor
    except ImportError:
        raise UserError(
            "optim='adafactor' is transformers' Adafactor; install it: pip install transformers"
        ) from None
    return Adafactor


def create_scheduler(
    optimizer: torch.optim.Optimizer, args: TrainingArguments, total: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """``args.lr_scheduler_type`` with warmup over ``total`` optimizer steps: transformers.get_scheduler's
    curves, its formulas step for step (so the same learning rates to the bit), and its
    ``lr_scheduler_kwargs`` (``num_cycles`` for the cosines, ``lr_end`` and ``power`` for
    polynomial, with its defaults), without depending on transformers."""
    warmup = args.warmup_for(total)
    kind, kwargs = args.lr_scheduler_type, args.lr_scheduler_kwargs or {}
    cycles = float(kwargs.get("num_cycles", 0.5 if kind == "cosine" else 1))
    lr_init, lr_end, power = (
        optimizer.defaults.get("lr") or 0.0,
        kwargs.get("lr_end", 1e-7),
        kwargs.get("power", 1.0),
    )
    if kind == "polynomial" and not lr_init > lr_end:
        raise UserError(
            f"lr_scheduler_kwargs lr_end={lr_end} must be smaller than learning_rate={lr_init}"
        )

    def factor(step: int) -> float:
        if kind == "constant":
            return 1.0
        if step < warmup:
            return float(step) / float(max(1, warmup))
        if kind == "constant_with_warmup":
            return 1.0
        if kind == "linear":
            return max(0.0, float(total - step) / float(max(1, total - warmup)))
        if kind == "polynomial":
            if step > total:
                return lr_end / lr_init
            remaining = 1 - (step - warmup) / max(1, total - warmup)
            return ((lr_init - lr_end) * remaining**power + lr_end) / lr_init
        progress = float(step - warmup) / float(max(1, total - warmup))
        if kind == "cosine":
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * cycles * 2.0 * progress)))
        if progress >= 1.0:  # cosine_with_restarts
            return 0.0
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((cycles * progress) % 1.0))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
