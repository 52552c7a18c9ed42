"""Run folders, trial records (``trial.json``), and what the best run is (`BestRun`, the Pareto
front); `_best` writes it as trials end."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from hpsweep.runs._atomic import _json_default, read_json, write_json

TRIAL_FILE = "trial.json"
#: One line (a run folder's name) each time a record is written: how ledgers learn what changed.
JOURNAL = ".trials.journal"
BEST_DIR = "best"
BEST_FILE = "best_run.json"
STATES = ("running", "complete", "pruned", "failed", "stopped")
MAX_NAME = 100
#: Names hpsweep itself uses at the top of a sweep folder; a run named so would clobber them.
RESERVED = {
    BEST_DIR,
    BEST_FILE,
    "report.html",
    "wandb_sweep.json",
    "wandb",
    "mlruns",
    "mlflow.db",
    "warm_start.json",
    "stopping.json",
}

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_T = TypeVar("_T")


# --- names ---------------------------------------------------------------------------------------


def safe_name(name: str, fallback: str) -> str:
    """``name`` as one safe folder name: no separators, no leading dots, at most 100 characters.

    ``../../etc`` becomes ``etc``; a name with nothing safe left becomes ``fallback``; a longer
    name keeps a hash of the whole, so two long names that differ only at the end stay two
    folders; a name hpsweep uses itself in the sweep folder (``best``, ``study.journal``) gets ``run-``.
    """
    cleaned = _UNSAFE.sub("-", str(name)).strip("-.")
    if len(cleaned) > MAX_NAME:
        digest = hashlib.sha1(cleaned.encode()).hexdigest()[:10]
        cleaned = f"{cleaned[: MAX_NAME - 11].strip('-.')}-{digest}"
    if not cleaned:
        return fallback
    reserved = cleaned.lower() in RESERVED or cleaned.lower().startswith(
        ("study.db", "study.journal")
    )
    return f"run-{cleaned}" if reserved else cleaned


def run_dir_for(output_dir: Path, trial_id: str, name: str | None = None) -> Path:
    """The run folder of a trial: ``run-<id>``, or the sanitised ``name`` (``hp_name``).

    A name already taken by another trial gets ``-<id>`` appended, so two trials never share a folder.
    """
    default = safe_name(f"run-{trial_id}", "run")
    folder = safe_name(name, default) if name is not None else default
    path = output_dir / folder
    if name is not None and path.exists():
        owner = read_json(path / TRIAL_FILE).get("id")
        if owner is None or str(owner) != str(trial_id):
            path = output_dir / safe_name(f"{folder}-{trial_id}", default)
    return path


# --- trial records -------------------------------------------------------------------------------


@dataclass
class TrialRecord:
    """What ``run-<id>/trial.json`` holds: one trial, for every backend alike."""

    id: str
    number: int
    backend: str
    params: dict[str, Any]
    state: str = "running"
    objective: float | list[float] | None = None
    objective_name: str = "eval_loss"
    directions: list[str] = field(default_factory=lambda: ["minimize"])
    metrics: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: str | None = None
    error: str | None = None
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    duration_s: float | None = None
    run_dir: str = ""
    user_attrs: dict[str, Any] = field(default_factory=dict)
    #: The checkpoint this run of the trial started from, when an earlier run of it was cut short.
    resumed_from: str | None = None
    #: How many times the trial was started (1, plus one per run again after an interruption).
    attempts: int = 1

    def save(self) -> None:
        """Write ``trial.json``, then name the run folder in the sweep folder's journal, so every
        process's ledger reads this record again (`hpsweep.runs.TrialIndex`)."""
        run_dir = Path(self.run_dir)
        write_json(run_dir / TRIAL_FILE, asdict(self))
        _journal(run_dir)

    def finish(self, state: str, *, objective: Any = None, error: str | None = None) -> None:
        self.state, self.error = state, error
        if objective is not None:
            self.objective = objective
        self.finished_at = time.time()
        self.duration_s = round(self.finished_at - self.started_at, 4)
        self.save()

    @classmethod
    def load(cls, path: Path) -> TrialRecord | None:
        return cls.from_dict(read_json(path))

    @classmethod
    def from_dict(cls, data: Any) -> TrialRecord | None:
        """The record ``trial.json`` holds as ``data``; None if it is not one."""
        if not data or not isinstance(data, dict):
            return None
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        try:
            return cls(**known)
        except TypeError:
            return None


def read_trials(output_dir: Path) -> list[TrialRecord]:
    """Every trial under ``output_dir`` as it is on disk now, by number (unreadable records are skipped).

    Each ``trial.json`` is checked (one ``stat``) and parsed again only when it changed; the
    ledger, which looks at the trials several times a trial, keeps a `TrialIndex` instead.
    """
    records = []
    for name in trial_names(output_dir):
        loaded = load_record(os.path.join(output_dir, name, TRIAL_FILE))
        if loaded is not None:
            copied = TrialRecord.__new__(TrialRecord)  # a shallow copy: callers may change theirs
            copied.__dict__.update(loaded[1].__dict__)
            records.append(copied)
    return sorted(records, key=lambda r: (r.number, r.id))


def trial_names(output_dir: Path | str) -> list[str]:
    """The names in ``output_dir`` that may be run folders (no ``stat`` each: a file fails later)."""
    try:
        return [name for name in os.listdir(output_dir) if not name.startswith(".")]
    except OSError:
        return []


