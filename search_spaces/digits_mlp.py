"""An MLP on scikit-learn's digits (8x8 images of 0-9; bundled with scikit-learn, no download).

    hpsweep run search_spaces/digits_mlp.py --n-trials 50

Searches the learning rate, batch size and epochs (TrainingArguments fields) and the hidden
width and dropout (model hyperparameters, read by model_init from trial.params).
"""

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import nn

import hpsweep


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits, read from its CSV without importing scikit-learn (that
    import took 4.3 of a 20-trial sweep's 17.7 seconds here); `load_digits` if the file moved."""
    package = importlib.util.find_spec("sklearn")
    path = (
        Path(package.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
        if package
        else None
    )
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits

        return load_digits(return_X_y=True)
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1], data[:, -1].astype(np.int64)


def _split(part: str) -> torch.utils.data.TensorDataset:
    x, y = _digits()
    order = np.random.default_rng(0).permutation(len(x))
    cut = int(0.8 * len(x))
    rows = order[:cut] if part == "train" else order[cut:]
    return torch.utils.data.TensorDataset(
        torch.tensor(x[rows] / 16.0, dtype=torch.float32), torch.tensor(y[rows], dtype=torch.long)
    )


def train_dataset():
    return _split("train")


def eval_dataset():
    return _split("eval")


class MLP(nn.Module):
    def __init__(self, hidden: int = 64, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 10)
        )

    def forward(self, x, labels=None):
        logits = self.net(x)
        # predicting, or label_smoothing_factor computing the loss from the logits
        if labels is None:
            return {"logits": logits}
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def model_init(trial):
    params = trial.params if trial is not None else {}
    return MLP(hidden=params.get("hidden", 64), dropout=params.get("dropout", 0.0))


def compute_metrics(p: hpsweep.EvalPrediction) -> dict:
    return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}


space = {
    "learning_rate": hpsweep.Float(1e-4, 3e-1, log=True),
    "per_device_train_batch_size": hpsweep.Categorical([16, 32, 64]),
    "num_train_epochs": hpsweep.Int(2, 6),
    "hidden": hpsweep.Int(16, 128, step=16),
    "dropout": hpsweep.Float(0.0, 0.3),
}

args = hpsweep.TrainingArguments(
    output_dir="hpsweep-output/digits",
    per_device_eval_batch_size=256,
    lr_scheduler_type="linear",
    save_total_limit=2,
)
objective = "eval_accuracy"
direction = "maximize"
