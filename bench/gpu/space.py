"""The space file bench/gpu's measurements sweep: `_task`'s CNN, its learning rate searched.

A plain space file (``hpsweep run bench/gpu/space.py``), with a callback that appends one JSON
line per trial event to ``$GPUBENCH_LOG`` when that is set, from the trial's own process:

- ``begin`` (the model, optimizer and loaders are built): the GPU's free memory
  (``torch.cuda.mem_get_info``, every process on it counted), this process's allocated and
  reserved CUDA memory, its RSS;
- ``end``: the trial's peak allocated CUDA memory, the dtype its logits came out in, and with
  ``GPUBENCH_STEP_TIMES=1`` the median time of an optimizer step (the GPU synchronised at each
  step's end, so the time is the GPU's as well as Python's).

``GPUBENCH_OOM_TRIAL=N``: trial N runs out of GPU memory in its first forward, for real: it
allocates 1 GiB blocks until CUDA refuses one, with every block still referenced by the frame
that raises. On the CPU (the dry run) it raises torch's ``OutOfMemoryError`` instead, so the
path after the error (the trial failed, the sweep going on) is the same.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _task  # noqa: E402

import hpsweep  # noqa: E402

SIZE = _task.size()
OOM_TRIAL = os.environ.get("GPUBENCH_OOM_TRIAL")
STEP_TIMES = os.environ.get("GPUBENCH_STEP_TIMES") == "1"
LOG = os.environ.get("GPUBENCH_LOG")


def train_dataset() -> torch.utils.data.TensorDataset:
    return _task.data("train")


def eval_dataset() -> torch.utils.data.TensorDataset:
    return _task.data("eval")


def compute_metrics(p) -> dict[str, float]:  # noqa: ANN001
    return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}


class Probed(_task.ConvNet):
    """Notes the dtype of the first logits it computes (autocast's, under mixed precision)."""

    logits_dtype: str | None = None

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = super().forward(x, labels)
        if Probed.logits_dtype is None:
            Probed.logits_dtype = str(out["logits"].dtype)
        return out


class OutOfMemory(Probed):
    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if x.device.type != "cuda":
            raise torch.OutOfMemoryError(
                "CUDA out of memory. (the dry run, on the CPU: raised, nothing allocated)"
            )
        blocks = []
        while True:  # until CUDA refuses: the blocks stay referenced by this frame's traceback
            blocks.append(torch.empty(2**30, dtype=torch.uint8, device=x.device))


def model_init(trial) -> torch.nn.Module:  # noqa: ANN001
    Probed.logits_dtype = None
    number = trial.number if trial is not None else -1
    if OOM_TRIAL is not None and number == int(OOM_TRIAL):
        return OutOfMemory()
    return Probed()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _write(row: dict) -> None:
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps(row) + "\n")


class Probe(hpsweep.TrainerCallback):
    def __init__(self) -> None:
        self.steps: list[float] = []

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001
        self.steps = []
        row = {"event": "begin", "trial": state.trial_number, "pid": os.getpid(), "t": time.time()}
        row["rss_mb"] = round(_rss_mb(), 1)
        if _cuda():
            free, total = torch.cuda.mem_get_info()
            torch.cuda.reset_peak_memory_stats()
            row.update(
                free_mb=round(free / 2**20, 1),
                total_mb=round(total / 2**20, 1),
                allocated_mb=round(torch.cuda.memory_allocated() / 2**20, 1),
                reserved_mb=round(torch.cuda.memory_reserved() / 2**20, 1),
            )
        _write(row)

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
        if STEP_TIMES:
            if _cuda():
                torch.cuda.synchronize()
            self.steps.append(time.perf_counter())

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001
        row = {"event": "end", "trial": state.trial_number, "pid": os.getpid(), "t": time.time()}
        row["steps"] = state.global_step
        row["logits_dtype"] = Probed.logits_dtype
        if _cuda():
            row["peak_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        gaps = [b - a for a, b in zip(self.steps, self.steps[1:])]
        if gaps:  # the median leaves out the few gaps that hold an evaluation or a checkpoint
            row["step_ms"] = round(1e3 * statistics.median(gaps), 3)
        _write(row)


space = {"learning_rate": hpsweep.Float(1e-4, 1e-2, log=True)}
args = hpsweep.TrainingArguments(
    output_dir="gpu-bench-output",
    num_train_epochs=SIZE.epochs,
    per_device_train_batch_size=SIZE.batch,
    per_device_eval_batch_size=4 * SIZE.batch,
    disable_progress=True,
)
objective = "eval_accuracy"
direction = "maximize"
callbacks = [Probe()]
