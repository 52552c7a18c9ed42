"""Warm start: a new sweep begins from an earlier sweep's finished trials (``--warm-start HOME``).

The earlier sweep's records (``run-*/trial.json``, the same for every backend, in a folder or an
object-store home) are read and projected onto the new space before anything is written:

- a param the new space no longer has is dropped from each trial;
- a trial whose value of a param lies outside the new range (a narrowed one, a removed choice,
  another type, off a step's grid) is left out;
- a param the new space adds is missing from every earlier trial: the backend samples it fresh
  (Optuna's samplers take trials with any subset of the params, on the Optuna backend and in Ray
  Tune's TPE; W&B's engine takes whole trials only, and refuses such a warm start:
  `whole_trials_only`).

Complete trials give their objective; pruned ones their objective per training step (what TPE
reads of a pruned trial), when the objective is a metric the records keep. A complete trial's
curve is not given: Optuna's pruners hold a new trial to the complete trials' curves at the
same training step, and the earlier curves were drawn on other data (with twice the data, a step
is half as far into training), so they would prune most new trials. The result, a
`WarmStart`, is handed to the backend once (`Backend.warm_start`), which gives the trials to its
search as evaluated ones: they are never trained, never get a run folder and never count
towards ``--n-trials``. A refusal (a missing home, another objective or direction, nothing that
fits) is one `UserError` line. ``--warm-start-best K`` also hands over the K best earlier
configs, which the backend trains first as ordinary new trials (they count).

The sweep's folder keeps what was taken in `TAKEN_FILE`, which ``hpsweep show`` and the HTML
report read to list the warm-start trials beside the sweep's own, marked.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hpsweep import runs
from hpsweep.errors import UserError
from hpsweep.search.checks import check_counts
from hpsweep.search.job import SweepCallback
from hpsweep.search.options import SearchOptions
from hpsweep.search.space import Categorical, Distribution, Float, Int

#: The user attribute a trial given to the study as evaluated carries (the earlier sweep's home),
#: and the study's own (the home it took its warm start from: taken once per study).
WARM_ATTR = "hpsweep_warm_start"
#: The user attribute naming the trial's number in the earlier sweep.
WARM_NUMBER = "hpsweep_warm_number"
#: The user attribute of a new trial that trains one of the earlier sweep's best configs again.
WARM_BEST = "hpsweep_warm_best"
#: In the sweep's folder: what the warm start took (`WarmStart.to_json`).
TAKEN_FILE = "warm_start.json"


@dataclass(frozen=True)
class WarmTrial:
    """One earlier trial, projected onto the new space."""

    #: Its number in the earlier sweep.
    number: int
    #: ``complete`` or ``pruned``.
    state: str
    #: Its params that the new space has (a param the new space adds is missing).
    params: dict[str, Any]
    #: Its objective (a list for several directions); None for a pruned trial.
    value: float | list[float] | None
    #: A pruned trial's objective by training step (single objective, a recorded metric).
    intermediate: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class WarmStart:
    """What a sweep takes from an earlier one: its usable trials and how many were not."""

    #: The earlier sweep's home: its folder's absolute path, or its URL.
    home: str
    #: The trials that fit the new space, by their earlier number.
    trials: tuple[WarmTrial, ...]
    #: The earlier sweep's finished trials that carry a result (what ``trials`` was taken from).
    of: int
    #: The new space's params that no earlier trial has: sampled fresh.
    new_params: tuple[str, ...] = ()
    #: ``--warm-start-best``: the best earlier configs, best first, to train again first.
    best: tuple[dict[str, Any], ...] = ()

    @property
    def outside(self) -> int:
        return self.of - len(self.trials)

    def line(self) -> str:
        """The one line that says what was taken."""
        text = (
            f"warm start: {len(self.trials)} of {self.of} trials of {self.home}; "
            f"{self.outside} outside the new space"
        )
        if self.new_params:
            text += f"; {', '.join(self.new_params)} sampled fresh"
        if len(self.best) == 1:
            text += "; its best config trains first"
        elif self.best:
            text += f"; its {len(self.best)} best configs train first"
        return text

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "outside": self.outside}


def read_warm_start(settings: SearchOptions) -> WarmStart | None:
    """The warm start ``settings`` ask for (None without ``--warm-start``), read and checked
    before anything is written: each refusal is one `UserError` line."""
    spec, best = settings.warm_start, settings.warm_start_best
    if spec is None:
        if best is not None:
            raise UserError(f"--warm-start-best {best} needs --warm-start HOME; add it or drop it")
        return None
    check_counts(warm_start_best=best)
    if settings.space is None:
        raise UserError(
            "--warm-start needs a `space` dict: a define-by-run hp_space's ranges are not known "
            "before its trials run; declare `space`, or drop --warm-start"
        )
    home, records = _earlier_records(str(spec), settings)
    finished = _finished(records, settings, str(spec))
    trials = [t for t in (_project(r, settings) for r in finished) if t is not None]
    if not trials:
        raise UserError(
            f"--warm-start {spec}: none of its {len(finished)} finished trials fits the new space "
            "(each has a param outside a range or choice the new space allows); widen the space, "
            "or drop --warm-start"
        )
    had = {name for t in trials for name in t.params}
    return WarmStart(
        home=home,
        trials=tuple(trials),
        of=len(finished),
        new_params=tuple(name for name in settings.space if name not in had),
        best=_best_configs(trials, settings, best),
    )


def _earlier_records(spec: str, settings: SearchOptions) -> tuple[str, list[runs.TrialRecord]]:
    """The earlier sweep's home as the study keeps it (a folder's absolute path, or its URL)
    and every trial record there; one line when there is none."""
    home = runs.open_home(spec)
    if not home.remote:
        folder = home.local
        if not folder.is_dir():
            raise UserError(
                f"--warm-start {spec}: no such folder; give the --output-dir of an earlier sweep"
            )
        if settings.output_dir is not None and folder == Path(settings.output_dir).resolve():
            raise UserError(
                f"--warm-start {spec} is this sweep's own --output-dir, which continues by itself; "
                "give an earlier sweep's folder, or drop --warm-start"
            )
        records = runs.read_trials(folder)
    else:
        records = home.records()  # type: ignore[attr-defined]
    if not records:
        raise UserError(
            f"--warm-start {spec}: no trials there (no run-*/trial.json); give the --output-dir "
            "of an earlier sweep"
        )
    return home.url, records


def _finished(
    records: Sequence[runs.TrialRecord], settings: SearchOptions, spec: str
) -> list[runs.TrialRecord]:
    """The records with a result to give: complete ones with an objective, and (one objective)
    pruned ones with their objective per step. Another objective or direction is refused."""
    for record in records:
        if (record.objective_name, list(record.directions)) != (
            settings.objective_name,
            list(settings.directions),
        ):
            raise UserError(
                f"--warm-start {spec} optimised {record.objective_name} "
                f"({', '.join(record.directions)}), this sweep {settings.objective_name} "
                f"({', '.join(settings.directions)}); warm-start from a sweep of the same "
                "objective and direction, or drop --warm-start"
            )
    finished = [
        r
        for r in records
        if (r.state == "complete" and _value(r, settings) is not None)
        or (r.state == "pruned" and _intermediate(r, settings))
    ]
    if not finished:
        raise UserError(
            f"--warm-start {spec}: none of its {len(records)} trials finished with a result; "
            "give a sweep with complete trials, or drop --warm-start"
        )
    return finished


def _value(record: runs.TrialRecord, settings: SearchOptions) -> float | list[float] | None:
    value = record.objective
    if settings.multi_objective:
        ok = isinstance(value, list) and len(value) == len(settings.directions)
        return [float(v) for v in value] if ok and all(map(_number, value)) else None  # type: ignore[arg-type, union-attr]
    return float(value) if _number(value) else None  # type: ignore[arg-type]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _intermediate(record: runs.TrialRecord, settings: SearchOptions) -> dict[int, float]:
    """The objective at each evaluation's training step, when it is a metric the record kept."""
    if settings.multi_objective:
        return {}
    name = settings.objective_name
    return {
        int(h["step"]): float(h[name])
        for h in record.history
        if isinstance(h, Mapping) and "step" in h and _number(h.get(name))
    }


