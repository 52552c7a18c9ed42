"""The optimizer and learning-rate schedule a run's `TrainingArguments` ask for."""
from __future__ import annotations

import math

import torch

from .arguments import TrainingArguments


def create_optimizer(model: torch.nn.Module, args: TrainingArguments) -> torch.optim.Optimizer:
    """AdamW / Adam / SGD over the trainable params; no weight decay on biases and norms."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or "norm" in name.lower() else decay).append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if args.optim == "sgd":
        return torch.optim.SGD(groups, lr=args.learning_rate, momentum=args.momentum)
    cls = torch.optim.AdamW if args.optim == "adamw" else torch.optim.Adam
    return cls(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)


def create_scheduler(optimizer: torch.optim.Optimizer, args: TrainingArguments,
                     total: int) -> torch.optim.lr_scheduler.LRScheduler:
    """``args.lr_scheduler_type`` with warmup over ``total`` optimizer steps: the same curves as
    transformers.get_scheduler, without depending on transformers."""
    warmup = args.warmup_for(total)
    kind = args.lr_scheduler_type

    def factor(step: int) -> float:
        if kind != "constant" and step < warmup:
            return step / max(1, warmup)
        if kind in ("constant", "constant_with_warmup"):
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        if kind in ("linear", "polynomial"):  # polynomial with power 1, as transformers' default
            return max(0.0, 1.0 - progress)
        cycles = 1 if kind == "cosine" else 2
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((cycles * progress) % 1.0 if cycles > 1 else progress))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
