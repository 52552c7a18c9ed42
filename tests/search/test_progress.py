"""The sweep's live display in a terminal: a line per finished trial, and a bar that is redrawn as
often as the records are read, not at rich's default 10 Hz (each redraw takes the GIL from the
trial that is training); a plain training run's bar likewise. Off a terminal, whole lines."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import rich.live
import torch
from support import hpsweep_cli, write_space

import hpsweep
from hpsweep import runs
from hpsweep.search.progress import Counts, SweepProgress


def test_the_bar_is_redrawn_as_often_as_the_records_are_read(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich draws as on a terminal
    redraws = []
    original = rich.live.Live.refresh
    monkeypatch.setattr(
        rich.live.Live, "refresh", lambda self: (redraws.append(time.monotonic()), original(self))
    )

    progress = SweepProgress(
        tmp_path, n_trials=2, timeout=None, directions=["maximize"], objective_name="eval_accuracy"
    )
    assert progress.console.is_terminal
    progress.start()
    started = time.monotonic()
    run_dir = runs.run_dir_for(tmp_path, "0")
    run_dir.mkdir()
    record = runs.TrialRecord(
        id="0",
        number=0,
        backend="optuna",
        params={"learning_rate": 0.01},
        objective_name="eval_accuracy",
        directions=["maximize"],
        run_dir=str(run_dir),
    )
    record.finish("complete", objective=0.9375)
    time.sleep(2.0)
    progress.stop()
    seconds = time.monotonic() - started

    err = capsys.readouterr().err
    assert (
        "complete" in err
        and "run-0" in err
        and "eval_accuracy=0.9375" in err
        and "learning_rate=0.01" in err
    )
    # every interval (0.5 s): the display's own tick plus rich's refresh thread; 10 Hz would be ~20 in 2 s
    assert 2 <= len(redraws) <= 2 * seconds / progress.interval + 2, len(redraws)


def test_a_sweep_logged_to_a_file_keeps_every_param_and_the_progress_on_one_line_per_trial(
    tmp_path,
):
    # Long parameter names, as a Hugging Face space has: a terminal line would cut them at its width.
    space = write_space(
        tmp_path,
        space='{"learning_rate": hpsweep.Float(1e-3, 3e-1, log=True), '
        '"per_device_train_batch_size": hpsweep.Categorical([16, 32]), '
        '"hidden": hpsweep.Int(8, 32, step=8), "weight_decay": hpsweep.Float(0, 0.1)}',
    )
    # stdout and stderr: pipes
    proc = hpsweep_cli("run", space, "--n-trials", "3", "--pruner", "none", check=True)
    lines = [line for line in proc.stderr.splitlines() if " run-" in line]
    assert len(lines) == 3
    for done, line in enumerate(lines, 1):
        assert all(
            f"{name}=" in line
            for name in ("learning_rate", "per_device_train_batch_size", "hidden", "weight_decay")
        ), line
        # the next trial may already run when the display reads the trial's end
        assert "…" not in line and re.search(
            rf"\({done}/3 done, (1 running, )?best eval_accuracy=", line
        ), line
    best_line = next(line for line in proc.stdout.splitlines() if line.startswith("best run-"))
    # one line, whole JSON
    params = json.loads(best_line.split("params=", 1)[1].split("  checkpoint=")[0])
    best = runs.read_best(tmp_path / "out")
    assert params == best.hyperparameters and best_line.endswith(best.checkpoint)


def test_a_plain_training_runs_bar_is_redrawn_twice_a_second(tmp_path, monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")
    redraws = []
    original = rich.live.Live.refresh
    monkeypatch.setattr(
        rich.live.Live, "refresh", lambda self: (redraws.append(time.monotonic()), original(self))
    )

    class Slow(hpsweep.TrainerCallback):  # a run long enough to count redraws: 20 steps of 0.1 s
        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(0.1)

    x = torch.randn(320, 8, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
    args = hpsweep.TrainingArguments(
        str(tmp_path),
        num_train_epochs=1,
        per_device_train_batch_size=16,
        eval_strategy="no",
        save_strategy="no",
    )
    trainer = hpsweep.Trainer(
        model=torch.nn.Linear(8, 2),
        args=args,
        train_dataset=data,
        callbacks=[Slow()],
        compute_loss_func=lambda out, y, **kw: torch.nn.functional.cross_entropy(out, y),
    )
    started = time.monotonic()
    assert trainer.train().global_step == 20
    seconds = time.monotonic() - started
    assert 2 <= len(redraws) <= 2 * seconds + 3, len(redraws)  # 10 Hz would be ~20


def test_off_a_terminal_rich_waits_for_the_first_line_and_the_lines_are_whole(tmp_path):
    # A pipe, as a cluster job's log or `hpsweep run ... | tee` has: no bar to draw, so the display
    # costs the first trial nothing (rich's import is ~20 ms of the GIL) and writes whole lines.
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from hpsweep import runs
        from hpsweep.search.progress import Counts, SweepProgress

        out = Path({str(tmp_path)!r})
        progress = SweepProgress(out, n_trials=2, timeout=None, directions=["maximize"], objective_name="eval_accuracy",
                                 interval=0.05)
        progress.start()
        time.sleep(0.3)
        before = "rich" in sys.modules
        run_dir = runs.run_dir_for(out, "0")
        run_dir.mkdir()
        record = runs.TrialRecord(id="0", number=0, backend="optuna", params={{"learning_rate": 0.01}},
                                  objective_name="eval_accuracy", directions=["maximize"], run_dir=str(run_dir))
        record.finish("complete", objective=0.9375)
        time.sleep(0.3)
        print("rich before the first line:", before, "after:", "rich" in sys.modules)
        progress.stop()
    """)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("FORCE_COLOR", "TTY_INTERACTIVE", "TTY_COMPATIBLE")
    }
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "rich before the first line: False after: True" in proc.stdout
    line = next(line for line in proc.stderr.splitlines() if " run-0" in line)
    assert "complete" in line and "eval_accuracy=0.9375" in line and "learning_rate=0.01" in line
    assert "(1/2 done, best eval_accuracy=0.9375 (run-0)" in line


