"""Metrics of a run: transformers' speed metrics, and reading one metric by name."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

from hpsweep.errors import UserError, did_you_mean

#: The suffixes of the speed metrics an evaluation adds (``eval_runtime``,
#: ``eval_samples_per_second``, ...): never part of an objective, a model card or a plot.
SPEED_SUFFIXES = ("_runtime", "_per_second", "_compilation_time")


def speed_metrics(split: str, started: float, *, steps: int, samples: int) -> dict[str, float]:
    """transformers' ``<split>_runtime``, ``_samples_per_second`` and ``_steps_per_second`` since ``started``."""
    runtime = max(time.time() - started, 1e-9)
    return {
        f"{split}_runtime": round(runtime, 4),
        f"{split}_samples_per_second": round(samples / runtime, 3),
        f"{split}_steps_per_second": round(steps / runtime, 3),
    }


def metric_value(metrics: Mapping[str, float], name: str, what: str = "objective") -> float:
    """``metrics[name]`` as a float, or a `UserError` listing the metrics there are."""
    if name not in metrics:
        raise UserError(
            f"{what} {name!r} is not among the evaluation's metrics ({', '.join(sorted(metrics))})"
            f"{did_you_mean(name, metrics)}; name one of them, or add it with compute_metrics"
        )
    value = float(metrics[name])
    if math.isnan(value):
        raise ValueError(f"{name} is NaN")
    return value
