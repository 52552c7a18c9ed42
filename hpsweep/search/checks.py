"""What a search is refused for before anything is written: counts, directions, the space
against the arguments, and the output folder."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpsweep import runs
from hpsweep.errors import UserError
from hpsweep.search.space import Categorical
from hpsweep.train.arguments import TrainingArguments, apply_params, field_types


def normalise_directions(direction: str | Sequence[str]) -> list[str]:
    directions = [direction] if isinstance(direction, str) else list(direction)
    for d in directions:
        if d not in ("minimize", "maximize"):
            raise UserError(f"direction {d!r} is not 'minimize' or 'maximize'")
    if not directions:
        raise UserError("direction: give 'minimize', 'maximize' or a list of them")
    return directions


def check_space_against_args(
    space: Mapping[str, Any], args: TrainingArguments, model_takes_trial: bool
) -> None:
    """Every name is placed and every bound is a valid value for its field, before trial 0."""
    fields = field_types(type(args))  # a subclass's extra fields are fields too
    apply_params(
        args,
        {name: None for name in space if name not in fields},
        model_takes_trial=model_takes_trial,
        source="space",
    )
    for name, dist in space.items():
        if name not in fields:
            continue
        values = dist.choices if isinstance(dist, Categorical) else (dist.low, dist.high)
        for value in values:
            try:
                apply_params(args, {name: value}, source="space")
            except UserError as exc:
                raise UserError(
                    f"space[{name!r}] = {dist!r} allows {name}={value!r}, which is invalid: {exc}"
                ) from None


def check_counts(**counts: Any) -> None:
    """Counts and limits a user gives: positive, finite numbers (``--timeout nan`` is refused)."""
    for name, value in counts.items():
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        least = 0 if name == "timeout" else 1
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or (value <= 0 if name == "timeout" else value < least)
        ):
            what = (
                "a positive number of seconds"
                if name == "timeout"
                else f"a whole number of at least {least}"
            )
            raise UserError(f"{flag} {value}: give {what}")


#: In ``--output-dir``: the name of the study whose sweep the folder holds.
STUDY_FILE = ".study"


def check_one_study(output_dir: Path, study_name: str) -> None:
    """One output folder holds one sweep: another study's trials would take the same run folders
    (Optuna numbers every study's trials from 0) and be counted as this one's."""
    try:
        recorded = (output_dir / STUDY_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return
    if recorded and recorded != study_name and runs.read_trials(output_dir):
        raise UserError(
            f"--output-dir {output_dir} holds the sweep of study {recorded!r}, not {study_name!r}; "
            f"give --study-name {recorded} to continue it, or another --output-dir"
        )


def check_output_dir(path: Path) -> Path:
    """``--output-dir`` as an absolute folder this process can write in, or one `UserError` line."""
    path = path.resolve()
    for parent in [path, *path.parents]:
        if parent.exists():
            if not parent.is_dir():
                where = "is a file" if parent == path else f"is under the file {parent}"
                raise UserError(f"--output-dir {path} {where}; give a folder")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise UserError(
                    f"--output-dir {path}: {parent} is not writable; give a folder you can write in"
                )
            break
    return path
