"""transformers' ``report_to`` in a sweep: each trial fed to TensorBoard and W&B as its own run, on
the one step axis (the training step) that Optuna's intermediate values use too, and every other
name transformers accepts refused in one line before anything is written.

TensorBoard's files are read back with TensorBoard's own event reader; W&B's offline run files
as the bytes `wandb sync` uploads (as tests/train/test_hf_search.py reads them)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from support import hpsweep_cli, load_sweep_study, write_space
from support.tiny_model import FourClassNet, four_class_rows
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata

import hpsweep
from hpsweep import runs
from hpsweep.errors import UserError
from hpsweep.search.job import REPORT_TO

#: Four evaluations per trial (16 steps of 32 rows), so the axis has several points.
EVERY_4_STEPS = ', eval_strategy="steps", eval_steps=4, logging_strategy="steps", logging_steps=2'


def events(run_dir: str | Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return accumulator


def scalars(accumulator: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, pytest.approx(e.value)) for e in accumulator.Scalars(tag)]


def hparams_of(accumulator: EventAccumulator) -> dict[str, float]:
    """The params the HParams tab shows for the run."""
    content = accumulator.SummaryMetadata(hparams_metadata.SESSION_START_INFO_TAG)
    info = hparams_metadata.parse_session_start_info_plugin_data(content.plugin_data.content)
    return {name: value.number_value for name, value in info.hparams.items()}


def test_report_to_tensorboard_writes_one_run_per_trial_on_the_training_step(
    tmp_path: Path,
) -> None:
    """Two worker processes, each with its own writers: every trial's folder holds its run, whose
    evaluation scalars sit at the steps of its record and of Optuna's intermediate values, and
    whose HParams are its params and objective."""
    space = write_space(tmp_path, extra_args=f', report_to="tensorboard"{EVERY_4_STEPS}')
    hpsweep_cli("run", space, "--n-trials", "2", "--n-jobs", "2", check=True)
    records = runs.read_trials(tmp_path / "out")
    study = load_sweep_study(tmp_path / "out")
    assert len(records) == 2 and {r.state for r in records} == {"complete"}
    for record in records:
        run = events(record.run_dir)
        evaluations = [(h["step"], pytest.approx(h["eval_accuracy"])) for h in record.history]
        assert [step for step, _ in evaluations] == [4, 8, 12, 16]
        assert scalars(run, "eval/accuracy") == evaluations
        assert [step for step, _ in scalars(run, "train/loss")] == list(range(2, 17, 2))
        assert hparams_of(run) == pytest.approx(record.params)
        assert scalars(run, "hparams/eval_accuracy") == [(16, pytest.approx(record.objective))]
        # Optuna's intermediate values, as optuna-dashboard plots them, on the same axis
        values = study.trials[record.number].intermediate_values
        assert sorted(values.items()) == evaluations


RUN_ONCE_THEN_DIE = """
import os

class DieOnceAfterCheckpoint(hpsweep.TrainerCallback):
    '''The first run of the trial dies at step 12, after evaluating there; its checkpoint is 8.'''
    def on_save(self, args, state, control, **kwargs):
        pass  # waits until the checkpoint is on disk
    def on_evaluate(self, args, state, control, **kwargs):
        mark = os.path.join(os.path.dirname(args.output_dir), "died")
        if state.global_step == 12 and not os.path.exists(mark):
            open(mark, "w").close()
            os._exit(1)

