"""The fast paths change how long training takes, never what it produces.

- On one process without mixed precision or accumulation the loop skips accelerate's no-op
  wrappers; the weights must come out bit-identical to a run through them.
- Checkpoints are written on a background thread (the last one in place); a resumed run must
  still reproduce an uninterrupted one bit for bit, every checkpoint must be whole once
  ``train()`` returns, and a process killed while writing must leave nothing that looks like a
  checkpoint but is not one.
- A sweep builds each trial's model ahead of its trainer; the trial must still train what a plain
  run of its params trains.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support import timeless
from torch import nn

import hpsweep
from hpsweep import runs
from hpsweep.search.trial_reporter import TrialReporter
from hpsweep.train.arguments import TrainingArguments
from hpsweep.train.data import BatchedTensors, default_data_collator

CHECKPOINT_FILES = {
    "model.safetensors",
    "optimizer.pt",
    "scheduler.pt",
    "rng_state.pth",
    "trainer_state.json",
    "training_args.json",
}


class Data(torch.utils.data.Dataset):
    """With ``noise``, draws random numbers while loading (augmentation), so a loader that fetched
    batches in another order relative to the model's dropout would change the result."""

    def __init__(self, n: int, seed: int, noise: float = 0.0) -> None:
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
        self.y = (self.x @ torch.randn(8, 4, generator=torch.Generator().manual_seed(0))).argmax(-1)
        self.noise = noise

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        x = self.x[i] + self.noise * torch.randn(8) if self.noise else self.x[i]
        return {"x": x, "labels": self.y[i]}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))

    def forward(self, x, labels):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def accuracy(p: hpsweep.EvalPrediction) -> dict:
    return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}


def make_trainer(out: Path, noise: float = 0.0, **kw) -> hpsweep.Trainer:
    args = TrainingArguments(
        output_dir=str(out),
        num_train_epochs=kw.pop("num_train_epochs", 3),
        per_device_train_batch_size=16,
        learning_rate=kw.pop("learning_rate", 3e-2),
        disable_progress=True,
        eval_strategy="steps",
        eval_steps=5,
        logging_strategy="steps",
        logging_steps=5,
        **kw,
    )
    return hpsweep.Trainer(
        model_init=Net,
        args=args,
        train_dataset=Data(200, 1, noise),
        eval_dataset=Data(64, 2),
        compute_metrics=accuracy,
    )


def weights(trainer: hpsweep.Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_skipping_accelerates_noop_wrappers_leaves_training_bit_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = make_trainer(tmp_path / "plain", noise=0.05, save_strategy="steps", save_steps=6)
    plain.train()
    assert plain.accelerate_wrappers_skipped

    monkeypatch.setenv("HPSWEEP_ACCELERATE_WRAPPERS", "always")
    wrapped = make_trainer(tmp_path / "wrapped", noise=0.05, save_strategy="steps", save_steps=6)
    wrapped.train()
    assert not wrapped.accelerate_wrappers_skipped

    expected, got = weights(wrapped), weights(plain)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    # losses, learning rates, eval metrics
    assert [timeless(h) for h in plain.state.log_history] == [
        timeless(h) for h in wrapped.state.log_history
    ]
    for name in ("checkpoint-6", f"checkpoint-{plain.state.global_step}"):
        a = torch.load(tmp_path / "plain" / name / "optimizer.pt", weights_only=True)["state"]
        b = torch.load(tmp_path / "wrapped" / name / "optimizer.pt", weights_only=True)["state"]
        assert all(torch.equal(a[i]["exp_avg_sq"], b[i]["exp_avg_sq"]) for i in b)


def test_the_default_adamw_runs_torchs_fused_kernel_and_learns_what_the_default_kernel_learns(
    tmp_path: Path,
) -> None:
    """``optim="adamw"`` (the default) is AdamW(fused=True) where torch has the kernel, as
    transformers' default ``adamw_torch_fused``; ``adamw_torch`` is torch's default kernel. The two
    differ by float rounding only."""
    runs_ = {
        optim: make_trainer(tmp_path / optim, optim=optim) for optim in ("adamw", "adamw_torch")
    }
    for trainer in runs_.values():
        trainer.train()
    assert runs_["adamw"].optimizer.param_groups[0]["fused"] is True
    assert runs_["adamw_torch"].optimizer.param_groups[0]["fused"] is None
    fused, default = weights(runs_["adamw"]), weights(runs_["adamw_torch"])
    assert all(torch.allclose(fused[k], default[k], rtol=1e-4, atol=1e-5) for k in default)
    evals = [
        [h["eval_accuracy"] for h in t.state.log_history if "eval_accuracy" in h]
        for t in runs_.values()
    ]
    assert evals[0] == evals[1] and len(evals[0]) >= 3


def test_the_default_adamw_falls_back_to_torchs_kernel_for_params_the_fused_one_cannot_take() -> (
    None
):
    from hpsweep.train.optim import create_optimizer

    class Complex(nn.Module):  # torch's fused Adam takes floating-point tensors only
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, dtype=torch.complex64))

    optimizer = create_optimizer(
        Complex(), TrainingArguments(output_dir="unused", learning_rate=0.1)
    )
    optimizer.param_groups[0]["params"][0].grad = torch.ones(4, dtype=torch.complex64)
    optimizer.step()  # fused=True would raise here
    assert not optimizer.param_groups[0]["fused"]


