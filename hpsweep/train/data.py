"""Datasets and batches: lazy dataset factories, the columns a model takes, collating, and reading
sizes and labels out of a batch.

Columns follow Hugging Face's Trainer: with ``remove_unused_columns`` (the default) a
``datasets.Dataset`` loses the columns the model's forward does not name (``label``,
``label_ids`` and ``label_names`` are kept), and dict samples of other datasets lose those keys
before the collator sees them. The default collator is transformers' ``default_data_collator``
rule for dict samples (``label`` / ``label_ids`` become ``labels``) and torch's otherwise.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset
from torch.utils.data._utils.collate import default_collate

from hpsweep.errors import UserError

_DATASETS: dict[Any, tuple[Any, Any]] = {}  # key -> (factory, dataset), per process


def resolve_dataset(dataset: Any) -> Any:
    """A dataset, or a 0-argument factory called once per process (lazy loading on workers)."""
    if (
        dataset is None
        or isinstance(dataset, Dataset)
        or is_hf_dataset(dataset)
        or not callable(dataset)
    ):
        return dataset
    # A factory unpickled afresh for every trial (Ray) is the same function: key it by name.
    qualname = getattr(dataset, "__qualname__", "")
    key: Any = (dataset.__module__, qualname) if qualname and "<" not in qualname else id(dataset)
    if key not in _DATASETS:
        loaded = dataset()
        if loaded is None:
            raise UserError(
                f"the dataset factory {getattr(dataset, '__name__', dataset)!r} returned None; "
                "return a torch Dataset"
            )
        _DATASETS[key] = (dataset, loaded)  # holding the factory keeps an id key unique
    return _DATASETS[key][1]


def is_hf_dataset(dataset: Any) -> bool:
    """A ``datasets.Dataset`` (checked without importing datasets)."""
    return (
        type(dataset).__module__.startswith("datasets")
        and hasattr(dataset, "column_names")
        and hasattr(dataset, "remove_columns")
    )


# --- the columns a model takes ----------------------------------------------------------------------


def is_several_datasets(dataset: Any) -> bool:
    """``{name: dataset}``, transformers' way to evaluate on several datasets (a ``DatasetDict`` too)."""
    return isinstance(dataset, Mapping) and not is_hf_dataset(dataset)


def forward_parameters(model: Any) -> list[str]:
    """The named parameters of ``model.forward`` (``**kwargs`` names none)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError, AttributeError):
        return []
    return [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def label_names_for(model: Any, label_names: Sequence[str] | None) -> list[str]:
    """``args.label_names``, else the forward's parameters with "label" in their name, as in transformers."""
    if label_names is not None:
        return list(label_names)
    found = [p for p in forward_parameters(model) if "label" in p]
    if "QuestionAnswering" in type(model).__name__:
        found += [p for p in forward_parameters(model) if p in ("start_positions", "end_positions")]
    return found


def signature_columns(model: Any, label_names: Sequence[str] | None) -> list[str] | None:
    """The columns to keep, or None to keep all (a forward naming no parameter takes anything)."""
    params = forward_parameters(model)
    if not params:
        return None
    return params + sorted(
        {"label", "label_ids", *label_names_for(model, label_names)} - set(params)
    )


def remove_unused_columns(dataset: Any, columns: list[str] | None, model: Any, what: str) -> Any:
    """A ``datasets.Dataset`` without the columns the model cannot take."""
    if columns is None:
        return dataset
    unused = [c for c in dataset.column_names if c not in columns]
    if len(unused) == len(dataset.column_names):
        raise UserError(
            f"{what}: none of its columns ({', '.join(dataset.column_names)}) is an argument of "
            f"{type(model).__name__}.forward ({', '.join(forward_parameters(model))}); tokenize the "
            "text first (dataset.map(...)) or set remove_unused_columns=False"
        )
    return dataset.remove_columns(unused) if unused else dataset


