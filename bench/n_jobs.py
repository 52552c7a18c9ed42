"""``--n-jobs 2`` against ``--n-jobs 1``: trial throughput after start-up, and wall time.

    python bench/n_jobs.py                       # 20 trials, 3 rounds: about 5 minutes here
    python bench/n_jobs.py --jobs 1,2,4 --trials 24

Runs ``hpsweep run`` through the command line, so it measures whatever worker loop is installed.
Rounds are interleaved (n-jobs 1, n-jobs 2, n-jobs 1, ...) and ratios are taken within a round.

- wall: the command's wall time, interpreter start and study creation included;
- throughput: trials finished per second between the first trial's start and the last trial's
  end, read from the trial records (``started_at`` / ``finished_at``), so worker start-up and the
  imports before the first trial are not counted.

The task is core_overhead.py's (the issue's 32-64-2 MLP, 3 epochs of 112 steps, evaluation and a
checkpoint every epoch), ``--pruner none`` so every trial does the same work.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from core_overhead import SPACE  # noqa: E402  (the same task as the overhead bench)


def run(space: Path, out: Path, trials: int, jobs: int) -> tuple[float, float]:
    cmd = [sys.executable, "-m", "hpsweep.cli", "run", str(space), "--n-trials", str(trials), "--pruner", "none",
           "--n-jobs", str(jobs), "--output-dir", str(out)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          cwd=tempfile.gettempdir())
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"--n-jobs {jobs} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(p.read_text()) for p in out.glob("*/trial.json")]
    span = max(r["finished_at"] for r in records) - min(r["started_at"] for r in records)
    return wall, len(records) / span


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", default="1,2", help="comma-separated --n-jobs values; the first is the peer")
    ns = parser.parse_args()
    jobs = [int(j) for j in ns.jobs.split(",")]
    wall: dict[int, list[float]] = {j: [] for j in jobs}
    rate: dict[int, list[float]] = {j: [] for j in jobs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(ns.rounds):
            for j in jobs:
                space = Path(tmp) / f"space_{r}_{j}.py"
                out = Path(tmp) / f"out_{r}_{j}"
                space.write_text(f"TRIALS, EPOCHS, OUT = {ns.trials}, 3, {str(out)!r}\n" + SPACE)
                w, t = run(space, out, ns.trials, j)
                wall[j].append(w)
                rate[j].append(t)
                print(f"  round {r + 1}: --n-jobs {j}: {w:6.1f} s wall, {t:5.2f} trials/s after start-up",
                      file=sys.stderr, flush=True)
    peer = jobs[0]
    print(f"\n{ns.trials} trials, {ns.rounds} interleaved rounds; ratios are medians over rounds of "
          f"(value / --n-jobs {peer} in the same round); usable cores: {len(os.sched_getaffinity(0))}")
    print(f"| --n-jobs | median wall s | wall speed-up vs {peer} | median trials/s after start-up "
          f"| throughput vs {peer} | min-max |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for j in jobs:
        speed = [b / a for a, b in zip(wall[j], wall[peer])]
        thr = [a / b for a, b in zip(rate[j], rate[peer])]
        print(f"| {j} | {statistics.median(wall[j]):.1f} | {statistics.median(speed):.2f}x | "
              f"{statistics.median(rate[j]):.2f} | {statistics.median(thr):.2f}x | {min(thr):.2f}-{max(thr):.2f} |")
    print(f"\nreproduce: python bench/n_jobs.py --trials {ns.trials} --rounds {ns.rounds} --jobs {ns.jobs}")


if __name__ == "__main__":
    main()
