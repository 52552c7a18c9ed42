"""What the tests share: a tiny real space file, the command line in a fresh process, and the
helpers that read what a sweep left. Tests read like a user's session: write a space file, run
the command line or the API, look at what is on disk."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import optuna

from hpsweep import runs
from hpsweep.train.metrics import SPEED_SUFFIXES
from support.sweep_invariants import SLOW_ARGS, SLOW_TRIALS

ROOT = Path(__file__).resolve().parents[2]
TINY_SPACE = Path(__file__).with_name("tiny_space.py")

#: The tiny space file's model_init (the one `write_space` keeps unless a test gives its own).
DEFAULT_MODEL_INIT = """
def model_init(trial):
    return Net(hidden=(trial.params.get("hidden", 16) if trial is not None else 16))
"""
DEFAULT_SPACE = (
    '{"learning_rate": hpsweep.Float(1e-3, 3e-1, log=True), "hidden": hpsweep.Int(8, 32, step=8)}'
)


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
    """Copy the tiny space file (`support/tiny_space.py`) into ``folder`` with this test's
    settings after it, and return its path. ``space`` and ``extra_args`` are Python source: the
    space dict's expression, and more ``TrainingArguments`` keywords (starting with a comma)."""
    own = f"""

# --- this test's settings, in place of the defaults above
{textwrap.dedent(model_init).strip()}


space = {space}
args = hpsweep.TrainingArguments(
    output_dir={output_dir or str(folder / "out")!r},
    num_train_epochs={epochs},
    per_device_train_batch_size=32,
    per_device_eval_batch_size=128,
    disable_progress=True{extra_args},
)
objective = {objective!r}
direction = {direction!r}
{textwrap.dedent(extra)}
"""
    path = folder / name
    path.write_text(TINY_SPACE.read_text() + own)
    return path


#: Ports a Ray node takes by default whatever else it is told (dashboard, its agent, GCS, client
#: server); a port picked at random for a test's server must not be one of them, or a Ray node
#: started with it refuses to start ("trying to use a port number ... used by other components").
RAY_DEFAULT_PORTS = frozenset({6379, 8265, 10001, 52365})


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (for a server to start on, or to find
    unreachable), never one of Ray's default ports."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in RAY_DEFAULT_PORTS:
            return port


def timeless(metrics: dict) -> dict:
    """``metrics`` without the ``*_runtime`` / ``*_per_second`` ones, which no two runs share."""
    return {k: v for k, v in metrics.items() if not k.endswith(SPEED_SUFFIXES)}


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
    """The sweep's Optuna study, opened with Optuna's own API as docs/backends.md shows users."""
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(out / "study.journal"))
    )
    return optuna.load_study(study_name=study_name, storage=storage)


def slow_space(tmp_path: Path, step_s: float = 0.03, extra: str = "") -> Path:
    return write_space(
        tmp_path, epochs=1, extra=SLOW_TRIALS.format(step_s=step_s) + extra, extra_args=SLOW_ARGS
    )


RANK_LOG = """
import json, os
class _RankLog(hpsweep.TrainerCallback):
    def on_train_end(self, args, state, control, **kwargs):
        with open(os.path.join(args.output_dir, f"rank-{os.environ.get('RANK', '0')}.json"), "w") as f:
            json.dump({"global_step": state.global_step, "pid": os.getpid()}, f)
callbacks = [_RankLog()] + globals().get("callbacks", [])
"""


def rank_steps(record: runs.TrialRecord) -> dict[str, int]:
    return {
        p.stem: json.loads(p.read_text())["global_step"]
        for p in sorted(Path(record.run_dir).glob("rank-*.json"))
    }


def offline_wandb_env(folder: Path) -> dict[str, str]:
    """The environment of a command that runs W&B with no login and no server: its runs offline,
    nothing read or written in the user's home (``folder`` stands in for it)."""
    home = folder / "home"
    home.mkdir(parents=True, exist_ok=True)
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_API_KEY": "",
        "HOME": str(home),
        "NETRC": str(home / ".netrc"),
        "WANDB_CONFIG_DIR": str(home / "wandb-config"),
        "WANDB_CACHE_DIR": str(home / "wandb-cache"),
        "WANDB_DATA_DIR": str(home / "wandb-data"),
    }
