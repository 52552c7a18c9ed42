"""Every benchmark under bench/ runs to the end of a tiny run and prints its table.

The figures in bench/README.md come from these scripts. One that stops working is found here,
not in the next measuring session. (`n_jobs.py` failed every trial with a NameError for several
sessions after `core_overhead.py`, whose task it borrows, gained a parameter.) No figure is
checked: speed is measured by running the scripts, never asserted in tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"

#: script -> (the smallest run of it, lines its output must hold: table rows naming what it compared)
CASES: dict[str, tuple[list[str], list[str]]] = {
    "core_overhead.py": (
        ["--trials", "1", "--epochs", "1", "--repeats", "1", "--variants", "hand,hpsweep"],
        ["| hand |", "| hpsweep |"],
    ),
    "step_overhead.py": (["--rounds", "1"], ["hand-bare", "hpsweep-bare"]),
    "n_jobs.py": (["--trials", "4", "--rounds", "1"], ["| 1 |", "| 2 |"]),
    "trial_cost.py": (
        ["--rounds", "1", "--seeds", "1", "--variants", "hpsweep,hand"],
        ["| hpsweep |", "| hand |"],
    ),
    "time_to_target.py": (
        [
            "--tasks",
            "digits",
            "--seeds",
            "1",
            "--trials",
            "3",
            "--repeats",
            "2",
            "--contenders",
            "hpsweep,optuna",
            "--plot",
            "{tmp}/ttt.png",
            "--save",
            "{tmp}/ttt.json",
        ],
        ["| hpsweep |", "| optuna |"],
    ),
    "pruner_settings.py": (
        ["--trials", "3", "--seeds", "1", "--candidates", "median(startup=3 warmup=1)"],
        ["median(startup=3 warmup=1)"],
    ),
    "same_training.py": (["--configs", "2"], ["hpsweep"]),
    "scaling.py": (["--trials", "20"], ["hpsweep", "optuna"]),
    "memory.py": (["--trials", "3", "--hidden", "16"], ["trial"]),
    "threads.py": (["--rounds", "1"], ["default"]),
    "other_load.py": (
        ["--trials", "1", "--epochs", "1", "--rounds", "1", "--busy", "1"],
        ["| hand |", "| hpsweep |", "| hpsweep-pinned |"],
    ),
    "ray_overhead.py": (["--trials", "2", "--concurrency", "1"], ["hpsweep", "torch"]),
}


def test_every_bench_script_has_a_case() -> None:
    scripts = {p.name for p in BENCH.glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(CASES), "add a tiny run of the new bench script to CASES"


@pytest.mark.parametrize("script", sorted(CASES))
def test_bench_runs(script: str, tmp_path: Path) -> None:
    args, expected = CASES[script]
    committed = _bench_files()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *(a.format(tmp=tmp_path) for a in args)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    for text in expected:
        assert text in proc.stdout, f"{script} printed no {text!r}:\n{proc.stdout[-3000:]}"
    assert _bench_files() == committed, f"{script} changed bench/'s files (the committed figures)"


def _bench_files() -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in BENCH.iterdir() if p.is_file()}


def test_time_to_target_takes_each_seeds_median_over_its_repeats() -> None:
    """With --repeats, one slow start-up does not decide a seed: its time is the median of its
    repeats, and it counts as reached when most repeats reached the target."""
    sys.path.insert(0, str(BENCH))
    try:
        import time_to_target
    finally:
        sys.path.remove(str(BENCH))

    def run(seed: int, hit_at: float | None, wall: float) -> dict:
        curve = [(1.0, 1.0, 0.5)] + ([(hit_at, hit_at, 0.99)] if hit_at is not None else [])
        return {"seed": seed, "wall": wall, "cpu": wall, "finished": len(curve), "curve": curve}

    runs = [
        run(0, 3.0, 5.0),
        run(1, None, 6.0),
        run(0, 9.0, 10.0),
        run(1, 4.0, 5.0),
        run(0, 4.0, 5.0),
        run(1, None, 7.0),
    ]
    walls, cpus, reached, got = time_to_target._per_seed(runs, target=0.98)
    assert walls == [4.0, 6.0] and cpus == [
        4.0,
        6.0,
    ]  # seed 0: median of 3, 9, 4; seed 1: of 6 (never), 4, 7 (never)
    assert got == [True, False] and reached == 1
    # runs saved before they carried their seed: each one its own seed, in order
    old = [{k: v for k, v in r.items() if k != "seed"} for r in runs[:2]]
    assert time_to_target._per_seed(old, target=0.98)[0] == [3.0, 6.0]