class BatchedTensors(TensorDataset):
    """A ``TensorDataset`` that hands its loader whole batches: one index per tensor a batch,
    instead of one per tensor and sample followed by a ``torch.stack`` per tensor (torch's
    fetcher takes ``__getitems__`` when a dataset has it). The same values in the same order,
    bit for bit; on small models the per-sample indexing was ~40% of an evaluation here."""

    def __init__(self, dataset: TensorDataset) -> None:
        super().__init__(*dataset.tensors)

    def __getitems__(self, indices: list[int]) -> Collated:
        index = torch.as_tensor(indices)
        return Collated(tensor[index] for tensor in self.tensors)


class Collated(list):
    """A batch `BatchedTensors` already collated (a list, as ``default_collate`` makes of tuples)."""


def batched(dataset: Any, collate_fn: Callable[[list], Any] | None) -> Any:
    """``dataset`` as `BatchedTensors` when it is a plain ``TensorDataset`` collated by default."""
    default = collate_fn is None or collate_fn is default_data_collator
    return BatchedTensors(dataset) if type(dataset) is TensorDataset and default else dataset


class Collator:
    """The collate function of a data loader: drops unused keys of dict samples, then collates,
    turning a failure over a string value into a one-line error naming the column."""

    def __init__(
        self, collate_fn: Callable[[list], Any] | None, columns: list[str] | None, what: str
    ) -> None:
        self.collate_fn = collate_fn or default_data_collator
        self.columns = set(columns) if columns is not None else None
        self.what = what

    def __call__(self, features: list[Any]) -> Any:
        if type(features) is Collated:
            return list(features)
        if self.columns is not None and features and isinstance(features[0], Mapping):
            features = [{k: v for k, v in f.items() if k in self.columns} for f in features]
        try:
            return self.collate_fn(features)
        except (ValueError, TypeError, RuntimeError) as exc:
            text = (
                [k for k, v in features[0].items() if isinstance(v, str)]
                if (features and isinstance(features[0], Mapping))
                else []
            )
            if not text:
                raise
            raise UserError(
                f"{self.what}: column {text[0]!r} holds text, which the data collator cannot batch "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]}); tokenize it first "
                "(dataset.map(...)) and let remove_unused_columns=True drop it"
            ) from None


def default_data_collator(features: list[Any]) -> Any:
    """transformers' ``default_data_collator`` for dict samples (``label`` / ``label_ids`` become
    ``labels``; text and None values are left out); torch's ``default_collate`` for the rest."""
    if not features or not isinstance(features[0], Mapping):
        return default_collate(features)
    first = features[0]
    batch: dict[str, Any] = {}
    if first.get("label") is not None:
        label = (
            first["label"].item() if isinstance(first["label"], torch.Tensor) else first["label"]
        )
        dtype = torch.long if isinstance(label, (int, np.integer)) else torch.float
        batch["labels"] = torch.tensor([f["label"] for f in features], dtype=dtype)
    elif first.get("label_ids") is not None:
        ids = first["label_ids"]
        if isinstance(ids, torch.Tensor):
            batch["labels"] = torch.stack([f["label_ids"] for f in features])
        else:
            dtype = torch.long if isinstance(ids[0], (int, np.integer)) else torch.float
            batch["labels"] = torch.tensor([f["label_ids"] for f in features], dtype=dtype)
    for key, value in first.items():
        if key in ("label", "label_ids") or value is None or isinstance(value, str):
            continue
        values = [f[key] for f in features]
        if isinstance(value, torch.Tensor):
            batch[key] = torch.stack(values)
        elif isinstance(value, np.ndarray):
            batch[key] = torch.from_numpy(np.stack(values))
        else:
            batch[key] = torch.tensor(values)
    return batch


# --- reading batches ---------------------------------------------------------------------------------


def batch_size(batch: Any) -> int:
    first = (
        next(iter(batch.values()))
        if isinstance(batch, Mapping)
        else (batch[0] if isinstance(batch, (list, tuple)) else batch)
    )
    return len(first) if hasattr(first, "__len__") else 1


