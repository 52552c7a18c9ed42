"""The Python API: the Trainer loop, callbacks, checkpoints and hyperparameter_search as users call them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from support import ROOT, hpsweep_cli, timeless, write_space
from torch import nn

import hpsweep
from hpsweep import runs
from hpsweep.errors import UserError
from hpsweep.train.arguments import TrainingArguments


def data(n: int, seed: int) -> torch.utils.data.TensorDataset:
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    y = (x @ torch.randn(8, 4, generator=torch.Generator().manual_seed(0))).argmax(-1)
    return torch.utils.data.TensorDataset(x, y)


TRAIN, EVAL = data(200, 1), data(100, 2)


class Net(nn.Module):
    def __init__(self, hidden: int = 16, dropout: float = 0.2) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 4)
        )

    def forward(self, x, labels):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def accuracy(p: hpsweep.EvalPrediction) -> dict:
    return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}


def make_trainer(out: Path, callbacks=(), **kw) -> hpsweep.Trainer:
    args = TrainingArguments(
        output_dir=str(out),
        num_train_epochs=kw.pop("num_train_epochs", 3),
        per_device_train_batch_size=32,
        learning_rate=kw.pop("learning_rate", 1e-2),
        disable_progress=True,
        **kw,
    )
    return hpsweep.Trainer(
        model_init=Net,
        args=args,
        train_dataset=TRAIN,
        eval_dataset=EVAL,
        compute_metrics=accuracy,
        callbacks=list(callbacks),
    )


class Recorder(hpsweep.TrainerCallback):
    """Counts events and keeps a counter that must survive a resume."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.steps_seen = 0

    def __getattribute__(self, name: str):
        if name.startswith("on_"):
            events = object.__getattribute__(self, "events")

            def record(args, state, control, **kwargs):
                events.append(name)
                if name == "on_step_end":
                    self.steps_seen += 1

            return record
        return object.__getattribute__(self, name)

    def state_dict(self):
        return {"steps_seen": self.steps_seen}

    def load_state_dict(self, state):
        self.steps_seen = state["steps_seen"]


for _event in hpsweep.train.callbacks.EVENTS:  # overriding every event, as a user subclass would
    setattr(Recorder, _event, lambda self, *a, **k: None)


