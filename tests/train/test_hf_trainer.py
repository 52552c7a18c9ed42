"""The Trainer arguments and model outputs Hugging Face users bring: tuples, ModelOutput objects,
label_names, preprocess_logits_for_metrics, compute_loss_func, optimizers=, model= with
model_init=, datasets.Dataset columns, and a tokenizer as processing_class."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support import timeless
from support.hf_models import Net, accuracy, args, rows, tiny_gpt2
from torch import nn

import hpsweep
import hpsweep.train.hf_compat.args
from hpsweep import UserError


def test_tuples_model_outputs_and_dicts_evaluate_alike(tmp_path: Path) -> None:
    results = {}
    for kind in ("tuple", "model_output", "dict"):
        trainer = hpsweep.Trainer(
            model_init=lambda kind=kind: Net(kind),
            args=args(tmp_path / kind),
            train_dataset=rows(96, 1),
            eval_dataset=rows(64, 2),
            compute_metrics=accuracy,
        )
        results[kind] = {
            k: v for k, v in timeless(trainer.train().metrics).items() if k.startswith("eval_")
        }
    assert results["tuple"] == results["model_output"] == results["dict"]
    assert results["tuple"]["eval_accuracy"] > 0.4


def test_label_names_choose_the_labels_compute_metrics_gets(tmp_path: Path) -> None:
    class Regressor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 1)

        def forward(self, x, target):  # no "label" in the name: transformers needs label_names too
            y = self.lin(x).squeeze(-1)
            return nn.functional.mse_loss(y, target), y, y * 2

    seen = {}

    def metrics(p):
        seen["predictions"], seen["labels"] = p.predictions, p.label_ids
        return {"mae": float(np.abs(p.predictions[0] - p.label_ids).mean())}

    data = [{"x": r["x"], "target": float(r["x"].sum())} for r in rows(64, 3)]
    trainer = hpsweep.Trainer(
        model=Regressor(),
        args=args(tmp_path, label_names=["target"]),
        train_dataset=data,
        eval_dataset=data,
        compute_metrics=metrics,
    )
    result = trainer.evaluate()
    # all but the loss
    assert isinstance(seen["predictions"], tuple) and len(seen["predictions"]) == 2
    assert np.allclose(seen["predictions"][1], seen["predictions"][0] * 2)
    assert np.allclose(seen["labels"], [d["target"] for d in data], atol=1e-5)
    assert result["eval_mae"] > 0


def test_preprocess_logits_for_metrics_runs_on_each_batch_before_gathering(tmp_path: Path) -> None:
    calls = []

    def to_classes(logits, labels):
        calls.append((tuple(logits.shape), tuple(labels.shape)))
        return logits.argmax(-1)

    def metrics(p):
        assert p.predictions.dtype == np.int64 and p.predictions.shape == (64,)
        return {"accuracy": float((p.predictions == p.label_ids).mean())}

    trainer = hpsweep.Trainer(
        model=Net(),
        args=args(tmp_path),
        train_dataset=rows(64, 1),
        eval_dataset=rows(64, 2),
        compute_metrics=metrics,
        preprocess_logits_for_metrics=to_classes,
    )
    assert 0 <= trainer.evaluate()["eval_accuracy"] <= 1
    assert calls == [((32, 4), (32,)), ((32, 4), (32,))]


def test_compute_loss_func_replaces_the_models_loss(tmp_path: Path) -> None:
    class Logits(nn.Module):  # returns logits only; the loss comes from compute_loss_func
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x):
            return self.lin(x)

    seen = []

    def loss_func(outputs, labels, num_items_in_batch=None):
        seen.append(labels.shape)
        return nn.functional.cross_entropy(outputs, labels)

    trainer = hpsweep.Trainer(
        model=Logits(),
        args=args(tmp_path, num_train_epochs=3),
        train_dataset=rows(96, 1),
        eval_dataset=rows(64, 2),
        compute_metrics=accuracy,
        compute_loss_func=loss_func,
    )
    before = trainer.evaluate()
    after = trainer.train().metrics
    assert after["eval_loss"] < before["eval_loss"] and after["eval_accuracy"] > 0.4
    assert seen and all(s[0] in (16, 32) for s in seen)


class Classifier(nn.Module):
    """A loss only when given labels, as transformers' models; logits alone or in a dict."""

    def __init__(self, dict_out: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dict_out, self.net = (
            dict_out,
            nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
        )

    def forward(self, x, labels=None):
        logits = self.net(x)
        if labels is not None:
            return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}
        return {"logits": logits} if self.dict_out else logits


