"""``--n-jobs 2`` against ``--n-jobs 1``: trial throughput after start-up, and wall time.

    python bench/n_jobs.py                       # 20 trials, 3 rounds: about 5 minutes here
    python bench/n_jobs.py --jobs 1,2,4 --trials 24

Runs ``hpsweep run`` through the command line, so it measures whatever worker loop is installed.
Rounds are interleaved (n-jobs 1, n-jobs 2, n-jobs 1, ...) and ratios are taken within a round.

- wall: the command's wall time, interpreter start and study creation included;
- throughput after start-up: trials finished per second from the moment every worker has
  finished its first trial (which pays the worker's imports) to the last trial's end, from the
  trial records;
- CPU per trial after start-up: the process tree's CPU seconds over that window per trial. On a
  machine whose cores are busy with other work, two workers cannot run twice as fast; equal CPU
  per trial says they would where two cores are free.

The task is core_overhead.py's (the issue's 32-64-2 MLP, 3 epochs of 112 steps, evaluation and a
checkpoint every epoch), ``--pruner none`` so every trial does the same work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import run_sampled  # noqa: E402
from core_overhead import SPACE  # noqa: E402  (the same task as the overhead bench)


def run(space: Path, out: Path, trials: int, jobs: int) -> tuple[float, float, float]:
    """Wall seconds of the command; trials/s and CPU s per trial after start-up."""
    cmd = [
        sys.executable,
        "-m",
        "hpsweep.cli",
        "run",
        str(space),
        "--n-trials",
        str(trials),
        "--pruner",
        "none",
        "--n-jobs",
        str(jobs),
        "--output-dir",
        str(out),
    ]
    r = run_sampled(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tempfile.gettempdir())
    if r.returncode != 0:
        raise SystemExit(f"--n-jobs {jobs} failed:\n{r.stderr[-3000:]}")
    records = [json.loads(p.read_text()) for p in out.glob("*/trial.json")]
    # After start-up: each worker's first trial pays its imports (torch._dynamo, lazily, in the
    # optimizer); count from the moment the last worker finished its first trial.
    first: dict[int, float] = {}
    for rec in sorted(records, key=lambda rec: rec["finished_at"]):
        first.setdefault(rec["user_attrs"].get("pid", 0), rec["finished_at"])
    warm = max(first.values())
    after = [rec["finished_at"] for rec in records if rec["finished_at"] > warm]
    span = max(after) - warm
    return r.end - r.start, len(after) / span, (r.cpu_at(max(after)) - r.cpu_at(warm)) / len(after)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--jobs", default="1,2", help="comma-separated --n-jobs values; the first is the peer"
    )
    ns = parser.parse_args()
    jobs = [int(j) for j in ns.jobs.split(",")]
    wall: dict[int, list[float]] = {j: [] for j in jobs}
    rate: dict[int, list[float]] = {j: [] for j in jobs}
    cpu: dict[int, list[float]] = {j: [] for j in jobs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(ns.rounds):
            for j in jobs:
                space = Path(tmp) / f"space_{r}_{j}.py"
                out = Path(tmp) / f"out_{r}_{j}"
                # HIDDEN: the 32-64-2 MLP, as core_overhead.py's default --hidden 64
                space.write_text(
                    f"TRIALS, EPOCHS, OUT, HIDDEN = {ns.trials}, 3, {str(out)!r}, [64]\n" + SPACE
                )
                w, t, c = run(space, out, ns.trials, j)
                wall[j].append(w)
                rate[j].append(t)
                cpu[j].append(c)
                print(
                    f"  round {r + 1}: --n-jobs {j}: {w:6.1f} s wall, {t:5.2f} trials/s and {c:5.2f} CPU s a trial "
                    "after start-up",
                    file=sys.stderr,
                    flush=True,
                )
    peer = jobs[0]
    print(
        f"\n{ns.trials} trials, {ns.rounds} interleaved rounds; ratios are medians over rounds of "
        f"(value / --n-jobs {peer} in the same round); usable cores: {len(os.sched_getaffinity(0))}"
    )
    print(
        f"| --n-jobs | median wall s | wall speed-up vs {peer} | trials/s after start-up | throughput vs {peer} "
        f"| min-max | CPU s a trial after start-up | CPU a trial vs {peer} |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for j in jobs:
        speed = [b / a for a, b in zip(wall[j], wall[peer])]
        thr = [a / b for a, b in zip(rate[j], rate[peer])]
        per = [a / b for a, b in zip(cpu[j], cpu[peer])]
        print(
            f"| {j} | {statistics.median(wall[j]):.1f} | {statistics.median(speed):.2f}x | "
            f"{statistics.median(rate[j]):.2f} | {statistics.median(thr):.2f}x | {min(thr):.2f}-{max(thr):.2f} | "
            f"{statistics.median(cpu[j]):.2f} | {statistics.median(per):.2f}x |"
        )
    print(
        f"\nreproduce: python bench/n_jobs.py --trials {ns.trials} --rounds {ns.rounds} --jobs {ns.jobs}"
    )


if __name__ == "__main__":
    main()
