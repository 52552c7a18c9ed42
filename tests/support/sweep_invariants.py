"""docs/guarantees.md as checks on a sweep folder: what must hold after any
interruption and a rerun.

Shared by the contract test (every backend) and the fault-injection harness.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from hpsweep import runs

# A slow-enough real trial to interrupt: each step sleeps, and every 4 steps evaluate and checkpoint.
SLOW_TRIALS = """
import time
class _Slow(hpsweep.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        time.sleep({step_s})
callbacks = [_Slow()]
"""
SLOW_ARGS = ', eval_strategy="steps", eval_steps=4, save_strategy="steps", save_steps=4'


def violations(
    output_dir: Path,
    n_trials: int,
    direction: str = "maximize",
    before: dict[str, float] | None = None,
    model_only: bool = False,
) -> list[str]:
    """Every broken promise of "When things go wrong" in ``output_dir`` after a sweep that exited 0
    (``model_only``: its checkpoints hold the model alone, ``save_only_model=True``)."""
    import torch
    from safetensors.torch import load_file

    found: list[str] = []
    records = runs.read_trials(output_dir)
    finished = [r for r in records if r.state in ("complete", "pruned")]
    if len(finished) != n_trials:
        found.append(f"{len(finished)} finished trials, not {n_trials}")
    for r in records:
        if r.state in ("running", "stopped"):
            found.append(f"trial {r.id} left {r.state}")
    if len({r.run_dir for r in records}) != len(records):
        found.append("two trials share a run folder")
    for r in records:
        if before and r.id in before and before[r.id] != r.finished_at:
            found.append(f"finished trial {r.id} was touched by the rerun")
        for checkpoint in runs.checkpoints(Path(r.run_dir)):
            try:
                load_file(str(checkpoint / "model.safetensors"))
                for name in () if model_only else ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
                    torch.load(checkpoint / name, weights_only=True)
            except Exception as exc:  # noqa: BLE001 - any unreadable file is the violation
                found.append(f"{checkpoint} does not load: {type(exc).__name__}: {exc}")
    complete = [r for r in records if r.state == "complete"]
    best = runs.read_best(output_dir)
    if complete:
        pick = max if direction == "maximize" else min
        want = pick(complete, key=lambda r: r.objective)
        if best is None or best.objective != want.objective:
            found.append(
                f"best_run.json is {best and best.objective}, the best complete trial {want.objective}"
            )
        elif not (output_dir / "best" / "model.safetensors").exists():
            found.append("best/ holds no model.safetensors")
    if (output_dir / ".leases").is_dir() and any((output_dir / ".leases").iterdir()):
        found.append("leases left behind")
    return found


def finished_at(output_dir: Path) -> dict[str, float]:
    """When each finished trial finished: a rerun must not touch them."""
    return {
        r.id: r.finished_at
        for r in runs.read_trials(output_dir)
        if r.state in ("complete", "pruned", "failed")
    }


def start(
    *args: str, cwd: Path | None = None, env: dict | None = None, preexec_fn=None
) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "hpsweep.cli", *map(str, args)],
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec_fn,
    )


def wait_for(condition, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def checkpoints_in(output_dir: Path) -> int:
    return (
        sum(len(runs.checkpoints(p)) for p in output_dir.glob("*") if p.is_dir())
        if output_dir.is_dir()
        else 0
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def worker_pids(output_dir: Path) -> set[int]:
    return {int(r.user_attrs["pid"]) for r in runs.read_trials(output_dir) if "pid" in r.user_attrs}
