"""Checkpoint folders: writing them atomically (on a background thread when training may go on),
reading them back without pickle, rotating them, and the RNG state they carry."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import sys
import threading
import time
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpsweep import faults
from hpsweep.runs._atomic import _json_default, atomic_dir, read_json

CHECKPOINT_PREFIX = "checkpoint-"
SCALER_FILE = "scaler.json"
#: In a plain torch model's ``model.safetensors`` metadata: the model's class (`model_class_path`),
#: which the card of ``best/`` names (transformers' models name theirs in ``config.json``).
MODEL_CLASS_KEY = "hpsweep.model_class"


# --- checkpoints ---------------------------------------------------------------------------------


def checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first (temporary folders are never listed)."""
    if not run_dir.is_dir():
        return []
    found = [
        p
        for p in run_dir.iterdir()
        if p.is_dir()
        and p.name.startswith(CHECKPOINT_PREFIX)
        and p.name[len(CHECKPOINT_PREFIX) :].isdigit()
    ]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX) :]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = checkpoints(run_dir)
    return found[-1] if found else None


def rotate_checkpoints(run_dir: Path, limit: int | None, keep: Path | None) -> list[Path]:
    """Delete the oldest checkpoints beyond ``limit``, never ``keep`` (the run's best)."""
    if limit is None:
        return []
    found = checkpoints(run_dir)
    newest = found[-limit:]
    doomed = [
        p for p in found if p not in newest and (keep is None or p.resolve() != keep.resolve())
    ]
    for path in doomed:
        # Renamed out of the listing first: a crash halfway through deleting must not leave a
        # checkpoint-<step> with files missing (recover_interrupted_swaps clears the leftover).
        trash = path.with_name(f".{path.name}.tmp-rotated{time.monotonic_ns()}")
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


def save_weights(
    model: Any, folder: Path, state_dict: Mapping[str, Any] | None = None, *, quiet: bool = False
) -> None:
    """Model weights as safetensors; Hugging Face models also write their config.json, and a plain
    torch model's file names its class in its metadata (`MODEL_CLASS_KEY`).

    ``state_dict`` (a `snapshot_checkpoint` copy) is written instead of the model's live weights.
    ``quiet`` (the run's ``disable_tqdm``, which every sweep trial has): without transformers'
    "Writing model shards" bar, which transformers 5 shows for every save, so every checkpoint.
    """
    if hasattr(model, "save_pretrained") and hasattr(model, "config"):
        extra = {} if state_dict is None else {"state_dict": dict(state_dict)}
        with _transformers_bars_off() if quiet else contextlib.nullcontext():
            model.save_pretrained(folder, safe_serialization=True, **extra)
    else:
        from safetensors.torch import save_model

        # save_model reads nothing but .state_dict(): a snapshot goes through the same
        # de-duplication of tied weights as the live model.
        source = (
            model
            if state_dict is None
            else types.SimpleNamespace(state_dict=lambda: dict(state_dict))
        )
        metadata = {"format": "pt", MODEL_CLASS_KEY: model_class_path(type(model))}
        save_model(source, str(folder / "model.safetensors"), metadata=metadata)


def model_class_path(cls: type) -> str:
    """Where ``cls`` is imported from, as a user's script writes it: ``package.module.Class``; a
    class of a script or a space file, imported under another name (``__main__``, the space
    file's own), by its file's name (``space.Net``)."""
    name = cls.__module__
    source = getattr(sys.modules.get(name), "__file__", None)
    if source and "." not in name and Path(source).stem not in (name, "__init__"):
        name = Path(source).stem
    return f"{name}.{cls.__qualname__}"


_BARS_LOCK = threading.Lock()
_bars_off = 0  # saves under _transformers_bars_off now (a background checkpoint and a save_model can overlap)
_bars_were: tuple[bool, bool] = (False, False)