def test_label_smoothing_is_transformers_loss_for_a_classifier_and_a_causal_lm(
    tmp_path: Path,
) -> None:
    import transformers

    gen = torch.Generator().manual_seed(1)
    lm = tiny_gpt2()
    ids = torch.randint(0, 32, (4, 10), generator=gen)
    prompt_masked = ids.masked_fill(torch.arange(10) < 3, -100)  # a prompt left out of the loss
    bert = dict(
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
    )
    classifier = transformers.BertForSequenceClassification(
        transformers.BertConfig(**bert, num_labels=3)
    )
    hf_args = transformers.TrainingArguments(
        str(tmp_path), label_smoothing_factor=0.2, report_to="none", use_cpu=True
    )
    for model, batch in (
        (classifier, {"input_ids": ids, "labels": torch.tensor([0, 2, 1, 2])}),
        (lm, {"input_ids": ids, "labels": prompt_masked}),
    ):
        model.eval()  # no dropout: the three calls see the same logits
        theirs = transformers.Trainer(model=model, args=hf_args).compute_loss(model, dict(batch))
        ours = hpsweep.Trainer(model=model, args=hf_args).compute_loss(model, dict(batch))
        unsmoothed = hpsweep.Trainer(model=model, args=args(tmp_path)).compute_loss(
            model, dict(batch)
        )
        torch.testing.assert_close(ours, theirs)
        assert abs(ours.item() - unsmoothed.item()) > 1e-4  # smoothed: not the model's own loss
    # torch_compile's wrapper: still a causal LM inside
    compiled = torch.compile(lm, backend="eager")
    torch.testing.assert_close(
        hpsweep.Trainer(model=lm, args=hf_args).compute_loss(compiled, dict(batch)), theirs
    )

    # Multi-label classification is left unsmoothed, with transformers' warning.
    multi = transformers.BertForSequenceClassification(
        transformers.BertConfig(**bert, num_labels=3, problem_type="multi_label_classification")
    ).eval()
    batch = {
        "input_ids": ids,
        "labels": torch.tensor([[1.0, 0, 1], [0, 1, 0], [0, 0, 1], [1, 1, 0]]),
    }
    with pytest.warns(UserWarning, match="multi-label"):
        theirs = transformers.Trainer(model=multi, args=hf_args).compute_loss(multi, dict(batch))
    with pytest.warns(UserWarning, match="multi-label"):
        ours = hpsweep.Trainer(model=multi, args=hf_args).compute_loss(multi, dict(batch))
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("dict_out", [True, False], ids=["dict", "logits-tensor"])
def test_label_smoothing_trains_and_evaluates_on_the_smoothed_loss(
    tmp_path: Path, dict_out: bool
) -> None:
    trainer = hpsweep.Trainer(
        model=Classifier(dict_out),
        args=args(tmp_path, label_smoothing_factor=0.1),
        train_dataset=rows(96, 1),
        eval_dataset=rows(64, 2),
        compute_metrics=accuracy,
    )
    metrics = trainer.train().metrics
    x = torch.stack([r["x"] for r in rows(64, 2)])
    labels = torch.tensor([r["labels"] for r in rows(64, 2)])
    with torch.no_grad():
        logits = trainer.model.net(x)
    smoothed = nn.functional.cross_entropy(logits, labels, label_smoothing=0.1)
    assert metrics["eval_loss"] == pytest.approx(smoothed.item(), rel=1e-5)
    # the logits, not a loss
    assert metrics["eval_accuracy"] == float((logits.argmax(-1) == labels).float().mean())


def test_optimizers_pair_is_the_one_that_trains(tmp_path: Path) -> None:
    model = Net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = hpsweep.Trainer(
        model=model,
        args=args(tmp_path, eval_strategy="no"),
        train_dataset=rows(64, 1),
        optimizers=(sgd, None),
    )
    start = model.net[0].weight.detach().clone()
    trainer.train()
    assert trainer.optimizer.optimizer is sgd and not torch.equal(start, model.net[0].weight)
    with pytest.raises(UserError, match="model_init"):
        hpsweep.Trainer(model_init=Net, args=args(tmp_path), optimizers=(sgd, None))


