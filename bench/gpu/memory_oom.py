"""A 50-trial sweep on one GPU in which trial 2 runs out of GPU memory: does the sweep go on, and
does the 50th trial start with the free GPU memory the first had?

    python bench/gpu/memory_oom.py --json memory_oom.json
    python bench/gpu/memory_oom.py --trials 20 --oom-trial 5

One ``hpsweep run bench/gpu/space.py`` (``--n-jobs 1``: one worker runs every trial; one epoch
each, `_task`'s CNN at twice the width, a checkpoint per trial). Trial 2 fills the GPU with 1 GiB
blocks until CUDA refuses one (a real ``torch.OutOfMemoryError``, the blocks still referenced
from the failing frame). The space file's callback records, as each trial starts training (its
model, optimizer and loaders built), the GPU's free memory (``torch.cuda.mem_get_info``: every
process counted), and the worker's allocated and reserved CUDA memory and RSS.

A failed trial does not count towards ``--n-trials``: the sweep ends with ``--trials`` complete
trials and the failed one, ``--trials + 1`` in all; "the 50th" is the last complete one.

With ``HPSWEEP_GPU_DRY_RUN=1`` (no GPU): tiny sizes on the CPU, 4 trials, and trial 2 raises
torch's ``OutOfMemoryError`` without allocating anything; free GPU memory is then None, RSS is
still recorded.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import dry_run, env_with, hpsweep_run, log_rows, trial_records, write_json  # noqa: E402

FIELDS = ("free_mb", "allocated_mb", "reserved_mb", "rss_mb")
#: the first trial's free memory, give or take this, is what "the same" means in the verdict
FREE_TOLERANCE_MB = 64.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--trials", type=int, help="complete trials (default 50; dry run 4)")
    parser.add_argument("--oom-trial", type=int, default=2, help="the trial that runs out")
    parser.add_argument("--timeout", type=float, default=300, help="seconds for the sweep")
    ns = parser.parse_args()
    trials = ns.trials or (4 if dry_run() else 50)
    work = Path(tempfile.mkdtemp(prefix="gpu-memory-"))
    try:
        result = measure(work, trials, ns.oom_trial, ns.timeout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if ns.json:
        write_json(ns.json, result)
    print(table(result))
    return 0 if result["ok"] else 1


def measure(work: Path, trials: int, oom_trial: int, timeout: float) -> dict[str, Any]:
    out, log = work / "out", work / "log.jsonl"
    env = env_with(
        GPUBENCH_LOG=str(log),
        GPUBENCH_OOM_TRIAL=str(oom_trial),
        GPUBENCH_WIDTH="2",
        GPUBENCH_EPOCHS="1",
    )
    args = ["--n-trials", str(trials), "--pruner", "none", "--sampler", "random", "--seed", "0"]
    ran = hpsweep_run(out, *args, env=env, timeout=timeout)
    records = trial_records(out)
    begins = {r["trial"]: r for r in log_rows(log) if r["event"] == "begin"}
    complete = [r["number"] for r in records if r["state"] == "complete"]
    failed = [r for r in records if r["state"] == "failed"]
    oom = next((r for r in records if r["number"] == oom_trial), None)
    error = (oom or {}).get("error") or ""

    def sample(number: int | None) -> dict[str, Any] | None:
        if number is None or number not in begins:
            return None
        return {"trial": number, **{k: begins[number].get(k) for k in FIELDS}}

    first = sample(complete[0] if complete else None)
    second = sample(complete[1] if len(complete) > 1 else None)
    after_oom = sample(next((n for n in complete if n > oom_trial), None))
    last = sample(complete[-1] if complete else None)
    pids = {r["user_attrs"].get("pid") for r in records}
    checks = {
        "sweep_finished": ran.returncode == 0 and len(complete) == trials,
        "oom_failed_only_its_trial": [r["number"] for r in failed] == [oom_trial],
        "oom_error_is_one_line": error.startswith("OutOfMemoryError: CUDA out of memory.")
        and "\n" not in error
        and "smaller per_device_train_batch_size" in error,
        "one_worker": len(pids) == 1,
    }
    if first and last and first["free_mb"] is not None:
        checks["last_free_as_first"] = abs(last["free_mb"] - first["free_mb"]) <= FREE_TOLERANCE_MB
        checks["last_allocated_as_first"] = abs(last["allocated_mb"] - first["allocated_mb"]) < 1.0
    result = {
        "trials_asked": trials,
        "oom_trial": oom_trial,
        "records": len(records),
        "complete": len(complete),
        "failed": [r["number"] for r in failed],
        "oom_state": (oom or {}).get("state"),
        "oom_error": error,
        "first": first,
        "second": second,
        "after_oom": after_oom,
        "last": last,
        "delta_last_first": _delta(last, first),
        "delta_last_second": _delta(last, second),
        "per_trial": [sample(n) for n in sorted(begins)],
        "free_tolerance_mb": FREE_TOLERANCE_MB,
        "checks": checks,
        "ok": all(checks.values()),
        "wall_s": round(ran.wall_s, 2),
    }
    if not result["ok"]:
        result["output_tail"] = ran.tail()
    return result


def _delta(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, float | None] | None:
    if not a or not b:
        return None
    return {
        k: round(a[k] - b[k], 1) if a[k] is not None and b[k] is not None else None for k in FIELDS
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| trial | free GPU MiB | allocated MiB | reserved MiB | RSS MiB |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for label in ("first", "second", "after_oom", "last"):
        s = result.get(label)
        if s:
            values = " | ".join(str(s[k]) for k in FIELDS)
            lines.append(f"| {label.replace('_', ' ')} (trial {s['trial']}) | {values} |")
    d = result.get("delta_last_first")
    if d:
        lines.append("| last - first | " + " | ".join(str(d[k]) for k in FIELDS) + " |")
    lines.append("")
    lines.append(
        f"{result['complete']} of {result['trials_asked']} trials complete, failed: "
        f"{result['failed']}; trial {result['oom_trial']}: {result['oom_state']}: "
        f"`{result['oom_error'][:160]}`"
    )
    lines.append(
        "checks: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in result["checks"].items())
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
