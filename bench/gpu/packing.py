"""Trials per minute on one GPU: a hand loop, ``gpu=1``, and two or four trials packed on it.

    python bench/gpu/packing.py --json packing.json                 # about 4 x 50 s on a GPU
    python bench/gpu/packing.py --json p.json --window 20 --configs hand,1,0.5

The same sweep of `_task`'s CNN (8192 32x32 images, 5 epochs of 32 steps of 256, evaluation and
a checkpoint every epoch, the learning rate drawn at random with seed 0, no pruning), for
``--window`` seconds each (no trial starts after it; the ones running finish):

- ``hand``: the same training as a hand-written torch loop on raw Optuna in one process
  (``RandomSampler(seed=0)``, as hpsweep's ``--sampler random --seed 0``; AdamW, linear decay,
  gradient clipping at 1, an evaluation and a ``torch.save`` of model, optimizer and scheduler
  every epoch), trial after trial;
- ``1``: ``hpsweep run --resources-per-trial gpu=1 --n-jobs 1``;
- ``0.5``: ``gpu=0.5 --n-jobs 2``, two trials at once on the GPU;
- ``0.25``: ``gpu=0.25 --n-jobs 4``.

Per run: trials finished; trials per minute over the command's wall time (start-up included) and
over the trials' own span (first start to last end); the GPU's utilisation sampled during that
span, and its peak used memory (every process's, CUDA contexts included); each trial's peak
allocated memory. Each run is one process tree started afresh; runs are not repeated (the GPU is
lent for minutes), so compare them as one sample each.

With ``HPSWEEP_GPU_DRY_RUN=1`` (no GPU): tiny sizes, 4 trials per run, and
``HPSWEEP_FAKE_GPUS=1``, so the placement of packed trials is hpsweep's real one while they
train on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    GpuSampler,
    dry_run,
    env_with,
    hpsweep_run,
    log_rows,
    run,
    trial_records,
    write_json,
)

#: name -> (gpu per trial, --n-jobs); "hand" is the hand loop
CONFIGS: dict[str, tuple[float, int]] = {
    "hand": (1, 1),
    "1": (1, 1),
    "0.5": (0.5, 2),
    "0.25": (0.25, 4),
}
LR_RANGE = (1e-4, 1e-2)  # space.py's
#: a run's start-up and its last trials' tail beyond its window (a guess, for --budget)
START_UP_S = 25


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", type=Path, help="write the results here (after each run)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="runs, in this order")
    parser.add_argument("--window", type=float, help="seconds each run starts trials for")
    parser.add_argument(
        "--budget", type=float, help="seconds for all runs: each gets its share as its window"
    )
    parser.add_argument("--max-trials", type=int, help="trials per run at most")
    parser.add_argument("--hand", action="store_true", help=argparse.SUPPRESS)  # the hand loop
    parser.add_argument("--log", type=Path, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.hand:
        return hand_loop(ns.window, ns.max_trials, ns.log)
    return measure(ns)


def measure(ns: argparse.Namespace) -> int:
    names = [c.strip() for c in ns.configs.split(",") if c.strip()]
    unknown = set(names) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"--configs: unknown {sorted(unknown)}; choose from {list(CONFIGS)}")
    deadline = time.time() + ns.budget if ns.budget else None
    fixed = ns.window if ns.window is not None else 300.0 if dry_run() else None
    max_trials = ns.max_trials or (4 if dry_run() else 1000)
    result: dict[str, Any] = {"max_trials": max_trials, "runs": []}
    work = Path(tempfile.mkdtemp(prefix="gpu-packing-"))
    try:
        with GpuSampler() as sampler:
            result["sampler"] = sampler.source
            for i, name in enumerate(names):
                # each run its share of what is left (a run over its window shortens the next)
                window = fixed if fixed is not None else 30.0
                if fixed is None and deadline is not None:
                    share = (deadline - time.time()) / (len(names) - i) - START_UP_S
                    window = min(30.0, share)
                if window < 5 and fixed is None:
                    result["runs"].append({"name": name, "skipped": "out of time"})
                else:
                    row = measure_one(name, work, window, max_trials, sampler, deadline)
                    result["runs"].append(row)
                    print(json.dumps(row), flush=True)
                if ns.json:
                    write_json(ns.json, result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(result))
    return 0 if all(r.get("ok", False) for r in result["runs"] if "skipped" not in r) else 1


def measure_one(
    name: str,
    work: Path,
    window: float,
    max_trials: int,
    sampler: GpuSampler,
    deadline: float | None,
) -> dict[str, Any]:
    gpu, n_jobs = CONFIGS[name]
    log = work / f"{name}.jsonl"
    out = work / f"out-{name}"
    extra = {"GPUBENCH_LOG": str(log)}
    if dry_run():
        extra["HPSWEEP_FAKE_GPUS"] = "1"
    env = env_with(**extra)
    timeout = (deadline - time.time()) if deadline else window + 600
    if name == "hand":
        cmd = [sys.executable, __file__, "--hand", "--window", str(window)]
        cmd += ["--max-trials", str(max_trials), "--log", str(log)]
        ran = run(cmd, env=env, timeout=timeout, sampler=sampler)
        rows = log_rows(log)
        trials = [r for r in rows if r["event"] == "trial"]
        complete = trials
        failed: list[dict[str, Any]] = []
        spans = [(r["started_at"], r["finished_at"]) for r in trials]
        best = max((r["eval_accuracy"] for r in trials), default=None)
        devices = sorted({r["device"] for r in trials})
        pids = {r["pid"] for r in trials}
        peak_alloc = [r["peak_allocated_mb"] for r in trials if r.get("peak_allocated_mb")]
    else:
        args = ["--n-trials", str(max_trials), "--timeout", str(window), "--n-jobs", str(n_jobs)]
        args += ["--resources-per-trial", f"gpu={gpu:g}", "--pruner", "none"]
        args += ["--sampler", "random", "--seed", "0"]
        ran = hpsweep_run(out, *args, env=env, timeout=timeout, sampler=sampler)
        records = trial_records(out)
        complete = [r for r in records if r["state"] == "complete"]
        failed = [r for r in records if r["state"] == "failed"]
        spans = [(r["started_at"], r["finished_at"]) for r in complete]
        best = max((r["objective"] for r in complete), default=None)
        devices = sorted({",".join(r["user_attrs"].get("devices", [])) for r in complete})
        pids = {r["user_attrs"].get("pid") for r in complete}
        ends = [r for r in log_rows(log) if r["event"] == "end"]
        peak_alloc = [r["peak_allocated_mb"] for r in ends if r.get("peak_allocated_mb")]
        shutil.rmtree(out, ignore_errors=True)  # checkpoints: the disk is not what is measured
    first, last = (min(s for s, _ in spans), max(e for _, e in spans)) if spans else (None, None)
    span = (last - first) if spans else None
    gpu_stats = sampler.summary(first, last) if spans else sampler.summary()
    return {
        "name": name,
        "what": "hand loop" if name == "hand" else f"hpsweep gpu={gpu:g} --n-jobs {n_jobs}",
        "window_s": round(window, 1),
        "ok": ran.returncode == 0 and bool(complete) and not failed,
        "returncode": ran.returncode,
        "wall_s": round(ran.wall_s, 2),
        "trials": len(complete),
        "failed": len(failed),
        "trials_per_min_wall": round(60 * len(complete) / ran.wall_s, 2) if complete else 0.0,
        "trials_per_min_span": round(60 * len(complete) / span, 2) if span else None,
        "trial_s_median": round(statistics.median(e - s for s, e in spans), 3) if spans else None,
        "best_eval_accuracy": best,
        "devices": devices,
        "processes": len(pids),
        "peak_allocated_mib_per_trial": max(peak_alloc) if peak_alloc else None,
        "gpu": gpu_stats,
        **({"output_tail": ran.tail()} if ran.returncode != 0 or failed else {}),
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"GPU sampled by {result.get('sampler')}; no trial starts after a run's window",
        "| run | window s | trials | trials/min (wall) | trials/min (trials' span) | GPU util % | peak GPU MiB | peak alloc/trial MiB | best acc |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["runs"]:
        if "skipped" in r:
            lines.append(f"| {r['name']} | skipped: {r['skipped']} | | | | | | | |")
            continue
        g = r["gpu"]
        lines.append(
            f"| {r['what']} | {r['window_s']} | {r['trials']} | {r['trials_per_min_wall']} | {r['trials_per_min_span']} "
            f"| {g['util_mean_pct']} | {g['mem_used_peak_mib']} | {r['peak_allocated_mib_per_trial']} "
            f"| {r['best_eval_accuracy']} |"
        )
    return "\n".join(lines)


def hand_loop(window: float, max_trials: int, log: Path) -> int:
    """Trials of the space's training written by hand, until ``window`` seconds have passed."""
    import _task
    import optuna
    import torch

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s = _task.size()
    train, val = _task.data("train"), _task.data("eval")
    started = time.time()
    ckpt_dir = Path(tempfile.mkdtemp(prefix="gpu-hand-"))
    try:
        for number in range(max_trials):
            if time.time() - started > window:
                break
            trial = study.ask()
            lr = trial.suggest_float("learning_rate", *LR_RANGE, log=True)
            row = {"event": "trial", "trial": number, "pid": os.getpid(), "lr": lr}
            row["started_at"] = time.time()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            torch.manual_seed(42)
            model = _task.ConvNet().to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
            loader = torch.utils.data.DataLoader(
                train, batch_size=s.batch, shuffle=True, pin_memory=device.type == "cuda"
            )
            total = s.epochs * len(loader)
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt, lambda step, total=total: 1 - step / total
            )
            for epoch in range(s.epochs):
                model.train()
                for x, y in loader:
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    loss = model(x, y)["loss"]
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    sched.step()
                    opt.zero_grad(set_to_none=True)
                accuracy = evaluate(model, val, 4 * s.batch, device)
                torch.save(
                    {
                        "model": model.state_dict(),
                        "opt": opt.state_dict(),
                        "sched": sched.state_dict(),
                    },
                    ckpt_dir / f"trial-{number}-epoch-{epoch}.pt",
                )
            study.tell(trial, accuracy)
            row.update(eval_accuracy=accuracy, device=str(device), finished_at=time.time())
            if device.type == "cuda":
                row["peak_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
            with open(log, "a") as f:
                f.write(json.dumps(row) + "\n")
            del model, opt, sched
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    return 0


def evaluate(model: Any, data: Any, batch: int, device: Any) -> float:
    import torch

    model.eval()
    right = 0
    with torch.no_grad():
        for x, y in torch.utils.data.DataLoader(data, batch_size=batch):
            logits = model(x.to(device), y.to(device))["logits"]
            right += int((logits.argmax(-1).cpu() == y).sum())
    return right / len(data)


if __name__ == "__main__":
    sys.exit(main())