def test_train_fires_every_event_and_steps_follow_the_arguments(tmp_path: Path) -> None:
    rec = Recorder()
    trainer = make_trainer(tmp_path, [rec], gradient_accumulation_steps=2)
    out = trainer.train()
    steps_per_epoch = -(-7 // 2)  # ceil(200/32)=7 batches, 2 per optimizer step
    assert out.global_step == 3 * steps_per_epoch == trainer.state.global_step
    assert rec.events.count("on_step_end") == out.global_step
    assert rec.events.count("on_substep_end") == 3 * 7 - out.global_step
    assert rec.events.count("on_evaluate") == 3 and rec.events.count("on_save") == 3
    assert set(hpsweep.train.callbacks.EVENTS) - {"on_exception", "on_predict"} <= set(rec.events)
    assert rec.events[:2] == ["on_init_end", "on_train_begin"] and rec.events[-1] == "on_train_end"
    assert out.metrics["eval_accuracy"] > 0.5


def test_resume_reproduces_an_uninterrupted_run_bit_for_bit(tmp_path: Path) -> None:
    full = make_trainer(tmp_path / "full", [Recorder()], save_strategy="steps", save_steps=4)
    full.train()
    expected = {k: v.clone() for k, v in full.model.state_dict().items()}
    for step in (4, 12):  # mid-epoch and across an epoch boundary (7 steps per epoch)
        rec = Recorder()
        resumed = make_trainer(tmp_path / f"r{step}", [rec], save_strategy="steps", save_steps=4)
        resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{step}"))
        got = resumed.model.state_dict()
        assert all(torch.equal(expected[k], got[k]) for k in expected), step
        assert resumed.state.global_step == full.state.global_step
        # callback state came back with the checkpoint
        assert rec.steps_seen == full.state.global_step
        assert timeless(resumed.state.evaluations()[-1]) == timeless(full.state.evaluations()[-1])


class StepCounter(hpsweep.TrainerCallback):
    """Counts the steps divisible by ``every``: two of them in one trainer keep different counts."""

    def __init__(self, every: int) -> None:
        self.every, self.count = every, 0

    def on_step_end(self, args, state, control, **kwargs):
        self.count += state.global_step % self.every == 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_two_callbacks_of_one_class_each_get_their_own_state_back_on_resume(tmp_path: Path) -> None:
    full = [StepCounter(1), StepCounter(3)]
    make_trainer(tmp_path / "full", full, save_strategy="steps", save_steps=4).train()
    resumed = [StepCounter(1), StepCounter(3)]
    make_trainer(tmp_path / "resumed", resumed, save_strategy="steps", save_steps=4).train(
        resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-8")
    )
    # 3 epochs of 7 steps
    assert [cb.count for cb in resumed] == [cb.count for cb in full] == [21, 7]


def test_save_total_limit_rotates_but_keeps_the_best(tmp_path: Path) -> None:
    trainer = make_trainer(
        tmp_path,
        num_train_epochs=6,
        learning_rate=0.3,
        save_total_limit=1,
        metric_for_best_model="eval_loss",
        greater_is_better=False,
    )
    trainer.train()
    kept = [p.name for p in runs.checkpoints(tmp_path)]
    best = Path(trainer.state.best_model_checkpoint).name
    assert best in kept and f"checkpoint-{trainer.state.global_step}" in kept and len(kept) <= 2
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert trainer.state.best_metric == min(h["eval_loss"] for h in evals)


def test_train_reports_transformers_train_metrics_and_saves_metric_files(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, num_train_epochs=2, gradient_accumulation_steps=2)
    out = trainer.train()
    metrics = out.metrics
    assert metrics["train_loss"] == out.training_loss and metrics["epoch"] == 2.0
    assert metrics["eval_accuracy"] == trainer.state.eval_metrics()["eval_accuracy"]
    # 32 samples a batch, 2 batches an optimizer step
    assert metrics["train_samples_per_second"] / metrics["train_steps_per_second"] == pytest.approx(
        64, rel=0.01
    )
    trainer.save_metrics("train", metrics, combined=False)
    assert json.loads((tmp_path / "train_results.json").read_text()) == metrics
    assert not (tmp_path / "all_results.json").exists()
    trainer.save_metrics("eval", {"eval_a": 1.0})
    # numpy scalars, as metrics often are
    trainer.save_metrics("test", {"test_b": 2, "test_c": np.float32(0.5)})
    assert json.loads((tmp_path / "all_results.json").read_text()) == {
        "eval_a": 1.0,
        "test_b": 2,
        "test_c": 0.5,
    }
    assert trainer.is_world_process_zero() and trainer.is_local_process_zero()


def test_load_best_model_at_end_restores_the_best_weights(tmp_path: Path) -> None:
    trainer = make_trainer(
        tmp_path,
        num_train_epochs=5,
        learning_rate=0.5,
        load_best_model_at_end=True,
        metric_for_best_model="eval_accuracy",
        greater_is_better=True,
    )
    out = trainer.train()
    assert out.metrics["eval_accuracy"] == trainer.state.best_metric
    assert trainer.evaluate()["eval_accuracy"] == pytest.approx(trainer.state.best_metric)


def test_early_stopping_stops_when_the_metric_stalls(tmp_path: Path) -> None:
    stopper = hpsweep.EarlyStoppingCallback(early_stopping_patience=2)
    trainer = make_trainer(
        tmp_path,
        [stopper],
        num_train_epochs=50,
        learning_rate=1e-6,
        metric_for_best_model="eval_accuracy",
        greater_is_better=True,
    )
    trainer.train()
    assert trainer.state.epoch < 50 and stopper.bad_evaluations == 2


def test_early_stopping_starts_each_run_afresh(tmp_path: Path) -> None:
    """A sweep hands the same callback instances to every trial: the patience of a trial must not
    count against an earlier trial's best. A second run of one trainer stops where a fresh one does."""
    stopper = hpsweep.EarlyStoppingCallback(early_stopping_patience=2)
    trainer = make_trainer(
        tmp_path / "twice",
        [stopper],
        num_train_epochs=50,
        learning_rate=0.5,
        metric_for_best_model="eval_accuracy",
        greater_is_better=True,
    )
    trainer.train()  # learns: its best is far above what the next run reaches
    trainer.args.learning_rate = 1e-7
    trainer.args.output_dir = str(tmp_path / "second")
    trainer.train()
    fresh = make_trainer(
        tmp_path / "fresh",
        [hpsweep.EarlyStoppingCallback(early_stopping_patience=2)],
        num_train_epochs=50,
        learning_rate=1e-7,
        metric_for_best_model="eval_accuracy",
        greater_is_better=True,
    )
    fresh.train()
    # the best at epoch 1, then 2 without a gain
    assert trainer.state.global_step == fresh.state.global_step == 3 * 7
    # ... while a resumed run keeps its count: from epoch 2's checkpoint (one without a gain), one more.
    resumed = make_trainer(
        tmp_path / "fresh",
        [hpsweep.EarlyStoppingCallback(early_stopping_patience=2)],
        num_train_epochs=50,
        learning_rate=1e-7,
        metric_for_best_model="eval_accuracy",
        greater_is_better=True,
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "fresh" / "checkpoint-14"))
    assert resumed.state.global_step == 3 * 7