def test_model_and_model_init_together_as_transformers_4_allows(tmp_path: Path) -> None:
    given = Net()
    trainer = hpsweep.Trainer(
        model=given,
        model_init=lambda: Net("dict"),
        args=args(tmp_path),
        train_dataset=rows(64, 1),
        eval_dataset=rows(64, 2),
    )
    trainer.evaluate()
    assert trainer.model is given  # evaluating before training uses the model given
    trainer.train()
    # train() builds it with model_init
    assert trainer.model is not given and trainer.model.kind == "dict"


def test_include_for_metrics_hands_over_inputs_and_losses(tmp_path: Path) -> None:
    seen = {}

    def metrics(p):
        seen["inputs"], seen["losses"] = p.inputs, p.losses
        return {}

    trainer = hpsweep.Trainer(
        model=Net(),
        args=args(tmp_path, include_for_metrics=["inputs", "loss"]),
        eval_dataset=rows(40, 2),
        compute_metrics=metrics,
    )
    trainer.evaluate()
    assert seen["inputs"].shape == (40, 8) and seen["losses"].shape == (40,)


# --- predict -------------------------------------------------------------------------------------


def test_predict_returns_what_the_model_predicts_with_labels_and_test_metrics(
    tmp_path: Path,
) -> None:
    class Events(hpsweep.TrainerCallback):
        seen: list = []

        def on_evaluate(self, args, state, control, metrics, **kwargs):
            self.seen.append(("evaluate", sorted(timeless(metrics))))

        def on_predict(self, args, state, control, metrics, **kwargs):
            self.seen.append(("predict", sorted(timeless(metrics))))

    test = rows(50, 4)  # not a multiple of the batch size (32)
    x, y = torch.stack([r["x"] for r in test]), torch.tensor([r["labels"] for r in test])
    for kind in ("tuple", "model_output", "dict"):
        Events.seen = []
        trainer = hpsweep.Trainer(
            model_init=lambda kind=kind: Net(kind),
            args=args(tmp_path / kind),
            train_dataset=rows(96, 1),
            eval_dataset=rows(64, 2),
            compute_metrics=accuracy,
            callbacks=[Events()],
        )
        trainer.train()
        history, evaluations = list(trainer.state.log_history), trainer.state.num_evaluations
        out = trainer.predict(test)
        predictions, label_ids, metrics = out  # a 3-tuple, as transformers' PredictionOutput
        assert isinstance(out, hpsweep.PredictionOutput)
        with torch.no_grad():
            expected = trainer.model.eval().net(x).numpy()
        assert predictions.shape == (50, 4) and np.allclose(predictions, expected, atol=1e-6)
        assert np.array_equal(label_ids, y.numpy())
        assert set(timeless(metrics)) == {"test_loss", "test_accuracy"}
        assert metrics["test_accuracy"] == float((expected.argmax(-1) == y.numpy()).mean())
        # the same numbers evaluate gives under that prefix; predicting is no evaluation to prune on
        assert Events.seen[-1] == ("predict", ["test_accuracy", "test_loss"])
        assert trainer.state.log_history == history and trainer.state.num_evaluations == evaluations
        assert timeless(trainer.evaluate(test, metric_key_prefix="test")) == pytest.approx(
            timeless(metrics)
        )
        assert Events.seen[-1] == ("evaluate", ["test_accuracy", "test_loss"])


