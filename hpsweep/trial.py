"""The `Trial`: all the trainer knows of a search backend.

A backend hands the trainer a `Trial`; the trainer reads ``trial.params``, reports each
evaluation with `Trial.report` and asks `Trial.should_prune`. It never learns which backend
it runs under. Backends subclass `Trial` in their own module.

A `Trial` also reads like the params dict that Hugging Face's Trainer hands ``model_init`` and
``hp_name`` on Ray and W&B, so that code moves over unchanged:

    >>> trial = Trial(0, {"lr": 0.1})
    >>> trial["lr"], "lr" in trial, trial.get("dropout", 0.2), dict(trial.items())
    (0.1, True, 0.2, {'lr': 0.1})
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, KeysView, Mapping, Sequence, ValuesView
from typing import Any

from hpsweep.errors import UserError


class Trial:
    """One trial of a search: its identity, its params and the line back to the backend.

    Args:
        number: 0-based index of the trial in its study (names the run folder ``run-<id>``).
        params: the sampled hyperparameters, name -> value.
        id: a string id for folder names; the number when not given.
    """

    backend: str = "none"
    #: The backend's own handle on the trial (JSON-able), kept in its lease so that a trial whose
    #: process died can be closed in the searcher's records (`AskTellSearcher.abandon`).
    ref: Any = None
    #: Whether ``suggest_*`` may add new params while the trial runs (define-by-run).
    define_by_run: bool = False
    #: Whether `report` needs the evaluation's checkpoint (its folder, on disk). A backend whose
    #: `report` ignores it sets False: its trial is then asked `should_prune` before a checkpoint
    #: is written, a trial pruned at an evaluation writes none for it (nothing resumes a pruned
    #: trial), and the loop's checkpoints are written off the training thread.
    reads_checkpoints: bool = True

    def __init__(
        self, number: int, params: Mapping[str, Any] | None = None, *, id: str | None = None
    ) -> None:
        self.number = number
        self.id = str(number) if id is None else str(id)
        self.params: dict[str, Any] = dict(params or {})
        self.user_attrs: dict[str, Any] = {}

    def report(
        self,
        step: int,
        metrics: Mapping[str, float],
        objective: float | Sequence[float] | None,
        checkpoint: str | None = None,
    ) -> None:
        """Called after each evaluation (``step`` counts evaluations, from 1).

        ``metrics`` holds the evaluation's metrics and its training step, ``metrics["step"]``: the
        axis that every logger uses, by which a backend keys intermediate values (`training_step`).
        ``checkpoint`` is the folder saved at that evaluation, when one was (always None for a
        trial that does not `reads_checkpoints`).
        """

    def should_prune(self) -> bool:
        """Whether the backend wants this trial stopped now. Asked after each `report`."""
        return False

    # Define-by-run. Backends with a fixed space only serve params they already sampled.
    def suggest_float(
        self, name: str, low: float, high: float, *, log: bool = False, step: float | None = None
    ) -> float:
        return self._fixed(name)

    def suggest_int(
        self, name: str, low: int, high: int, *, log: bool = False, step: int = 1
    ) -> int:
        return self._fixed(name)

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        return self._fixed(name)

    def _fixed(self, name: str) -> Any:
        if name in self.params:
            return self.params[name]
        raise UserError(
            f"trial.suggest_*({name!r}) asks for a new parameter, but the {self.backend} backend "
            f"cannot sample define-by-run; declare {name!r} in `space` or use --backend optuna"
        )

    # Read like the params dict (not a Mapping subclass: a trial is never mistaken for a space).
    def __getitem__(self, name: str) -> Any:
        if name not in self.params:
            raise MissingParam(
                f"trial[{name!r}]: the trial has no param {name!r} (it has: "
                f"{', '.join(self.params) or 'none'}); declare it in the space, or read it "
                f"with trial.get({name!r}, default)"
            )
        return self.params[name]

    def __contains__(self, name: object) -> bool:
        return name in self.params

    def __iter__(self) -> Iterator[str]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)

    def __bool__(
        self,
    ) -> bool:  # `if trial:` means "is there a trial", even before any param exists
        return True

    def get(self, name: str, default: Any = None) -> Any:
        return self.params.get(name, default)

    def keys(self) -> KeysView[str]:
        return self.params.keys()

    def items(self) -> ItemsView[str, Any]:
        return self.params.items()

    def values(self) -> ValuesView[Any]:
        return self.params.values()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(number={self.number}, params={self.params})"


def training_step(step: int, metrics: Mapping[str, Any]) -> int:
    """The training step of a reported evaluation: ``metrics["step"]``, or for a report without
    it (a caller other than the trainer's) its evaluation's number ``step``."""
    return int(metrics.get("step", step))


class MissingParam(UserError, KeyError):
    """``trial[name]`` for a param the trial does not have: a user error, and a KeyError for
    code that catches one."""

    def __str__(self) -> str:
        return str(self.args[0])
