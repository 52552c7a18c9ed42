"""Which number a sweep optimises: the user's objective, or Hugging Face's default.

Without an objective the rule is transformers' ``default_compute_objective``: the evaluation loss
when there is no ``compute_metrics``, else the sum of the other evaluation metrics. Maximising the
loss is refused, and the sweep says on stdout what it optimises before the first trial, e.g.
``hpsweep: optimising eval_accuracy (maximize)``; minimising what looks like a score (accuracy,
f1, ...: `score_like`) is said on that same line, with the fix.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hpsweep.errors import UserError
from hpsweep.train.metrics import SPEED_SUFFIXES

_NOT_METRICS = ("eval_loss", "epoch", "step")
#: Words of metric names where higher is better (``eval_accuracy``, ``eval_f1_macro``, ``rougeL``),
#: and words that make a name a loss or an error however it goes on (``eval_accuracy_loss``).
SCORE_WORDS = frozenset(
    "accuracy acc f1 precision recall auc roc bleu sacrebleu rouge exact em matthews mcc "
    "pearson pearsonr spearman spearmanr r2 iou dice meteor chrf".split()
)
SCORE_PREFIXES = ("rouge", "bleu", "f1", "top1", "top5")
LOSS_WORDS = frozenset("loss error errors mse mae rmse wer cer perplexity ppl nll".split())
_NAME = re.compile(r"[A-Za-z][\w./-]*")


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
    line = f"hpsweep: optimising {describe_objective(objective)} ({', '.join(directions)})"
    scores = minimised_scores(objective, directions, compute_metrics)
    if scores:
        line += (
            f"; warning: {', '.join(scores)} look{'s' * (len(scores) == 1)} like a score (higher is "
            'better), and minimising it looks for the worst model: pass direction="maximize"'
        )
    print(line, flush=True)
    return objective


def minimised_scores(
    objective: Any, directions: Sequence[str], compute_metrics: Callable[..., Any] | None
) -> list[str]:
    """The metrics that look like scores (`score_like`) in a single objective that is minimised:
    its name, or the names its function (or, for Hugging Face's default sum, ``compute_metrics``)
    spells out in its code, as ``{"accuracy": ...}`` or ``metrics["eval_f1"]``."""
    if list(directions) != ["minimize"]:
        return []
    if isinstance(objective, str):
        names = [objective]
    else:
        source = compute_metrics if isinstance(objective, DefaultObjective) else objective
        names = sorted(_names_in_code(source))
    return [name for name in names if score_like(name)]


def score_like(name: str) -> bool:
    """Whether a metric's name says higher is better.

    >>> [score_like(n) for n in ("eval_accuracy", "eval_f1_macro", "rougeL", "eval_loss", "mse")]
    [True, True, True, False, False]
    """
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    if any(w in LOSS_WORDS for w in words):
        return False
    return any(w in SCORE_WORDS or w.startswith(SCORE_PREFIXES) for w in words)


def _names_in_code(fn: Any) -> set[str]:
    """The name-like strings a function (a callable object's ``__call__``, a partial's function)
    holds in its code, nested functions included; docstrings and messages have spaces."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    # a callable object's method, from its class or a base
    call = next((vars(c)["__call__"] for c in type(fn).__mro__ if "__call__" in vars(c)), None)
    code = getattr(fn, "__code__", None) or getattr(call, "__code__", None)
    found: set[str] = set()
    pending = [code] if code is not None else []
    while pending:
        for const in pending.pop().co_consts:
            if hasattr(const, "co_consts"):
                pending.append(const)
                continue
            values = const if isinstance(const, (tuple, frozenset)) else (const,)
            found.update(v for v in values if isinstance(v, str) and _NAME.fullmatch(v))
    return found


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
