"""What bench/gpu's measurements share: running ``hpsweep run`` on the space file, reading the
trial records and the space file's log, and sampling the GPU while a command runs.

Nothing here imports torch: the measuring process never holds a CUDA context of its own, so the
GPU's memory and utilisation are the measured commands' alone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SPACE = HERE / "space.py"


def dry_run() -> bool:
    return os.environ.get("HPSWEEP_GPU_DRY_RUN", "") not in ("", "0")


def env_with(**extra: str) -> dict[str, str]:
    """This environment with the repository on PYTHONPATH (hpsweep is used from the working tree)
    and ``extra`` on top."""
    path = os.environ.get("PYTHONPATH", "")
    parts = [p for p in path.split(os.pathsep) if p]
    if str(ROOT) not in parts:
        parts.insert(0, str(ROOT))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(parts), "PYTHONUNBUFFERED": "1"}
    if dry_run():
        env["HPSWEEP_GPU_DRY_RUN"] = "1"
    env.update(extra)
    return env


@dataclass
class Ran:
    returncode: int
    wall_s: float
    stdout: str
    stderr: str

    def tail(self, n: int = 1500) -> str:
        return (self.stdout + "\n" + self.stderr).strip()[-n:]


def hpsweep_run(
    out: Path, *args: str, env: dict[str, str], timeout: float, sampler: GpuSampler | None = None
) -> Ran:
    """``python -m hpsweep.cli run bench/gpu/space.py --output-dir OUT ARGS``, to its end."""
    cmd = [sys.executable, "-m", "hpsweep.cli", "run", str(SPACE), "--output-dir", str(out), *args]
    return run(cmd, env=env, timeout=timeout, sampler=sampler)


def run(
    cmd: list[str], *, env: dict[str, str], timeout: float, sampler: GpuSampler | None = None
) -> Ran:
    print("$", " ".join(cmd), flush=True)
    started = time.perf_counter()
    if sampler is not None:
        sampler.mark("start")
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, err = -9, f"killed after {timeout:.0f} s"
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    if sampler is not None:
        sampler.mark("end")
    ran = Ran(code, time.perf_counter() - started, out, err)
    if code != 0:
        print(f"exit {code}:\n{ran.tail(3000)}", flush=True)
    return ran


def trial_records(out: Path) -> list[dict[str, Any]]:
    """The sweep's ``run-*/trial.json`` records, by trial number."""
    records = [json.loads(p.read_text()) for p in out.glob("*/trial.json")]
    return sorted(records, key=lambda r: r["number"])


def log_rows(path: Path) -> list[dict[str, Any]]:
    """The space file's log (`space.Probe`): one dict per line."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(path)


@dataclass
class GpuSampler:
    """Samples the GPU's utilisation (%) and used memory (MiB, every process counted) every
    ``interval`` seconds in a thread: from ``nvidia-smi``, else NVML (``pynvml``), else
    ``torch.cuda.utilization`` in a helper process. ``source`` says which; ``none`` where no GPU
    answers (the dry run), and then every figure is None."""

    interval: float = 0.25
    source: str = "none"
    samples: list[tuple[float, float | None, float | None]] = field(default_factory=list)
    marks: dict[str, float] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _proc: subprocess.Popen | None = None

    def __enter__(self) -> GpuSampler:
        index = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        if shutil.which("nvidia-smi") and self._start_smi(index):
            return self
        if self._start_nvml(index):
            return self
        self._start_torch()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def mark(self, name: str) -> None:
        self.marks[name] = time.time()

    def _start_smi(self, index: str) -> bool:
        cmd = [
            "nvidia-smi",
            f"--id={index}",
            "--query-gpu=utilization.gpu,memory.used",
            "--format=csv,noheader,nounits",
            f"--loop-ms={int(self.interval * 1000)}",
        ]
        try:
            self._proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
        except OSError:
            return False

        def read() -> None:
            assert self._proc is not None and self._proc.stdout is not None
            for line in self._proc.stdout:
                parts = [p.strip() for p in line.split(",")]
                try:
                    self.samples.append((time.time(), float(parts[0]), float(parts[1])))
                except (ValueError, IndexError):
                    continue

        self._thread = threading.Thread(target=read, daemon=True)
        self._thread.start()
        for _ in range(30):  # nvidia-smi takes a moment to start
            if self.samples or self._proc.poll() is not None:
                break
            time.sleep(0.1)
        if self.samples:
            self.source = "nvidia-smi"
            return True
        self._proc.kill()
        self._proc, self._thread = None, None
        return False

    def _start_nvml(self, index: str) -> bool:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(index))
        except Exception:  # no binding, no driver, no such GPU
            return False

        def poll() -> None:
            while not self._stop.is_set():
                try:
                    util = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
                    used = pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
                    self.samples.append((time.time(), float(util), float(used)))
                except Exception:
                    pass
                self._stop.wait(self.interval)

        self.source = "pynvml"
        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return True

    def _start_torch(self) -> None:
        """torch.cuda.utilization in a process of its own (this one never imports torch); it
        prints one line per sample, or nothing where torch cannot read it."""
        code = (
            "import sys, time, torch\n"
            "torch.cuda.utilization(0)\n"  # raises where neither NVML nor AMD SMI answers
            f"while True:\n    print(torch.cuda.utilization(0), flush=True); time.sleep({self.interval})\n"
        )
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", code],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=env_with(),
            )
        except OSError:
            return

        def read() -> None:
            assert self._proc is not None and self._proc.stdout is not None
            for line in self._proc.stdout:
                try:
                    self.samples.append((time.time(), float(line), None))
                except ValueError:
                    continue
                self.source = "torch.cuda.utilization"

        self._thread = threading.Thread(target=read, daemon=True)
        self._thread.start()

    def summary(self, start: float | None = None, end: float | None = None) -> dict[str, Any]:
        """Mean and max utilisation and peak used memory between ``start`` and ``end`` (times;
        default: the last ``mark("start")`` and ``mark("end")``), and the used memory just before
        the last command started."""
        start = start if start is not None else self.marks.get("start", 0.0)
        end = end if end is not None else self.marks.get("end", time.time())
        during = [s for s in self.samples if start <= s[0] <= end]
        began = self.marks.get("start", start)  # the command's start, before its CUDA contexts
        before = [s[2] for s in self.samples if s[0] < began and s[2] is not None]
        utils = [s[1] for s in during if s[1] is not None]
        mems = [s[2] for s in during if s[2] is not None]
        return {
            "source": self.source,
            "samples": len(during),
            "util_mean_pct": round(sum(utils) / len(utils), 1) if utils else None,
            "util_max_pct": max(utils) if utils else None,
            "mem_used_peak_mib": max(mems) if mems else None,
            "mem_used_before_mib": before[-1] if before else None,
        }
