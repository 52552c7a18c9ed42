"""Everything a sweep writes to disk: run folders, checkpoints, trial records and the best run.

Layout (``DIR`` is ``--output-dir``)::

    DIR/run-<id>/checkpoint-<step>/   model.safetensors, optimizer.pt, scheduler.pt, rng_state.pth,
                                      trainer_state.json, training_args.json (+ config.json)
    DIR/run-<id>/trial.json           the `TrialRecord`
    DIR/best/                         the best run's checkpoint, with README.md
    DIR/best_run.json                 the `BestRun` (a list of them for multi-objective sweeps)

Every file and folder is written under a temporary name and renamed into place, so a crash
leaves either the old version or the new one, never half of one.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CHECKPOINT_PREFIX = "checkpoint-"
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


# --- atomic writes -------------------------------------------------------------------------------

def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file in the same folder, then rename),
    with the permissions a plain ``open()`` would give, not mkstemp's owner-only 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: Path, data: Any) -> None:
    """Write JSON to ``path`` atomically (see `write_text`)."""
    write_text(path, json.dumps(data, indent=2, default=_json_default) + "\n")


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    if isinstance(value, Path):
        return str(value)
    return repr(value)


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def atomic_dir(final: Path) -> _AtomicDir:
    """Context manager: fill a temporary sibling folder, renamed to ``final`` on success.

    An existing ``final`` is replaced; on an exception the temporary folder is removed.
    """
    return _AtomicDir(final)


class _AtomicDir:
    def __init__(self, final: Path) -> None:
        self.final = final

    def __enter__(self) -> Path:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(dir=self.final.parent, prefix=f".{self.final.name}.tmp-"))
        return self.tmp

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        _as_open_would_make(self.tmp)
        _swap_into_place(self.tmp, self.final)


def _as_open_would_make(folder: Path) -> None:
    """Give ``folder`` and what is in it the modes ``mkdir``/``open`` would (mkdtemp makes 0700,
    some writers 0600), so other users of a shared sweep folder can read checkpoints and best/."""
    mask = _umask()
    os.chmod(folder, 0o777 & ~mask)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


def _swap_into_place(tmp: Path, final: Path) -> None:
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def recover_interrupted_swaps(folder: Path) -> None:
    """Finish or undo swaps a crash interrupted, and drop leftover temporary folders."""
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        match = re.fullmatch(r"\.(.+)\.old-\d+", entry.name)
        if match:
            final = folder / match.group(1)
            if final.exists():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                os.rename(entry, final)
        elif re.fullmatch(r"\..+\.tmp-\w+", entry.name) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


# --- checkpoints ---------------------------------------------------------------------------------

def checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first (temporary folders are never listed)."""
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir()
             if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and p.name[len(CHECKPOINT_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = checkpoints(run_dir)
    return found[-1] if found else None


def rotate_checkpoints(run_dir: Path, limit: int | None, keep: Path | None) -> list[Path]:
    """Delete the oldest checkpoints beyond ``limit``, never ``keep`` (the run's best)."""
    if limit is None:
        return []
    found = checkpoints(run_dir)
    newest = found[-limit:]
    doomed = [p for p in found if p not in newest and (keep is None or p.resolve() != keep.resolve())]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def save_weights(model: Any, folder: Path) -> None:
    """Model weights as safetensors; Hugging Face models also write their config.json."""
    if hasattr(model, "save_pretrained") and hasattr(model, "config"):
        model.save_pretrained(folder, safe_serialization=True)
    else:
        from safetensors.torch import save_model

        save_model(model, str(folder / "model.safetensors"))


def load_weights(model: Any, folder: Path) -> None:
    """Load weights written by `save_weights` into ``model`` (no pickle involved)."""
    from safetensors.torch import load_model

    path = folder / "model.safetensors"
    if path.exists():
        load_model(model, str(path))
        return
    index = folder / "model.safetensors.index.json"
    if index.exists():  # sharded Hugging Face checkpoint
        from safetensors.torch import load_file

        state: dict[str, Any] = {}
        for shard in sorted(set(read_json(index)["weight_map"].values())):
            state.update(load_file(str(folder / shard)))
        model.load_state_dict(state, strict=False)
        return
    raise FileNotFoundError(f"{folder} holds no model.safetensors")


def write_checkpoint(final: Path, *, model: Any, optimizer: Any, scheduler: Any, state: Mapping[str, Any],
                     args: Mapping[str, Any]) -> Path:
    """Write a whole checkpoint folder atomically: weights (safetensors), optimizer, scheduler and
    RNG state (tensors and plain numbers only, so ``torch.load(weights_only=True)`` reads them),
    trainer_state.json and training_args.json."""
    import torch

    with atomic_dir(final) as tmp:
        save_weights(model, tmp)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(rng_state(), tmp / "rng_state.pth")
        write_json(tmp / "trainer_state.json", state)
        write_json(tmp / "training_args.json", args)
    return final


def read_checkpoint(folder: Path, *, model: Any, optimizer: Any, scheduler: Any) -> tuple[dict[str, Any], Any]:
    """Load a checkpoint written by `write_checkpoint` into the given objects (never with pickle).

    Returns the trainer state (a dict) and the RNG state, which the caller restores when the
    resumed run reaches the point the checkpoint was taken at (`set_rng_state`).
    """
    import torch

    load_weights(model, folder)
    optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
    return read_json(folder / "trainer_state.json"), torch.load(folder / "rng_state.pth", weights_only=True)


def rng_state() -> dict[str, Any]:
    """Python, numpy, torch (and CUDA) RNG states as tensors and plain numbers."""
    import random

    import numpy as np
    import torch

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                       "has_gauss": has_gauss, "cached": cached}}
    # Not is_available(): that initialises the CUDA driver, and processes forked afterwards (the
    # data-parallel ranks of a trial whose model was built here) could no longer use the GPU.
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    import random

    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
    """Every trial under ``output_dir``, by number (unreadable records are skipped)."""
    records = [r for r in (TrialRecord.load(p) for p in trial_files(output_dir)) if r is not None]
    return sorted(records, key=lambda r: (r.number, r.id))


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
