"""bench/gpu/check.sh's two small jobs in Python: what machine this is, and its results in one
JSON file and one markdown page.

    python bench/gpu/summary.py --env PARTS/env.json         # GPU, driver, torch, CUDA, packages
    python bench/gpu/summary.py --parts PARTS --out OUT      # OUT/results.json, OUT/results.md

``--parts`` reads what the steps left in PARTS (``steps.jsonl``: each step's exit status and
seconds; ``pytest.xml``; ``packing.json``, ``precision.json``, ``memory_oom.json``; ``env.json``);
a step that did not run or was cut short is shown as such, so the page is written after every
step and is whole whenever the run stops.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory_oom  # noqa: E402
import packing  # noqa: E402
import precision  # noqa: E402
from _common import ROOT, dry_run, write_json  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", type=Path, help="write this machine's description here")
    parser.add_argument("--parts", type=Path, help="the steps' outputs")
    parser.add_argument("--out", type=Path, help="where results.json and results.md go")
    ns = parser.parse_args()
    if ns.env:
        write_json(ns.env, environment())
    if ns.parts and ns.out:
        results = collect(ns.parts, ns.out)
        ns.out.mkdir(parents=True, exist_ok=True)
        write_json(ns.out / "results.json", results)
        (ns.out / "results.md").write_text(markdown(results))
    return 0


def environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "dry_run": dry_run(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device_count": torch.cuda.device_count(),
        "cpu_count": os.cpu_count(),
        "hpsweep_commit": _git("rev-parse", "--short", "HEAD"),
        "hpsweep_tree_changed": bool(_git("status", "--porcelain", "--untracked-files=no")),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            gpu_memory_mib=round(props.total_memory / 2**20),
            bf16_supported=torch.cuda.is_bf16_supported(),
        )
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        info["nvidia_smi"] = smi.stdout.strip()
    for name in ("optuna", "accelerate", "transformers", "pytest", "nvidia-ml-py"):
        try:  # the installed version, without the cost of importing it
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = None
    spec = importlib.util.find_spec("optuna")
    info["optuna_from"] = str(Path(spec.origin).parent) if spec and spec.origin else None
    return info


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    except OSError:
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def collect(parts: Path, out: Path) -> dict[str, Any]:
    def load(name: str) -> Any:
        path = parts / name
        return json.loads(path.read_text()) if path.exists() else None

    steps = []
    if (parts / "steps.jsonl").exists():
        lines = (parts / "steps.jsonl").read_text().splitlines()
        steps = [json.loads(line) for line in lines if line.strip()]
    return {
        "dry_run": dry_run(),
        "env": load("env.json"),
        "steps": steps,
        "gpu_tests": junit(parts / "pytest.xml") or verbose_lines(out / "pytest.txt"),
        "packing": load("packing.json"),
        "precision": load("precision.json"),
        "memory_oom": load("memory_oom.json"),
    }


def junit(path: Path) -> dict[str, Any] | None:
    """pytest's JUnit XML as one outcome per test."""
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:  # cut short while writing it
        return {"error": f"unreadable {path.name}: {exc}"}
    tests = []
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = (child.get("message") or "").strip()
                break
        seconds = round(float(case.get("time") or 0), 1)
        tests.append(
            {
                "test": case.get("name"),
                "outcome": outcome,
                "seconds": seconds,
                "message": message[:500],
            }
        )
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return {"collected": len(tests), "counts": counts, "tests": tests}


def verbose_lines(path: Path) -> dict[str, Any] | None:
    """The outcomes ``pytest -v`` printed, where it wrote no JUnit XML (cut short)."""
    if not path.exists():
        return None
    found = re.findall(
        r"^\S+::(\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", path.read_text(), re.M
    )
    if not found:
        return None
    tests = [{"test": name, "outcome": outcome.lower(), "message": ""} for name, outcome in found]
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return {"collected": None, "counts": counts, "tests": tests, "cut_short": True}


def markdown(r: dict[str, Any]) -> str:
    env = r.get("env") or {}
    lines = ["# hpsweep on a GPU (`bench/gpu/check.sh`)", ""]
    if r["dry_run"]:
        lines += ["**Dry run: no GPU.** Tiny sizes on the CPU; these figures measure nothing.", ""]
    if env:
        gpu = env.get("gpu") or "no CUDA device"
        lines.append(
            f"{gpu}, {env.get('nvidia_smi') or 'no nvidia-smi'}; torch {env.get('torch')} "
            f"(CUDA {env.get('torch_cuda')}), Python {env.get('python')}, {env.get('cpu_count')} "
            f"cores; hpsweep {env.get('hpsweep_commit') or '(no git)'}"
            + (" with changes" if env.get("hpsweep_tree_changed") else "")
        )
        lines.append("")
    lines += ["| step | exit | seconds |", "| --- | ---: | ---: |"]
    for s in r["steps"]:
        lines.append(f"| {s['step']} | {s['status']} | {s['seconds']} |")
    lines += ["", "## 1. The GPU tests (`pytest -m gpu tests/devices/test_gpu.py`)", ""]
    tests = r.get("gpu_tests")
    if not tests:
        lines.append("not run")
    elif "error" in tests:
        lines.append(tests["error"])
    else:
        lines.append(", ".join(f"{n} {k}" for k, n in sorted(tests["counts"].items())))
        if tests.get("cut_short"):
            lines[-1] += " (cut short: the tests that finished, from pytest -v's lines)"
        lines += ["", "| test | outcome | s | message |", "| --- | --- | ---: | --- |"]
        for t in tests["tests"]:
            message = t["message"].replace("|", "/").replace("\n", " ")[:200]
            lines.append(f"| {t['test']} | {t['outcome']} | {t.get('seconds', '')} | {message} |")
    lines += ["", "## 2. Trials packed on one GPU (`bench/gpu/packing.py`)", ""]
    lines.append(packing.table(r["packing"]) if r.get("packing") else "not run")
    lines += ["", "## 3. bf16 and fp16 against fp32 (`bench/gpu/precision.py`)", ""]
    lines.append(precision.table(r["precision"]) if r.get("precision") else "not run")
    lines += [
        "",
        "## 4. Memory over 50 trials, and an out-of-memory trial (`bench/gpu/memory_oom.py`)",
    ]
    lines.append("")
    lines.append(memory_oom.table(r["memory_oom"]) if r.get("memory_oom") else "not run")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