def _project(record: runs.TrialRecord, settings: SearchOptions) -> WarmTrial | None:
    """``record`` on the new space: its removed params dropped; None when a value it keeps lies
    outside the new space, or no param is left."""
    space = settings.space or {}
    params = {name: value for name, value in record.params.items() if name in space}
    if not params or not all(fits(space[name], value) for name, value in params.items()):
        return None
    return WarmTrial(
        number=record.number,
        state=record.state,
        params=params,
        value=_value(record, settings) if record.state == "complete" else None,
        # a complete trial's curve stays out: a pruner would hold the new trials to curves drawn
        # on other data (a changed size moves every step), and prune nearly all of them
        intermediate=_intermediate(record, settings) if record.state == "pruned" else {},
    )


def fits(dist: Distribution, value: Any) -> bool:
    """Whether ``value`` is one ``dist`` can give: of its type, in its range, on its step's grid."""
    if isinstance(dist, Categorical):
        return any(
            choice == value and isinstance(choice, bool) == isinstance(value, bool)
            for choice in dist.choices
        )
    if isinstance(value, bool) or not dist.contains(value):
        return False
    step = dist.step
    if isinstance(dist, Int):
        return (value - dist.low) % step == 0
    assert isinstance(dist, Float)
    if step is None:
        return True
    k = (value - dist.low) / step
    return abs(k - round(k)) < 1e-8


