"""Parallel trials with torch's default thread count against the threads an ``--n-jobs`` worker gets.

    python bench/threads.py                     # 2 trials at once, 5 rounds: about 3 minutes here
    python bench/threads.py --parallel 3 --rounds 3

Each round starts ``--parallel`` training processes at once (what ``--n-jobs`` does) twice: once
with torch's default intra-op threads (one per core of the machine, in every process), once with
the threads `hpsweep.devices` gives each of ``--n-jobs parallel`` workers (the usable cores split
between them). The two variants alternate,
and the ratio is taken within each round. A trial: 15 steps of a 512-1024-1024-10 MLP at batch
256 with AdamW, big enough for torch to use its threads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TRIAL = """
import sys, torch
from torch import nn
if sys.argv[1] == "split":  # what an --n-jobs worker does before its first trial
    from hpsweep import devices
    devices.apply(devices.plan(n_jobs=int(sys.argv[2]), resources=None, gpus=[], cores=devices.usable_cores()), 0)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(256, 512), torch.randint(0, 10, (256,))
for _ in range(15):
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step(); opt.zero_grad()
print(torch.get_num_threads())
"""


def round_of(variant: str, parallel: int) -> tuple[float, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    # torch imported and warm before the clock starts: the trials' training is what is compared
    code = "import torch, torch.optim, hpsweep.devices\nimport sys; sys.stdin.readline()\n" + TRIAL
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, variant, str(parallel)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(parallel)
    ]
    time.sleep(4.0)  # imports done
    start = time.perf_counter()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    threads = [p.communicate()[0].strip() for p in procs]
    return time.perf_counter() - start, threads[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    ns = parser.parse_args()
    times: dict[str, list[float]] = {"default": [], "split": []}
    threads = {}
    for r in range(ns.rounds):
        for variant in times:
            t, threads[variant] = round_of(variant, ns.parallel)
            times[variant].append(t)
            print(
                f"  round {r + 1}: {variant:<8} {t:6.2f} s ({threads[variant]} threads per trial)",
                file=sys.stderr,
                flush=True,
            )
    ratios = [d / s for d, s in zip(times["default"], times["split"])]
    print(
        f"\n{ns.parallel} trials at once, {ns.rounds} interleaved rounds; usable cores "
        f"{len(os.sched_getaffinity(0))}; wall seconds until every trial of the round finished"
    )
    print("| torch threads per trial | median s | default / split (median of rounds) | min-max |")
    print("| --- | ---: | ---: | ---: |")
    print(
        f"| default ({threads['default']}) | {statistics.median(times['default']):.2f} | "
        f"{statistics.median(ratios):.2f}x | {min(ratios):.2f}-{max(ratios):.2f} |"
    )
    print(
        f"| --n-jobs {ns.parallel} split ({threads['split']}) | {statistics.median(times['split']):.2f} | 1.00x | |"
    )
    print(f"\nreproduce: python bench/threads.py --parallel {ns.parallel} --rounds {ns.rounds}")


if __name__ == "__main__":
    main()