def test_a_trial_that_ends_while_the_study_is_read_is_counted_on_its_own_line_only(
    tmp_path, capsys
):
    """Machines that share a study count its trials; a trial of this machine that ended while
    the counts were read is in them, but the line of the trial before it still counts 1, not 2."""
    progress: SweepProgress

    def finish(number: int) -> None:
        run_dir = runs.run_dir_for(tmp_path, str(number))
        run_dir.mkdir()
        runs.TrialRecord(
            id=str(number),
            number=number,
            backend="optuna",
            params={"learning_rate": 0.01 * (number + 1)},
            objective_name="eval_accuracy",
            directions=["maximize"],
            run_dir=str(run_dir),
        ).finish("complete", objective=0.5 + number / 10)

    reads = []

    def study_counts() -> Counts:
        reads.append(time.time())
        if len(reads) == 2:  # the read for run-0's line: trial 1 ends meanwhile, and is told
            finish(1)
        done = 0 if len(reads) == 1 else 2
        return Counts(done=done, best=(0.6, 1) if done else None, as_of=time.time())

    progress = SweepProgress(
        tmp_path,
        n_trials=2,
        timeout=None,
        directions=["maximize"],
        objective_name="eval_accuracy",
        interval=0.05,
        counts=study_counts,
        counts_every=60.0,
    )
    progress.start()
    finish(0)
    time.sleep(0.5)
    progress.stop()
    lines = [line for line in capsys.readouterr().err.splitlines() if " run-" in line]
    assert [line.split()[1] for line in lines] == ["run-0", "run-1"], lines
    assert "(1/2 done" in lines[0] and "(2/2 done" in lines[1], lines
    assert "best eval_accuracy=0.5 (run-0)" in lines[0], lines  # not trial 1's, to come
