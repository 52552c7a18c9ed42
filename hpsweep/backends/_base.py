"""The one interface a search backend implements."""
from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ..errors import UserError
from ..space import Distribution
from ..trial import Trial

#: What a backend calls for every trial: trains it and returns its objective value(s).
#: Raises `hpsweep.errors.TrialPruned` when the trial was pruned, `TrialFailed` when it failed
#: (already recorded on disk), `UserError` when the sweep as a whole cannot go on.
TrialFunction = Callable[[Trial], "float | list[float]"]


class TrialFailed(Exception):
    """A trial raised; its error is recorded in its trial.json and the sweep goes on."""


@dataclass
class SearchSettings:
    """Everything a backend needs to know about the search, independent of the trainer."""

    output_dir: Path
    space: dict[str, Distribution] | None = None
    hp_space: Callable[[Trial], dict[str, Any]] | None = None
    directions: list[str] = field(default_factory=lambda: ["minimize"])
    objective_name: str = "eval_loss"
    n_trials: int | None = None
    timeout: float | None = None
    n_jobs: int = 1
    study_name: str = "hpsweep"
    storage: str | None = None
    resume: bool = False
    sampler: str | None = None
    pruner: str | None = None
    scheduler: str | None = None
    seed: int | None = None
    address: str | None = None
    resources_per_trial: dict[str, float] = field(default_factory=lambda: {"cpu": 1.0, "gpu": 0.0})
    options: dict[str, Any] = field(default_factory=dict)
    backend: str = ""  # the backend's name, for sweep callbacks that record it (MLflow, model cards)

    @property
    def multi_objective(self) -> bool:
        return len(self.directions) > 1


class Backend(abc.ABC):
    """Decides which params to try and where trials run; `run` drives the whole search.

    A backend is one module in ``hpsweep/backends/``, registered in ``backends/__init__.py``.
    `__init__` checks the settings and raises `UserError` for what it cannot do (a sampler it
    lacks, define-by-run, a missing extra), before anything is written to disk.
    """

    name: ClassVar[str]
    #: Which of the generic settings the backend reads; others given explicitly are an error.
    samplers: ClassVar[Sequence[str]] = ()
    pruners: ClassVar[Sequence[str]] = ()
    schedulers: ClassVar[Sequence[str]] = ()

    def __init__(self, settings: SearchSettings) -> None:
        self.settings = settings
        self._check_choice("sampler", settings.sampler, self.samplers)
        self._check_choice("pruner", settings.pruner, self.pruners)
        self._check_choice("scheduler", settings.scheduler, self.schedulers)
        if settings.n_trials is not None and settings.n_trials < 1:
            raise UserError(f"--n-trials {settings.n_trials}: give at least 1 trial")
        if settings.timeout is not None and settings.timeout <= 0:
            raise UserError(f"--timeout {settings.timeout}: give a positive number of seconds")
        if settings.n_jobs < 1:
            raise UserError(f"--n-jobs {settings.n_jobs}: give at least 1")

    def _check_choice(self, what: str, value: str | None, allowed: Sequence[str]) -> None:
        if value is None:
            return
        if not allowed:
            raise UserError(f"--{what} {value}: the {self.name} backend has no {what}s; drop --{what}")
        if value not in allowed:
            raise UserError(f"--{what} {value!r} is not one of {', '.join(allowed)} for the {self.name} backend")

    @abc.abstractmethod
    def run(self, trial_fn: TrialFunction) -> None:
        """Run trials until ``n_trials`` are finished or ``timeout`` passes.

        ``trial_fn`` is picklable; backends that run trials in other processes ship it there.
        `KeyboardInterrupt` must leave the backend's own records consistent and propagate.
        """