def test_metric_callback_adds_a_non_differentiable_metric(tmp_path: Path) -> None:
    errors = hpsweep.MetricCallback(lambda p, y: float((p.argmax(-1) != y).sum()), name="errors")
    trainer = make_trainer(tmp_path, [errors], num_train_epochs=1)
    metrics = trainer.train().metrics
    assert metrics["eval_errors"] == pytest.approx(round((1 - metrics["eval_accuracy"]) * 100))


def test_bf16_mixed_precision_trains_through_the_same_loop(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, num_train_epochs=2, bf16=True)
    out = trainer.train()
    assert trainer.accelerator.mixed_precision == "bf16"
    assert out.metrics["eval_accuracy"] > 0.4
    weights = json.loads(
        (tmp_path / f"checkpoint-{out.global_step}" / "training_args.json").read_text()
    )
    assert weights["mixed_precision"] == "bf16"


def test_lr_schedules_follow_warmup_and_decay(tmp_path: Path) -> None:
    for kind, check in [
        ("linear", lambda lrs: lrs[-1] < lrs[len(lrs) // 2] < max(lrs)),
        ("constant", lambda lrs: len(set(lrs)) == 1),
        ("cosine", lambda lrs: lrs[-1] < 1e-4),
    ]:
        trainer = make_trainer(
            tmp_path / kind,
            num_train_epochs=2,
            lr_scheduler_type=kind,
            warmup_steps=3,
            logging_strategy="steps",
            logging_steps=1,
        )
        trainer.train()
        lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
        assert len(lrs) == 14 and check(lrs), (kind, lrs)
        if kind != "constant":
            assert lrs[0] < lrs[2]  # warming up


def test_hyperparameter_search_api_with_hf_style_define_by_run(tmp_path: Path) -> None:
    """Code written for HF's Trainer.hyperparameter_search moves over with the import changed."""

    def model_init(trial):
        hidden = trial.suggest_int("hidden", 4, 32, log=True) if trial is not None else 16
        return Net(hidden=hidden)

    def hp_space(trial):
        return {
            "learning_rate": trial.suggest_float("learning_rate", 1e-3, 1e-1, log=True),
            "num_train_epochs": trial.suggest_int("num_train_epochs", 1, 2),
        }

    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=32, disable_progress=True
    )
    trainer = hpsweep.Trainer(
        model_init=model_init,
        args=args,
        train_dataset=TRAIN,
        eval_dataset=EVAL,
        compute_metrics=accuracy,
    )
    best = trainer.hyperparameter_search(
        hp_space=hp_space,
        n_trials=3,
        direction="maximize",
        compute_objective=lambda m: m["eval_accuracy"],
        show_progress=False,
    )
    assert isinstance(best, hpsweep.BestRun)
    assert set(best.hyperparameters) == {"learning_rate", "num_train_epochs", "hidden"}
    assert Path(best.checkpoint, "model.safetensors").exists()
    record = next(r for r in runs.read_trials(tmp_path) if r.id == best.run_id)
    assert record.objective == best.objective == record.metrics["eval_accuracy"]


def test_hp_space_is_refused_for_grid_search(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path)
    with pytest.raises(UserError, match="grid"):
        trainer.hyperparameter_search(hp_space=lambda t: {}, sampler="grid", show_progress=False)
    assert not any(tmp_path.iterdir())


def test_config_file_and_set_override_the_space_file(tmp_path: Path) -> None:
    space = write_space(
        tmp_path, space='{"hidden": hpsweep.Categorical([8])}', extra_args=", seed=1"
    )
    config = tmp_path / "args.yaml"
    config.write_text("learning_rate: 0.05\nseed: 7\nnum_train_epochs: 3\n")
    hpsweep_cli(
        "run",
        space,
        "--n-trials",
        "1",
        "--config",
        config,
        "--set",
        "seed=11",
        "--set",
        "save_strategy=no",
        check=True,
    )
    record = runs.read_trials(tmp_path / "out")[0]
    args = json.loads((Path(record.run_dir) / record.checkpoint / "training_args.json").read_text())
    assert (args["learning_rate"], args["seed"], args["num_train_epochs"]) == (0.05, 11, 3.0)
    assert args["save_strategy"] == "no"  # a string field keeps the text YAML would read as False
    # only the final one
    assert [p.name for p in runs.checkpoints(Path(record.run_dir))] == ["checkpoint-24"]


def test_eval_delay_skips_the_early_evaluations_and_the_trial_keeps_its_objective(
    tmp_path: Path,
) -> None:
    space = write_space(tmp_path, epochs=2)
    hpsweep_cli(
        "run",
        space,
        "--n-trials",
        "2",
        "--set",
        "eval_delay=2",
        "--set",
        "logging_first_step=true",
        check=True,
    )
    for record in runs.read_trials(tmp_path / "out"):
        assert record.state == "complete" and record.objective == record.metrics["eval_accuracy"]
        assert [entry["epoch"] for entry in record.history] == [2.0]  # epoch 1 was not evaluated


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(per_device_train_batch_size=0), "must be > 0"),
        (dict(eval_strategy="sometimes"), "not one of no, steps, epoch"),
        (dict(save_strategy="steps", save_steps=0), "save_steps"),
        (dict(warmup_ratio=1.5), "[0, 1)"),
        (dict(eval_delay=-1), "eval_delay=-1.0 is negative; give a value >= 0"),
        (dict(fp16=True, bf16=True), "choose one"),
        (dict(load_best_model_at_end=True, eval_strategy="no"), "load_best_model_at_end"),
        (dict(num_train_epochs="three"), "not a valid float"),
    ],
)
def test_training_arguments_are_validated_on_construction(bad: dict, message: str) -> None:
    with pytest.raises(UserError, match=None) as info:
        TrainingArguments(**bad)
    assert message in str(info.value)


