"""Run folders, trial records (``trial.json``) and the best run (``best/``, ``best_run.json``)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ._atomic import _json_default, atomic_dir, read_json, write_json


TRIAL_FILE = "trial.json"
BEST_DIR = "best"
BEST_FILE = "best_run.json"
STATES = ("running", "complete", "pruned", "failed", "stopped")
MAX_NAME = 100
#: Names hpsweep itself uses at the top of a sweep folder; a run named so would clobber them.
RESERVED = {BEST_DIR, BEST_FILE, "report.html", "wandb_sweep.json", "wandb", "mlruns", "mlflow.db"}

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


# --- names ---------------------------------------------------------------------------------------

def safe_name(name: str, fallback: str) -> str:
    """``name`` as one safe folder name: no separators, no leading dots, at most 100 characters.

    ``../../etc`` becomes ``etc``; a name with nothing safe left becomes ``fallback``; a longer
    name keeps a hash of the whole, so two long names that differ only at the end stay two
    folders; a name hpsweep uses itself in the sweep folder (``best``, ``study.db``) gets ``run-``.
    """
    cleaned = _UNSAFE.sub("-", str(name)).strip("-.")
    if len(cleaned) > MAX_NAME:
        digest = hashlib.sha1(cleaned.encode()).hexdigest()[:10]
        cleaned = f"{cleaned[:MAX_NAME - 11].strip('-.')}-{digest}"
    if not cleaned:
        return fallback
    return f"run-{cleaned}" if cleaned.lower() in RESERVED or cleaned.lower().startswith("study.db") else cleaned


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
        write_json(Path(self.run_dir) / TRIAL_FILE, asdict(self))

    def finish(self, state: str, *, objective: Any = None, error: str | None = None) -> None:
        self.state, self.error = state, error
        if objective is not None:
            self.objective = objective
        self.finished_at = time.time()
        self.duration_s = round(self.finished_at - self.started_at, 4)
        self.save()

    @classmethod
    def load(cls, path: Path) -> TrialRecord | None:
        data = read_json(path)
        if not data:
            return None
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        try:
            return cls(**known)
        except TypeError:
            return None


def read_trials(output_dir: Path) -> list[TrialRecord]:
    """Every trial under ``output_dir``, by number (unreadable records are skipped).

    The ledger reads them before every claim, so this must not grow costly with the sweep: a
    record already read as ``complete``, ``pruned`` or ``failed`` never changes again, and is
    reused while its run folder is the same folder (same inode); others are read again when
    their file changed (mtime, size).
    """
    records = []
    try:
        entries = list(os.scandir(output_dir))
    except OSError:
        return []
    for entry in entries:
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        path = os.path.join(entry.path, TRIAL_FILE)
        cached = _RECORDS.get(path)
        if cached is not None and cached[0] == entry.inode() and cached[2] is not None \
                and cached[2].state in FINAL_STATES:
            record = cached[2]
        else:
            try:
                st = os.stat(path)
            except OSError:
                continue
            if cached is None or cached[1] != (st.st_mtime_ns, st.st_size) or cached[0] != entry.inode():
                cached = (entry.inode(), (st.st_mtime_ns, st.st_size), TrialRecord.load(Path(path)))
                _RECORDS[path] = cached
            record = cached[2]
        if record is not None:
            copied = TrialRecord.__new__(TrialRecord)  # a shallow copy, without copy.copy's generic path
            copied.__dict__.update(record.__dict__)
            records.append(copied)
    return sorted(records, key=lambda r: (r.number, r.id))


FINAL_STATES = ("complete", "pruned", "failed")
_RECORDS: dict[str, tuple[int, tuple[int, int], TrialRecord | None]] = {}


def trial_files(output_dir: Path) -> Iterator[Path]:
    if output_dir.is_dir():
        for entry in os.scandir(output_dir):
            if entry.is_dir() and not entry.name.startswith("."):
                path = Path(entry.path) / TRIAL_FILE
                if path.exists():
                    yield path


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
        summary = {"number": record.number, "state": record.state, "metrics": record.metrics,
                   "objective_name": record.objective_name, "directions": record.directions,
                   "duration_s": record.duration_s, "backend": record.backend}
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
    return [r for r in done if not any(dominates(o.objective, r.objective, directions)  # type: ignore[arg-type]
                                       for o in done if o is not r)]


def promote_if_best(output_dir: Path, record: TrialRecord) -> bool:
    """Make ``record`` the sweep's best run if it beats the current one; returns whether it did.

    Runs under a file lock, so parallel workers and processes never interleave promotions.
    ``best/`` gets a copy of the trial's checkpoint (swapped in atomically) with a README.md.
    """
    from filelock import FileLock

    with FileLock(str(output_dir / ".best.lock")):
        current = read_json(output_dir / BEST_FILE)
        if len(record.directions) > 1:
            front = best_records(read_trials(output_dir), record.directions)
            write_json(output_dir / BEST_FILE, [BestRun.from_record(r).to_dict() for r in front])
            return any(r.id == record.id for r in front)
        current_value = current.get("objective") if isinstance(current, dict) else None
        if not is_better(record.objective, current_value, record.directions[0]):  # type: ignore[arg-type]
            return False
        best = BestRun.from_record(record)
        if best.checkpoint and Path(best.checkpoint).is_dir():
            with atomic_dir(output_dir / BEST_DIR) as tmp:
                shutil.copytree(best.checkpoint, tmp, dirs_exist_ok=True, copy_function=_link_or_copy)
                (tmp / "README.md").write_text(best_run_readme(best))
        write_json(output_dir / BEST_FILE, best.to_dict())
        return True


def _link_or_copy(src: str, dst: str) -> None:
    """Hard-link a checkpoint file (instant, no extra disk: checkpoint files are never modified
    after their folder is renamed into place, and rotation only unlinks them); copy across devices."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def read_best(output_dir: Path) -> BestRun | list[BestRun] | None:
    data = read_json(output_dir / BEST_FILE) if (output_dir / BEST_FILE).exists() else None
    if not data:
        return None
    if isinstance(data, list):
        return [BestRun(**d) for d in data]
    return BestRun(**data)


def best_run_readme(best: BestRun) -> str:
    """A short README for ``best/``: where it came from and how to load it."""
    params = "\n".join(f"| `{k}` | `{v}` |" for k, v in best.hyperparameters.items())
    name = best.run_summary.get("objective_name", "objective")
    return (f"# Best run: {Path(best.run_dir).name}\n\n"
            f"{name} = {best.objective}\n\n| parameter | value |\n| --- | --- |\n{params}\n\n"
            "Load the weights with `safetensors.torch.load_model(model, 'model.safetensors')`"
            " (or `from_pretrained(this_folder)` for Hugging Face models).\n")


def params_json(params: Mapping[str, Any]) -> str:
    return json.dumps(dict(params), sort_keys=True, default=_json_default)