def _best_configs(
    trials: Sequence[WarmTrial], settings: SearchOptions, k: int | None
) -> tuple[dict[str, Any], ...]:
    """The params of the ``k`` best complete trials, best first."""
    if k is None:
        return ()
    if settings.multi_objective:
        raise UserError(
            f"--warm-start-best {k} ranks trials by one objective, and this sweep has "
            f"{len(settings.directions)}; drop --warm-start-best"
        )
    done = [t for t in trials if t.value is not None]
    maximize = settings.directions[0] == "maximize"
    done.sort(key=lambda t: (-t.value if maximize else t.value, t.number))  # type: ignore[operator]
    return tuple(dict(t.params) for t in done[:k])


# --- handing it over, and what the sweep's folder keeps --------------------------------------------


class WarmStartTaken(SweepCallback):
    """Says what the warm start took, as the sweep begins, and keeps it in `TAKEN_FILE` (at an
    object-store home too) for ``hpsweep show`` and the report."""

    def __init__(self, warm: WarmStart) -> None:
        self.warm = warm

    def on_sweep_begin(self, settings: SearchOptions) -> None:
        print(f"hpsweep: {self.warm.line()}", file=sys.stderr)
        assert settings.output_dir is not None
        path = Path(settings.output_dir) / TAKEN_FILE
        runs.write_json(path, self.warm.to_json())
        if settings.home is not None and settings.home.remote:
            settings.home.upload_file(path, TAKEN_FILE)


def give_backend(backend: Any, settings: SearchOptions) -> list[SweepCallback]:
    """Read the warm start ``settings`` ask for and hand it to ``backend`` (which refuses what it
    cannot take), before anything is written; returns the sweep callback that says what was
    taken (none without ``--warm-start``)."""
    warm = read_warm_start(settings)
    if warm is None:
        return []
    backend.warm_start(warm)
    return [WarmStartTaken(warm)]


def whole_trials_only(warm: WarmStart, backend: str) -> None:
    """Refuse, in one line, a warm start that a backend whose search takes whole earlier trials
    only (W&B's engine) cannot use: one that adds a param no earlier trial has,
    or asks for ``--warm-start-best``, which it has no queue for."""
    if warm.new_params:
        raise UserError(
            f"--warm-start: the {backend} backend's search takes whole earlier trials only, and "
            f"none has {', '.join(warm.new_params)} (new in this space); use --backend optuna, "
            "or warm-start a space without new params"
        )
    if warm.best:
        raise UserError(
            f"--warm-start-best: the {backend} backend cannot queue configs to train first; "
            "drop --warm-start-best or use --backend optuna"
        )


def read_taken(folder: Path) -> dict[str, Any] | None:
    """What the sweep in ``folder`` took as its warm start (`TAKEN_FILE`), or None."""
    path = Path(folder) / TAKEN_FILE
    data = runs.read_json(path) if path.exists() else None
    return data if isinstance(data, dict) and isinstance(data.get("trials"), list) else None