def test_hf_transformers_space_pushes_a_from_pretrained_model(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    hpsweep_cli(
        "run",
        ROOT / "search_spaces" / "hf_text_classifier.py",
        "--n-trials",
        "2",
        "--output-dir",
        tmp_path,
        "--set",
        "num_train_epochs=1",
        check=True,
    )
    best = json.loads((tmp_path / "best_run.json").read_text())
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "best")
    assert model.config.hidden_size == best["hyperparameters"]["hidden_size"]
    assert (tmp_path / "best" / "config.json").exists() and (
        tmp_path / "best" / "model.safetensors"
    ).exists()


# the first step is skipped
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_an_fp16_gradient_scaler_comes_back_with_its_checkpoint(tmp_path: Path) -> None:
    # accelerate makes no GradScaler on the CPU (fp16 needs a GPU there: tests/test_gpu.py runs the
    # whole trial), so this drives torch's own CPU scaler through the checkpoint code. A loss scaled
    # by 1e30 (and a learning rate divided by it) puts float32's limit where fp16's is for a real
    # fp16 run: the scale backs off on overflowing steps, which are skipped, and grows after 2 good
    # ones. A resumed run with a fresh scaler would skip other steps and end elsewhere.
    big = 1e30

    def start() -> tuple[nn.Module, torch.optim.Optimizer, object, torch.amp.GradScaler]:
        torch.manual_seed(0)
        model = Net(dropout=0.0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1 / big)
        return (
            model,
            optimizer,
            torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
            torch.amp.GradScaler("cpu", init_scale=2.0**30, growth_interval=2),
        )

    x, y = TRAIN.tensors

    def steps(model, optimizer, scheduler, scaler, first: int, last: int) -> None:
        for i in range(first, last):
            batch = slice(32 * (i % 6), 32 * (i % 6 + 1))
            optimizer.zero_grad()
            scaler.scale(model(x[batch], y[batch])["loss"] * big).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()

    full = start()
    steps(*full, 0, 3)
    runs.write_checkpoint(
        tmp_path / "checkpoint-3",
        model=full[0],
        optimizer=full[1],
        scheduler=full[2],
        state={"global_step": 3},
        args={},
        scaler=full[3],
    )
    steps(*full, 3, 12)

    # plain JSON, no pickle
    saved = json.loads((tmp_path / "checkpoint-3" / runs.SCALER_FILE).read_text())
    # backed off twice, then one good step
    assert saved["scale"] == 2.0**28 and saved["_growth_tracker"] == 1

    def resumed(restore_scaler: bool) -> tuple:
        run = start()
        runs.read_checkpoint(
            tmp_path / "checkpoint-3",
            model=run[0],
            optimizer=run[1],
            scheduler=run[2],
            scaler=run[3] if restore_scaler else None,
        )
        steps(*run, 3, 12)
        return run

    run = resumed(restore_scaler=True)
    assert run[3].state_dict() == full[3].state_dict()
    assert all(
        torch.equal(a, b)
        for a, b in zip(run[0].state_dict().values(), full[0].state_dict().values())
    )
    fresh = resumed(restore_scaler=False)  # what resuming did before the scaler was saved
    assert not all(
        torch.equal(a, b)
        for a, b in zip(fresh[0].state_dict().values(), full[0].state_dict().values())
    )