@contextlib.contextmanager
def _transformers_bars_off() -> Iterator[None]:
    """transformers' progress bars off, through its own switch, then back as they were. The switch
    is process-wide and also turns huggingface_hub's bars off, so both states are restored, once
    the last of overlapping saves is done."""
    global _bars_off, _bars_were
    import importlib.util

    # another library's save_pretrained (diffusers')
    if importlib.util.find_spec("transformers") is None:
        yield
        return
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as hf_logging

    with _BARS_LOCK:
        if _bars_off == 0:
            _bars_were = (
                hf_logging.is_progress_bar_enabled(),
                hub_utils.are_progress_bars_disabled(),
            )
            hf_logging.disable_progress_bar()
        _bars_off += 1
    try:
        yield
    finally:
        with _BARS_LOCK:
            _bars_off -= 1
            if _bars_off == 0:
                transformers_on, hub_off = _bars_were
                if transformers_on:
                    hf_logging.enable_progress_bar()  # turns the hub's on too
                if hub_off != hub_utils.are_progress_bars_disabled():
                    (
                        hub_utils.disable_progress_bars
                        if hub_off
                        else hub_utils.enable_progress_bars
                    )()


def load_weights(model: Any, folder: Path) -> None:
    """Load weights written by `save_weights` into ``model`` (no pickle involved)."""
    from safetensors.torch import load_model

    path = folder / "model.safetensors"
    if path.exists():
        load_model(model, str(path))
        return
    index = folder / "model.safetensors.index.json"
    if index.exists():  # sharded Hugging Face checkpoint
        from safetensors.torch import load_file

        state: dict[str, Any] = {}
        for shard in sorted(set(read_json(index)["weight_map"].values())):
            state.update(load_file(str(folder / shard)))
        model.load_state_dict(state, strict=False)
        return
    raise FileNotFoundError(f"{folder} holds no model.safetensors")


@dataclass
class CheckpointSnapshot:
    """What a checkpoint holds, copied (tensors to the CPU) so that training can go on while it is
    written: the files are those a write at the moment of the copy would have produced."""

    model: Any  # for save_pretrained and its config; its live weights are read only without a copy
    weights: dict[str, Any] | None  # None: no copy, the model's weights as they are when written
    # None, and scheduler and rng: the model alone (save_only_model)
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    rng: dict[str, Any] | None
    state: dict[str, Any]
    args: dict[str, Any]
    # fp16's gradient scaler: its scale and growth tracker (plain numbers)
    scaler: dict[str, Any] | None = None


def snapshot_checkpoint(
    *,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    state: Mapping[str, Any],
    args: Mapping[str, Any],
    scaler: Any = None,
    copy: bool = True,
    model_only: bool = False,
) -> CheckpointSnapshot:
    """Gather what `write_snapshot` writes. ``copy`` (for a write on another thread) copies the
    tensors, a memcpy of the weights and optimizer state; without it the snapshot refers to the
    live state and must be written before training goes on. ``scaler``: fp16's ``GradScaler``
    (accelerate's ``Accelerator.scaler``), whose state is plain numbers, copied either way.
    ``model_only`` (``save_only_model``): the weights and the trainer state, nothing to resume from."""
    if model_only:
        weights = _cpu_copy(model.state_dict(), {}) if copy else None
        return CheckpointSnapshot(
            model=model,
            weights=weights,
            optimizer=None,
            scheduler=None,
            rng=None,
            state=_cpu_copy(dict(state), {}),
            args=_cpu_copy(dict(args), {}),
        )
    # a disabled scaler has none
    scaler_state = (scaler.state_dict() or None) if scaler is not None else None
    if not copy:
        return CheckpointSnapshot(
            model=model,
            weights=None,
            optimizer=optimizer.state_dict(),
            scheduler=scheduler.state_dict(),
            rng=rng_state(),
            state=dict(state),
            args=dict(args),
            scaler=scaler_state,
        )
    memo: dict[Any, Any] = {}
    return CheckpointSnapshot(
        model=model,
        weights=_cpu_copy(model.state_dict(), memo),
        optimizer=_cpu_copy(optimizer.state_dict(), memo),
        scheduler=_cpu_copy(scheduler.state_dict(), memo),
        rng=rng_state(),
        state=_cpu_copy(dict(state), memo),
        args=_cpu_copy(dict(args), memo),
        scaler=scaler_state,
    )


