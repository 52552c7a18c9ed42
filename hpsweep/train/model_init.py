"""Calling the user's ``model_init``: shared by the `Trainer` and the search layer (which builds a
trial's model before naming its folder), so neither has to import the other."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from hpsweep.errors import UserError


def model_init_arity(model_init: Callable[..., Any]) -> int:
    """0 or 1: how many arguments ``model_init`` takes (a `UserError` for anything else)."""
    if not callable(model_init):
        raise UserError(
            f"model_init is {model_init!r}; define a function returning a fresh torch.nn.Module"
        )
    signature = inspect.signature(model_init).parameters
    required = [
        p
        for p in signature.values()
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(required) > 1:
        raise UserError(
            f"model_init takes {len(required)} arguments; it takes none, or one: the trial"
        )
    # `def model_init(trial=None)` (HF style) takes the trial; `MyNet(hidden=16)` does not.
    return 1 if required or "trial" in signature else 0


def call_model_init(model_init: Callable[..., Any], trial: Any = None) -> Any:
    """``model_init(trial)`` or ``model_init()``; anything but a `torch.nn.Module` is a `UserError`."""
    import torch

    model = model_init(trial) if model_init_arity(model_init) == 1 else model_init()
    if not isinstance(model, torch.nn.Module):
        raise UserError(
            f"model_init returned {type(model).__name__ if model is not None else 'None'}; "
            "it must return a fresh torch.nn.Module (did you forget `return model`?)"
        )
    return model


def set_seed(seed: int, full_determinism: bool = False) -> None:
    """Seed Python, numpy and torch (all devices) the way accelerate does; with
    ``full_determinism``, also what transformers' ``enable_full_determinism`` sets: deterministic
    algorithms only (an op without one raises), cuDNN without autotuning, and the CUDA settings
    those need. Like transformers, it stays so for the rest of the process."""
    from accelerate.utils import set_seed as accelerate_set_seed

    # deterministic: torch's deterministic algorithms
    accelerate_set_seed(seed, deterministic=full_determinism)
    if full_determinism:
        import os

        import torch

        os.environ.update(
            CUDA_LAUNCH_BLOCKING="1",
            CUBLAS_WORKSPACE_CONFIG=":16:8",
            FLASH_ATTENTION_DETERMINISTIC="1",
        )
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False


def enable_activation_checkpointing(model: Any, args: Any) -> None:
    """transformers' ``activation_checkpointing`` (``gradient_checkpointing`` before 5): the model
    recomputes its layers' activations in the backward pass instead of keeping them, through its
    own ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` on models that only
    have that), with ``activation_checkpointing_kwargs`` as transformers passes them."""
    if not args.activation_checkpointing:
        return
    kwargs = dict(args.activation_checkpointing_kwargs or {})
    layers = {k: kwargs.pop(k) for k in ("every_n_layers", "offload") if k in kwargs}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=kwargs or None, **layers
        )
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None, **layers)
    else:
        raise UserError(
            f"activation_checkpointing=True: {type(model).__name__} has no activation_checkpointing_enable() "
            "(transformers' models have it); call torch.utils.checkpoint.checkpoint in its forward instead"
        )
