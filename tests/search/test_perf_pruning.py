"""Pruning saves time: a trial is stopped before its last evaluation or not at all.

A trial pruned at its last evaluation has already spent all its training; stopping it saves
nothing and records finished work as pruned. So the last evaluation is reported (the pruner
sees the whole curve) but never offered for pruning, and the trial is recorded complete.
"""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from support import hpsweep_cli, load_sweep_study, write_space
from support.tiny_model import FourClassNet, four_class_rows

import hpsweep
from hpsweep import runs
from hpsweep.search.backends._optuna._backend import OptunaTrial
from hpsweep.search.trial_reporter import TrialReporter
from hpsweep.train.arguments import TrainingArguments


def accuracy(p: hpsweep.EvalPrediction) -> dict:
    return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}


class PruneAtEveryChance(hpsweep.Trial):
    """A backend at its most aggressive: it wants the trial stopped whenever it is asked (from
    evaluation ``start`` on), and notes when it was asked."""

    def __init__(self, start: int = 1) -> None:
        super().__init__(0)
        self.start = start
        self.reported: list[int] = []
        self.asked_at: list[int] = []
        self.checkpoints: list[str | None] = []

    def report(self, step, metrics, objective, checkpoint=None) -> None:
        self.reported.append(step)
        self.checkpoints.append(checkpoint)

    def should_prune(self) -> bool:
        self.asked_at.append(self.reported[-1])
        return self.reported[-1] >= self.start


def train_trial(
    out: Path, trial: hpsweep.Trial, callbacks=(), **kw
) -> tuple[hpsweep.Trainer, TrialReporter]:
    reporter = TrialReporter(trial, lambda m: m["eval_accuracy"])
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=32,
        learning_rate=1e-2,
        disable_progress=True,
        **kw,
    )
    trainer = hpsweep.Trainer(
        model_init=FourClassNet,
        args=args,
        train_dataset=four_class_rows(160, 1),
        eval_dataset=four_class_rows(64, 2),
        compute_metrics=accuracy,
        callbacks=[*callbacks, reporter],
    )
    trainer.train(trial=trial)
    return trainer, reporter


def test_a_trial_is_pruned_at_its_first_chance_not_after_its_training(tmp_path: Path) -> None:
    trial = PruneAtEveryChance()
    trainer, reporter = train_trial(tmp_path, trial, num_train_epochs=3)
    assert reporter.pruned and trial.reported == [1] == trial.asked_at
    assert trainer.state.global_step == 5  # one epoch of 160 / 32 batches, not three


def test_the_last_evaluation_is_reported_but_never_offered_for_pruning(tmp_path: Path) -> None:
    trial = PruneAtEveryChance()
    trainer, reporter = train_trial(tmp_path / "epoch", trial, num_train_epochs=1)
    assert trial.reported == [1] and trial.asked_at == [] and not reporter.pruned

    # Early stopping ends training at the second evaluation: that one is the last, not offered.
    trial = PruneAtEveryChance(start=99)
    stop_at_2 = hpsweep.EarlyStoppingCallback(
        early_stopping_patience=1, early_stopping_threshold=10.0
    )
    trainer, reporter = train_trial(
        tmp_path / "steps",
        trial,
        [stop_at_2],
        max_steps=5,
        eval_strategy="steps",
        eval_steps=2,
        metric_for_best_model="eval_accuracy",
        greater_is_better=True,
    )
    assert trial.reported == [1, 2] and trial.asked_at == [1] and trainer.state.global_step == 4
    trainer.evaluate()  # after training, as a sweep does when the last step was not evaluated
    assert trial.reported == [1, 2, 3] and trial.asked_at == [1] and not reporter.pruned


@pytest.mark.parametrize("reads_checkpoints", [False, True])
def test_the_evaluation_that_prunes_a_trial_writes_no_checkpoint_unless_the_backend_reads_it(
    tmp_path: Path, reads_checkpoints: bool
) -> None:
    trial = PruneAtEveryChance(start=2)
    # Optuna and W&B: False; Ray (Tune keeps each result's checkpoint): True
    trial.reads_checkpoints = reads_checkpoints
    # a checkpoint every epoch, 5 steps each
    trainer, reporter = train_trial(tmp_path, trial, num_train_epochs=3)
    assert reporter.pruned and trial.reported == [1, 2] and trainer.state.global_step == 10
    written = [p.name for p in runs.checkpoints(tmp_path)]
    if reads_checkpoints:  # the backend was handed the pruned evaluation's checkpoint, whole
        assert written == ["checkpoint-5", "checkpoint-10"]
        assert trial.checkpoints == [
            str(tmp_path / "checkpoint-5"),
            str(tmp_path / "checkpoint-10"),
        ]
    else:  # pruned at the second evaluation: its checkpoint, which nothing would read, is not written
        assert written == ["checkpoint-5"] and trial.checkpoints == [None, None]
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nor half of it


def test_optuna_records_a_trial_pruned_before_its_last_step(tmp_path: Path) -> None:
    # A real study on SQLite whose pruner stops every trial it is asked about.
    study = optuna.create_study(
        storage=f"sqlite:///{tmp_path / 'study.db'}",
        direction="maximize",
        pruner=optuna.pruners.ThresholdPruner(lower=2.0),
    )
    for epochs, expected in (
        (1, optuna.trial.TrialState.COMPLETE),
        (3, optuna.trial.TrialState.PRUNED),
    ):
        otrial = study.ask()
        _, reporter = train_trial(
            tmp_path / f"e{epochs}", OptunaTrial(otrial, False), num_train_epochs=epochs
        )
        study.tell(otrial, state=expected) if reporter.pruned else study.tell(otrial, 0.5)
    complete, pruned = study.trials
    # each reported its first evaluation, keyed by its training step (an epoch of 5 steps)
    assert complete.state == optuna.trial.TrialState.COMPLETE and list(
        complete.intermediate_values
    ) == [5]
    assert pruned.state == optuna.trial.TrialState.PRUNED and list(pruned.intermediate_values) == [
        5
    ]


def test_a_sweeps_pruned_trials_stop_before_their_last_evaluation(tmp_path: Path) -> None:
    space = write_space(
        tmp_path, epochs=4, space='{"learning_rate": hpsweep.Float(1e-6, 1e-1, log=True)}'
    )
    hpsweep_cli("run", space, "--n-trials", "12", "--sampler", "random", "--seed", "3", check=True)
    records = runs.read_trials(tmp_path / "out")
    pruned = [r for r in records if r.state == "pruned"]
    assert pruned, "this seed prunes some trials"
    assert all(len(r.history) < 4 for r in pruned)
    for r in pruned:  # a checkpoint for each evaluation but the one that pruned it
        assert [c.name for c in runs.checkpoints(Path(r.run_dir))] == [
            f"checkpoint-{h['step']}" for h in r.history[:-1]
        ]
    assert all(len(r.history) == 4 for r in records if r.state == "complete")
    study = load_sweep_study(tmp_path / "out")
    steps = {r.number: [h["step"] for h in r.history] for r in records}
    for t in study.trials:  # keyed by the training step, as the records and every logger are
        assert sorted(t.intermediate_values) == steps[t.number]
        if t.state == optuna.trial.TrialState.PRUNED:
            assert max(t.intermediate_values) < 32  # before the last of 4 epochs of 8 steps