def _cpu_copy(value: Any, memo: dict[Any, Any]) -> Any:
    """A deep copy with tensors detached and copied to the CPU; views of one storage with one
    shape (tied weights) stay one tensor, so saving de-duplicates them as before."""
    import torch

    if isinstance(value, torch.Tensor):
        key = (
            value.untyped_storage().data_ptr(),
            value.storage_offset(),
            value.shape,
            value.stride(),
            value.dtype,
            str(value.device),
        )
        if key not in memo:
            memo[key] = value.detach().to("cpu", copy=True)
        return memo[key]
    if type(value) is dict:
        return {k: _cpu_copy(v, memo) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_cpu_copy(v, memo) for v in value)
    return copy.deepcopy(value)


def write_snapshot(final: Path, snapshot: CheckpointSnapshot) -> Path:
    """Write a whole checkpoint folder atomically: weights (safetensors), optimizer, scheduler and
    RNG state (tensors and plain numbers only, so ``torch.load(weights_only=True)`` reads them;
    none of the three for a model-only snapshot), trainer_state.json, training_args.json, and
    scaler.json when fp16 training has a gradient scaler."""
    import torch

    with atomic_dir(final) as tmp:
        save_weights(
            snapshot.model, tmp, snapshot.weights, quiet=bool(snapshot.args.get("disable_progress"))
        )
        faults.reached("writing")
        for name, value in (
            ("optimizer.pt", snapshot.optimizer),
            ("scheduler.pt", snapshot.scheduler),
            ("rng_state.pth", snapshot.rng),
        ):
            if value is not None:
                torch.save(value, tmp / name)
        # Plain writes: the folder is renamed into place as a whole, its files need no renames of their own.
        files = [("trainer_state.json", snapshot.state), ("training_args.json", snapshot.args)]
        if snapshot.scaler is not None:
            files.append((SCALER_FILE, snapshot.scaler))
        for name, data in files:
            (tmp / name).write_text(
                json.dumps(data, indent=2, default=_json_default) + "\n", encoding="utf-8"
            )
    return final


def write_checkpoint(
    final: Path,
    *,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    state: Mapping[str, Any],
    args: Mapping[str, Any],
    scaler: Any = None,
) -> Path:
    """Write a checkpoint of the objects as they are now, on this thread (see `write_snapshot`)."""
    return write_snapshot(
        final,
        snapshot_checkpoint(
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            state=state,
            args=args,
            scaler=scaler,
            copy=False,
        ),
    )