def load_record(path: str) -> tuple[tuple[int, int, int], TrialRecord] | None:
    """The record at ``path`` with its file's (inode, mtime, size), parsed again only when those
    changed; None when it is missing or unreadable. The record is shared: do not change it."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    signature = (st.st_ino, st.st_mtime_ns, st.st_size)
    cached = _PARSED.get(path)
    if cached is None or cached[0] != signature:
        cached = _PARSED[path] = (signature, TrialRecord.load(Path(path)))
    return None if cached[1] is None else (signature, cached[1])  # type: ignore[return-value]


def _journal(run_dir: Path) -> None:
    """Append the run folder's name to its sweep folder's journal. One short ``O_APPEND`` write, so
    lines from several processes do not mix; a line that cannot be written is found by the next
    full check instead (`TrialIndex.verify`), so it never fails the save."""
    try:
        fd = os.open(
            run_dir.parent / JOURNAL, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666
        )
    except OSError:
        return
    try:
        os.write(fd, f"{run_dir.name}\n".encode())
    except OSError:
        pass
    finally:
        os.close(fd)


FINAL_STATES = ("complete", "pruned", "failed")
#: Parsed records by path, with their file's (inode, mtime, size), shared by every reader in the process.
_PARSED: dict[str, tuple[tuple[int, int, int], TrialRecord | None]] = {}


# --- the best run --------------------------------------------------------------------------------


@dataclass
class BestRun:
    """The best trial of a sweep (one of the Pareto front for multi-objective sweeps)."""

    run_id: str
    objective: float | list[float]
    hyperparameters: dict[str, Any]
    run_dir: str
    checkpoint: str | None
    run_summary: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_record(cls, record: TrialRecord) -> BestRun:
        checkpoint = str(Path(record.run_dir) / record.checkpoint) if record.checkpoint else None
        summary = {
            "number": record.number,
            "state": record.state,
            "metrics": record.metrics,
            "objective_name": record.objective_name,
            "directions": record.directions,
            "duration_s": record.duration_s,
            "backend": record.backend,
        }
        return cls(record.id, record.objective, record.params, record.run_dir, checkpoint, summary)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def is_better(a: float, b: float | None, direction: str) -> bool:
    return b is None or (a > b if direction == "maximize" else a < b)


def dominates(a: Sequence[float], b: Sequence[float], directions: Sequence[str]) -> bool:
    signs = [1 if d == "maximize" else -1 for d in directions]
    pairs = [(s * x, s * y) for s, x, y in zip(signs, a, b)]
    return all(x >= y for x, y in pairs) and any(x > y for x, y in pairs)


def best_records(records: Sequence[TrialRecord], directions: Sequence[str]) -> list[TrialRecord]:
    """The best complete trial, or the Pareto front for several directions."""
    done = [r for r in records if r.state == "complete" and r.objective is not None]
    if len(directions) == 1:
        best: TrialRecord | None = None
        for r in done:
            if is_better(r.objective, best.objective if best else None, directions[0]):  # type: ignore[arg-type]
                best = r
        return [best] if best else []
    return [
        r
        for r in done
        if not any(
            dominates(o.objective, r.objective, directions)  # type: ignore[arg-type]
            for o in done
            if o is not r
        )
    ]


def front_with(
    front: Sequence[_T],
    new: _T,
    directions: Sequence[str],
    objective: Callable[[_T], Sequence[float]],
) -> list[_T]:
    """The Pareto front of ``front`` (itself a front) and ``new``, in at most two comparisons per
    trial of ``front``: ``new`` stays out if one of them dominates it, else it joins and those it
    dominates leave.

    A trial dominated once stays dominated, so the front of every trial so far is the front of the
    last front and the newest trial: a promotion costs the front's size, not the sweep's. With
    objectives that do not move together, the front of N trials holds O(log N) of them for two
    directions (O(log^(d-1) N) for d).
    """
    value = objective(new)
    kept = []
    for old in front:
        if dominates(objective(old), value, directions):
            return list(front)  # then ``new`` dominates none of them either
        if not dominates(value, objective(old), directions):
            kept.append(old)
    return [*kept, new]


def front_after(current: Any, entry: dict[str, Any], record: TrialRecord) -> list[Any] | None:
    """The front a ``best_run.json`` holds (``current``) with ``record`` offered to it
    (``entry``: its `BestRun` as written there), by number; None when it must be computed again
    from every record: there is no front yet (or not one of these directions), or a trial of the
    front comes back with another objective or state (it ran again, or was edited), so the trials
    it dominated may be back. The same trial with the same objective takes its own place."""
    n = len(record.directions)
    if not isinstance(current, list) or not all(_is_entry(e, n) for e in current):
        return None
    done = record.state == "complete" and isinstance(record.objective, (list, tuple))
    earlier = [e for e in current if e["run_id"] == record.id]
    if earlier:
        if not done or earlier[0]["objective"] != list(record.objective):  # type: ignore[arg-type]
            return None
        return _by_number([*(e for e in current if e["run_id"] != record.id), entry])
    if not done:
        return current
    return _by_number(front_with(current, entry, record.directions, lambda e: e["objective"]))


def _is_entry(entry: Any, n: int) -> bool:
    """Whether ``entry`` is a `BestRun` of a front of ``n`` directions, as written."""
    return (
        isinstance(entry, dict)
        and "run_id" in entry
        and isinstance(entry.get("objective"), list)
        and len(entry["objective"]) == n
    )


def _by_number(front: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(
        front, key=lambda e: ((e.get("run_summary") or {}).get("number", -1), e["run_id"])
    )


def read_best(output_dir: Path) -> BestRun | list[BestRun] | None:
    data = read_json(output_dir / BEST_FILE) if (output_dir / BEST_FILE).exists() else None
    if not data:
        return None
    if isinstance(data, list):
        return [BestRun(**d) for d in data]
    return BestRun(**data)


def params_json(params: Mapping[str, Any]) -> str:
    return json.dumps(dict(params), sort_keys=True, default=_json_default)
