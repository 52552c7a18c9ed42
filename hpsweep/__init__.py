"""hpsweep: hyperparameter search over PyTorch training, on Optuna, Ray Tune or W&B Sweeps."""

from __future__ import annotations

from typing import Any

from . import devices  # noqa: F401  first: the load a search's first trial measures runs from here (CoreShare)
from .arguments import TrainingArguments
from .callbacks import (
    EarlyStoppingCallback,
    EvalLoopOutput,
    EvalPrediction,
    MetricCallback,
    PredictionOutput,
    ProgressCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)
from .errors import TrialPruned, UserError
from .runs import BestRun, TrialRecord
from .space import Categorical, Float, Int
from .trial import Trial

__version__ = "0.1.0"

_LAZY = {
    "Trainer": ".trainer",
    "run": ".api",
    "SweepCallback": ".sweep",
    "PushToHubCallback": ".integrations.hub",
    "MLflowTracker": ".integrations.mlflow",
}


def __getattr__(name: str) -> Any:  # torch loads only when the trainer is used
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hpsweep' has no attribute {name!r}")


__all__ = [
    "BestRun",
    "Categorical",
    "EarlyStoppingCallback",
    "EvalLoopOutput",
    "EvalPrediction",
    "Float",
    "Int",
    "MetricCallback",
    "PredictionOutput",
    "ProgressCallback",
    "SweepCallback",
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "TrainingArguments",
    "Trial",
    "TrialPruned",
    "TrialRecord",
    "UserError",
    "run",
]