class CheckpointWriter:
    """Writes checkpoints on a background thread, one at a time and in order, each followed by its
    rotation. `submit` waits for the previous write first (one snapshot in memory at most; rotation
    sees every earlier checkpoint). `wait` returns once all is on disk and raises what a write
    raised. Not a daemon: an interpreter that exits (Ctrl-C) finishes the write; a killed process
    leaves a temporary folder, which no listing takes for a checkpoint.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def pending(self) -> bool:
        return self._thread is not None

    def submit(
        self,
        final: Path,
        snapshot: CheckpointSnapshot,
        *,
        limit: int | None,
        keep: Path | None,
        background: bool = True,
    ) -> None:
        """Write ``snapshot`` to ``final``, then rotate. ``background=False`` writes on this thread
        (after pending writes): a caller that must wait anyway saves the thread hand-off, which a
        busy machine can make cost milliseconds."""
        self.wait()
        if not background:
            write_snapshot(final, snapshot)
            rotate_checkpoints(final.parent, limit, keep)
            return

        def job() -> None:
            try:
                write_snapshot(final, snapshot)
                rotate_checkpoints(final.parent, limit, keep)
            except BaseException as exc:  # raised on the training thread by wait()
                self._error = exc

        self._thread = threading.Thread(
            target=job, name=f"hpsweep-write-{final.name}", daemon=False
        )
        self._thread.start()

    def wait(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error


def read_checkpoint(
    folder: Path, *, model: Any, optimizer: Any, scheduler: Any, scaler: Any = None
) -> tuple[dict[str, Any], Any]:
    """Load a checkpoint written by `write_checkpoint` into the given objects (never with pickle).

    ``scaler`` (fp16's ``GradScaler``) gets its scale and growth tracker back when the checkpoint
    has them; a checkpoint without (bf16, fp32, or one written before they were saved) leaves it
    as it starts. Returns the trainer state (a dict) and the RNG state, which the caller restores
    when the resumed run reaches the point the checkpoint was taken at (`set_rng_state`).
    """
    import torch

    load_weights(model, folder)
    saved = _fit_groups(
        torch.load(folder / "optimizer.pt", weights_only=True),
        torch.load(folder / "scheduler.pt", weights_only=True),
        [len(g["params"]) for g in optimizer.param_groups],
    )
    optimizer.load_state_dict(saved[0])
    scheduler.load_state_dict(saved[1])
    if scaler is not None and (folder / SCALER_FILE).exists():
        scaler.load_state_dict(read_json(folder / SCALER_FILE))
    return read_json(folder / "trainer_state.json"), torch.load(
        folder / "rng_state.pth", weights_only=True
    )


def _fit_groups(
    optimizer: dict[str, Any], scheduler: dict[str, Any], sizes: list[int]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Fit a checkpoint's param groups to the optimizer's (``sizes``: its groups' param counts)
    when only their split differs. hpsweep makes one group without weight decay and two with it
    (decay, no decay), over the params in the same order, so a checkpoint written with the other
    split loads: a resume with another weight decay (PBT's), or a checkpoint written with two
    groups whatever the decay. Each group takes the settings of the saved group its first param was in (the
    resume then sets the weight decay it is run with), and the schedule's per-group lists follow."""
    saved = optimizer["param_groups"]
    flat = [i for g in saved for i in g["params"]]
    if len(saved) == len(sizes) or len(flat) != sum(sizes):
        return optimizer, scheduler
    owner = {i: k for k, g in enumerate(saved) for i in g["params"]}
    groups, start = [], 0
    for size in sizes:
        ids = flat[start : start + size]
        start += size
        groups.append({**saved[owner[ids[0]] if ids else 0], "params": ids})
    sources = [owner[g["params"][0]] if g["params"] else 0 for g in groups]
    scheduler = {
        k: [v[j] for j in sources]
        if k in ("base_lrs", "_last_lr", "lr_lambdas")
        and isinstance(v, list)
        and len(v) == len(saved)
        else v
        for k, v in scheduler.items()
    }
    return {**optimizer, "param_groups": groups}, scheduler


def rng_state() -> dict[str, Any]:
    """Python, numpy, torch (and CUDA) RNG states as tensors and plain numbers."""
    import random

    import numpy as np
    import torch

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    # Python's 625 state words as one tensor: as a tuple, torch.save pickled them one by one
    # (~600 calls into its pickler a checkpoint; a small model's checkpoint took 5.3 ms, now 4.6).
    version, internal, gauss = random.getstate()
    state = {
        "python": {
            "version": version,
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss": gauss,
        },
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "cached": cached,
        },
    }
    # Not is_available(): that initialises the CUDA driver, and processes forked afterwards (the
    # data-parallel ranks of a trial whose model was built here) could no longer use the GPU.
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    import random

    import numpy as np
    import torch

    python = state["python"]  # a tuple in checkpoints written before the state became a tensor
    version, internal, gauss = (
        (python["version"], python["internal"].tolist(), python["gauss"])
        if isinstance(python, Mapping)
        else python
    )
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"])
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def resumable(folder: Path) -> bool:
    """Whether a run can go on from ``folder``: not when it holds the model alone (``save_only_model``)."""
    return (folder / "optimizer.pt").exists()


def resolve_checkpoint(output_dir: Path, resume: str | bool | None) -> Path | None:
    """The checkpoint ``resume_from_checkpoint`` names: ``True`` for the latest in ``output_dir``,
    a path for that ``checkpoint-<step>`` folder; a wrong one is one `UserError`."""
    from hpsweep.errors import UserError

    if not resume:
        return None
    if resume is True:
        path = latest_checkpoint(output_dir)
        if path is None:
            raise UserError(f"resume_from_checkpoint=True, but {output_dir} holds no checkpoint")
    else:
        path = Path(resume)
        if not (path / "trainer_state.json").exists():
            raise UserError(
                f"{path} is not a checkpoint folder (no trainer_state.json); give a checkpoint-<step> folder"
            )
    # transformers goes on with a new optimizer and schedule: not the run it was
    if not resumable(path):
        raise UserError(
            f"{path} holds the model alone (save_only_model=True) and cannot resume its run; train "
            "without resume_from_checkpoint to start again, or keep full checkpoints (save_only_model=False)"
        )
    return path
