"""Every benchmark under bench/ runs to the end of a tiny run and prints its table.

The figures in bench/README.md (and docs/performance.md) come from these scripts. One that stops
working is found here, not when someone next measures: a script that borrows another's task
breaks silently when that task gains a parameter. No figure is checked: speed is measured by
running the scripts, never asserted in tests.
"""

from __future__ import annotations

import json
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
    "warm_start.py": (
        ["--tasks", "wine", "--seeds", "1", "--first-trials", "3", "--trials", "2"],
        ["| wine | 0 |"],
    ),
    "stopping.py": (
        ["--tasks", "wine", "--seeds", "1", "--n-trials", "2"],
        ["| regret |", "| plateau |"],
    ),
    "time_to_target.py": (
        [
            "--tasks",
            "digits",
            "--seeds",
            "1",
            "--trials",
            "2",
            "--repeats",
            "1",
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
    "scaling.py": (["--trials", "8"], ["hpsweep", "optuna"]),
    "memory.py": (["--trials", "3", "--hidden", "16"], ["trial"]),
    "threads.py": (["--rounds", "1"], ["default"]),
    "other_load.py": (
        ["--trials", "1", "--epochs", "1", "--rounds", "1", "--busy", "1"],
        ["| hand |", "| hpsweep |", "| hpsweep-pinned |"],
    ),
    "ray_overhead.py": (
        ["--trials", "2", "--concurrency", "1", "--reuse", "off", "--no-warm"],
        ["hpsweep --backend ray", "bare torch trainable", "ratio hpsweep / bare torch"],
    ),
    "bookkeeping.py": (
        ["--workers", "2", "--trials", "12", "--trial-s", "0", "--storages", "journal"]
        + ["--json", "{tmp}/bookkeeping.json"],
        [
            "| storage | side | finished | start s | all W running s | CPU s to 1st trial "
            "| CPU ms/trial, first 10% "
            "| last 10% | **growth** | DB ms/trial, first 10% | last 10% | wall s/trial x W, "
            "first 10% | last 10% |",
            "| storage | side | finished | wall s | ideal s | **/ ideal** |",
            "| journal | hpsweep | 12 |",  # exactly --n-trials, in both tables
            "| journal | optuna |",
        ],
    ),
    "scale.py": (
        ["--workers", "2", "--trials", "4", "--trial-s", "0.1"],
        ["| hpsweep | database | 4 |", "| optuna | database |", "| hpsweep | proxy | 4 |"],
    ),
    "startup.py": (
        ["--rounds", "1", "--storages", "journal"],
        ["| journal | 1 | optuna |", "| journal | 1 | hpsweep |"],
    ),
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


def test_the_gpu_check_runs_on_the_cpu_as_a_dry_run(tmp_path: Path) -> None:
    """bench/gpu/check.sh is run on a lent GPU machine in one call, with no second try to spare:
    its dry run (tiny sizes on the CPU, real training through the real command line) runs every
    step here, so that the one GPU run fails only at what needs CUDA."""
    out = tmp_path / "out"
    committed = {p: p.stat().st_mtime_ns for p in (BENCH / "gpu").iterdir() if p.is_file()}
    env = {
        **os.environ,
        "OUT": str(out),
        "PYTHON": sys.executable,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "TMPDIR": str(tmp_path),
    }
    env.pop("HPSWEEP_FAKE_GPUS", None)
    proc = subprocess.run(
        ["bash", str(BENCH / "gpu" / "check.sh"), "--dry-run"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = (out / "log.txt").read_text() if (out / "log.txt").exists() else ""
    assert proc.returncode == 0, f"check.sh failed:\n{proc.stdout[-3000:]}\n{log[-6000:]}"
    # what comes back from the GPU machine: at most 8 files, at most 2 folders deep
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["log.txt", "pytest.txt", "results.json", "results.md"]
    results = json.loads((out / "results.json").read_text())
    assert results["dry_run"] and results["env"]["cuda_available"] is False
    assert [(s["step"], s["status"]) for s in results["steps"]] == [
        ("env", "0"),
        ("gpu-tests", "0"),
        ("precision", "0"),
        ("memory-oom", "0"),
        ("packing", "0"),
    ]

    # 1. the GPU tests were collected and, without CUDA, all skipped: the 2-GPU one says so
    tests = {t["test"]: t for t in results["gpu_tests"]["tests"]}
    assert len(tests) == 7 and {t["outcome"] for t in tests.values()} == {"skipped"}
    nccl = "test_two_nccl_processes_train_what_one_gpu_does_with_twice_the_batch"
    assert tests.pop(nccl)["message"] == "needs 2 GPUs"
    assert {t["message"] for t in tests.values()} == {"needs CUDA"}

    # 2. every run trained its trials; packed trials were all placed on the one (pretended) GPU,
    # over as many worker processes as --n-jobs
    runs = {r["name"]: r for r in results["packing"]["runs"]}
    assert list(runs) == ["hand", "1", "0.5", "0.25"]
    assert all(r["ok"] and r["trials"] == 4 and r["trials_per_min_wall"] > 0 for r in runs.values())
    assert runs["hand"]["devices"] == ["cpu"]
    for name, jobs in (("1", 1), ("0.5", 2), ("0.25", 4)):
        assert runs[name]["devices"] == ["0"] and 1 <= runs[name]["processes"] <= jobs
        assert 0 <= runs[name]["best_eval_accuracy"] <= 1
    assert runs["hand"]["gpu"]["source"] == "none" and runs["hand"]["gpu"]["util_mean_pct"] is None

    # 3. one trial in each precision the CPU has, trained in that precision, timed per step
    precisions = {r["precision"]: r for r in results["precision"]["runs"]}
    assert precisions["fp16"] == {
        "precision": "fp16",
        "skipped": "fp16 needs CUDA (refused on the CPU)",
    }
    for name, dtype in (("fp32", "torch.float32"), ("bf16", "torch.bfloat16")):
        run = precisions[name]
        assert run["ok"] and run["logits_dtype"] == dtype and run["step_ms"] > 0
        assert 0 <= run["eval_accuracy"] <= 1 and run["step_vs_fp32"] > 0
    assert precisions["fp32"]["learning_rate"] == precisions["bf16"]["learning_rate"]

    # 4. the out-of-memory trial failed alone, in one line, and the sweep went on to the end
    memory = results["memory_oom"]
    assert memory["ok"] and memory["checks"] == {
        "sweep_finished": True,
        "oom_failed_only_its_trial": True,
        "oom_error_is_one_line": True,
        "one_worker": True,
    }
    assert memory["complete"] == 4 and memory["failed"] == [2] and memory["last"]["trial"] == 4
    assert memory["first"]["rss_mb"] > 0 and memory["first"]["free_mb"] is None

    page = (out / "results.md").read_text()
    for heading in ("## 1. The GPU tests", "## 2. Trials packed", "## 3. bf16", "## 4. Memory"):
        assert heading in page
    assert "| hpsweep gpu=0.25 --n-jobs 4 |" in page and "| bf16 |" in page
    assert "7 skipped" in (out / "pytest.txt").read_text()
    now = {p: p.stat().st_mtime_ns for p in (BENCH / "gpu").iterdir() if p.is_file()}
    assert now == committed, "the dry run changed bench/gpu's files"
