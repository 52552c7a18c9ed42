"""A run_glue.py-style search, as a Hugging Face user writes it: a datasets.Dataset of text and
labels, a tokenizer, a BERT classifier, DataCollatorWithPadding and hyperparameter_search.

Only the import of Trainer and TrainingArguments differs from the transformers version of this
session; everything is built locally (no download)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import datasets
import huggingface_hub.utils as hub_utils
import numpy as np
import torch
from support import timeless
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

from hpsweep import Trainer, TrainingArguments

POSITIVE = "good great fine lovely superb".split()
NEGATIVE = "bad awful poor dreadful grim".split()
FILLER = "the a film plot actor scene was is very quite movie story".split()
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", *POSITIVE, *NEGATIVE, *FILLER]


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
    )


def sentences(n: int, seed: int) -> datasets.Dataset:
    rng = random.Random(seed)
    text, label = [], []
    for _ in range(n):
        positive = rng.random() < 0.5
        words = rng.sample(FILLER, rng.randint(2, 6)) + [
            rng.choice(POSITIVE if positive else NEGATIVE)
        ]
        rng.shuffle(words)
        text.append(" ".join(words))
        label.append(int(positive))
    return datasets.Dataset.from_dict({"text": text, "label": label})


def test_a_run_glue_style_search_moves_over_with_the_import_changed(tmp_path: Path, capsys) -> None:
    tokenizer = build_tokenizer()

    def preprocess_function(examples):
        return tokenizer(examples["text"], truncation=True, max_length=16)

    train_dataset = sentences(160, seed=1).map(preprocess_function, batched=True)
    eval_dataset = sentences(64, seed=2).map(preprocess_function, batched=True)

    def model_init(trial):
        config = BertConfig(
            vocab_size=len(VOCAB),
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=32,
            num_labels=2,
        )
        return BertForSequenceClassification(config)

    def compute_metrics(eval_pred):
        predictions, labels = eval_pred
        return {"accuracy": float((np.argmax(predictions, axis=1) == labels).mean())}

    def hp_space(trial):
        return {
            "learning_rate": trial.suggest_float("learning_rate", 3e-3, 3e-2, log=True),
            "per_device_train_batch_size": trial.suggest_categorical(
                "per_device_train_batch_size", [16, 32]
            ),
        }

    training_args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        eval_strategy="epoch",
        save_strategy="epoch",
        num_train_epochs=3,
        per_device_eval_batch_size=32,
        weight_decay=0.01,
        load_best_model_at_end=True,
        metric_for_best_model="accuracy",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = Trainer(
        model_init=model_init,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer=tokenizer),
        compute_metrics=compute_metrics,
    )
    bars_before = hf_logging.is_progress_bar_enabled(), hub_utils.are_progress_bars_disabled()
    best_run = trainer.hyperparameter_search(
        hp_space=hp_space, direction="maximize", backend="optuna", n_trials=2
    )

    # It optimised the accuracy: with one metric, transformers' default objective is that metric.
    printed = capsys.readouterr()
    assert "hpsweep: optimising the sum of compute_metrics' eval metrics" in printed.out
    # Quietly (disable_tqdm): transformers 5's save_pretrained shows a bar for every save, so one
    # per checkpoint of every trial; the sweep turns them off while it saves, then back as they were.
    assert "Writing model shards" not in printed.err
    assert (
        hf_logging.is_progress_bar_enabled(),
        hub_utils.are_progress_bars_disabled(),
    ) == bars_before
    out = tmp_path / "out"
    summary = json.loads((out / "best_run.json").read_text())
    assert summary["objective"] == summary["run_summary"]["metrics"]["eval_accuracy"] > 0.6
    assert set(summary["hyperparameters"]) == {"learning_rate", "per_device_train_batch_size"}

    # best/ is a model and a tokenizer that from_pretrained loads ...
    model = AutoModelForSequenceClassification.from_pretrained(out / "best").eval()
    loaded_tokenizer = AutoTokenizer.from_pretrained(out / "best")
    assert loaded_tokenizer("good film")["input_ids"] == tokenizer("good film")["input_ids"]

    # ... and re-evaluating it gives the accuracy the sweep recorded.
    collator = DataCollatorWithPadding(tokenizer=loaded_tokenizer)
    features = (
        sentences(64, seed=2)
        .map(lambda b: loaded_tokenizer(b["text"], truncation=True, max_length=16), batched=True)
        .remove_columns(["text"])
    )
    right = 0
    with torch.no_grad():
        for start in range(0, len(features), 32):
            batch = collator([features[i] for i in range(start, min(start + 32, len(features)))])
            labels = batch.pop("labels")
            right += int((model(**batch).logits.argmax(-1) == labels).sum())
    assert right / len(features) == summary["objective"] == best_run.objective

    # Then the rest of transformers' recipe: train with the best hyperparameters and predict on a
    # test split without labels (run_glue.py removes the label column before `predict`).
    for name, value in best_run.hyperparameters.items():
        setattr(trainer.args, name, value)
    final = tmp_path / "final"
    trainer.args.output_dir = str(final)
    train_result = trainer.train()
    # the best trial, trained again
    assert train_result.metrics["eval_accuracy"] == best_run.objective

    # run_glue.py's reporting, as it is written there
    metrics = train_result.metrics
    metrics["train_samples"] = len(train_dataset)
    trainer.save_model()  # saves the tokenizer too
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    eval_metrics = trainer.evaluate()
    eval_metrics["eval_samples"] = len(eval_dataset)
    trainer.log_metrics("eval", eval_metrics)
    trainer.save_metrics("eval", eval_metrics)

    printed = capsys.readouterr().out
    assert "***** train metrics *****" in printed and "***** eval metrics *****" in printed
    # aligned, as transformers prints it
    assert re.search(r"^  train_samples +=  +160$", printed, re.M)
    assert re.search(r"^  train_runtime += +0:00:\d\d\.\d\d$", printed, re.M)  # h:mm:ss.cc
    assert metrics["train_loss"] == train_result.training_loss and metrics["epoch"] == 3.0
    assert metrics["train_steps_per_second"] > 0 and metrics["train_runtime"] > 0
    assert (
        AutoTokenizer.from_pretrained(final)("good film")["input_ids"]
        == tokenizer("good film")["input_ids"]
    )
    assert json.loads((final / "train_results.json").read_text())["train_samples"] == 160
    assert json.loads((final / "all_results.json").read_text()) == {**metrics, **eval_metrics}
    state = json.loads((final / "trainer_state.json").read_text())
    assert (
        state["global_step"] == train_result.global_step
        and state["best_metric"] == best_run.objective
    )
    # all but evaluate()'s
    assert [h["eval_accuracy"] for h in state["log_history"] if "eval_accuracy" in h] == [
        h["eval_accuracy"] for h in trainer.state.log_history[:-1] if "eval_accuracy" in h
    ]
    test = sentences(48, seed=3).map(preprocess_function, batched=True)
    blind = trainer.predict(test.remove_columns("label"))
    assert (
        blind.label_ids is None
        and timeless(blind.metrics) == {}
        and blind.metrics["test_runtime"] > 0
    )
    features = test.remove_columns(["text", "label"])
    saved = AutoModelForSequenceClassification.from_pretrained(
        final
    ).eval()  # what save_model() wrote
    with torch.no_grad():  # the logits the saved model gives, batch by batch
        logits = torch.cat(
            [
                saved(**collator([features[i] for i in range(s, min(s + 32, 48))])).logits
                for s in range(0, 48, 32)
            ]
        )
    assert blind.predictions.shape == (48, 2) and np.allclose(
        blind.predictions, logits.numpy(), atol=1e-5
    )
    labelled = trainer.predict(test)
    assert np.allclose(blind.predictions, labelled.predictions)
    assert np.array_equal(labelled.label_ids, test["label"])
    accuracy = float((blind.predictions.argmax(-1) == np.array(test["label"])).mean())
    assert labelled.metrics["test_accuracy"] == accuracy and labelled.metrics["test_loss"] > 0
