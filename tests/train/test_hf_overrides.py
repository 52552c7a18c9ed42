"""transformers' override points: a `Trainer` subclass that replaces `create_optimizer_and_scheduler`,
`create_optimizer`, `get_train_dataloader`, `get_eval_dataloader` / `get_test_dataloader`,
`training_step` or `prediction_step`, as Hugging Face users write them, trains with its own
methods, alone and in every trial of a sweep."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import optuna
import pytest
import torch
from support import timeless
from support.hf_models import Net, accuracy, args, rows
from torch.utils.data import DataLoader

import hpsweep
import hpsweep.train.data
from hpsweep import UserError


def trained(trainer: hpsweep.Trainer) -> dict[str, torch.Tensor]:
    trainer.train()
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


class MomentumSGD(hpsweep.Trainer):
    """Hugging Face's advice for a custom optimizer with model_init: build it for each run's model."""

    built: list[tuple[float, int]] = []

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        self.optimizer = torch.optim.SGD(
            self.model.parameters(), lr=self.args.learning_rate, momentum=0.9
        )
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)
        MomentumSGD.built.append((self.args.learning_rate, num_training_steps))


def test_a_custom_optimizer_for_every_trial_of_a_sweep(tmp_path: Path) -> None:
    MomentumSGD.built = []
    trainer = MomentumSGD(
        model_init=lambda trial: Net(),
        args=args(tmp_path, num_train_epochs=1, save_strategy="epoch"),
        train_dataset=rows(96, 1),
        eval_dataset=rows(64, 2),
        compute_metrics=accuracy,
    )
    trainer.hyperparameter_search(
        space={"learning_rate": hpsweep.Float(1e-3, 1e-1, log=True)},
        n_trials=3,
        direction="maximize",
        show_progress=False,
    )
    trials = sorted(
        (json.loads(p.read_text()) for p in tmp_path.glob("*/trial.json")),
        key=lambda r: r["number"],
    )
    assert [lr for lr, _ in MomentumSGD.built] == [t["params"]["learning_rate"] for t in trials]
    assert all(steps == 6 for _, steps in MomentumSGD.built)  # 96 rows in batches of 16, one epoch
    # every trial's checkpoint holds SGD's state (a momentum buffer), not AdamW's moments
    saved = [torch.load(f, weights_only=True) for f in tmp_path.glob("*/checkpoint-6/optimizer.pt")]
    assert len(saved) == 3 and all(opt["state"] for opt in saved)
    assert all(set(s) == {"momentum_buffer"} for opt in saved for s in opt["state"].values())


def test_without_an_override_optimizers_with_model_init_names_the_override(tmp_path: Path) -> None:
    sgd = torch.optim.SGD(Net().parameters(), lr=0.1)
    with pytest.raises(UserError, match="create_optimizer_and_scheduler"):
        hpsweep.Trainer(model_init=Net, args=args(tmp_path), optimizers=(sgd, None))


def test_create_optimizer_alone_gets_the_default_schedule(tmp_path: Path) -> None:
    class Plain(hpsweep.Trainer):
        def create_optimizer(self):
            if self.optimizer is None:
                self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.2)
            return self.optimizer

    trainer = Plain(
        model_init=Net,
        args=args(tmp_path, eval_strategy="no", logging_strategy="steps", logging_steps=1),
        train_dataset=rows(64, 1),
    )
    trainer.train()
    assert type(trainer.optimizer.optimizer) is torch.optim.SGD
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    # linear decay from SGD's lr
    assert lrs[0] == pytest.approx(0.2 * (1 - 1 / 8)) and lrs[-1] == pytest.approx(0.0)
    first = trainer.optimizer
    trainer.train()  # a second run builds its own optimizer, over the new model
    assert trainer.optimizer is not first and trainer.optimizer.optimizer.param_groups[0]["params"][
        0
    ] is next(trainer.model.parameters())


@pytest.mark.parametrize("prepare", [False, True], ids=["plain", "prepared"])
def test_get_train_dataloader_decides_the_batches(tmp_path: Path, prepare: bool) -> None:
    seen: list[int] = []

    class Batches(hpsweep.Trainer):
        def get_train_dataloader(self):
            loader = DataLoader(
                self.train_dataset, batch_size=8, shuffle=True, collate_fn=self.collate
            )
            return self.accelerator.prepare(loader) if prepare else loader

        def collate(self, features):
            seen.append(len(features))
            return hpsweep.train.data.default_data_collator(features)

    trainer = Batches(
        model_init=Net,
        args=args(tmp_path, eval_strategy="no", num_train_epochs=2),
        train_dataset=rows(40, 1),
    )
    start = trainer.call_model_init()
    out = trainer.train()
    assert out.global_step == 10 and set(seen) == {
        8
    }  # 40 rows in batches of 8 (not 16), two epochs
    assert not torch.equal(start.net[0].weight, trainer.model.net[0].weight)


def test_get_eval_and_test_dataloaders_decide_what_is_evaluated(tmp_path: Path) -> None:
    class FirstHalf(hpsweep.Trainer):
        def get_eval_dataloader(self, eval_dataset=None):
            data = eval_dataset if eval_dataset is not None else self.eval_dataset
            return DataLoader(
                data[: len(data) // 2],
                batch_size=10,
                collate_fn=hpsweep.train.data.default_data_collator,
            )

        def get_test_dataloader(self, test_dataset):
            return self.get_eval_dataloader(test_dataset[:6])

    counted: list[int] = []

    def count(p: hpsweep.EvalPrediction) -> dict:
        counted.append(len(p.label_ids))
        return accuracy(p)

    trainer = FirstHalf(
        model_init=Net,
        args=args(tmp_path, eval_strategy="epoch"),
        train_dataset=rows(64, 1),
        eval_dataset=rows(40, 2),
        compute_metrics=count,
    )
    trainer.train()
    assert counted == [20, 20]  # each epoch's evaluation saw the override's half
    assert len(trainer.predict(rows(40, 3)).predictions) == 3  # half of the first 6


def test_an_hf_style_training_step_trains_the_same_weights(tmp_path: Path) -> None:
    class HFStyle(hpsweep.Trainer):
        steps = 0

        def training_step(self, model, inputs, num_items_in_batch=None):
            HFStyle.steps += 1
            model.train()
            with self.compute_loss_context_manager():  # as transformers' own training_step reads
                loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
            self.accelerator.backward(loss)
            return 2 * loss.detach()  # what the loop logs

    def run(cls: type, out: Path) -> tuple[dict, list[float]]:
        trainer = cls(
            model_init=Net,
            args=args(out, eval_strategy="no", logging_strategy="steps", logging_steps=2),
            train_dataset=rows(64, 1),
        )
        weights = trained(trainer)
        return weights, [h["loss"] for h in trainer.state.log_history if "loss" in h]

    default_weights, default_losses = run(hpsweep.Trainer, tmp_path / "default")
    weights, losses = run(HFStyle, tmp_path / "override")
    assert HFStyle.steps == 8  # 64 rows, batches of 16, two epochs
    assert all(torch.equal(default_weights[k], weights[k]) for k in weights)
    assert losses == pytest.approx([2 * x for x in default_losses], rel=1e-5)


def test_prediction_step_decides_what_compute_metrics_gets(tmp_path: Path) -> None:
    class Ids(hpsweep.Trainer):
        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            loss, logits, labels = super().prediction_step(
                model, inputs, prediction_loss_only, ignore_keys
            )
            return (
                loss,
                logits.argmax(-1),
                labels,
            )  # ids, as a generating Seq2SeqTrainer hands them over

    seen: list[tuple] = []

    def ids_accuracy(p: hpsweep.EvalPrediction) -> dict:
        seen.append(p.predictions.shape)
        return {"accuracy": float((p.predictions == p.label_ids).mean())}

    common = dict(
        model_init=Net, args=args(tmp_path, eval_strategy="no"), train_dataset=rows(64, 1)
    )
    ids = Ids(**common, compute_metrics=ids_accuracy)
    plain = hpsweep.Trainer(**common, compute_metrics=accuracy)
    ids.train(), plain.train()
    data = rows(40, 2)
    # same loss, same accuracy from the ids
    assert timeless(ids.evaluate(data)) == pytest.approx(timeless(plain.evaluate(data)))
    assert seen == [(40,)]
    assert np.array_equal(ids.predict(data).predictions, plain.predict(data).predictions.argmax(-1))


def test_a_log_override_with_transformers_signature_sees_every_log(tmp_path: Path) -> None:
    class Logged(hpsweep.Trainer):
        seen: list[dict] = []

        def log(self, logs, start_time=None):
            Logged.seen.append(dict(logs))
            super().log(logs, start_time)

    trainer = Logged(
        model_init=Net,
        args=args(tmp_path, eval_strategy="epoch"),
        train_dataset=rows(64, 1),
        eval_dataset=rows(32, 2),
    )
    trainer.train()
    # per epoch, the training loss, then the evaluation's metrics (evaluate logs them, as transformers' does);
    # at the end, the run's summary
    assert [sorted(timeless(x)) for x in Logged.seen] == [
        ["grad_norm", "learning_rate", "loss"],
        ["eval_loss"],
    ] * 2 + [["train_loss"]]
    assert [
        {k: v for k, v in h.items() if k not in ("epoch", "step")}
        for h in trainer.state.log_history
    ] == Logged.seen


def test_callbacks_are_added_popped_and_removed_as_in_transformers_and_reach_every_trial(
    tmp_path: Path,
) -> None:
    class Count(hpsweep.TrainerCallback):
        def __init__(self) -> None:
            self.trainings = 0

        def on_train_begin(self, args, state, control, **kwargs):
            self.trainings += 1

    class Never(hpsweep.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            raise AssertionError("a removed callback was called")

    trainer = hpsweep.Trainer(
        model_init=lambda trial: Net(),
        args=args(tmp_path, eval_strategy="epoch"),
        train_dataset=rows(64, 1),
        eval_dataset=rows(32, 2),
        compute_metrics=accuracy,
        callbacks=[Never],
    )
    # a class is instantiated, here as in the constructor, as transformers does
    trainer.add_callback(Count)
    count = trainer.callback_handler.callbacks[-1]
    assert isinstance(count, Count)
    # as transformers warns
    with pytest.warns(UserWarning, match="already has a Count; both will run"):
        trainer.add_callback(Count)
    trainer.remove_callback(trainer.callback_handler.callbacks[-1])
    never = trainer.pop_callback(Never)  # the first of a class, returned
    assert isinstance(never, Never) and trainer.pop_callback(Never) is None
    trainer.add_callback(never)
    trainer.remove_callback(never)  # an instance
    assert not any(isinstance(cb, Never) for cb in trainer.callback_handler.callbacks)
    trainer.hyperparameter_search(
        space={"learning_rate": hpsweep.Float(1e-3, 1e-1, log=True)},
        n_trials=2,
        direction="maximize",
        show_progress=False,
    )
    # a callback added after construction is in every trial, as in transformers
    assert count.trainings == 2


class GroupedAdamW(hpsweep.Trainer):
    """The custom optimizer of transformers' docs and of many a fine-tuning script: its own param
    groups from get_decay_parameter_names, its class and arguments from get_optimizer_cls_and_kwargs."""

    def create_optimizer(self):
        decay = self.get_decay_parameter_names(self.model)
        params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [
            {
                "params": [p for n, p in params if n in decay],
                "weight_decay": self.args.weight_decay,
            },
            {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0},
        ]
        optimizer_cls, optimizer_kwargs = hpsweep.Trainer.get_optimizer_cls_and_kwargs(
            self.args, self.model
        )
        self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer


def test_transformers_custom_optimizer_recipe_trains_as_the_default_optimizer(
    tmp_path: Path,
) -> None:
    common = dict(model_init=Net, train_dataset=rows(96, 1))
    custom = GroupedAdamW(
        **common, args=args(tmp_path / "custom", weight_decay=0.1, eval_strategy="no")
    )
    default = hpsweep.Trainer(
        **common, args=args(tmp_path / "default", weight_decay=0.1, eval_strategy="no")
    )
    got, expected = trained(custom), trained(default)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    # the default's kernel, with the model given
    assert custom.optimizer.defaults.get("fused") is True
    assert [g["weight_decay"] for g in custom.optimizer.param_groups] == [0.1, 0.0]


def test_decay_parameter_names_follow_transformers_rule(tmp_path: Path) -> None:
    import transformers
    from transformers import BertConfig, BertForSequenceClassification

    bert = BertForSequenceClassification(
        BertConfig(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
        )
    )
    odd = torch.nn.ModuleDict(
        {
            "proj": torch.nn.Linear(4, 4),
            "ln": torch.nn.LayerNorm(4),
            "bn": torch.nn.BatchNorm1d(4),
            "final_norm": torch.nn.Linear(4, 4),
        }
    )
    for model in (bert, odd):
        ours = hpsweep.Trainer.get_decay_parameter_names(None, model)
        assert sorted(ours) == sorted(transformers.Trainer.get_decay_parameter_names(None, model))
    assert sorted(hpsweep.Trainer.get_decay_parameter_names(None, odd)) == [
        "bn.weight",
        "proj.weight",
    ]
    # the default optimizer decays the same params
    trainer = hpsweep.Trainer(model=odd, args=args(tmp_path, weight_decay=0.1, eval_strategy="no"))
    decayed, not_decayed = trainer.create_optimizer().param_groups
    assert [id(p) for p in decayed["params"]] == [id(odd["proj"].weight), id(odd["bn"].weight)]
    assert decayed["weight_decay"] == 0.1 and not_decayed["weight_decay"] == 0.0


def test_a_transformers_callback_hears_every_event_it_overrides(tmp_path: Path) -> None:
    import transformers

    # transformers' own base class, names and signatures
    class Events(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.events: list[str] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.events.append("step_begin")

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.events.append("pre_optimizer_step")

        def on_optimizer_step(self, args, state, control, **kwargs):
            self.events.append("optimizer_step")

        def on_prediction_step(self, args, state, control, **kwargs):
            self.events.append("prediction_step")

        def on_evaluate(self, args, state, control, metrics, **kwargs):
            self.events.append("evaluate")

    class Legacy(hpsweep.TrainerCallback):  # hpsweep 0.1's name for on_pre_optimizer_step
        calls = 0

        def on_before_optimizer_step(self, args, state, control, **kwargs):
            Legacy.calls += 1

    events = Events()
    trainer = hpsweep.Trainer(
        model_init=Net,
        args=args(tmp_path, eval_strategy="epoch", save_strategy="epoch", num_train_epochs=2),
        train_dataset=rows(64, 1),
        eval_dataset=rows(40, 2),
        callbacks=[events, Legacy()],
    )
    trainer.train()
    assert (
        tmp_path / "checkpoint-8" / "model.safetensors"
    ).is_file()  # checkpoints with a transformers callback
    # per epoch: 4 steps (64 rows in batches of 16), then an evaluation of 2 batches (40 rows in batches of 32)
    epoch = (
        ["step_begin", "pre_optimizer_step", "optimizer_step"] * 4
        + ["prediction_step"] * 2
        + ["evaluate"]
    )
    assert events.events == epoch * 2
    assert Legacy.calls == trainer.state.global_step == 8
    events.events.clear()
    trainer.predict(rows(70, 3))
    assert events.events == ["prediction_step"] * 3


def test_callbacks_get_the_model_optimizer_and_loaders_as_transformers_hands_them(
    tmp_path: Path,
) -> None:
    import transformers

    class Keeps(transformers.TrainerCallback):
        def on_train_begin(
            self,
            args,
            state,
            control,
            model=None,
            optimizer=None,
            lr_scheduler=None,
            train_dataloader=None,
            **kwargs,
        ):
            self.begin = (model, optimizer, lr_scheduler, len(train_dataloader))

        def on_evaluate(self, args, state, control, metrics=None, eval_dataloader=None, **kwargs):
            self.eval_batches = len(eval_dataloader)

        def on_train_end(self, args, state, control, model=None, processing_class=None, **kwargs):
            self.end = (model, processing_class)

    keeps = Keeps()
    trainer = hpsweep.Trainer(
        model_init=Net,
        args=args(tmp_path, eval_strategy="epoch"),
        train_dataset=rows(64, 1),
        eval_dataset=rows(40, 2),
        callbacks=[keeps],
    )
    trainer.train()
    model, optimizer, scheduler, train_batches = keeps.begin
    assert model is trainer.model and isinstance(model, Net)
    assert optimizer is trainer.optimizer and scheduler is trainer.lr_scheduler
    assert (train_batches, keeps.eval_batches) == (
        4,
        2,
    )  # 64 rows in batches of 16; 40 in batches of 32
    assert keeps.end == (trainer.model, None)


def test_trainer_state_holds_what_transformers_callbacks_read(tmp_path: Path) -> None:
    import transformers

    class Seen(transformers.TrainerCallback):
        states: list[tuple] = []

        def on_train_end(self, args, state, control, **kwargs):
            Seen.states.append(
                (
                    state.is_world_process_zero,
                    state.is_local_process_zero,
                    state.is_hyper_param_search,
                    state.trial_name,
                    state.best_global_step,
                    state.train_batch_size,
                )
            )

    trainer = hpsweep.Trainer(
        model_init=lambda trial: Net(),
        args=args(
            tmp_path / "alone",
            eval_strategy="epoch",
            save_strategy="epoch",
            metric_for_best_model="eval_loss",
        ),
        train_dataset=rows(64, 1),
        eval_dataset=rows(32, 2),
        callbacks=[Seen],
    )
    trainer.train()
    best_step = int(trainer.state.best_model_checkpoint.rpartition("-")[2])
    assert Seen.states == [(True, True, False, None, best_step, 16)]
    trainer.args.output_dir = str(tmp_path / "sweep")
    trainer.hyperparameter_search(
        space={"learning_rate": hpsweep.Float(1e-3, 1e-1, log=True)},
        n_trials=2,
        show_progress=False,
    )
    trials = Seen.states[1:]
    assert all(searching for _, _, searching, *_ in trials)
    # a trial's name is its run folder's
    assert [name for _, _, _, name, *_ in trials] == [
        Path(r.run_dir).name for r in hpsweep.runs.read_trials(tmp_path / "sweep")
    ]


def test_transformers_own_callbacks_run_on_hpsweeps_trainer(tmp_path: Path, capsys) -> None:
    import transformers

    stop = transformers.EarlyStoppingCallback(early_stopping_patience=2)
    run_args = args(
        tmp_path,
        eval_strategy="epoch",
        save_strategy="epoch",
        num_train_epochs=20,
        load_best_model_at_end=True,
        metric_for_best_model="eval_accuracy",
        greater_is_better=True,
    )
    # learns nothing: the accuracy never improves on the first evaluation's
    run_args.learning_rate = 1e-7
    trainer = hpsweep.Trainer(
        model_init=Net,
        args=run_args,
        train_dataset=rows(64, 1),
        eval_dataset=rows(32, 2),
        compute_metrics=accuracy,
        callbacks=[stop, transformers.ProgressCallback],
    )
    trainer.train()
    # the best at epoch 1, then 2 evaluations without a gain
    assert trainer.state.global_step == 3 * 4
    assert stop.early_stopping_patience_counter == 2
    # transformers' progress bar printed the logs
    assert "'eval_accuracy'" in capsys.readouterr().out


def test_a_resumed_run_keeps_transformers_early_stopping_counter(tmp_path: Path) -> None:
    """transformers' EarlyStoppingCallback keeps its patience counter as an ExportableState: a run
    resumed from a checkpoint stops where the uninterrupted run stopped, not a patience later."""
    import transformers

    def trainer(folder: str) -> hpsweep.Trainer:
        run_args = args(
            tmp_path / folder,
            eval_strategy="epoch",
            save_strategy="epoch",
            num_train_epochs=20,
            metric_for_best_model="eval_accuracy",
            greater_is_better=True,
        )
        # learns nothing: the accuracy never improves on the first evaluation's
        run_args.learning_rate = 1e-7
        return hpsweep.Trainer(
            model_init=Net,
            args=run_args,
            train_dataset=rows(64, 1),
            eval_dataset=rows(32, 2),
            compute_metrics=accuracy,
            callbacks=[transformers.EarlyStoppingCallback(early_stopping_patience=3)],
        )

    whole = trainer("whole")
    whole.train()
    # the best at epoch 1, then 3 evaluations without a gain
    assert whole.state.global_step == 4 * 4
    saved = json.loads((tmp_path / "whole" / "checkpoint-12" / "trainer_state.json").read_text())
    assert saved["callbacks"]["EarlyStoppingCallback"]["attributes"] == {
        "early_stopping_patience_counter": 2
    }
    resumed = trainer("resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-12"))
    assert resumed.state.global_step == whole.state.global_step
    assert resumed.callback_handler.callbacks[-1].early_stopping_patience_counter == 3


def test_a_control_a_callback_returns_steers_the_loop(tmp_path: Path) -> None:
    """transformers' handler adopts the control a callback returns: a callback may return a new
    one instead of setting flags on the one it was given."""
    import transformers

    class StopAtFive(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 5:
                return transformers.TrainerControl(should_training_stop=True)
            return control

    trainer = hpsweep.Trainer(
        model_init=Net,
        args=args(tmp_path, eval_strategy="no", num_train_epochs=5),
        train_dataset=rows(64, 1),
        callbacks=[StopAtFive()],
    )
    trainer.train()
    assert trainer.state.global_step == 5


def test_transformers_helper_methods(tmp_path: Path) -> None:
    rates = []

    class Rates(hpsweep.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            rates.append(trainer.get_learning_rates())

    trainer = hpsweep.Trainer(
        model_init=Net,
        args=args(tmp_path, eval_strategy="no"),
        train_dataset=rows(64, 1),
        callbacks=[Rates()],
    )
    with pytest.raises(UserError, match="no optimizer yet"):
        trainer.get_learning_rates()
    trainer.train()
    # linear decay from 5e-2 over 8 steps, one param group
    assert [r for (r,) in rates] == pytest.approx([5e-2 * (1 - s / 8) for s in range(1, 9)])
    assert trainer.get_num_trainable_parameters() == sum(
        p.numel() for p in trainer.model.parameters()
    )
    assert trainer.num_examples(trainer.get_train_dataloader()) == 64
    assert trainer.metrics_format({"eval_runtime": 3725.5, "eval_loss": 0.123456, "epoch": 2}) == {
        "eval_runtime": "1:02:05.50",
        "eval_loss": 0.1235,
        "epoch": 2,
    }


class PostProcessed(hpsweep.Trainer):
    """The pattern of transformers' question-answering example: evaluate runs evaluation_loop without
    compute_metrics, post-processes the predictions, then computes, logs and announces the metrics."""

    samples: list[int] = []

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        eval_dataloader = self.get_eval_dataloader(eval_dataset)
        compute_metrics, self.compute_metrics = self.compute_metrics, None
        try:
            output = self.evaluation_loop(
                eval_dataloader,
                description="Evaluation",
                prediction_loss_only=True if compute_metrics is None else None,
                ignore_keys=ignore_keys,
                metric_key_prefix=metric_key_prefix,
            )
        finally:
            self.compute_metrics = compute_metrics
        PostProcessed.samples.append(output.num_samples)
        ids = output.predictions.argmax(-1)  # the post-processing
        computed = compute_metrics(hpsweep.EvalPrediction(ids, output.label_ids))
        metrics = {**output.metrics, **{f"{metric_key_prefix}_{k}": v for k, v in computed.items()}}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(
            self.args, self.state, self.control, metrics
        )
        return metrics


def test_an_evaluate_override_running_evaluation_loop_drives_a_sweep(tmp_path: Path) -> None:
    def exact(p: hpsweep.EvalPrediction) -> dict:
        return {"exact": float((p.predictions == p.label_ids).mean())}

    PostProcessed.samples = []
    trainer = PostProcessed(
        model_init=lambda trial: Net(),
        args=args(tmp_path, eval_strategy="epoch"),
        train_dataset=rows(64, 1),
        eval_dataset=rows(40, 2),
        compute_metrics=exact,
    )
    best = trainer.hyperparameter_search(
        space={"learning_rate": hpsweep.Float(1e-3, 1e-1, log=True)},
        n_trials=2,
        direction="maximize",
        objective="eval_exact",
        show_progress=False,
    )
    records = hpsweep.runs.read_trials(tmp_path)
    # each trial reported both evaluations, with the post-processed metric
    assert [len(r.history) for r in records] == [2, 2] and all(
        "eval_exact" in h for r in records for h in r.history
    )
    assert all(
        r.objective == r.history[-1]["eval_exact"] and "eval_loss" in r.history[-1] for r in records
    )
    assert best.objective == max(r.objective for r in records)
    assert PostProcessed.samples == [40] * 4
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(tmp_path / "study.journal"))
    )
    study = optuna.load_study(study_name=None, storage=storage)
    # one report per evaluation, at its training step
    assert [sorted(t.intermediate_values) for t in study.trials] == [
        [h["step"] for h in r.history] for r in records
    ]
    # the post-processed metric is the accuracy the default evaluation computes
    trainer.args.output_dir = str(tmp_path / "again")
    trainer.train()
    plain = hpsweep.Trainer(
        model=trainer.model,
        args=args(tmp_path / "plain"),
        eval_dataset=rows(40, 2),
        compute_metrics=accuracy,
    )
    assert trainer.evaluate()["eval_exact"] == plain.evaluate()["eval_accuracy"]
    # the override's evaluations count, as the default's do
    assert trainer.state.num_evaluations == 3


def test_an_evaluation_loop_override_decides_what_evaluate_returns(tmp_path: Path) -> None:
    class Counted(hpsweep.Trainer):
        def evaluation_loop(
            self,
            dataloader,
            description,
            prediction_loss_only=None,
            ignore_keys=None,
            metric_key_prefix="eval",
        ):
            output = super().evaluation_loop(
                dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
            )
            output.metrics[f"{metric_key_prefix}_rows"] = output.num_samples
            return output

    trainer = Counted(
        model=Net(), args=args(tmp_path), eval_dataset=rows(40, 2), compute_metrics=accuracy
    )
    metrics = trainer.evaluate()
    assert metrics["eval_rows"] == 40 and "eval_accuracy" in metrics and metrics["eval_runtime"] > 0
    assert trainer.predict(rows(10, 3)).metrics["test_rows"] == 10


def test_an_evaluation_is_logged_before_on_evaluate_as_in_transformers(tmp_path: Path) -> None:
    import transformers

    class LatestLog(transformers.TrainerCallback):  # listed before the MetricCallback, on purpose
        seen: list[tuple[dict, dict]] = []

        def on_evaluate(self, args, state, control, metrics, **kwargs):
            LatestLog.seen.append((dict(state.log_history[-1]), dict(metrics)))

    errors = hpsweep.MetricCallback(lambda p, y: float((p.argmax(-1) != y).sum()), name="errors")
    trainer = hpsweep.Trainer(
        model_init=Net,
        args=args(tmp_path, eval_strategy="epoch"),
        train_dataset=rows(64, 1),
        eval_dataset=rows(40, 2),
        compute_metrics=accuracy,
        callbacks=[LatestLog(), errors],
    )
    trainer.train()
    assert len(LatestLog.seen) == 2
    for logged, metrics in LatestLog.seen:
        # the entry transformers' callbacks find at the end of log_history is this evaluation's,
        # with the MetricCallback's metric in it, whatever the order of the callbacks
        assert {k: v for k, v in logged.items() if k not in ("epoch", "step")} == metrics
        assert metrics["eval_errors"] == round((1 - metrics["eval_accuracy"]) * 40)
