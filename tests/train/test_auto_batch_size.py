"""transformers' ``auto_find_batch_size``: a run that runs out of memory trains again from the start
with half the batch, until a batch fits.

The out-of-memory error is the CPU allocator's own message (accelerate's ``should_reduce_batch_size``
knows it as it knows CUDA's), raised by a model whose batches above 8 rows do not fit; so the
whole path runs here as on a GPU.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import hpsweep
import hpsweep.train.hf_compat.args
from hpsweep import runs
from hpsweep.train.arguments import TrainingArguments

X = torch.randn(200, 8, generator=torch.Generator().manual_seed(1))
DATA = torch.utils.data.TensorDataset(
    X, (X @ torch.randn(8, 4, generator=torch.Generator().manual_seed(0))).argmax(-1)
)


class Hungry(nn.Module):
    """Training batches above ``fits`` rows run out of memory once ``warm`` steps have run (so a
    failed attempt can leave checkpoints behind); evaluation batches above ``eval_fits``."""

    fits, warm, eval_fits = 8, 10, 10_000

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 4))
        self.steps = 0

    def forward(self, x, labels=None):
        limit = self.fits if self.training else self.eval_fits
        if self.training:
            self.steps += 1
        if len(x) > limit and (self.steps > self.warm or not self.training):
            raise RuntimeError(
                f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {len(x) << 28} "
                "bytes. Error code 12 (Cannot allocate memory)"
            )
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def trainer(out: Path, batch: int, model_init=Hungry, **kw) -> hpsweep.Trainer:
    kw.setdefault("learning_rate", 3e-2)
    args = TrainingArguments(
        output_dir=str(out),
        num_train_epochs=3,
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=64,
        eval_strategy="epoch",
        save_strategy="epoch",
        disable_progress=True,
        **kw,
    )
    return hpsweep.Trainer(model_init=model_init, args=args, train_dataset=DATA, eval_dataset=DATA)


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_it_halves_the_batch_until_one_fits_and_trains_what_that_batch_trains(
    tmp_path: Path,
) -> None:
    auto = trainer(tmp_path / "auto", 32, auto_find_batch_size=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto.train()
    said = [str(w.message) for w in caught if "auto_find_batch_size" in str(w.message)]
    assert len(said) == 2 and "=32;" in said[0] and "at 16" in said[0] and "at 8" in said[1]
    assert auto.state.train_batch_size == 8 and auto.args.per_device_train_batch_size == 8
    # The attempt at 32 wrote checkpoint-7 before it ran out of memory: gone, as a resume from it
    # would continue steps of a batch that does not fit. What is left is the run at 8 (25 steps an epoch).
    assert [p.name for p in runs.checkpoints(tmp_path / "auto")] == [
        "checkpoint-25",
        "checkpoint-50",
        "checkpoint-75",
    ]
    state = json.loads((tmp_path / "auto" / "checkpoint-75" / "trainer_state.json").read_text())
    assert state["train_batch_size"] == 8
    plain = trainer(tmp_path / "plain", 8)
    plain.train()
    assert same(
        weights(tmp_path / "auto" / "checkpoint-75"), weights(tmp_path / "plain" / "checkpoint-75")
    )


def test_a_resume_starts_at_the_batch_that_fitted_and_goes_on_bit_for_bit(tmp_path: Path) -> None:
    trainer(tmp_path / "full", 32, auto_find_batch_size=True).train()
    resumed = trainer(tmp_path / "resumed", 32, auto_find_batch_size=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no out-of-memory retry: it starts at 8
        resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-25"))
    assert resumed.state.train_batch_size == 8
    assert same(
        weights(tmp_path / "full" / "checkpoint-75"),
        weights(tmp_path / "resumed" / "checkpoint-75"),
    )


def test_without_it_running_out_of_memory_fails_the_run(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="DefaultCPUAllocator"):
        trainer(tmp_path, 32).train()


def test_an_evaluation_out_of_memory_names_the_eval_batch_and_is_not_retried(
    tmp_path: Path,
) -> None:
    class EvalHungry(Hungry):
        eval_fits = 16

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a retry would warn
        with pytest.raises(RuntimeError, match="set a smaller per_device_eval_batch_size"):
            trainer(tmp_path, 8, model_init=EvalHungry, auto_find_batch_size=True).train()


def test_a_transformers_args_with_it_converts() -> None:
    import transformers

    args = hpsweep.train.hf_compat.args.as_training_arguments(
        transformers.TrainingArguments(
            "out", auto_find_batch_size=True, per_device_train_batch_size=32
        )
    )
    assert args.auto_find_batch_size is True and args.per_device_train_batch_size == 32


def test_a_sweep_trial_finds_its_batch_and_trains_what_a_plain_run_of_its_params_trains(
    tmp_path: Path,
) -> None:
    # The sweep builds each trial's model ahead of training; a retry gets a fresh one, built the same way.
    sweep = trainer(tmp_path / "sweep", 32, auto_find_batch_size=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sweep.hyperparameter_search(
            hp_space=lambda t: {"learning_rate": t.suggest_float("learning_rate", 1e-3, 1e-1)},
            n_trials=1,
            pruner="none",
            seed=0,
            show_progress=False,
        )
    [record] = runs.read_trials(tmp_path / "sweep")
    assert record.state == "complete" and record.checkpoint == "checkpoint-75"
    plain = trainer(tmp_path / "plain", 8, learning_rate=record.params["learning_rate"])
    plain.train()
    assert same(
        weights(Path(record.run_dir) / "checkpoint-75"),
        weights(tmp_path / "plain" / "checkpoint-75"),
    )


class MockCudaOOMCallback(hpsweep.TrainerCallback):
    """transformers' own test callback (tests/trainer/test_trainer.py): CUDA's out-of-memory error
    at the end of a step while the batch is at least ``batch_size_limit``."""

    def __init__(self, batch_size_limit: int = 16) -> None:
        self.batch_size_limit = batch_size_limit

    def on_step_end(self, args, state, control, **kwargs):
        if state.train_batch_size >= self.batch_size_limit:
            raise RuntimeError("CUDA out of memory.")


def test_transformers_own_auto_batch_size_with_resume_from_checkpoint(tmp_path: Path) -> None:
    # transformers' test_auto_batch_size_with_resume_from_checkpoint, on hpsweep's Trainer.
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        save_strategy="steps",
        save_steps=1,
        eval_strategy="no",
        per_device_train_batch_size=16,
        auto_find_batch_size=True,
        disable_progress=True,
    )  # eval_strategy: transformers' default
    model = nn.Linear(8, 4)

    def loss(outputs, labels, num_items_in_batch=None):
        return nn.functional.cross_entropy(outputs, labels)

    first = hpsweep.Trainer(
        model, args, train_dataset=DATA, callbacks=[MockCudaOOMCallback()], compute_loss_func=loss
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first.train()
    assert first.state.train_batch_size == 8
    again = hpsweep.Trainer(model, args, train_dataset=DATA, compute_loss_func=loss)
    assert again.args.per_device_train_batch_size == 16  # at 16 to start
    again.train(resume_from_checkpoint=True)
    assert again.state.train_batch_size == 8  # picked up from the last run's checkpoint


def test_with_several_processes_per_trial_it_is_one_line_before_anything_runs(
    tmp_path: Path,
) -> None:
    sweep = trainer(tmp_path / "sweep", 32, auto_find_batch_size=True)
    with pytest.raises(
        hpsweep.UserError, match="set per_device_train_batch_size to a size that fits"
    ):
        sweep.hyperparameter_search(
            hp_space=lambda t: {"learning_rate": t.suggest_float("learning_rate", 1e-3, 1e-1)},
            n_trials=1,
            processes_per_trial=2,
            show_progress=False,
        )
    assert not (tmp_path / "sweep").exists()  # nothing half-written
