"""The training every GPU measurement shares: a small CNN on synthetic 32x32 images (torch only).

Ten classes: an image's label is the largest of ten fixed linear functions of its 4x4 grid of
channel means, so a CNN that keeps where things are (no global pooling before its head) learns it
within a few epochs. Sizes come from the environment, so the space file (`space.py`), which
hpsweep's workers load, and the hand loop (`packing.py --hand`) build exactly the same thing:

- ``HPSWEEP_GPU_DRY_RUN=1``: tiny images, data and channels (the CPU path that CI runs);
- ``GPUBENCH_WIDTH=K``: K times the channels (the precision and memory measurements use 2);
- ``GPUBENCH_EPOCHS=N``: N epochs per trial instead of the size's default.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from torch import nn

CLASSES = 10


@dataclass(frozen=True)
class Size:
    image: int  # height = width
    n_train: int
    n_eval: int
    channels: tuple[int, int, int]
    batch: int
    epochs: int


FULL = Size(image=32, n_train=8192, n_eval=2048, channels=(64, 128, 256), batch=256, epochs=5)
TINY = Size(image=8, n_train=256, n_eval=128, channels=(4, 8, 8), batch=64, epochs=2)


def dry_run() -> bool:
    return os.environ.get("HPSWEEP_GPU_DRY_RUN", "") not in ("", "0")


def size() -> Size:
    base = TINY if dry_run() else FULL
    width = int(os.environ.get("GPUBENCH_WIDTH", "1"))
    epochs = int(os.environ.get("GPUBENCH_EPOCHS", str(base.epochs)))
    channels = tuple(c * width for c in base.channels)
    return Size(base.image, base.n_train, base.n_eval, channels, base.batch, epochs)  # type: ignore[arg-type]


@functools.cache
def data(part: str) -> torch.utils.data.TensorDataset:
    """The ``train`` or ``eval`` images and labels (built once per process, on the CPU)."""
    s = size()
    n = s.n_train if part == "train" else s.n_eval
    x = torch.randn(
        n, 3, s.image, s.image, generator=torch.Generator().manual_seed(1 + (part == "eval"))
    )
    w = torch.randn(3 * 16, CLASSES, generator=torch.Generator().manual_seed(0))
    grid = nn.functional.adaptive_avg_pool2d(x, 4).flatten(1)  # (n, 48): channel means, 4x4 grid
    return torch.utils.data.TensorDataset(x, (grid @ w).argmax(-1))


def _block(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class ConvNet(nn.Module):
    """Four 3x3 conv blocks (two of stride 2), then a linear head over the whole feature map."""

    def __init__(self) -> None:
        super().__init__()
        s = size()
        c1, c2, c3 = s.channels
        self.features = nn.Sequential(
            _block(3, c1), _block(c1, c2, 2), _block(c2, c2), _block(c2, c3, 2), nn.Flatten()
        )
        self.head = nn.Linear(c3 * (s.image // 4) ** 2, CLASSES)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.features(x))
        return {"loss": nn.functional.cross_entropy(logits.float(), labels), "logits": logits}
