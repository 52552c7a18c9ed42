"""transformers' ``auto_find_batch_size``: training again with half the batch after a step runs out
of memory, until a batch fits; and the one-line error for an evaluation that runs out of memory
under it, which a smaller train batch cannot help.
"""

from __future__ import annotations

import contextlib
import shutil
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpsweep import runs
from hpsweep.runs import read_json
from hpsweep.train.run_state import LoopTrainer
from hpsweep.train.training_loop import TrainingLoop, TrainOutput


def train_finding_batch_size(
    trainer: LoopTrainer, resume_from_checkpoint: str | bool | None, trial: Any
) -> TrainOutput:
    """``trainer``'s training run, and when a step runs out of memory (accelerate's
    ``should_reduce_batch_size``: CUDA, XPU, MPS, HPU or the CPU allocator), a new run from the
    start with half the ``per_device_train_batch_size``, until a batch fits.

    A resume starts at the batch size its checkpoint was written with. Each attempt starts from a
    fresh model (``model_init``; a ``model=`` is reused as the failed attempt left it, as in
    transformers), and the checkpoints of a failed attempt are removed: they hold steps of a batch
    that did not fit. ``trainer.args`` keeps the size that fitted, as ``train_batch_size`` does.
    An evaluation that runs out of memory is not retried: it names ``per_device_eval_batch_size``."""
    from accelerate.utils.memory import should_reduce_batch_size

    args = trainer.args
    output_dir = Path(args.output_dir)
    size = args.per_device_train_batch_size
    checkpoint = runs.resolve_checkpoint(output_dir, resume_from_checkpoint)
    if checkpoint is not None:
        size = read_json(checkpoint / "trainer_state.json").get("train_batch_size") or size
    while True:
        trainer.args = args.replace(per_device_train_batch_size=size)
        kept = set(runs.checkpoints(output_dir))
        try:
            return TrainingLoop(trainer, trial).run(str(checkpoint) if checkpoint else None)
        except RuntimeError as exc:
            if size == 1 or not should_reduce_batch_size(exc):
                raise
            traceback.clear_frames(exc.__traceback__)  # the failed step's tensors
        _forget_the_attempt(trainer, output_dir, kept)
        warnings.warn(
            f"auto_find_batch_size: out of memory at per_device_train_batch_size={size}; "
            f"training again from the start at {size // 2}",
            stacklevel=3,
        )
        size, checkpoint = size // 2, None


def _forget_the_attempt(trainer: LoopTrainer, output_dir: Path, kept: set[Path]) -> None:
    """Remove the checkpoints a failed attempt wrote in ``output_dir`` (all but ``kept``) and give
    its memory back."""
    from hpsweep.devices import memory

    for folder in set(runs.checkpoints(output_dir)) - kept:
        shutil.rmtree(folder, ignore_errors=True)
    trainer.model_wrapped = trainer.optimizer = trainer.lr_scheduler = None
    memory.reset_accelerate_state()
    memory.collect()


@contextlib.contextmanager
def not_a_smaller_train_batch(args: Any) -> Iterator[None]:
    """Under ``auto_find_batch_size``, an evaluation that runs out of memory ends the run in one
    line, as in transformers: a smaller train batch (what an out-of-memory error would get) cannot
    help it."""
    try:
        yield
    except RuntimeError as exc:
        from accelerate.utils.memory import should_reduce_batch_size

        if args.auto_find_batch_size and should_reduce_batch_size(exc):
            # Not the allocator's words (they stay in the error it chains): they would look
            # retryable.
            raise RuntimeError(
                "an evaluation batch did not fit in memory; auto_find_batch_size shrinks only the "
                "training batch: set a smaller per_device_eval_batch_size"
            ) from exc
        raise
