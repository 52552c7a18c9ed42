"""Giving a trial's memory back before the next trial starts in the same process.

A worker runs trial after trial. Measured with ``bench/memory.py`` (weak references to every
trial's model, tensor bytes Python can reach, RSS), the search layer keeps no finished trial's
model alive by a plain reference. What stayed was held by reference cycles or below Python:

- glibc keeps freed tensor pages in its heap (its mmap threshold rises after the first big
  free), so RSS sat one model-and-optimizer above trial 1 and jumped by more at random trials;
  ``malloc_trim`` after each trial hands the pages back;
- on a GPU, torch's caching allocator keeps freed blocks reserved: invisible to a worker that
  shares the GPU (``gpu=0.5``), which then runs out of memory; ``empty_cache`` returns them;
- reference cycles, which wait for Python's occasional full collection, held whole trials (found
  with the collector off and weak references to each trial's model): with mixed precision,
  accelerate binds a wrapped ``forward`` to the model itself, so trial 4 started with trials 1 to
  3 alive, optimizer state included; and torch's lazy import of its compiler during trial 1's
  optimizer (``torch.fx.wrap`` keeps its own frame) pinned that trial's training frame, with its
  model and optimizer, until a full collection;
- accelerate's process-wide ``GradientState`` keeps the last prepared loaders until the next
  trial resets it;
- a failed trial's traceback frames hold its tensors (after a CUDA out-of-memory error: the
  activations of the step that failed) as long as the exception lives; the search layer clears
  them once the error is recorded.

`release` does this as each trial ends, whatever happened, so the next one starts from what the
first one had.
"""

from __future__ import annotations

import ctypes
import gc
import weakref
from typing import Any, Protocol


class HoldsARun(Protocol):
    """A trainer, as this module sees it: its model, and a way to drop all its run holds (the
    per-step operations hold the optimizer and scheduler through their bound ``step`` methods, so
    the trainer, not this module, knows every reference)."""

    model: Any

    def release_run(self) -> None: ...


def release(trainer: HoldsARun) -> None:
    """Drop what a finished trial's ``trainer`` holds (`release_run`: model, optimizer, scheduler,
    accelerator, loaders), reset accelerate's per-run state and give the memory back;
    ``trainer.state`` stays readable.

    A full garbage collection costs 0.1 to 0.5 s on two cores (a warm trial on Ray takes 11 ms),
    so it runs only when the model or its parameters outlive their last references: then a
    cycle holds them (the cases in this module's docstring, or a new one).
    """
    model = getattr(trainer, "model", None)
    held = (
        [weakref.ref(model), *(weakref.ref(p) for p in list(model.parameters())[:1])]
        if model is not None
        else []
    )
    trainer.release_run()
    if model is not None:
        _unpatch_forward(model)
    del model
    reset_accelerate_state()
    if any(ref() is not None for ref in held):
        gc.collect()
    collect()


def _unpatch_forward(model: Any) -> None:
    """With mixed precision, accelerate sets ``model.forward`` (and ``_original_forward``) to methods
    bound to the model itself: a cycle. Undo it, so the model goes as soon as it is unreferenced."""
    attrs = vars(model)
    if "_original_forward" in attrs:
        attrs.pop("_original_forward", None)
        attrs.pop("forward", None)


def reset_accelerate_state() -> None:
    """Forget accelerate's per-run singletons (``GradientState`` keeps the last prepared loaders);
    a data-parallel rank keeps them: its process group lives there, and it ends with the trial."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    if PartialState._shared_state and PartialState._shared_state.get("num_processes", 1) > 1:
        return
    AcceleratorState._reset_state()
    GradientState._reset_state()


def collect() -> None:
    """Give freed memory back: cached CUDA blocks to the driver, free heap pages to the system."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    _trim_heap()


def _trim_heap() -> None:
    """glibc keeps freed tensors' pages in its heap (its mmap threshold rises after the first big
    free), so RSS stays at the high-water mark of any trial; ``malloc_trim`` hands them back."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc: nothing to trim
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


def is_cuda_oom(exc: BaseException) -> bool:
    """``torch.cuda.OutOfMemoryError``, or an older/wrapped ``RuntimeError`` saying CUDA ran out of memory."""
    import torch

    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom is not None and isinstance(exc, oom):
        return True
    return isinstance(exc, RuntimeError) and "CUDA out of memory" in str(exc)


OOM_HINT = (
    "use a smaller per_device_train_batch_size (gradient_accumulation_steps keeps the effective batch) "
    "or give each trial a whole GPU with --resources-per-trial gpu=1"
)


def oom_line(exc: BaseException) -> str:
    """One line for a trial that ran out of GPU memory: torch's first line and what to change."""
    text = str(exc).strip()
    first = text.splitlines()[0][:300] if text else "CUDA out of memory"
    return f"{type(exc).__name__}: {first} (the trial ran out of GPU memory); {OOM_HINT}"