def test_after_a_search_the_trainer_holds_the_best_trials_model(tmp_path: Path) -> None:
    """evaluate, predict, save_model and trainer.model after hyperparameter_search use the best
    trial's model (model_init with its params, best/'s weights) on every backend, not a fresh
    untrained one (the trials trained in copies of the trainer, or in other processes)."""

    class Wide(nn.Module):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))

        def forward(self, x, labels=None):
            return nn.functional.cross_entropy(self.net(x), labels), self.net(x)

    trainer = hpsweep.Trainer(
        model_init=lambda trial: Wide(trial["hidden"] if trial else 2),
        args=args(tmp_path / "out"),
        train_dataset=rows(96, 1),
        eval_dataset=rows(64, 2),
        compute_metrics=accuracy,
    )
    best = trainer.hyperparameter_search(
        space={
            "hidden": hpsweep.Categorical([4, 24]),
            "learning_rate": hpsweep.Float(1e-2, 1e-1, log=True),
        },
        n_trials=3,
        direction="maximize",
        objective="eval_accuracy",
        show_progress=False,
    )
    # model_init with its params
    assert trainer.model.net[0].out_features == best.hyperparameters["hidden"]
    from safetensors.torch import load_file

    kept = load_file(str(tmp_path / "out" / "best" / "model.safetensors"))
    assert all(torch.equal(kept[k], v) for k, v in trainer.model.state_dict().items())
    # what the sweep measured, measured again
    assert trainer.evaluate()["eval_accuracy"] == best.objective
    assert trainer.predict(rows(64, 2)).metrics["test_accuracy"] == best.objective
    trainer.save_model(tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert saved.keys() == kept.keys() and all(torch.equal(saved[k], kept[k]) for k in kept)
    # training again replaces it, as transformers' recipe does after a search
    trainer.args.output_dir = str(tmp_path / "again")
    trainer.train()
    assert trainer.model.net[0].out_features == 2


def test_predict_on_a_test_set_without_labels(tmp_path: Path) -> None:
    class Optional(Net):  # transformers' models: no labels, no loss
        def forward(self, x, labels=None):
            if labels is not None:
                return super().forward(x, labels)
            logits = self.net(x)
            from transformers.modeling_outputs import SequenceClassifierOutput

            return (logits,) if self.kind == "tuple" else SequenceClassifierOutput(logits=logits)

    labelled = rows(40, 5)
    unlabelled = [{"x": r["x"]} for r in labelled]
    for kind in ("tuple", "model_output"):
        trainer = hpsweep.Trainer(
            model=Optional(kind),
            args=args(tmp_path / kind, eval_strategy="no"),
            train_dataset=rows(96, 1),
            compute_metrics=accuracy,
        )
        trainer.train()
        blind = trainer.predict(unlabelled)
        # no loss, and compute_metrics needs labels
        assert blind.label_ids is None and timeless(blind.metrics) == {}
        assert np.allclose(blind.predictions, trainer.predict(labelled).predictions)
        # a plain tensor dataset of inputs only, as a test split often is
        inputs = torch.utils.data.TensorDataset(torch.stack([r["x"] for r in labelled]))
        assert np.allclose(trainer.predict(inputs).predictions, blind.predictions)


def test_predict_with_two_outputs_and_two_label_names(tmp_path: Path) -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 1)

        def forward(self, x, labels, labels_2):
            y = self.lin(x).squeeze(-1)
            return (
                nn.functional.mse_loss(y, labels) + nn.functional.mse_loss(2 * y, labels_2),
                y,
                2 * y,
            )

    data = [
        {"x": r["x"], "labels": float(r["x"].sum()), "labels_2": float(2 * r["x"].sum())}
        for r in rows(40, 6)
    ]
    trainer = hpsweep.Trainer(
        model=TwoHeads(),
        args=args(tmp_path, label_names=["labels", "labels_2"], eval_strategy="no"),
        train_dataset=data,
    )
    predictions, label_ids, metrics = trainer.predict(data)
    assert len(predictions) == 2 and np.allclose(predictions[1], 2 * predictions[0])
    assert np.allclose(label_ids[0], [d["labels"] for d in data], atol=1e-5)
    assert np.allclose(label_ids[1], [d["labels_2"] for d in data], atol=1e-5)
    assert set(timeless(metrics)) == {"test_loss"} and metrics["test_loss"] > 0


# --- datasets and tokenizers ---------------------------------------------------------------------

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "good", "bad", "film", "very", "the"]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


class BagOfWords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(len(WORDS), 2, mode="sum")
        # Zeros, not the global RNG: random starts learned the task in 3 epochs for half the seeds,
        # so the test passed or failed by which tests had drawn random numbers before it.
        nn.init.zeros_(self.emb.weight)

    def forward(self, input_ids, attention_mask, labels):
        logits = self.emb(input_ids, per_sample_weights=attention_mask.float())
        return nn.functional.cross_entropy(logits, labels), logits


