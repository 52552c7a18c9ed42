"""What a sweep hands every trial, and its plug-in point: `SweepJob` and `SweepCallback`.

This module is a leaf of the search layer: integrations (MLflow, the Hub) subclass
`SweepCallback` without importing the sweep that runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpsweep import runs
from hpsweep.errors import UserError
from hpsweep.search.objective import function_name
from hpsweep.search.options import Objective, SearchOptions
from hpsweep.train.arguments import REPORT_TO_PACKAGES, TrainingArguments
from hpsweep.train.callbacks import TrainerCallback
from hpsweep.train.metrics import metric_value
from hpsweep.trial import Trial


class SweepCallback:
    """Hooks around a whole sweep (tracking, pushing). Instances travel to the processes and
    nodes that run trials, so keep their state picklable; `on_sweep_begin` runs before that.

    `trial_callbacks` adds `TrainerCallback`s to one trial's training run.
    """

    def on_sweep_begin(self, settings: SearchOptions) -> None: ...
    def trial_callbacks(self, trial: Trial, record: runs.TrialRecord) -> list[TrainerCallback]:
        return []

    def on_trial_end(self, record: runs.TrialRecord) -> None: ...
    def on_sweep_end(
        self, best: Any, records: list[runs.TrialRecord], interrupted: bool
    ) -> None: ...


@dataclass
class SweepJob:
    """What every trial needs, independent of the backend; picklable for remote workers."""

    model_init: Callable[..., Any]
    args: TrainingArguments
    train_dataset: Any
    eval_dataset: Any
    objective: Objective = "eval_loss"
    directions: list[str] = field(default_factory=lambda: ["minimize"])
    data_collator: Callable | None = None
    compute_metrics: Callable | None = None
    callbacks: list[TrainerCallback] = field(default_factory=list)
    hp_space: Callable[[Trial], dict[str, Any]] | None = None
    hp_name: Callable[[Trial], str] | None = None
    sweep_callbacks: list[SweepCallback] = field(default_factory=list)
    model_takes_trial: bool = True
    #: The class that trains each trial (the user's `Trainer` subclass, if any) and the extra
    #: keyword arguments it was given.
    trainer_cls: Any = None
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    #: Data-parallel processes per trial (``--processes-per-trial``; see `hpsweep.devices.data_parallel`).
    processes_per_trial: int = 1
    #: The object-store home (`hpsweep.runs.RemoteHome`) when ``--output-dir`` is a URL; None
    #: when the output folder is the home.
    home: runs.Home | None = None

    @property
    def output_dir(self) -> Path:
        return Path(self.args.output_dir)

    @property
    def runs_home(self) -> runs.Home:
        """Where the sweep's runs, records and best run go: the object-store home, or the output
        folder itself (which a Ray node's trial replaces with its own)."""
        return self.home if self.home is not None else runs.Home(self.output_dir)

    @property
    def objective_name(self) -> str:
        return self.objective if isinstance(self.objective, str) else function_name(self.objective)

    def objective_value(self, metrics: Mapping[str, float]) -> float | list[float]:
        return objective_value(self.objective, self.directions, metrics)


def objective_value(
    objective: Objective, directions: Sequence[str], metrics: Mapping[str, float]
) -> float | list[float]:
    """The value(s) ``objective`` gives an evaluation's ``metrics``, one per direction."""
    if isinstance(objective, str):
        return metric_value(metrics, objective)
    value = objective(metrics)
    if len(directions) > 1:
        if not isinstance(value, Sequence) or len(value) != len(directions):
            raise UserError(
                f"objective returned {value!r} for {len(directions)} directions; "
                f"return a sequence of {len(directions)} floats"
            )
        return [float(v) for v in value]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UserError(
            f"objective returned {value!r}; return one float (or a list for several directions)"
        ) from None


#: transformers' ``report_to`` names that hpsweep feeds each trial of a sweep to, as sweep
#: callbacks: name -> (module, class). Looked up by name, as `hpsweep.search.backends.BACKENDS`
#: is, so the search layer never imports an integration. `TrainingArguments` refuses the other
#: names, and names whose package is missing (`REPORT_TO_PACKAGES`).
REPORT_TO: dict[str, tuple[str, str]] = {
    "mlflow": ("hpsweep.integrations.mlflow", "MLflowTracker"),
    "tensorboard": ("hpsweep.integrations.tensorboard", "TensorBoardTracker"),
    "wandb": ("hpsweep.integrations.wandb_runs", "WandbRuns"),
}


def trainer_parts(trainer: Any) -> dict[str, Any]:
    """The parts of the `Trainer` a search was called on that every trial is built from, as
    `SweepJob` fields: its model factory, data, collator, metrics, callbacks, and the class and
    extra keywords of the trainer each trial gets."""
    return {
        "model_init": trainer.model_init,
        "train_dataset": trainer.train_dataset,
        "eval_dataset": trainer.eval_dataset,
        "data_collator": trainer.data_collator,
        "compute_metrics": trainer.compute_metrics,
        "callbacks": list(trainer.user_callbacks),
        "trainer_cls": type(trainer),
        "trainer_kwargs": dict(getattr(trainer, "trial_kwargs", {}) or {}),
    }


#: The sweep callback ``push_to_hub=True`` makes: the push of the best run (``--push-to-hub``),
#: looked up by name as `REPORT_TO`'s are.
PUSH_BEST = ("hpsweep.integrations.hub", "PushBestAtEnd")


def push_to_hub_callbacks(args: Any, given: Sequence[SweepCallback]) -> list[SweepCallback]:
    """``push_to_hub=True``: the best run pushed once the sweep ends, as ``--push-to-hub`` does, to
    ``hub_model_id`` (None: the output folder's name, under the token's user), private with
    ``hub_private_repo``, on the ``hub_revision`` branch, with ``hub_token`` (None: the login's).
    None when a push of the best run is given already (``--push-to-hub`` names the repo then)."""
    import importlib

    if not args.push_to_hub:
        return []
    module, cls_name = PUSH_BEST
    cls = getattr(importlib.import_module(module), cls_name)
    if any(isinstance(c, cls) for c in given):
        return []
    repo_id = args.hub_model_id or Path(str(args.output_dir).rstrip("/")).name
    return [
        cls(
            repo_id,
            private=args.hub_private_repo,
            revision=args.hub_revision,
            token=args.hub_token,
        )
    ]


def trial_arguments(args: TrainingArguments, output_dir: Path) -> TrainingArguments:
    """The arguments every trial of a sweep in ``output_dir`` starts from: no push of its own (the
    sweep pushes its best run) and no Hub token, which travels to no trial's process or record."""
    return args.replace(output_dir=str(output_dir), push_to_hub=False, hub_token=None)


def report_to_callbacks(report_to: Any, given: Sequence[SweepCallback]) -> list[SweepCallback]:
    """The sweep callbacks ``report_to`` names (``"all"``: every one in `REPORT_TO` whose package
    is installed, as transformers does), each one made with its defaults, as transformers'
    callbacks read their settings from the environment (``MLFLOW_TRACKING_URI``,
    ``WANDB_PROJECT``), unless one of its class is given."""
    import importlib
    import importlib.util

    named = [report_to] if isinstance(report_to, str) else list(report_to or [])
    wanted = [n for n in named if n in REPORT_TO]
    if "all" in named:
        wanted = [n for n in REPORT_TO if importlib.util.find_spec(REPORT_TO_PACKAGES[n])]
    made: list[SweepCallback] = []
    for name in wanted:
        module, cls_name = REPORT_TO[name]
        cls = getattr(importlib.import_module(module), cls_name)
        if not any(isinstance(c, cls) for c in given):
            made.append(cls())
    return made