callbacks = [DieOnceAfterCheckpoint()]
"""


def test_a_trial_run_again_from_its_checkpoint_shows_each_step_once(
    tmp_path: Path, offline_wandb: None
) -> None:
    """The first run of the trial wrote steps 4 to 12 and died; the second resumes from step 8.
    TensorBoard shows each step once, the second run's from 12 on, and W&B goes on in one run:
    also when the shell the commands start from runs W&B itself (a notebook that used wandb),
    whose service outlives the dead command."""
    import wandb

    wandb.setup()  # this process's W&B service, named to its children in WANDB_SERVICE
    assert os.environ.get("WANDB_SERVICE")
    space = write_space(
        tmp_path,
        space='{"learning_rate": hpsweep.Float(1e-3, 3e-1, log=True)}',
        extra_args=', report_to=["tensorboard", "wandb"], eval_strategy="steps", eval_steps=4, '
        "save_strategy='steps', save_steps=8",
        extra=RUN_ONCE_THEN_DIE,
    )
    assert hpsweep_cli("run", space, "--n-trials", "1").returncode == 1
    hpsweep_cli("run", space, "--n-trials", "1", check=True)
    [record] = runs.read_trials(tmp_path / "out")
    assert record.attempts == 2 and record.resumed_from.endswith("checkpoint-8")
    run = events(record.run_dir)
    second = [(h["step"], pytest.approx(h["eval_accuracy"])) for h in record.history]
    assert [step for step, _ in scalars(run, "eval/accuracy")] == [4, 8, 12, 16]
    assert scalars(run, "eval/accuracy")[2:] == second[2:]  # 12: the second run's
    offline = sorted((tmp_path / "out" / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and len({d.name.rpartition("-")[2] for d in offline}) == 1
    wandb.teardown()


# --- W&B, from Trainer.hyperparameter_search -------------------------------------------------------


def search(out: Path, report_to: str) -> None:
    """Two trials of `Trainer.hyperparameter_search`, four evaluations each."""
    args = hpsweep.TrainingArguments(
        str(out), num_train_epochs=1, eval_strategy="steps", eval_steps=4, report_to=report_to
    )
    trainer = hpsweep.Trainer(
        model_init=lambda trial: FourClassNet(),
        args=args,
        train_dataset=four_class_rows(128, 1),
        eval_dataset=four_class_rows(64, 2),
        compute_metrics=lambda p: {
            "accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())
        },
    )
    trainer.hyperparameter_search(
        space={"learning_rate": hpsweep.Float(1e-3, 3e-1, log=True)},
        n_trials=2,
        direction="maximize",
        objective="eval_accuracy",
        study_name="lines",
        show_progress=False,
    )


def test_report_to_wandb_offline_makes_one_run_per_trial_grouped_by_the_sweep(
    tmp_path: Path, offline_wandb: None
) -> None:
    out = tmp_path / "out"
    search(out, "wandb")
    import wandb

    wandb.teardown()  # W&B's service writes the offline runs' files after they finish
    files = {
        d.name: next(d.glob("run-*.wandb")).read_bytes() for d in (out / "wandb").glob("offline-*")
    }
    records = runs.read_trials(out)
    assert len(files) == len(records) == 2
    for record in records:
        # the run named by the trial's folder holds its params, in the sweep's project and group
        [run] = [f for f in files.values() if Path(record.run_dir).name.encode() in f]
        assert json.dumps(record.params["learning_rate"]).encode() in run
        assert b"lines" in run and str(out.resolve()).encode() in run
        assert b"eval/accuracy" in run and b"train/loss" in run


# --- names that cannot work ---------------------------------------------------------------------------


def test_every_name_transformers_accepts_works_or_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    for name in ["all", "none", *INTEGRATION_TO_CALLBACK, "tensorbord"]:
        if name in (*REPORT_TO, "all", "none"):
            assert hpsweep.TrainingArguments(report_to=[name]).report_to == [name]
            continue
        with pytest.raises(UserError) as refused:
            hpsweep.TrainingArguments(report_to=name)
        message = str(refused.value)
        assert "\n" not in message and f"report_to={name!r}" in message, message
        assert all(n in message for n in ("'tensorboard'", "'wandb'", "'mlflow'"))
    assert "did you mean 'tensorboard'" in message  # the typo's line
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as where it is not installed
    with pytest.raises(UserError, match="report_to='tensorboard' needs tensorboard: pip install"):
        hpsweep.TrainingArguments(report_to="tensorboard")


def test_a_refused_name_in_a_space_file_stops_the_command_before_anything_is_written(
    tmp_path: Path,
) -> None:
    space = write_space(tmp_path, extra_args=', report_to=["tensorboard", "comet_ml"]')
    proc = hpsweep_cli("run", space, "--n-trials", "1")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "report_to='comet_ml'" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["space.py"]


def test_report_to_wandb_without_a_login_stops_the_sweep_in_one_line(
    tmp_path: Path, offline_wandb: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import wandb

    wandb.teardown()  # W&B reads its mode once per process
    monkeypatch.delenv("WANDB_MODE")
    with pytest.raises(UserError) as refused:
        search(tmp_path / "out", "wandb")
    assert "\n" not in str(refused.value) and "WANDB_MODE=offline" in str(refused.value)
    assert not (tmp_path / "out").exists()
    wandb.teardown()
