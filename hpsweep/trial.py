"""The `Trial`: all the trainer knows of a search backend.

A backend hands the trainer a `Trial`; the trainer reads ``trial.params``, reports each
evaluation with `Trial.report` and asks `Trial.should_prune`. It never learns which backend
it runs under. Backends subclass `Trial` in their own module.
"""
from __future__ import annotations

from collections.abc import ItemsView, Iterator, KeysView, Mapping, Sequence
from typing import Any

from .errors import UserError


class Trial:
    """One trial of a search: its identity, its params and the line back to the backend.

    Args:
        number: 0-based index of the trial in its study (names the run folder ``run-<id>``).
        params: the sampled hyperparameters, name -> value.
        id: a string id for folder names; the number when not given.
    """

    backend: str = "none"
    #: The backend's own handle on the trial (JSON-able), kept in its lease so that a trial whose
    #: process died can be closed in the backend's records (`Backend.abandon`).
    ref: Any = None
    #: Whether ``suggest_*`` may add new params while the trial runs (define-by-run).
    define_by_run: bool = False

    def __init__(self, number: int, params: Mapping[str, Any] | None = None, *, id: str | None = None) -> None:
        self.number = number
        self.id = str(number) if id is None else str(id)
        self.params: dict[str, Any] = dict(params or {})
        self.user_attrs: dict[str, Any] = {}

    def report(self, step: int, metrics: Mapping[str, float], objective: float | Sequence[float] | None,
               checkpoint: str | None = None) -> None:
        """Called after each evaluation (``step`` counts evaluations, from 1).

        ``checkpoint`` is the folder saved at that evaluation, when one was.
        """

    def should_prune(self) -> bool:
        """Whether the backend wants this trial stopped now. Asked after each `report`."""
        return False

    # Define-by-run. Backends with a fixed space only serve params they already sampled.
    def suggest_float(self, name: str, low: float, high: float, *, log: bool = False,
                      step: float | None = None) -> float:
        return self._fixed(name)

    def suggest_int(self, name: str, low: int, high: int, *, log: bool = False, step: int = 1) -> int:
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

    # Hugging Face's Ray and W&B integrations hand model_init(trial) and hp_name(trial) the params
    # as a dict: code written that way (``trial["learning_rate"]``) runs unchanged.
    def __getitem__(self, name: str) -> Any:
        return self.params[name]

    def __contains__(self, name: object) -> bool:
        return name in self.params

    def __iter__(self) -> Iterator[str]:  # else Python would iterate through __getitem__(0), (1), ...
        return iter(self.params)

    def get(self, name: str, default: Any = None) -> Any:
        return self.params.get(name, default)

    def keys(self) -> KeysView[str]:
        return self.params.keys()

    def items(self) -> ItemsView[str, Any]:
        return self.params.items()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(number={self.number}, params={self.params})"
