"""The tiny space file the tests run: a 2-layer MLP on a fixed synthetic 4-class problem.

A complete space file on its own. `support.write_space` copies it into a test's folder and
appends that test's own settings (space, args, model_init, objective, extra code), which replace
the defaults at the end of this file.
"""

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
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def compute_metrics(p):
    return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}


def model_init(trial):
    return Net(hidden=(trial.params.get("hidden", 16) if trial is not None else 16))


space = {"learning_rate": hpsweep.Float(1e-3, 3e-1, log=True), "hidden": hpsweep.Int(8, 32, step=8)}
args = hpsweep.TrainingArguments(
    output_dir="out",
    num_train_epochs=2,
    per_device_train_batch_size=32,
    per_device_eval_batch_size=128,
    disable_progress=True,
)
objective = "eval_accuracy"
direction = "maximize"
