"""The tasks of bench/time_to_target.py, shared by every contender so all train the same thing.

- digits: the shipped ``search_spaces/digits_mlp.py`` (its data split, MLP and space).
- shapes: a harder one, no download: 12x12 images of six noisy line shapes at random places and
  lengths (bars, diagonals, crosses, boxes), classified by a small two-layer CNN.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


def _digits_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "digits_mlp_space", ROOT / "search_spaces" / "digits_mlp.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _shapes(part: str) -> torch.utils.data.TensorDataset:
    rng = np.random.default_rng(1 if part == "train" else 2)
    n = 3000 if part == "train" else 1000
    x = rng.normal(0.0, 0.7, size=(n, 1, 12, 12)).astype(np.float32)
    y = rng.integers(0, 6, size=n)
    for i, c in enumerate(y):
        length = int(rng.integers(4, 9))
        r, k = (int(v) for v in rng.integers(0, 12 - length + 1, size=2))
        idx = np.arange(length)
        img = x[i, 0]
        if c == 0:
            img[r + length // 2, k + idx] += 1.5  # horizontal bar
        elif c == 1:
            img[r + idx, k + length // 2] += 1.5  # vertical bar
        elif c == 2:
            img[r + idx, k + idx] += 1.5  # diagonal
        elif c == 3:
            img[r + idx, k + length - 1 - idx] += 1.5  # anti-diagonal
        elif c == 4:
            img[r + length // 2, k + idx] += 1.5  # cross
            img[r + idx, k + length // 2] += 1.5
        else:
            img[r, k + idx] += 1.5  # box outline
            img[r + length - 1, k + idx] += 1.5
            img[r + idx, k] += 1.5
            img[r + idx, k + length - 1] += 1.5
    return torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y).long())


class CNN(nn.Module):
    def __init__(self, channels: int = 8, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(2 * channels * 9, 6),
        )

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


@dataclass
class Task:
    name: str
    load: Callable[[str], torch.utils.data.Dataset]
    build: Callable[[dict], nn.Module]
    #: name -> ("float", low, high, log) | ("int", low, high, step) | ("cat", choices)
    space: dict[str, tuple]
    max_epochs: int


def _digits() -> Task:
    m = _digits_module()
    return Task(
        "digits",
        m._split,
        lambda p: m.MLP(hidden=p["hidden"], dropout=p["dropout"]),
        {
            "learning_rate": ("float", 1e-4, 3e-1, True),
            "per_device_train_batch_size": ("cat", [16, 32, 64]),
            "num_train_epochs": ("int", 2, 6, 1),
            "hidden": ("int", 16, 128, 16),
            "dropout": ("float", 0.0, 0.3, False),
        },
        6,
    )


def _shapes_task() -> Task:
    return Task(
        "shapes",
        _shapes,
        lambda p: CNN(channels=p["channels"], dropout=p["dropout"]),
        {
            "learning_rate": ("float", 1e-4, 1e-1, True),
            "per_device_train_batch_size": ("cat", [32, 64, 128]),
            "num_train_epochs": ("int", 2, 6, 1),
            "channels": ("cat", [4, 8, 16]),
            "dropout": ("float", 0.0, 0.5, False),
        },
        6,
    )


def get(name: str) -> Task:
    return {"digits": _digits, "shapes": _shapes_task}[name]()


def suggest(trial: Any, space: dict[str, tuple]) -> dict:
    """Params from an Optuna-style trial (``suggest_float`` / ``suggest_int`` / ``suggest_categorical``)."""
    out = {}
    for name, (kind, *spec) in space.items():
        if kind == "float":
            out[name] = trial.suggest_float(name, spec[0], spec[1], log=spec[2])
        elif kind == "int":
            out[name] = trial.suggest_int(name, spec[0], spec[1], step=spec[2])
        else:
            out[name] = trial.suggest_categorical(name, spec[0])
    return out


_LOADED: dict[tuple[str, str], Any] = {}


def dataset(task: Task, part: str) -> Any:
    """``task.load(part)``, once per process (as hpsweep's dataset factories are)."""
    if (task.name, part) not in _LOADED:
        _LOADED[task.name, part] = task.load(part)
    return _LOADED[task.name, part]


def hand_train(
    task: Task,
    params: dict,
    report: Callable[[int, float], bool],
    fused: bool | None = None,
    checkpoint: Callable[..., Any] | None = None,
) -> float | None:
    """The loop a careful user writes: AdamW, linear decay, clipping, evaluation every epoch.
    ``report(epoch, accuracy)`` returns True to stop (pruned); returns the final accuracy or None.
    ``fused``: AdamW's ``fused`` argument (torch's default kernel unless set). ``checkpoint(epoch,
    model, optimizer, scheduler)``, when given, is called after each epoch that was not pruned."""
    torch.manual_seed(42)
    model = task.build(params)
    opt = torch.optim.AdamW(
        model.parameters(), lr=params["learning_rate"], weight_decay=0.0, fused=fused
    )
    loader = torch.utils.data.DataLoader(
        dataset(task, "train"), batch_size=params["per_device_train_batch_size"], shuffle=True
    )
    epochs = params["num_train_epochs"]
    total = epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / total))
    val = dataset(task, "eval")
    acc = 0.0
    for epoch in range(epochs):
        model.train()
        for x, y in loader:
            model(x, y)["loss"].backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            correct = sum(
                int((model(x, y)["logits"].argmax(-1) == y).sum())
                for x, y in torch.utils.data.DataLoader(val, batch_size=256)
            )
        acc = correct / len(val)
        if report(epoch + 1, acc):
            return None
        if checkpoint is not None:
            checkpoint(epoch + 1, model, opt, sched)
    return acc