def reviews(n: int):
    import datasets

    rng = np.random.default_rng(n)
    text = [
        " ".join(["the", "film"] + ["very"] * int(rng.integers(0, 4)) + [("good", "bad")[i % 2]])
        for i in range(n)
    ]
    ds = datasets.Dataset.from_dict(
        {"text": text, "label": [1 - i % 2 for i in range(n)], "idx": list(range(n))}
    )
    return ds.map(lambda b: tokenizer()(b["text"]), batched=True)


def test_dataset_columns_the_model_does_not_take_are_dropped(tmp_path: Path) -> None:
    from transformers import AutoTokenizer, DataCollatorWithPadding

    class SeesTheTokenizer(hpsweep.TrainerCallback):  # as a pusher or the trial reporter would
        saved = []

        def on_save(self, args, state, control, checkpoint, **kwargs):
            self.saved.append((Path(checkpoint) / "tokenizer.json").exists())

    tok = tokenizer()
    trainer = hpsweep.Trainer(
        model=BagOfWords(),
        args=args(tmp_path, save_strategy="epoch", num_train_epochs=3),
        train_dataset=reviews(64),
        eval_dataset=reviews(32),
        processing_class=tok,
        compute_metrics=accuracy,
        callbacks=[SeesTheTokenizer()],
    )
    assert isinstance(trainer.data_collator, DataCollatorWithPadding) and trainer.tokenizer is tok
    metrics = trainer.train().metrics  # "text" and "idx" would break padding and forward
    assert metrics["eval_accuracy"] > 0.6
    assert SeesTheTokenizer.saved == [True, True, True]
    checkpoint = tmp_path / f"checkpoint-{trainer.state.global_step}"
    assert (
        AutoTokenizer.from_pretrained(checkpoint)("good film")["input_ids"]
        == tok("good film")["input_ids"]
    )


def test_a_text_column_reaching_the_collator_is_one_line_naming_it(tmp_path: Path) -> None:
    trainer = hpsweep.Trainer(
        model=BagOfWords(),
        args=args(tmp_path, remove_unused_columns=False),
        train_dataset=reviews(32),
        tokenizer=tokenizer(),
    )
    with pytest.raises(UserError) as info:
        trainer.train()
    assert "column 'text' holds text" in str(info.value) and "remove_unused_columns=True" in str(
        info.value
    )


def test_a_dataset_with_no_column_the_model_takes_says_to_tokenize(tmp_path: Path) -> None:
    import datasets

    raw = datasets.Dataset.from_dict({"sentence": ["good film"] * 8, "score": [1] * 8})
    trainer = hpsweep.Trainer(model=BagOfWords(), args=args(tmp_path), train_dataset=raw)
    with pytest.raises(UserError, match="none of its columns .* tokenize the text first"):
        trainer.train()


def test_several_eval_datasets_are_one_evaluation_with_a_prefix_each(tmp_path: Path) -> None:
    near, far = rows(64, 2), rows(64, 3)
    errors = hpsweep.MetricCallback(lambda p, y: float((p.argmax(-1) != y).sum()), name="errors")
    trainer = hpsweep.Trainer(
        model_init=Net,
        args=args(tmp_path, eval_strategy="epoch"),
        train_dataset=rows(96, 1),
        eval_dataset={"near": near, "far": far},
        compute_metrics=accuracy,
        callbacks=[errors],
    )
    metrics = trainer.train().metrics
    evaluations = [h for h in trainer.state.log_history if any(k.startswith("eval_") for k in h)]
    # one per epoch, both datasets in it
    assert trainer.state.num_evaluations == len(evaluations) == 2
    assert sorted(k for k in timeless(evaluations[-1]) if k.startswith("eval_")) == [
        "eval_far_accuracy",
        "eval_far_errors",
        "eval_far_loss",
        "eval_near_accuracy",
        "eval_near_errors",
        "eval_near_loss",
    ]
    assert metrics["eval_far_errors"] == round((1 - metrics["eval_far_accuracy"]) * 64)
    # each dataset's part is what evaluating it alone gives; a name picks one, as in transformers
    alone = timeless(trainer.evaluate(far, metric_key_prefix="eval_far"))
    assert {
        k: v for k, v in timeless(metrics).items() if k.startswith("eval_far")
    } == pytest.approx(alone)
    assert timeless(trainer.evaluate("far")) == pytest.approx(
        {k.replace("_far", ""): v for k, v in alone.items()}
    )
    assert metrics["eval_far_samples_per_second"] > 0 and metrics["eval_near_runtime"] > 0
    with pytest.raises(UserError, match="its datasets are 'near', 'far'"):
        trainer.evaluate("val")


