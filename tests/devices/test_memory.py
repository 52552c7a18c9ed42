"""A worker gives each trial's memory back before the next trial starts, and a CUDA
out-of-memory error costs only its trial.

The sweeps run in this process (``n_jobs=1``, as a ``--n-jobs`` worker runs them), so the tests
can hold weak references to each trial's model: a model still alive when the next trial starts
is memory the worker kept. Python's collector is off while they run: what only a full
collection would free stays held for an unknown while in a real worker (on a GPU, long enough
to run the next trial out of memory).
"""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import hpsweep
from hpsweep import runs


def _data(n: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 64, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :4]).argmax(-1))


class Net(nn.Module):
    """A few MB of weights, so that a kept model is visible; ``oom`` fails like a too-big batch on a GPU."""

    def __init__(self, oom: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 4)
        )
        self.oom = oom

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.net[0](x)  # an activation the failed step leaves behind
        if self.oom:
            raise torch.cuda.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which "
                "1.20 GiB is free.\nIf reserved but unallocated memory is large try setting "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
            )
        logits = self.net[2:](self.net[1](hidden))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class Watch:
    """model_init that remembers each trial's model weakly, and checks at every new trial that
    the earlier ones are gone: no garbage collection of ours, the sweep must have freed them."""

    def __init__(self, oom_trials: tuple[int, ...] = ()) -> None:
        self.models: list[weakref.ref] = []
        self.params: list[weakref.ref] = []  # the optimizer and accelerate's wrappers hold these
        self.kept: list[int] = []
        self.oom_trials = oom_trials

    def __call__(self, trial: hpsweep.Trial) -> nn.Module:
        self.kept.append(sum(ref() is not None for ref in self.models + self.params))
        model = Net(oom=trial.number in self.oom_trials)
        self.models.append(weakref.ref(model))
        self.params.append(weakref.ref(model.net[2].weight))
        return model


@pytest.fixture(autouse=True)
def no_garbage_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def search(tmp_path: Path, watch: Watch, n_trials: int, mixed_precision: str = "no") -> None:
    args = hpsweep.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        num_train_epochs=1,
        per_device_train_batch_size=32,
        per_device_eval_batch_size=64,
        disable_progress=True,
        mixed_precision=mixed_precision,
    )
    trainer = hpsweep.Trainer(
        model_init=watch, args=args, train_dataset=_data(128, 1), eval_dataset=_data(64, 2)
    )
    trainer.hyperparameter_search(
        space={"learning_rate": hpsweep.Float(1e-3, 1e-2, log=True)},
        n_trials=n_trials,
        pruner="none",
        sampler="random",
        seed=0,
        show_progress=False,
    )


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_each_trial_starts_with_the_previous_trials_model_and_optimizer_freed(
    tmp_path: Path, precision: str
) -> None:
    watch = Watch()
    search(tmp_path, watch, n_trials=4, mixed_precision=precision)
    assert watch.kept == [0, 0, 0, 0]
    assert all(r.state == "complete" for r in runs.read_trials(tmp_path / "out"))


def test_release_frees_a_trained_model_without_a_garbage_collection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full collection costs a worker 0.1-0.5 s a trial (and on Ray outlasted the 200 ms that
    Ray gives an actor to exit): nothing the trainer keeps after `release` may hold the model."""
    from hpsweep.devices import memory

    args = hpsweep.TrainingArguments(
        output_dir=str(tmp_path),
        num_train_epochs=1,
        per_device_train_batch_size=32,
        disable_progress=True,
    )
    trainer = hpsweep.Trainer(
        model_init=Net, args=args, train_dataset=_data(128, 1), eval_dataset=_data(64, 2)
    )
    trainer.train()
    weights = weakref.ref(trainer.model.net[2].weight)
    collections: list[int] = []
    monkeypatch.setattr(memory.gc, "collect", lambda *a: collections.append(1) or 0)
    memory.release(trainer)
    # freed by reference counting, the trainer still alive
    assert weights() is None and collections == []
    assert trainer.state.global_step == 4  # what a caller reads after release stays


def test_a_cuda_out_of_memory_error_fails_only_its_trial_and_frees_its_memory(
    tmp_path: Path,
) -> None:
    watch = Watch(oom_trials=(1,))
    search(tmp_path, watch, n_trials=2)
    records = runs.read_trials(tmp_path / "out")
    assert [r.state for r in records] == [
        "complete",
        "failed",
        "complete",
    ]  # another trial ran in its place
    failed = records[1]
    assert "\n" not in failed.error
    assert failed.error.startswith(
        "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."
    )
    assert "ran out of GPU memory" in failed.error
    assert (
        "smaller per_device_train_batch_size" in failed.error
        and "--resources-per-trial gpu=1" in failed.error
    )
    # the whole traceback is kept there
    assert "forward" in (Path(failed.run_dir) / "error.log").read_text()
    # the failed trial's model and its half-done step were released before the next trial started
    assert watch.kept == [0, 0, 0]
    shown = json.loads((Path(failed.run_dir) / "trial.json").read_text())
    assert shown["state"] == "failed"
