"""What transformers' ``TrainingArguments`` offers besides its fields, for code written for it;
`hpsweep.TrainingArguments` inherits it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class TransformersView:
    """transformers' ``TrainingArguments`` besides its fields: the process it runs in, read from
    accelerate's `PartialState` (the state the run's Accelerator shares; in a
    ``--processes-per-trial`` trial each process sees its own rank), the batch sizes and its
    serialisations, so that a callback, a ``compute_loss`` override or a data script written for
    transformers runs unchanged."""

    use_cpu: bool
    per_device_train_batch_size: int
    per_device_eval_batch_size: int

    @property
    def train_batch_size(self) -> int:
        """The batch size of one process (transformers multiplies by its DataParallel GPUs; we use none)."""
        return self.per_device_train_batch_size

    @property
    def eval_batch_size(self) -> int:
        return self.per_device_eval_batch_size

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2)  # type: ignore[attr-defined]

    def to_sanitized_dict(self) -> dict[str, Any]:
        """``to_dict`` with the batch sizes, every value a bool, number or string (transformers' form,
        for TensorBoard's hparams)."""
        d = {
            **self.to_dict(),
            "train_batch_size": self.train_batch_size,  # type: ignore[attr-defined]
            "eval_batch_size": self.eval_batch_size,
        }
        return {k: v if type(v) in (bool, int, float, str) else str(v) for k, v in d.items()}

    @property
    def device(self) -> Any:
        """The ``torch.device`` this process trains on."""
        import torch

        return torch.device("cpu") if self.use_cpu else _process_state(self).device

    @property
    def n_gpu(self) -> int:
        """Accelerator devices this process uses: 0 on the CPU, else 1 (a trial never runs
        ``DataParallel``; more GPUs are more processes)."""
        return int(self.device.type != "cpu")

    @property
    def world_size(self) -> int:
        """Processes training this run together (``--processes-per-trial``)."""
        return _process_state(self).num_processes

    @property
    def process_index(self) -> int:
        return _process_state(self).process_index

    @property
    def local_process_index(self) -> int:
        return _process_state(self).local_process_index

    @property
    def should_log(self) -> bool:
        """Whether this process logs: the first on its machine, as transformers' default."""
        return self.local_process_index == 0

    @property
    def should_save(self) -> bool:
        """Whether this process writes checkpoints and models: the first of the run."""
        return self.process_index == 0

    @contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work") -> Iterator[None]:
        """The main process (of this machine with ``local``) runs the block first, the others
        after it, as around a ``datasets.map`` whose cache they then read; ``desc`` is unused."""
        state = _process_state(self)
        with state.local_main_process_first() if local else state.main_process_first():
            yield


def _process_state(args: Any) -> Any:
    from accelerate.state import PartialState

    from hpsweep.devices.process_group import join_launched

    # torchrun's processes, joined before anything reads them (accelerate alone would count
    # one process on a machine without CUDA)
    join_launched(args)
    return PartialState()
