"""A callback written for transformers sees on hpsweep's Trainer what it sees on transformers': the
same events in the same order at the same steps, the same control flags at ``on_step_end``, and
the same entries in ``log_history``. Each case trains one small model on both trainers."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import transformers
from support.hf_models import Net, rows

import hpsweep

EVENTS = (
    "on_init_end",
    "on_train_begin",
    "on_epoch_begin",
    "on_step_begin",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_substep_end",
    "on_step_end",
    "on_prediction_step",
    "on_log",
    "on_evaluate",
    "on_save",
    "on_epoch_end",
    "on_train_end",
)


class Recorder(transformers.TrainerCallback):
    """Every event with its step; at ``on_step_end``, the flags the flow set for that step too."""

    def __init__(self) -> None:
        self.events: list[tuple] = []


def _record(event: str):
    def record(self, args, state, control, **kwargs):
        flags = (
            control.should_log,
            control.should_evaluate,
            control.should_save,
            control.should_training_stop,
        )
        self.events.append((event, state.global_step, *(flags if event == "on_step_end" else ())))

    return record


for _event in EVENTS:
    setattr(Recorder, _event, _record(_event))


def collate(batch: list[dict]) -> dict:
    return {
        "x": torch.stack([r["x"] for r in batch]),
        "labels": torch.tensor([r["labels"] for r in batch]),
    }


def train(trainer_cls: type, out: Path, settings: dict) -> tuple[list[tuple], list[tuple]]:
    args = transformers.TrainingArguments(
        str(out),
        num_train_epochs=2,
        learning_rate=5e-2,
        use_cpu=True,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=32,
        disable_tqdm=True,
        report_to="none",
        **settings,
    )
    recorder = Recorder()
    trainer = trainer_cls(
        model=Net("dict"),
        args=args,
        train_dataset=rows(96, 1),
        eval_dataset=rows(64, 2),
        data_collator=collate,
        callbacks=[recorder],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    # What each log entry holds (not its values: the two draw different random numbers); transformers
    # adds total_flos to its last, which hpsweep does not count (docs/huggingface.md, "What differs").
    history = [
        (sorted(set(h) - {"total_flos"}), h["step"], h["epoch"]) for h in trainer.state.log_history
    ]
    return recorder.events, history


@pytest.mark.parametrize(
    "settings",
    [
        dict(eval_strategy="epoch", save_strategy="epoch", logging_strategy="epoch"),
        dict(
            eval_strategy="epoch",
            save_strategy="epoch",
            logging_strategy="epoch",
            load_best_model_at_end=True,
        ),
        dict(
            eval_strategy="steps",
            eval_steps=5,
            save_strategy="steps",
            save_steps=4,
            logging_steps=3,
        ),
        dict(
            eval_strategy="steps",
            eval_steps=4,
            save_strategy="no",
            logging_steps=2,
            gradient_accumulation_steps=2,
        ),
        dict(eval_strategy="no", save_strategy="no", logging_steps=5, max_steps=7),
        dict(
            eval_strategy="steps",
            eval_steps=3,
            save_strategy="no",
            logging_steps=4,
            logging_first_step=True,
            eval_delay=7,
        ),
        dict(
            eval_strategy="epoch",
            save_strategy="epoch",
            logging_strategy="epoch",
            logging_first_step=True,
            eval_delay=2,
        ),
        dict(
            eval_strategy="epoch",
            save_strategy="epoch",
            logging_strategy="epoch",
            eval_on_start=True,
        ),
    ],
    ids=[
        "epochs",
        "best-at-end",
        "steps",
        "accumulation",
        "max-steps",
        "first-step-delay",
        "epoch-delay",
        "eval-on-start",
    ],
)
def test_callbacks_see_what_they_see_on_transformers_trainer(
    tmp_path: Path, settings: dict
) -> None:
    theirs = train(transformers.Trainer, tmp_path / "transformers", settings)
    ours = train(hpsweep.Trainer, tmp_path / "hpsweep", settings)
    assert ours[0] == theirs[0]  # events, steps and flags
    assert ours[1] == theirs[1]  # log_history: keys, steps, epochs
