"""`SearchOptions`: what a user asks a search for, written once.

The command line builds it from its flags (`hpsweep.cli.commands.search_options`), the Python
API from its keywords (`SearchOptions.from_keywords`: `hpsweep.run`,
`Trainer.hyperparameter_search`). The sweep checks it and adds what it derives (the output
folder, the directions as a list, the objective's name, the resources each trial gets, the
home) with `dataclasses.replace`; backends, the trial loop and sweep callbacks read that one
frozen object and never change it.

    >>> options = SearchOptions.from_keywords(n_trials=8, sampler="random", reduction_factor=2)
    >>> options.n_trials, options.sampler, dict(options.options)
    (8, 'random', {'reduction_factor': 2})
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: What a sweep optimises: a metric's name, or a function of the evaluation metrics.
Objective = str | Callable[[Mapping[str, float]], Any]

#: The options only some backends read (`Backend.reads`); one given to a backend that does not
#: read it is refused, never ignored.
OPTIONAL = ("storage", "address", "resources_per_trial")

#: The study's name when a search names none (the command line names it after the space file).
DEFAULT_STUDY_NAME = "hpsweep"

_DERIVED = {"derived": True}


@dataclass(frozen=True)
class SearchOptions:
    """One search: what the user asks for (the first group of fields), and what the sweep
    derives from it after checking (the second group, which the sweep alone sets).

    Frozen, and `options` is a read-only mapping: every reader sees what the user asked for.
    A backend that works something out of the options (W&B's sweep config, Ray's Tune domains)
    keeps it as its own attribute."""

    space: Mapping[str, Any] | None = None
    """The search space: names to `hpsweep.Float` / `Int` / `Categorical`; after checking,
    validated. None with a define-by-run ``hp_space``."""
    hp_space: Callable[[Any], dict[str, Any]] | None = None
    """A define-by-run function of a trial returning the params (or a backend's native space: a W&B
    sweep config, Ray Tune domains, from ``hp_space(None)``)."""
    hp_name: Callable[[Any], str] | None = None
    """A trial's run name, from its params (Hugging Face's ``hp_name``)."""
    n_trials: int | None = 20
    """Trials the study should hold when done; None: until ``timeout``."""
    direction: str | Sequence[str] = "minimize"
    """``"minimize"``, ``"maximize"``, or a list of them for a multi-objective search."""
    objective: Objective | None = None
    """The metric to optimise, or a function of the metrics; None: Hugging Face's default."""
    backend: str = "optuna"
    """The backend's name (``BACKENDS``): optuna, ray or wandb."""
    timeout: float | None = None
    """Seconds after which no trial starts."""
    n_jobs: int = 1
    """Trials run at once (worker processes, or a backend's concurrent trials)."""
    study_name: str | None = None
    """The study's name; None: the space file's name under ``hpsweep run``, else
    `DEFAULT_STUDY_NAME`. After checking, always a name."""
    storage: Any = field(default=None, repr=False)
    """Where the study is kept: a path, a URL, or an optuna ``BaseStorage`` (the Python API); Ray:
    where Tune keeps its experiment. Left out of the repr: a URL may hold a password."""
    resume: bool = False
    """Accepted for compatibility: the same command always continues its sweep."""
    sampler: Any = None
    """The backend's sampler, by name (``tpe``, ``random``, ...) or as a ready-made object."""
    pruner: Any = None
    """The backend's pruner, by name or as an object."""
    scheduler: Any = None
    """Ray Tune's trial scheduler, by name or as an object."""
    seed: int | None = None
    """Seed for the sampler."""
    address: str | None = None
    """Ray: the cluster to run on (``auto``, ``HOST:PORT`` or ``ray://HOST:10001``)."""
    resources_per_trial: Mapping[str, float] | None = None
    """What each trial gets (``{"cpu": 1, "gpu": 0.5}``); after checking, the resources each trial
    is given on this machine or cluster."""
    max_failed_trials: int = 5
    """The sweep ends after this many failed trials in one command."""
    processes_per_trial: int = 1
    """Data-parallel processes that train each trial."""
    sweep_callbacks: Sequence[Any] = ()
    """`hpsweep.SweepCallback` instances around the sweep (MLflow, the Hub, the user's own)."""
    show_progress: bool = True
    """Whether the live view of the sweep is shown."""
    warm_start: str | None = None
    """An earlier sweep's home (a folder or an object-store URL, any backend) whose finished
    trials the backend is given as evaluated ones before the first new trial
    (`hpsweep.search.warm_start`); they never count towards ``n_trials``."""
    warm_start_best: int | None = None
    """With ``warm_start``: the earlier sweep's best configs trained again as this sweep's first
    trials (they count)."""
    stop_when: str | None = None
    """A rule that ends the sweep before ``n_trials`` (`hpsweep.search.stopping`): ``plateau``,
    ``plateau:N[:TOL]``, ``target:VALUE``, ``regret``; ``none`` goes on past a stop recorded by an
    earlier command. None: no rule, and a recorded stop stands."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """The backend's own options (``Backend.option_names``) and the keywords transformers hands a
    backend's library; read-only."""

    # What the sweep derives after its checks, and sets alone.
    output_dir: Path | None = field(default=None, metadata=_DERIVED)
    """The sweep's local folder: the output folder, or an object-store home's staging folder."""
    directions: list[str] = field(default_factory=lambda: ["minimize"], metadata=_DERIVED)
    """``direction`` as a list."""
    objective_name: str = field(default="eval_loss", metadata=_DERIVED)
    """The name the objective is recorded under (``objective`` for a function)."""
    given: frozenset[str] = field(default=frozenset(), metadata=_DERIVED)
    """The `OPTIONAL` options the user gave (checked against `Backend.reads`)."""
    home: Any = field(default=None, metadata=_DERIVED)
    """The sweep's home (`hpsweep.runs.Home`): ``output_dir`` itself, or an object store that
    ``output_dir`` stages for; None: the output folder is the home."""

    def __post_init__(self) -> None:
        # frozen: the object's own fields are set once, here
        object.__setattr__(self, "options", types.MappingProxyType(dict(self.options)))
        object.__setattr__(self, "sweep_callbacks", tuple(self.sweep_callbacks))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its fields, ``options`` as a dict (a read-only mapping does not pickle): a
        sweep callback that keeps the options travels to the processes that run trials."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return _made_again, (type(self), {**fields, "options": dict(self.options)})

    @classmethod
    def asked(cls) -> tuple[str, ...]:
        """The names of what a user asks for (not what the sweep derives)."""
        return tuple(f.name for f in dataclasses.fields(cls) if not f.metadata.get("derived"))

    @classmethod
    def from_keywords(cls, **keywords: Any) -> SearchOptions:
        """The options a Python call's keywords ask for: hpsweep's own by name, every other
        keyword a backend option (refused by the backend when it has no such option)."""
        own = set(cls.asked()) - {"options"}
        return cls(
            **{name: value for name, value in keywords.items() if name in own},
            options={name: value for name, value in keywords.items() if name not in own},
        )

    @property
    def home_url(self) -> str:
        """The home as users name it (and as a study on many machines remembers it)."""
        return self.home.url if self.home is not None else str(self.output_dir)

    @property
    def multi_objective(self) -> bool:
        return len(self.directions) > 1


def given_optional(options: SearchOptions) -> frozenset[str]:
    """The `OPTIONAL` options given explicitly, before the sweep fills in their defaults."""
    return frozenset(name for name in OPTIONAL if getattr(options, name) is not None)


def _made_again(cls: type[SearchOptions], fields: dict[str, Any]) -> SearchOptions:
    return cls(**fields)