@pytest.mark.parametrize("fused", [True, None], ids=["fused-kernel", "torch-default-kernel"])
def test_one_param_group_without_weight_decay_trains_as_the_two_groups_bit_for_bit(
    tmp_path: Path, fused: bool | None
) -> None:
    """hpsweep 0.1 made two groups with torch's default AdamW kernel; the default is now one group on
    the fused kernel. A checkpoint of either resumes under today's defaults exactly: the kernel is
    part of the optimizer's saved settings."""

    def trainer(out: str, two_groups: bool, optim: str = "adamw") -> hpsweep.Trainer:
        torch.manual_seed(0)
        model = Net()
        groups = [
            {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.0},
            {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
        ]
        # as hpsweep 0.1 built it (its kernel: torch's default)
        optimizer = torch.optim.AdamW(groups, lr=3e-2, fused=fused) if two_groups else None
        args = TrainingArguments(
            output_dir=str(tmp_path / out),
            num_train_epochs=2,
            per_device_train_batch_size=16,
            learning_rate=3e-2,
            disable_progress=True,
            save_strategy="steps",
            save_steps=5,
            eval_strategy="no",
            optim=optim,
        )
        return hpsweep.Trainer(
            model=model, args=args, train_dataset=Data(200, 1), optimizers=(optimizer, None)
        )

    one = trainer("one", two_groups=False, optim="adamw" if fused else "adamw_torch")
    two, resumed = trainer("two", two_groups=True), trainer("r", False)
    one.train()
    two.train()
    assert len(one.optimizer.param_groups) == 1 and len(two.optimizer.param_groups) == 2
    assert one.optimizer.param_groups[0]["fused"] is fused
    expected = weights(two)
    assert all(torch.equal(expected[k], weights(one)[k]) for k in expected)
    # A checkpoint of the two groups (a sweep cut short before the upgrade) resumes in one, exactly.
    resumed.train(resume_from_checkpoint=str(tmp_path / "two" / "checkpoint-10"))
    assert resumed.optimizer.param_groups[0]["fused"] is fused
    assert all(torch.equal(expected[k], weights(resumed)[k]) for k in expected)


def test_a_tensor_dataset_fetched_a_batch_at_a_time_trains_bit_for_bit_as_sample_by_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = Data(200, 1)
    train, val = (
        torch.utils.data.TensorDataset(data.x, data.y),
        torch.utils.data.TensorDataset(data.x[:50], data.y[:50]),
    )
    fetched = []
    whole_batches = BatchedTensors.__getitems__
    monkeypatch.setattr(
        BatchedTensors,
        "__getitems__",
        lambda self, i: fetched.append(len(i)) or whole_batches(self, i),
    )

    def run(out: str, collator: Any) -> hpsweep.Trainer:
        args = TrainingArguments(
            output_dir=str(tmp_path / out),
            num_train_epochs=2,
            per_device_train_batch_size=16,
            per_device_eval_batch_size=32,
            learning_rate=3e-2,
            disable_progress=True,
            save_strategy="no",
            eval_strategy="epoch",
        )
        trainer = hpsweep.Trainer(
            model_init=Net,
            args=args,
            train_dataset=train,
            eval_dataset=val,
            data_collator=collator,
            compute_metrics=accuracy,
        )
        trainer.train()
        return trainer

    # a collator of one's own
    sample_by_sample = run("samples", lambda features: default_data_collator(features))
    assert fetched == []
    whole = run("batched", None)  # the default collator: the loader takes whole batches
    # two epochs, two evaluations
    assert fetched[:13] == [16] * 12 + [8] and len(fetched) == 2 * 13 + 2 * 2
    expected, got = weights(sample_by_sample), weights(whole)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    # losses and eval metrics
    assert [timeless(h) for h in whole.state.log_history] == [
        timeless(h) for h in sample_by_sample.state.log_history
    ]


def test_the_rng_state_round_trips_and_older_checkpoints_tuple_form_still_loads(
    tmp_path: Path,
) -> None:
    import random

    random.seed(1)
    state = runs.rng_state()
    expected = [random.random() for _ in range(3)], torch.rand(3)
    random.seed(3)
    old = {**state, "python": random.getstate()}  # the tuple of 625 ints checkpoints held before
    expected_old = [random.random() for _ in range(3)]
    torch.save(state, tmp_path / "rng_state.pth")
    torch.save(old, tmp_path / "old.pth")
    loaded = torch.load(tmp_path / "rng_state.pth", weights_only=True)
    # one tensor, not 625 pickled ints
    assert isinstance(loaded["python"]["internal"], torch.Tensor)
    random.seed(2)
    runs.set_rng_state(loaded)
    assert [random.random() for _ in range(3)] == expected[0] and torch.equal(
        torch.rand(3), expected[1]
    )
    random.seed(2)
    runs.set_rng_state(torch.load(tmp_path / "old.pth", weights_only=True))
    assert [random.random() for _ in range(3)] == expected_old


@pytest.mark.parametrize("kw", [{"gradient_accumulation_steps": 2}, {"bf16": True}])
def test_accumulation_and_mixed_precision_keep_accelerates_wrappers(
    tmp_path: Path, kw: dict
) -> None:
    trainer = make_trainer(tmp_path, num_train_epochs=1, save_strategy="no", **kw)
    trainer.train()
    assert not trainer.accelerate_wrappers_skipped
    assert trainer.state.global_step == trainer.state.max_steps


def test_resume_after_background_checkpoints_is_bit_identical(tmp_path: Path) -> None:
    # Data without loading noise: accelerate's loader fetches one batch ahead, so a checkpoint's
    # RNG state already includes the next batch's draws, with or without these fast paths.
    full = make_trainer(tmp_path / "full", save_strategy="steps", save_steps=4)
    full.train()
    expected = weights(full)
    saved = runs.checkpoints(tmp_path / "full")
    # and the last step
    assert [p.name for p in saved] == [f"checkpoint-{s}" for s in (*range(4, 37, 4), 39)]
    for folder in saved:  # whole as soon as train() returned: nothing was still being written
        assert {p.name for p in folder.iterdir()} == CHECKPOINT_FILES
    for step in (4, 16):  # mid-epoch and in a later epoch (13 steps per epoch)
        resumed = make_trainer(tmp_path / f"r{step}", save_strategy="steps", save_steps=4)
        resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{step}"))
        got = weights(resumed)
        assert all(torch.equal(expected[k], got[k]) for k in expected), step
        evals = [
            [timeless(h) for h in t.state.log_history if "eval_loss" in h] for t in (resumed, full)
        ]
        assert evals[0] == evals[1]  # every evaluation, before and after the resume point


def test_the_last_checkpoint_is_written_in_place_and_holds_the_final_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copies: list[bool] = []
    snapshot = runs.snapshot_checkpoint

    def noting(**kwargs: Any) -> runs.CheckpointSnapshot:
        copies.append(kwargs["copy"])
        return snapshot(**kwargs)

    monkeypatch.setattr(runs, "snapshot_checkpoint", noting)
    trainer = make_trainer(tmp_path, save_strategy="epoch")
    trainer.train()
    # Epochs 1 and 2 are copied and written while training goes on; after the last step there is
    # nothing to overlap with, so the last checkpoint is written from the live state, in place.
    assert copies == [True, True, False]
    last = runs.latest_checkpoint(tmp_path)
    assert last is not None and last.name == f"checkpoint-{trainer.state.global_step}"
    assert {p.name for p in last.iterdir()} == CHECKPOINT_FILES
    saved, final = load_file(last / "model.safetensors"), weights(trainer)
    assert saved.keys() == final.keys() and all(torch.equal(saved[k], final[k]) for k in final)


def test_a_sweep_trial_trains_what_a_plain_run_of_its_params_trains(tmp_path: Path) -> None:
    # A trial's model is built before its folder is named (hp_name may read what model_init
    # suggests), then handed to its trainer with the random state that building it left. So
    # retraining the best params by hand, on the trial's threads, gives the best model again, bit
    # for bit: dropout and the shuffled loader draw from that state.
    sweep = make_trainer(tmp_path / "sweep", num_train_epochs=2, save_strategy="epoch")
    sweep.hyperparameter_search(
        hp_space=lambda t: {
            "learning_rate": t.suggest_float("learning_rate", 1e-3, 1e-1, log=True)
        },
        n_trials=2,
        pruner="none",
        seed=0,
        show_progress=False,
    )
    records = runs.read_trials(tmp_path / "sweep")
    assert [r.state for r in records] == ["complete", "complete"]
    threads = torch.get_num_threads()
    for r in records:
        plain = make_trainer(
            tmp_path / f"plain-{r.number}",
            num_train_epochs=2,
            save_strategy="epoch",
            learning_rate=r.params["learning_rate"],
        )
        # on the trial's threads, which the load when it started decided (torch's sums depend on them)
        torch.set_num_threads(r.user_attrs["threads"])
        try:
            plain.train()
        finally:
            torch.set_num_threads(threads)
        trained, swept = (
            weights(plain),
            load_file(Path(r.run_dir) / r.checkpoint / "model.safetensors"),
        )
        assert swept.keys() == trained.keys() and all(
            torch.equal(swept[k], trained[k]) for k in trained
        )


def test_background_rotation_keeps_the_limit_and_the_best(tmp_path: Path) -> None:
    trainer = make_trainer(
        tmp_path,
        save_strategy="steps",
        save_steps=5,
        save_total_limit=2,
        metric_for_best_model="eval_loss",
        greater_is_better=False,
        learning_rate=1.0,
    )
    trainer.train()
    kept = [p.name for p in runs.checkpoints(tmp_path)]
    best = Path(trainer.state.best_model_checkpoint).name
    assert trainer.state.global_step == 39  # checkpoints at 5, 10, ..., 35 and the last step
    assert kept[-2:] == ["checkpoint-35", "checkpoint-39"] and best in kept and len(kept) <= 3


class NotesPaths(hpsweep.Trial):
    """A backend whose reports ignore checkpoints (as Optuna's and W&B's do); it notes what it is told."""

    reads_checkpoints = False

    def __init__(self) -> None:
        super().__init__(0)
        self.paths: list[str | None] = []

    def report(self, step, metrics, objective, checkpoint=None) -> None:
        self.paths.append(checkpoint)


def test_a_trial_that_reads_no_checkpoints_trains_on_while_they_are_written(tmp_path: Path) -> None:
    trial = NotesPaths()
    reporter = TrialReporter(trial, lambda m: m["eval_accuracy"])
    trainer = make_trainer(tmp_path, save_strategy="steps", save_steps=5)
    trainer.add_callback(reporter)
    # so the loop's checkpoints are written in the background
    assert not trainer.callback_handler.reads_checkpoints()
    trainer.train(trial=trial)
    # told at each evaluation (steps 5, 10, ..., 35, and the last, 39, as transformers 5 ends a steps schedule),
    # before its checkpoint is written
    assert trial.paths == [None] * 8
    written = runs.checkpoints(tmp_path)
    assert [p.name for p in written] == [f"checkpoint-{s}" for s in (5, 10, 15, 20, 25, 30, 35, 39)]
    for path in written:  # all on disk, whole, when training returns
        assert {p.name for p in path.iterdir()} == CHECKPOINT_FILES


def test_a_checkpoint_that_cannot_be_written_fails_the_run(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the run's checkpoints should go")
    trainer = make_trainer(blocker, num_train_epochs=1, save_strategy="steps", save_steps=3)
    with pytest.raises(OSError):
        trainer.train()


KILLED_RUN = """
import sys, torch
from torch import nn
import hpsweep
torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(4096, 256), torch.randint(0, 4, (4096,)))
class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 4))
    def forward(self, x, labels):
        return nn.functional.cross_entropy(self.net(x), labels)
args = hpsweep.TrainingArguments(output_dir=sys.argv[1], max_steps=100000, save_strategy="steps", save_steps=1,
                                 save_total_limit=4, eval_strategy="no", logging_strategy="no",
                                 per_device_train_batch_size=8, disable_progress=True)
hpsweep.Trainer(model_init=Wide, args=args, train_dataset=data).train()
"""


def test_a_process_killed_while_writing_leaves_only_whole_checkpoints(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KILLED_RUN), str(out)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while (
            len(runs.checkpoints(out)) < 3 and time.monotonic() < deadline and proc.poll() is None
        ):
            time.sleep(0.05)
        time.sleep(0.13)  # somewhere in the middle of the next write
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    found = runs.checkpoints(out)
    assert len(found) >= 3
    for folder in found:
        assert {p.name for p in folder.iterdir()} == CHECKPOINT_FILES
        state = runs.read_json(folder / "trainer_state.json")
        assert state["global_step"] == int(folder.name.split("-")[1])
    runs.recover_interrupted_swaps(out)
    # temporaries gone
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in found)
