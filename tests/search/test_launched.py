"""A Hugging Face user's script started by torchrun: ``torchrun --nproc_per_node 2 script.py``.

Every process builds the Trainer and calls ``hyperparameter_search``; the processes run one sweep
together: rank 0 alone asks Optuna and writes the records, and every trial is trained by both
processes (each one half of the batches), with the same params, the ones Optuna suggested in
``hp_space`` and in ``model_init``. Both return the same best run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import optuna
from support import USER_SCRIPT_PRELUDE, free_port, load_sweep_study

TRAIN, BATCH, PROCESSES = 128, 16, 2

SCRIPT = (
    USER_SCRIPT_PRELUDE
    + f"TRAIN, BATCH = {TRAIN}, {BATCH}\n"
    + """
import os
from hpsweep import TrainerCallback

out, rank = sys.argv[1], int(os.environ["RANK"])


class Seen(TrainerCallback):
    # where this process trained each trial: its world, its share of the batches, its params
    def on_train_begin(self, args, state, control, train_dataloader=None, model=None, **kwargs):
        seen = {
            "run": os.path.basename(args.output_dir),
            "world_size": args.world_size,
            "process_index": args.process_index,
            "batches": len(train_dataloader),
            "learning_rate": args.learning_rate,
            "hidden": model.net[0].out_features,
        }
        with open(os.path.join(out, f"seen-{rank}.jsonl"), "a") as f:
            f.write(json.dumps(seen) + "\\n")


def model_init(trial):
    return Net(hidden=trial.suggest_int("hidden", 4, 32) if trial is not None else 16)


def hp_space(trial):
    return {"learning_rate": trial.suggest_float("learning_rate", 1e-3, 1e-1, log=True)}


trainer = Trainer(
    model_init=model_init,
    args=TrainingArguments(
        output_dir=os.path.join(out, "sweep"),
        num_train_epochs=1,
        per_device_train_batch_size=BATCH,
        eval_strategy="steps",
        eval_steps=2,  # two evaluations a trial: the first is offered for pruning
        report_to="none",
        disable_tqdm=True,
    ),
    train_dataset=rows(TRAIN, 1),
    eval_dataset=rows(64, 2),
    callbacks=[Seen()],
)
best = trainer.hyperparameter_search(hp_space=hp_space, n_trials=3, direction="minimize", backend="optuna")
with open(os.path.join(out, f"best-{rank}.json"), "w") as f:  # what each process returned
    json.dump({"run_id": best.run_id, "objective": best.objective, "hyperparameters": best.hyperparameters}, f)
"""
)


def torchrun(script: Path, *args: object, timeout: float = 120) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node 2 script ARGS`` on this machine, as a user starts it."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={PROCESSES}",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            str(script),
            *map(str, args),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_torchrun_processes_train_every_trial_together_and_return_one_best(
    tmp_path: Path,
) -> None:
    script = tmp_path / "search.py"
    script.write_text(SCRIPT)
    proc = torchrun(script, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    # every process returned the same best run
    bests = [json.loads((tmp_path / f"best-{rank}.json").read_text()) for rank in range(PROCESSES)]
    assert bests[0] == bests[1]
    best = bests[0]

    # one study, of exactly n_trials, asked by rank 0 alone; the best run is its best trial
    study = load_sweep_study(tmp_path / "sweep", study_name="hpsweep")
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 3
    assert best["objective"] == study.best_value
    assert best["hyperparameters"] == study.best_params
    assert set(best["hyperparameters"]) == {"learning_rate", "hidden"}
    assert sorted(p.name for p in (tmp_path / "sweep").glob("run-*")) == ["run-0", "run-1", "run-2"]

    # each trial trained on both processes, with its params, each on half of the batches
    seen = {
        rank: [
            json.loads(line) for line in (tmp_path / f"seen-{rank}.jsonl").read_text().splitlines()
        ]
        for rank in range(PROCESSES)
    }
    for rank, runs in seen.items():
        assert [r["run"] for r in runs] == ["run-0", "run-1", "run-2"]
        assert {(r["world_size"], r["process_index"], r["batches"]) for r in runs} == {
            (PROCESSES, rank, TRAIN // BATCH // PROCESSES)
        }
    for trial, ours, theirs in zip(study.trials, seen[0], seen[1]):
        asked = {"learning_rate": trial.params["learning_rate"], "hidden": trial.params["hidden"]}
        assert {k: ours[k] for k in asked} == {k: theirs[k] for k in asked} == asked
