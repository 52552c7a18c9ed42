"""transformers' ``skip_memory_metrics=False``: how much memory a training run or an evaluation
took, as ``<stage>_mem_cpu_alloc_delta`` / ``_peaked_delta`` (the process's resident memory, in
bytes) and, on CUDA, ``<stage>_mem_gpu_alloc_delta`` / ``_peaked_delta`` (torch's allocator).
``alloc_delta`` is what the stage left allocated; ``peaked_delta`` how far above that it went.

    >>> tracker = MemoryTracker.start(args, "train")  # None unless skip_memory_metrics=False
    >>> ...; metrics.update(stop_tracking(tracker))
"""

from __future__ import annotations

import threading
from typing import Any

import psutil
import torch

#: how often the process's resident memory is read while a stage runs, in seconds
SAMPLE_EVERY = 0.005


class MemoryTracker:
    """Samples the process's resident memory in a thread from `start` to `stop`."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.process = prefix, psutil.Process()
        self.cpu_begin = self.cpu_peak = self.process.memory_info().rss
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.gpu_begin = torch.cuda.memory_allocated()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="memory-metrics")
        self._thread.start()

    @classmethod
    def start(cls, args: Any, prefix: str) -> MemoryTracker | None:
        return None if args.skip_memory_metrics else cls(prefix)

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY):
            self.cpu_peak = max(self.cpu_peak, self.process.memory_info().rss)

    def stop(self) -> dict[str, int]:
        """The stage's metrics; the sampling ends."""
        self._stop.set()
        self._thread.join()
        end = self.process.memory_info().rss
        metrics = _deltas(f"{self.prefix}_mem_cpu", self.cpu_begin, end, max(self.cpu_peak, end))
        if self.cuda:
            gpu_end = torch.cuda.memory_allocated()
            metrics |= _deltas(
                f"{self.prefix}_mem_gpu", self.gpu_begin, gpu_end, torch.cuda.max_memory_allocated()
            )
        return metrics


def stop_tracking(tracker: MemoryTracker | None) -> dict[str, int]:
    """``tracker``'s metrics, or none when memory metrics are skipped."""
    return tracker.stop() if tracker is not None else {}


def _deltas(name: str, begin: int, end: int, peak: int) -> dict[str, int]:
    return {f"{name}_alloc_delta": end - begin, f"{name}_peaked_delta": max(0, peak - end)}