# inside torch's compiler
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")
def test_torch_compile_trains_the_compiled_model_and_saves_the_modules_own_weights(
    tmp_path: Path,
) -> None:
    from safetensors.torch import load_file

    trainer = make_trainer(tmp_path, num_train_epochs=2, torch_compile=True)
    out = trainer.train()
    # accelerate compiled it
    assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    assert trainer.args.torch_compile_backend == "inductor"  # transformers' default backend
    saved = load_file(tmp_path / f"checkpoint-{out.global_step}" / "model.safetensors")
    # no "_orig_mod." prefix: loads into the plain module
    assert set(saved) == set(trainer.model.state_dict())
    eager = Net()
    eager.load_state_dict(saved)
    eager.eval()
    with torch.no_grad():
        x, y = EVAL.tensors
        expected = nn.functional.cross_entropy(eager.net(x), y).item()
    # the compiled model is the saved one
    assert out.metrics["eval_loss"] == pytest.approx(expected, rel=1e-4)


def test_full_determinism_turns_on_deterministic_algorithms_as_transformers_does(
    tmp_path: Path, monkeypatch
) -> None:
    import os

    for name in (
        "CUDA_LAUNCH_BLOCKING",
        "CUBLAS_WORKSPACE_CONFIG",
        "FLASH_ATTENTION_DETERMINISTIC",
    ):
        # restored after the test, as the process-wide switch below
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", torch.backends.cudnn.deterministic)
    try:
        runs_ = [
            make_trainer(tmp_path / str(i), num_train_epochs=1, full_determinism=True).train()
            for i in range(2)
        ]
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert (
            os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8" and not torch.backends.cudnn.benchmark
        )
        assert runs_[0].training_loss == runs_[1].training_loss
    finally:
        torch.use_deterministic_algorithms(False)
