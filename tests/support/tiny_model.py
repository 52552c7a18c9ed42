"""A four-class task and a small net for tests that train in their own process (the Python API)."""

from __future__ import annotations

import torch
from torch import nn


def four_class_rows(n: int, seed: int) -> torch.utils.data.TensorDataset:
    """``n`` rows of 8 features whose class (of 4) a linear map decides."""
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    y = (x @ torch.randn(8, 4, generator=torch.Generator().manual_seed(0))).argmax(-1)
    return torch.utils.data.TensorDataset(x, y)


class FourClassNet(nn.Module):
    """Returns its loss and logits as a mapping, as transformers' models do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x, labels):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}
