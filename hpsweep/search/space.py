"""Backend-neutral search-space distributions: `Float`, `Int`, `Categorical`.

The same ``space`` dict runs unchanged on every backend; each backend translates these three
classes into its own (Optuna distributions, Ray Tune domains, W&B sweep parameters).

    >>> space = {"learning_rate": Float(1e-4, 1e-1, log=True),
    ...          "per_device_train_batch_size": Categorical([16, 32, 64]),
    ...          "hidden": Int(32, 256, step=32)}
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpsweep.errors import UserError


@dataclass(frozen=True)
class Float:
    """A float in ``[low, high]``; ``log`` samples on a log scale, ``step`` discretises."""

    low: float
    high: float
    log: bool = False
    step: float | None = None

    def __post_init__(self) -> None:
        _check_bounds(self, self.low, self.high)
        if self.log and self.low <= 0:
            raise UserError(
                f"{self!r}: a log-scale range needs low > 0; raise low or drop log=True"
            )
        if self.step is not None and self.log:
            raise UserError(f"{self!r}: step and log=True cannot be combined; choose one")
        if self.step is not None and not self.step > 0:
            raise UserError(f"{self!r}: step must be > 0")

    def grid(self) -> list[float]:
        if self.step is None:
            raise UserError(
                f"{self!r} has no step: a grid search needs Float(..., step=...) or Categorical"
            )
        n = int(math.floor((self.high - self.low) / self.step + 1e-9))
        return [round(self.low + i * self.step, 12) for i in range(n + 1)]

    def contains(self, value: Any) -> bool:
        return isinstance(value, (int, float)) and self.low <= value <= self.high


@dataclass(frozen=True)
class Int:
    """An integer in ``[low, high]`` (both included); ``log`` samples on a log scale."""

    low: int
    high: int
    log: bool = False
    step: int = 1

    def __post_init__(self) -> None:
        for name in ("low", "high", "step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise UserError(
                    f"{self!r}: {name} must be an int, got {value!r}; use Float for real numbers"
                )
        _check_bounds(self, self.low, self.high)
        if self.step < 1:
            raise UserError(f"{self!r}: step must be >= 1")
        if self.log and (self.low < 1 or self.step != 1):
            raise UserError(f"{self!r}: a log-scale Int needs low >= 1 and step=1")

    def grid(self) -> list[int]:
        return list(range(self.low, self.high + 1, self.step))

    def contains(self, value: Any) -> bool:
        return isinstance(value, int) and self.low <= value <= self.high


@dataclass(frozen=True)
class Categorical:
    """One of ``choices`` (numbers, strings, bools or None)."""

    choices: tuple

    def __init__(self, choices: Sequence[Any]) -> None:
        if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence):
            raise UserError(
                f"Categorical({choices!r}): choices must be a list, e.g. Categorical([16, 32])"
            )
        if len(choices) == 0:
            raise UserError("Categorical([]): give at least one choice")
        for choice in choices:
            if not (choice is None or isinstance(choice, (bool, int, float, str))):
                raise UserError(
                    f"Categorical choice {choice!r} is a {type(choice).__name__}; "
                    "choices must be numbers, strings, bools or None (map names to objects in model_init)"
                )
        object.__setattr__(self, "choices", tuple(choices))

    def grid(self) -> list[Any]:
        return list(self.choices)

    def contains(self, value: Any) -> bool:
        return value in self.choices


Distribution = Float | Int | Categorical


def _check_bounds(dist: Any, low: Any, high: Any) -> None:
    for value in (low, high):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise UserError(f"{dist!r}: bounds must be finite numbers, got {value!r}")
    if low > high:
        raise UserError(f"{dist!r}: low ({low}) > high ({high}); swap them")


def validate_space(space: Any) -> dict[str, Distribution]:
    """Check that ``space`` is a dict of name -> Float/Int/Categorical and return it."""
    if not isinstance(space, Mapping) or not space:
        raise UserError(
            f"space must be a non-empty dict of name -> hpsweep.Float/Int/Categorical, got {space!r}"
        )
    for name, dist in space.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise UserError(
                f"space key {name!r} is not a valid parameter name; use a Python identifier"
            )
        if not isinstance(dist, (Float, Int, Categorical)):
            raise UserError(
                f"space[{name!r}] is {dist!r}; use hpsweep.Float(low, high), hpsweep.Int(low, high) "
                "or hpsweep.Categorical([...])"
            )
    return dict(space)


def space_to_json(space: Mapping[str, Distribution]) -> dict[str, dict[str, Any]]:
    """A JSON-able description of a space (for trackers, reports and model cards)."""
    out: dict[str, dict[str, Any]] = {}
    for name, dist in space.items():
        if isinstance(dist, Categorical):
            out[name] = {"type": "categorical", "choices": list(dist.choices)}
        else:
            out[name] = {
                "type": type(dist).__name__.lower(),
                "low": dist.low,
                "high": dist.high,
                "log": dist.log,
                "step": dist.step,
            }
    return out
