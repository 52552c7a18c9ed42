"""bf16 and fp16 against fp32: one trial of the same sweep in each, its step time and final metric.

    python bench/gpu/precision.py --json precision.json

`_task`'s CNN at twice the width (so that the GPU's arithmetic, not Python, sets the step time),
one trial each of ``hpsweep run bench/gpu/space.py --n-trials 1 --sampler random --seed 0
--set mixed_precision=no|fp16|bf16``: the same learning rate, data and order. The space file's
callback synchronises the GPU at each step's end and reports the median step; it also reports the
dtype the model's logits came out in (float16 or bfloat16 under autocast: the precision asked for
is the one trained in).

``fp32`` here is torch's default: convolutions may use TF32 (``torch.backends.cudnn.allow_tf32``
is True by default), matrix products do not.

With ``HPSWEEP_GPU_DRY_RUN=1`` (no GPU): tiny sizes on the CPU, fp32 and bf16; fp16 is skipped
(hpsweep refuses fp16 on the CPU).
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

PRECISIONS = {"fp32": "no", "fp16": "fp16", "bf16": "bf16"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here (after each run)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per run at most")
    ns = parser.parse_args()
    result: dict[str, Any] = {"runs": []}
    work = Path(tempfile.mkdtemp(prefix="gpu-precision-"))
    try:
        for name, value in PRECISIONS.items():
            if dry_run() and name == "fp16":
                row = {"precision": name, "skipped": "fp16 needs CUDA (refused on the CPU)"}
            else:
                row = one(name, value, work, ns.timeout)
            result["runs"].append(row)
            print(row, flush=True)
            if ns.json:
                write_json(ns.json, result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = next((r for r in result["runs"] if r["precision"] == "fp32" and r.get("step_ms")), None)
    for r in result["runs"]:
        if base and r.get("step_ms"):
            r["step_vs_fp32"] = round(r["step_ms"] / base["step_ms"], 3)
    if ns.json:
        write_json(ns.json, result)
    print(table(result))
    return 0 if all(r.get("ok") for r in result["runs"] if "skipped" not in r) else 1


def one(name: str, value: str, work: Path, timeout: float) -> dict[str, Any]:
    out, log = work / f"out-{name}", work / f"{name}.jsonl"
    env = env_with(GPUBENCH_LOG=str(log), GPUBENCH_WIDTH="2", GPUBENCH_STEP_TIMES="1")
    args = ["--n-trials", "1", "--pruner", "none", "--sampler", "random", "--seed", "0"]
    ran = hpsweep_run(out, *args, "--set", f"mixed_precision={value}", env=env, timeout=timeout)
    records = trial_records(out)
    end = next((r for r in log_rows(log) if r["event"] == "end"), {})
    record = records[0] if records else {}
    metrics = record.get("metrics", {})
    row = {
        "precision": name,
        "ok": ran.returncode == 0 and record.get("state") == "complete",
        "state": record.get("state"),
        "learning_rate": record.get("params", {}).get("learning_rate"),
        "steps": end.get("steps"),
        "step_ms": end.get("step_ms"),
        "logits_dtype": end.get("logits_dtype"),
        "eval_accuracy": metrics.get("eval_accuracy"),
        "eval_loss": metrics.get("eval_loss"),
        "trial_s": record.get("duration_s"),
        "peak_allocated_mib": end.get("peak_allocated_mb"),
        "devices": record.get("user_attrs", {}).get("devices"),
    }
    if not row["ok"]:
        row["error"] = record.get("error")
        row["output_tail"] = ran.tail()
    shutil.rmtree(out, ignore_errors=True)
    return row


def table(result: dict[str, Any]) -> str:
    lines = [
        "| precision | step ms (median) | vs fp32 | logits dtype | eval_accuracy | eval_loss | trial s |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in result["runs"]:
        if "skipped" in r:
            lines.append(f"| {r['precision']} | skipped: {r['skipped']} | | | | | |")
        else:
            lines.append(
                f"| {r['precision']} | {r['step_ms']} | {r.get('step_vs_fp32')} | {r['logits_dtype']} "
                f"| {_num(r['eval_accuracy'])} | {_num(r['eval_loss'])} | {r['trial_s']} |"
            )
    return "\n".join(lines)


def _num(x: Any) -> str:
    return f"{x:.4f}" if isinstance(x, float) else str(x)


if __name__ == "__main__":
    sys.exit(main())
