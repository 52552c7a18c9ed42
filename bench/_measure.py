"""Run a command and sample its whole process tree: CPU seconds and resident memory over time.

On a shared machine wall time mostly measures the neighbours; CPU time (user + system, summed over
the process and every descendant: workers, Ray's daemons) measures the work a contender did. The
benches report both.
"""

from __future__ import annotations

import bisect
import compileall
import functools
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil


@dataclass
class Sampled:
    returncode: int
    stdout: str
    stderr: str
    start: float  # time.time() just before the command started
    end: float
    # (time, CPU s, RSS MB of the tree)
    samples: list[tuple[float, float, float]] = field(default_factory=list)

    def cpu_at(self, t: float) -> float:
        """CPU seconds the tree had used by time ``t`` (linear between samples)."""
        times = [s[0] for s in self.samples]
        i = bisect.bisect_left(times, t)
        if i == 0:
            return self.samples[0][1] if self.samples else 0.0
        if i >= len(self.samples):
            return self.samples[-1][1]
        (t0, c0, _), (t1, c1, _) = self.samples[i - 1], self.samples[i]
        return c0 + (c1 - c0) * (t - t0) / max(t1 - t0, 1e-9)

    @property
    def cpu(self) -> float:
        return self.samples[-1][1] if self.samples else 0.0

    @property
    def peak_rss_mb(self) -> float:
        return max((s[2] for s in self.samples), default=0.0)


@functools.cache
def compile_sources(tree: Path = Path(__file__).resolve().parents[1]) -> None:  # noqa: B008
    """Compile a checkout's Python files (hpsweep, the space files, bench's) to bytecode, once, as an
    installed package has them: pip compiles a package when it installs it, and Python caches an
    editable install's on first import. A machine with PYTHONDONTWRITEBYTECODE=1 (the development
    machine has it) never caches them, so each contender's process compiled them from source, on
    every start: 37 modules, ~50 ms, for hpsweep; fewer for the peers that import hpsweep's space file.
    Compiled here, every contender starts as a user's process does."""
    for folder in ("hpsweep", "search_spaces", "bench"):
        if (tree / folder).is_dir():
            compileall.compile_dir(str(tree / folder), quiet=1)


def run_sampled(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    interval: float = 0.2,
    timeout: float | None = None,
    cwd: str | None = None,
) -> Sampled:
    """Run ``cmd`` to the end while a thread samples its process tree every ``interval`` seconds.

    A process's CPU time is kept at its last sample after it exits, so the total never goes down
    (a process that lives less than ``interval`` is missed; ours live for seconds).
    """
    compile_sources()
    start = time.time()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd
    )
    samples: list[tuple[float, float, float]] = []
    last_cpu: dict[int, float] = {}
    done = threading.Event()

    def sample() -> None:
        try:
            root = psutil.Process(proc.pid)
        except psutil.NoSuchProcess:
            return
        while not done.is_set():
            rss = 0.0
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            for p in tree:
                try:
                    with p.oneshot():
                        t = p.cpu_times()
                        last_cpu[p.pid] = t.user + t.system
                        rss += p.memory_info().rss / 2**20
                except psutil.Error:
                    pass
            samples.append((time.time(), sum(last_cpu.values()), rss))
            done.wait(interval)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    out, err = proc.communicate(timeout=timeout)
    end = time.time()
    done.set()
    thread.join()
    return Sampled(proc.returncode, out, err, start, end, samples)
