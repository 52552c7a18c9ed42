"""Datasets and batches: lazy dataset factories, and reading sizes and labels out of a batch."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import Dataset

from .errors import UserError

_DATASETS: dict[Any, tuple[Any, Any]] = {}  # key -> (factory, dataset), per process


def resolve_dataset(dataset: Any) -> Any:
    """A dataset, or a 0-argument factory called once per process (lazy loading on workers)."""
    if dataset is None or isinstance(dataset, Dataset) or not callable(dataset):
        return dataset
    # A factory unpickled afresh for every trial (Ray) is the same function: key it by name.
    qualname = getattr(dataset, "__qualname__", "")
    key: Any = (dataset.__module__, qualname) if qualname and "<" not in qualname else id(dataset)
    if key not in _DATASETS:
        loaded = dataset()
        if loaded is None:
            raise UserError(f"the dataset factory {getattr(dataset, '__name__', dataset)!r} returned None; "
                            "return a torch Dataset")
        _DATASETS[key] = (dataset, loaded)  # holding the factory keeps an id key unique
    return _DATASETS[key][1]


def batch_size(batch: Any) -> int:
    first = next(iter(batch.values())) if isinstance(batch, Mapping) else (
        batch[0] if isinstance(batch, (list, tuple)) else batch)
    return len(first) if hasattr(first, "__len__") else 1


def batch_labels(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, Mapping):
        return batch.get("labels", batch.get("label"))
    if isinstance(batch, (list, tuple)) and len(batch) > 1:
        return batch[-1]
    return None
