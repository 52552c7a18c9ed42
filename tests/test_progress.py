"""The sweep's live display in a terminal: a line per finished trial, and a bar that is redrawn as
often as the records are read, not at rich's default 10 Hz (each redraw takes the GIL from the
trial that is training)."""
from __future__ import annotations

import time

import rich.live

from hpsweep import runs
from hpsweep.progress import SweepProgress


def test_the_bar_is_redrawn_as_often_as_the_records_are_read(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich draws as on a terminal
    redraws = []
    original = rich.live.Live.refresh
    monkeypatch.setattr(rich.live.Live, "refresh", lambda self: (redraws.append(time.monotonic()), original(self)))

    progress = SweepProgress(tmp_path, n_trials=2, timeout=None, directions=["maximize"],
                             objective_name="eval_accuracy")
    assert progress.console.is_terminal
    progress.start()
    started = time.monotonic()
    run_dir = runs.run_dir_for(tmp_path, "0")
    run_dir.mkdir()
    record = runs.TrialRecord(id="0", number=0, backend="optuna", params={"learning_rate": 0.01},
                              objective_name="eval_accuracy", directions=["maximize"], run_dir=str(run_dir))
    record.finish("complete", objective=0.9375)
    time.sleep(2.0)
    progress.stop()
    seconds = time.monotonic() - started

    err = capsys.readouterr().err
    assert "complete" in err and "run-0" in err and "eval_accuracy=0.9375" in err and "learning_rate=0.01" in err
    # every interval (0.5 s): the display's own tick plus rich's refresh thread; 10 Hz would be ~20 in 2 s
    assert 2 <= len(redraws) <= 2 * seconds / progress.interval + 2, len(redraws)
