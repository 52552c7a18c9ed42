"""Which number a sweep optimises: the user's objective, or Hugging Face's default.

Without an objective the rule is transformers' ``default_compute_objective``: the evaluation loss
when there is no ``compute_metrics``, else the sum of the other evaluation metrics. Maximising the
loss is refused, and the sweep says on stdout what it optimises before the first trial, e.g.
``hpsweep: optimising eval_accuracy (maximize)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hpsweep.errors import UserError
from hpsweep.train.metrics import SPEED_SUFFIXES

_NOT_METRICS = ("eval_loss", "epoch", "step")


class DefaultObjective:
    """transformers' ``default_compute_objective``: ``eval_loss`` when the evaluation has no other
    metric, else the sum of the others (loss, epoch and speed metrics left out)."""

    def __init__(self, maximize: bool = False) -> None:
        self.maximize = maximize
        self.__name__ = "default_compute_objective"

    def __call__(self, metrics: Mapping[str, float]) -> float:
        others = [
            v
            for k, v in metrics.items()
            if k not in _NOT_METRICS and not k.endswith(SPEED_SUFFIXES)
        ]
        if others:
            return float(sum(others))
        if self.maximize:
            raise UserError(
                "direction='maximize' with the default objective, but the evaluation has no metric "
                "besides eval_loss: make compute_metrics return one, or use direction='minimize'"
            )
        return float(metrics["eval_loss"])


def check_objective(objective: Any, where: str = "objective") -> None:
    """Refuse a callable that is not ``metrics -> value``, such as Optuna's ``objective(trial)``."""
    if objective is None or isinstance(objective, str) or not callable(objective):
        if objective is not None and not isinstance(objective, str):
            raise UserError(
                f"{where} is a {type(objective).__name__}; give a metric name such as 'eval_accuracy' "
                "or a function of the metrics dict"
            )
        return
    try:
        params = list(inspect.signature(objective).parameters.values())
    except (TypeError, ValueError):
        return
    required = [
        p
        for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    takes_trial = bool(params) and (
        params[0].name == "trial" or "Trial" in str(params[0].annotation)
    )
    if (
        takes_trial
        or len(required) > 1
        or (not required and not any(p.kind == p.VAR_POSITIONAL for p in params))
    ):
        name = function_name(objective)
        raise UserError(
            f"{where}: {name}({', '.join(p.name for p in params)}) is not a function of the metrics "
            "(an Optuna-style objective(trial)? hpsweep trains each trial itself); rename that "
            "function and set objective = 'eval_<metric>' or a function metrics -> float"
        )


def resolve_objective(
    objective: Any, directions: Sequence[str], compute_metrics: Callable[..., Any] | None
) -> str | Callable[[Mapping[str, float]], Any]:
    """The objective to optimise (Hugging Face's default when None), checked and announced."""
    check_objective(objective)
    multi = len(directions) > 1
    if objective is None:
        if multi:
            raise UserError(
                f"{len(directions)} directions need an objective function returning "
                f"{len(directions)} values"
            )
        objective = (
            DefaultObjective(directions[0] == "maximize")
            if compute_metrics is not None
            else "eval_loss"
        )
    if isinstance(objective, str):
        if not objective.startswith("eval_"):
            raise UserError(
                f"objective {objective!r}: evaluation metrics are named eval_*; "
                f"did you mean 'eval_{objective}'?"
            )
        if objective == "eval_loss" and directions == ["maximize"]:
            raise UserError(
                "direction='maximize' with the objective eval_loss would maximise the loss; use "
                "direction='minimize', or give compute_metrics and an objective such as 'eval_accuracy'"
            )
    # stdout, with the summary of the best run at the end: stderr stays one line when a user error follows
    print(
        f"hpsweep: optimising {describe_objective(objective)} ({', '.join(directions)})", flush=True
    )
    return objective


def function_name(objective: Any) -> str:
    """The name an objective function shows under in tables, records and MLflow: its own, or
    "objective" for a lambda (``compute_objective=lambda m: m["eval_accuracy"]``, as Hugging Face's
    docs write it), whose ``<lambda>`` would name nothing."""
    name = getattr(objective, "__name__", "objective")
    return "objective" if name.startswith("<") else name


def describe_objective(objective: Any) -> str:
    if isinstance(objective, str):
        return objective
    if isinstance(objective, DefaultObjective):
        return (
            "the sum of compute_metrics' eval metrics (Hugging Face's default_compute_objective; "
            "objective='eval_<metric>' picks one)"
        )
    return f"{function_name(objective)}(metrics)"
