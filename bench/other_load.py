"""A sweep beside other work: torch's default threads against the threads hpsweep gives a trial.

    python bench/other_load.py                     # 1 busy process, then none; 5 rounds: ~6 minutes here
    python bench/other_load.py --busy 0,1,2 --rounds 3

The issue's task (`core_overhead.py`'s: a 32-64-2 MLP, 3 epochs of 112 steps, a checkpoint every
epoch, 10 trials), each variant a fresh process with the threads torch gives it (no
``OMP_NUM_THREADS``), while ``--busy`` other processes keep cores busy (plain Python loops,
started before the round and stopped after it, as another job on a shared machine would):

- hand: the raw-Optuna hand loop (journal study, a report and a checkpoint every epoch) on
  torch's default threads: one per core, whatever else runs.
- hpsweep: ``hpsweep run`` at its defaults: each trial's threads are its share of the cores less
  those other processes kept busy (`hpsweep.devices.CoreShare`).
- hpsweep-pinned: the same with ``--resources-per-trial cpu=N`` (N: every usable core), which
  pins the threads: what every trial got before hpsweep measured the load.

Variants run interleaved within a round; ratios are taken within each round against the first
variant and the median over rounds is reported, with the threads hpsweep's trials ran with.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import core_overhead  # noqa: E402
from _measure import compile_sources  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BUSY = "while True:\n    pass\n"


def command(name: str, out: Path, ns: argparse.Namespace, cores: int) -> list[str]:
    base = "hpsweep" if name.startswith("hpsweep") else name
    cmd = core_overhead.command(base, out, ns)
    # torch's default threads, not core_overhead's one: what the load does to them is the subject here
    if base == "hand":
        cmd[-1] = cmd[-1].replace("torch.set_num_threads(1)\n", "")
    else:
        space = Path(cmd[4])
        space.write_text(space.read_text().replace("torch.set_num_threads(1)\n", ""))
    return cmd + (["--resources-per-trial", f"cpu={cores}"] if name == "hpsweep-pinned" else [])


def timed(cmd: list[str]) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:3]} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return time.perf_counter() - start


def trial_threads(out: Path) -> list[int]:
    return sorted(
        json.loads(p.read_text())["user_attrs"]["threads"] for p in out.glob("run-*/trial.json")
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--busy", default="1,0", help="comma-separated: busy processes beside the sweep, per table"
    )
    parser.add_argument(
        "--variants",
        default="hand,hpsweep,hpsweep-pinned",
        help="comma-separated; the first is the peer every ratio divides by",
    )
    ns = parser.parse_args()
    ns.hidden, ns.pruner, ns.seed = "64", "none", 0
    variants = ns.variants.split(",")
    from hpsweep import devices

    cores = devices.usable_cores()
    compile_sources()
    work = Path(tempfile.mkdtemp(prefix="hpsweep-load-"))
    print(
        f"{ns.trials} trials of {ns.epochs} epochs, {ns.rounds} rounds, {cores} usable cores, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    try:
        for busy in (int(b) for b in ns.busy.split(",")):
            walls: dict[str, list[float]] = {v: [] for v in variants}
            ratios: dict[str, list[float]] = {v: [] for v in variants}
            threads: dict[str, list[int]] = {v: [] for v in variants}
            for r in range(ns.rounds):
                hogs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(busy)]
                try:
                    # the other work is under way when the sweep starts
                    time.sleep(1.0 if busy else 0.0)
                    for v in variants:
                        out = work / f"{busy}-{r}-{v}"
                        walls[v].append(timed(command(v, out, ns, cores)))
                        threads[v] += trial_threads(out)
                        shutil.rmtree(out, ignore_errors=True)
                finally:
                    for h in hogs:
                        h.kill()
                        h.wait()
                for v in variants:
                    ratios[v].append(walls[v][-1] / walls[variants[0]][-1])
            print(f"\n{busy} busy process{'es' if busy != 1 else ''} beside the sweep:\n")
            print(
                f"| variant | median wall s | vs {variants[0]} (median of rounds) | min-max | trial threads |"
            )
            print("| --- | ---: | ---: | ---: | --- |")
            for v in variants:
                counts = {t: threads[v].count(t) for t in sorted(set(threads[v]))}
                shown = ", ".join(f"{t}: {n}" for t, n in counts.items()) or "(torch's default)"
                print(
                    f"| {v} | {statistics.median(walls[v]):.2f} | {statistics.median(ratios[v]):.2f}x | "
                    f"{min(ratios[v]):.2f}-{max(ratios[v]):.2f} | {shown} |"
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
