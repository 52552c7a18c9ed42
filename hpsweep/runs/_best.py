"""The sweep's best run as trials end: ``best_run.json`` (one `BestRun`, or the Pareto front of
several directions) and ``best/``, the best trial's model with its README, swapped in atomically.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpsweep.runs._atomic import atomic_dir, read_json, write_json
from hpsweep.runs._model_folder import README, best_run_readme, copy_model, model_kind_of
from hpsweep.runs._records import (
    BEST_DIR,
    BEST_FILE,
    BestRun,
    TrialRecord,
    best_records,
    front_after,
    is_better,
    read_trials,
)


def promote_if_best(output_dir: Path, record: TrialRecord, *, where: str | None = None) -> bool:
    """Make ``record`` the sweep's best run if it beats the current one; returns whether it did
    (several directions: whether it is on the Pareto front, `front_after`).

    Runs under a file lock, so parallel workers and processes never interleave promotions. It
    reads ``best_run.json``, not every trial's record, so it costs the same at the 10,000th trial
    as at the first (several directions: what the front's size costs, `front_with`). ``best/``
    (swapped in atomically) gets the model's files of the trial's checkpoint, not its training
    state, with a README.md whose usage loads it from ``where`` (``out/best``).
    """
    from filelock import FileLock

    with FileLock(str(output_dir / ".best.lock")):
        current = read_json(output_dir / BEST_FILE)
        if len(record.directions) > 1:
            return _promote_to_front(output_dir, record, current)
        current_value = current.get("objective") if isinstance(current, dict) else None
        if not is_better(record.objective, current_value, record.directions[0]):  # type: ignore[arg-type]
            return False
        best = BestRun.from_record(record)
        if best.checkpoint and Path(best.checkpoint).is_dir():
            with atomic_dir(output_dir / BEST_DIR) as tmp:
                copy_model(Path(best.checkpoint), tmp)
                readme = best_run_readme(
                    best, model_kind_of(tmp), where or f"{output_dir.name}/{BEST_DIR}"
                )
                (tmp / README).write_text(readme, encoding="utf-8")
        write_json(output_dir / BEST_FILE, best.to_dict())
        return True


def _promote_to_front(output_dir: Path, record: TrialRecord, current: Any) -> bool:
    """Several directions: ``best_run.json`` becomes the front it holds with ``record`` offered to
    it (or, when `front_after` says so, the front of every record on disk)."""
    entry = BestRun.from_record(record).to_dict()
    front = front_after(current, entry, record)
    if front is None:
        return any(r.id == record.id for r in _write_front(output_dir, record.directions))
    if not any(e is entry for e in front):
        return False
    write_json(output_dir / BEST_FILE, front)
    return True


def _write_front(output_dir: Path, directions: Sequence[str]) -> list[TrialRecord]:
    """``best_run.json`` as the Pareto front of every record on disk (each one read)."""
    front = best_records(read_trials(output_dir), directions)
    write_json(output_dir / BEST_FILE, [BestRun.from_record(r).to_dict() for r in front])
    return front


def settle_front(output_dir: Path) -> None:
    """Once a command ends, a sweep of several directions: ``best_run.json`` made the front of
    every record on disk, so a trial whose process died between its record and its promotion is
    on it too. Reads every record, once a command; a sweep of one direction is left as it is."""
    from filelock import FileLock

    current = read_json(output_dir / BEST_FILE)
    if isinstance(current, dict) and current:  # one direction's best run
        return
    with FileLock(str(output_dir / ".best.lock")):
        records = read_trials(output_dir)
        if records and len(records[0].directions) > 1:
            _write_front(output_dir, records[0].directions)
