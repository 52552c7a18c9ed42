"""hpsweep: hyperparameter search over PyTorch training, on Optuna, Ray Tune or W&B Sweeps.

The package has one folder per side (docs/architecture.md): `hpsweep.train` (one training
run), `hpsweep.search` (the sweep and its backends), `hpsweep.devices`, `hpsweep.runs` (what a
sweep writes) and `hpsweep.integrations` (MLflow, the report, the Hub). This module is the face:
what a space file and a user's script import.
"""

from __future__ import annotations

from typing import Any

from hpsweep.errors import TrialPruned, UserError
from hpsweep.runs import BestRun, TrialRecord
from hpsweep.search.space import Categorical, Float, Int
from hpsweep.train.arguments import TrainingArguments
from hpsweep.train.callbacks import (
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
from hpsweep.trial import Trial

__version__ = "0.1.0"

#: Names that import torch or a backend's library, loaded when first used.
_LAZY = {
    "Trainer": "hpsweep.train.trainer",
    "run": "hpsweep.api",
    "SweepCallback": "hpsweep.search.job",
    "PushToHubCallback": "hpsweep.integrations.hub",
    "MLflowTracker": "hpsweep.integrations.mlflow",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
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