def test_a_sweep_over_several_eval_datasets_reports_once_per_evaluation(tmp_path: Path) -> None:
    trainer = hpsweep.Trainer(
        model_init=lambda trial: Net(),
        args=args(tmp_path, eval_strategy="epoch"),
        train_dataset=rows(96, 1),
        eval_dataset={"near": rows(64, 2), "far": rows(64, 3)},
        compute_metrics=accuracy,
    )
    best = trainer.hyperparameter_search(
        space={"learning_rate": hpsweep.Float(1e-3, 1e-1, log=True)},
        n_trials=2,
        direction="maximize",
        objective="eval_far_accuracy",
        show_progress=False,
    )
    records = hpsweep.runs.read_trials(tmp_path)
    assert all(
        len(r.history) == 2 and r.objective == r.history[-1]["eval_far_accuracy"] for r in records
    )
    assert best.objective == max(r.objective for r in records)


def test_evaluate_and_predict_report_their_speed_and_on_log_sees_the_epoch(tmp_path: Path) -> None:
    seen = []

    class Logs(hpsweep.TrainerCallback):
        def on_log(self, args, state, control, *, logs, **kwargs):
            seen.append(dict(logs))

    trainer = hpsweep.Trainer(
        model_init=Net,
        args=args(tmp_path, eval_strategy="epoch"),
        train_dataset=rows(96, 1),
        eval_dataset=rows(640, 2),
        compute_metrics=accuracy,
        callbacks=[Logs()],
    )
    trainer.train()
    # transformers' speed metrics: 640 rows in 20 batches of 32; 100 test rows in 4
    for metrics, split, samples, steps in (
        (trainer.evaluate(), "eval", 640, 20),
        (trainer.predict(rows(100, 3)).metrics, "test", 100, 4),
    ):
        runtime = metrics[f"{split}_runtime"]
        assert runtime > 0
        assert metrics[f"{split}_samples_per_second"] == pytest.approx(samples / runtime, rel=0.05)
        assert metrics[f"{split}_steps_per_second"] == pytest.approx(steps / runtime, rel=0.05)
    # as transformers' on_log does, every entry carries the epoch; log_history adds the step
    evaluations = [logs for logs in seen if "eval_accuracy" in logs]
    assert [logs["epoch"] for logs in evaluations] == [1.0, 2.0, 2.0]
    assert trainer.state.log_history[-1] == {**seen[-1], "step": trainer.state.global_step}


class Recording(Net):
    """Notes the first feature of every training batch: the order the data came in."""

    def __init__(self) -> None:
        super().__init__("dict")
        self.batches: list[list[float]] = []

    def forward(self, x, labels=None):
        if self.training:
            self.batches.append(x[:, 0].tolist())
        return super().forward(x, labels)


@pytest.mark.parametrize("accumulation", [1, 2], ids=["plain-loader", "accelerate-sampler"])
def test_data_seed_alone_decides_the_order_of_the_training_data(
    tmp_path: Path, accumulation: int
) -> None:
    def order(**kw) -> list[list[float]]:
        model = Recording()
        hpsweep.Trainer(
            model=model,
            args=args(tmp_path, eval_strategy="no", gradient_accumulation_steps=accumulation, **kw),
            train_dataset=rows(64, 1),
        ).train()
        return model.batches

    # the model's seed does not move the data
    assert order(seed=1, data_seed=7) == order(seed=2, data_seed=7)
    assert order(seed=1, data_seed=7) != order(seed=1, data_seed=8)
    # without data_seed, seed orders the data, as in transformers
    assert order(seed=1) != order(seed=2)


def test_prediction_loss_only_computes_the_loss_and_gathers_nothing(tmp_path: Path) -> None:
    trainer = hpsweep.Trainer(
        model=Net("dict"),
        args=args(tmp_path, prediction_loss_only=True),
        train_dataset=rows(64, 1),
        eval_dataset=rows(64, 2),
        compute_metrics=accuracy,
    )
    metrics = trainer.evaluate()
    # as transformers: no compute_metrics
    assert "eval_loss" in metrics and "eval_accuracy" not in metrics
    predicted = trainer.predict(rows(32, 3))
    assert predicted.predictions is None and "test_loss" in predicted.metrics


