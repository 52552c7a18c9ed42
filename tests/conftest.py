"""Shared helpers: tests read like a user's session (write a space file, run the CLI, look at disk)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import optuna
import pytest

from hpsweep.objective import SPEED_SUFFIXES

ROOT = Path(__file__).resolve().parents[1]

# The Ctrl-C tests send SIGINT to the commands they start, as a terminal does. A shell that runs the
# suite in the background without job control starts it with SIGINT ignored; the commands would
# inherit that, and Python installs no KeyboardInterrupt handler in a process that starts so. A
# handled signal is reset to its default in a child, so handling it here gives every command the
# terminal's Ctrl-C back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# A tiny, fast, real space file: a 2-layer MLP on a fixed synthetic 4-class problem.
TINY_SPACE = """
import torch
from torch import nn
import hpsweep

def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    y = (x @ w).argmax(-1)
    return torch.utils.data.TensorDataset(x, y)

def train_dataset():
    return _data(256, 1)

def eval_dataset():
    return _data(128, 2)

class Net(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))
    def forward(self, x, labels):
        logits = self.net(x)
        return {{"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}}

def compute_metrics(p):
    return {{"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}}

{model_init}

space = {space}
args = hpsweep.TrainingArguments(output_dir={output_dir!r}, num_train_epochs={epochs}, per_device_train_batch_size=32,
                                 per_device_eval_batch_size=128, disable_progress=True{extra_args})
objective = {objective!r}
direction = {direction!r}
{extra}
"""

DEFAULT_MODEL_INIT = """
def model_init(trial):
    return Net(hidden=(trial.params.get("hidden", 16) if trial is not None else 16))
"""
DEFAULT_SPACE = (
    '{"learning_rate": hpsweep.Float(1e-3, 3e-1, log=True), "hidden": hpsweep.Int(8, 32, step=8)}'
)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (for a server to start on, or to find unreachable)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timeless(metrics: dict) -> dict:
    """``metrics`` without the ``*_runtime`` / ``*_per_second`` ones, which no two runs share."""
    return {k: v for k, v in metrics.items() if not k.endswith(SPEED_SUFFIXES)}


def write_space(
    folder: Path,
    *,
    name: str = "space.py",
    space: str = DEFAULT_SPACE,
    model_init: str = DEFAULT_MODEL_INIT,
    epochs: int = 2,
    objective: str = "eval_accuracy",
    direction: str = "maximize",
    extra: str = "",
    extra_args: str = "",
    output_dir: str | None = None,
) -> Path:
    """Write a tiny real space file into ``folder`` and return its path."""
    path = folder / name
    path.write_text(
        TINY_SPACE.format(
            model_init=textwrap.dedent(model_init),
            space=space,
            output_dir=output_dir or str(folder / "out"),
            epochs=epochs,
            objective=objective,
            direction=direction,
            extra=textwrap.dedent(extra),
            extra_args=extra_args,
        )
    )
    return path


#: The start of a user's whole script, written as transformers' examples are, for the tests that run
#: one as it is (tiny data, a model returning (loss, logits)); only the Trainer import is hpsweep's.
USER_SCRIPT_PRELUDE = """
import json, sys
import numpy as np
import torch
from hpsweep import Trainer, TrainingArguments  # was: from transformers import Trainer, TrainingArguments

W = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
def rows(n, seed):
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return [{"x": xi, "labels": int(yi)} for xi, yi in zip(x, (x @ W).argmax(-1))]

class Net(torch.nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3))
    def forward(self, x, labels=None):
        logits = self.net(x)
        return torch.nn.functional.cross_entropy(logits, labels), logits
"""


def hpsweep_cli(
    *args: str,
    cwd: Path | None = None,
    env: dict | None = None,
    timeout: float = 300,
    check: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``hpsweep ARGS`` in a fresh process, as a user would."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "hpsweep.cli", *map(str, args)],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"hpsweep {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def load_sweep_study(out: Path, study_name: str = "space") -> optuna.Study:
    """The sweep's Optuna study, opened with Optuna's own API as the README shows users."""
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(out / "study.journal"))
    )
    return optuna.load_study(study_name=study_name, storage=storage)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` need CUDA: the one kind of test skipped where it is missing (CI)."""
    import torch

    if torch.cuda.is_available():
        return
    needs_cuda = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(needs_cuda)


@pytest.fixture
def space_file(tmp_path: Path) -> Path:
    return write_space(tmp_path)