def batch_labels(batch: Any, label_names: Sequence[str] = ()) -> Any:
    """The labels of a batch: the ``label_names`` entries of a dict batch (a tuple when several),
    else its ``labels`` / ``label``; the last element of a tuple batch."""
    if isinstance(batch, Mapping):
        found = [batch[n] for n in label_names if batch.get(n) is not None]
        if found and len(found) == len(label_names):
            return found[0] if len(found) == 1 else tuple(found)
        return batch.get("labels", batch.get("label"))
    if isinstance(batch, (list, tuple)) and len(batch) > 1:
        return batch[-1]
    return None


def split_labels(batch: Any) -> tuple[Any, Any]:
    """``(inputs, labels)``: a dict batch without its ``labels``; a tuple batch without its last element."""
    if isinstance(batch, Mapping):
        if "labels" not in batch:
            return batch, None
        inputs = dict(batch)
        return inputs, inputs.pop("labels")
    if isinstance(batch, (list, tuple)) and len(batch) > 1:
        return batch[:-1], batch[-1]
    return batch, None


def train_sampler(
    dataset: Any, args: Any, seed: int, processing_class: Any
) -> torch.utils.data.Sampler | None:
    """The training order ``args.train_sampling_strategy`` names, as transformers': None for
    ``"random"`` (the loader shuffles), the dataset's own order, or transformers'
    ``LengthGroupedSampler``: shuffled, then sorted by length within mega-batches of optimizer
    steps, so that a batch pads little. Its lengths come from the ``length_column_name`` column of
    a ``datasets.Dataset`` that has one, else from each sample's first ``model_input_names`` of
    the processing class (``input_ids``). Each epoch's order is drawn from ``seed`` + the epoch,
    as the random order is, so a run resumed mid-epoch goes on in the same order."""
    if args.train_sampling_strategy == "sequential":
        return torch.utils.data.SequentialSampler(dataset)
    if args.train_sampling_strategy != "group_by_length":
        return None
    length_column = args.length_column_name
    batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
    input_name = (getattr(processing_class, "model_input_names", None) or [None])[0]
    try:
        from transformers.trainer_pt_utils import LengthGroupedSampler
    except ImportError:
        raise UserError(
            "train_sampling_strategy='group_by_length' is transformers' LengthGroupedSampler; "
            "install it: pip install transformers"
        ) from None

    class EpochSeeded(LengthGroupedSampler):
        def set_epoch(self, epoch: int) -> None:  # accelerate's loader calls it before each epoch
            self.generator.manual_seed(seed + epoch)

    column = is_hf_dataset(dataset) and length_column in dataset.column_names
    try:
        sampler = EpochSeeded(
            batch_size,
            dataset=dataset,
            lengths=list(dataset[length_column]) if column else None,
            model_input_name=input_name,
            generator=torch.Generator(),
        )
    except ValueError as exc:  # samples that are not dicts with input_ids
        raise UserError(
            f"train_sampling_strategy='group_by_length': {str(exc).rstrip('.')}; give the train_dataset "
            f"a {length_column!r} column (length_column_name), or use another strategy"
        ) from None
    sampler.set_epoch(0)
    return sampler


def check_trainable(dataset: Any, name: str) -> None:
    """An empty dataset fails every trial the same way: say so, instead of torch's sampler error.
    So does a stream (a torch or ``datasets`` IterableDataset): an epoch, the shuffled order and a
    resume mid-epoch are defined over a dataset with a length."""
    resolved = resolve_dataset(dataset)
    if isinstance(resolved, torch.utils.data.IterableDataset):
        raise UserError(
            f"{name} is an IterableDataset (a stream, without a length), which hpsweep does not train on; "
            "load it without streaming=True (or with Dataset.from_generator), or give a Dataset with __len__"
        )
    if hasattr(resolved, "__len__") and len(resolved) == 0:
        raise UserError(f"{name} is empty (0 samples); give it data")