def test_activation_checkpointing_recomputes_and_trains_the_same_weights(tmp_path: Path) -> None:
    def gpt():
        return tiny_gpt2(n_layer=2, dropout=False)  # numbers to compare

    ids = torch.randint(0, 32, (32, 12), generator=torch.Generator().manual_seed(3))
    data = [{"input_ids": row, "labels": row} for row in ids]
    weights, flags = [], []

    class Flag(hpsweep.TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            on = getattr(model, "is_activation_checkpointing", None)
            flags.append(model.is_gradient_checkpointing if on is None else on)  # 5.2x's name

    for checkpointing in (False, True):
        trainer = hpsweep.Trainer(
            model_init=gpt,
            args=args(
                tmp_path / str(checkpointing),
                eval_strategy="no",
                activation_checkpointing=checkpointing,
            ),
            train_dataset=data,
            callbacks=[Flag()],
        )
        trainer.train()
        weights.append(trainer.model.state_dict())
    assert flags == [False, True]
    for name, weight in weights[
        0
    ].items():  # recomputed, not changed (gradients may sum in another order)
        torch.testing.assert_close(weights[1][name], weight, rtol=1e-5, atol=1e-6)
    # and it trained
    assert any(not torch.equal(weights[0][k], gpt().state_dict()[k]) for k in weights[0])

    # a plain module
    with pytest.raises(UserError, match="Net has no activation_checkpointing_enable"):
        hpsweep.Trainer(
            model_init=Net,
            args=args(tmp_path / "net", gradient_checkpointing=True),
            train_dataset=rows(32, 1),
        ).train()


def test_neftune_noises_the_embeddings_while_training_and_only_then(tmp_path: Path) -> None:
    import transformers

    alpha = 5.0
    ids = torch.randint(0, 32, (32, 12), generator=torch.Generator().manual_seed(3))
    data = [{"input_ids": row, "labels": row} for row in ids]
    seen: dict[str, object] = {}

    def gpt():
        return tiny_gpt2(dropout=False)

    class Look(hpsweep.TrainerCallback):
        # after hpsweep's own callbacks
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            wte, batch = model.get_input_embeddings(), ids[:4]
            seen["train"] = (wte(batch) - wte.weight[batch]).abs().max().item()
            wte.eval()
            seen["eval"] = (wte(batch) - wte.weight[batch]).abs().max().item()
            wte.train()

    def trained(neftune: float | None) -> hpsweep.Trainer:
        trainer = hpsweep.Trainer(
            model_init=gpt,
            args=args(tmp_path / str(neftune), eval_strategy="no", neftune_noise_alpha=neftune),
            train_dataset=data,
            callbacks=[Look()],
        )
        trainer.train()
        return trainer

    noisy = trained(alpha)
    # transformers' alpha / sqrt(sequence length x embedding width)
    bound = alpha / (12 * 16) ** 0.5
    # noise while training, none in eval mode
    assert 0 < seen["train"] <= bound + 1e-6 and seen["eval"] == 0
    # taken off when training ends: the model is plain again
    wte = noisy.model.get_input_embeddings()
    assert not wte._forward_hooks and not hasattr(wte, "neftune_noise_alpha")
    assert torch.equal(wte.train()(ids[:4]), wte.weight[ids[:4]])
    plain = trained(None)
    assert seen["train"] == 0  # off by default
    assert any(
        not torch.equal(noisy.model.state_dict()[k], v) for k, v in plain.model.state_dict().items()
    )

    # a plain module: one line
    with pytest.raises(UserError, match="Net has no get_input_embeddings"):
        hpsweep.Trainer(
            model_init=Net,
            args=args(tmp_path / "net", neftune_noise_alpha=alpha),
            train_dataset=rows(32, 1),
        ).train()
    converted = hpsweep.train.hf_compat.args.as_training_arguments(
        transformers.TrainingArguments("out", neftune_noise_alpha=alpha)
    )
    assert converted.neftune_noise_alpha == alpha  # no longer refused
