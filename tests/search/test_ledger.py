"""The ledger keeps the trial records in memory; what other processes and people write must still
reach it: a second command, a Ray worker on another host, a hand edit of trial.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import hpsweep_cli, write_space

from hpsweep import runs
from hpsweep.search.ledger import Claim, Ledger


@pytest.fixture
def swept(tmp_path: Path) -> Path:
    """A finished sweep of 3 trials: what a second command finds."""
    hpsweep_cli(
        "run", write_space(tmp_path, epochs=1), "--n-trials", "3", "--pruner", "none", check=True
    )
    return tmp_path / "out"


def in_another_process(code: str) -> None:
    """Run ``code`` in a fresh Python, as another command or a Ray worker on another host would."""
    subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True, env={**os.environ})


def test_a_trial_another_process_sends_back_runs_again_here(swept: Path) -> None:
    ledger = Ledger(swept, n_trials=3)
    with ledger.locked():
        assert ledger.claim() == "done"
    first = runs.read_trials(swept)[0]
    # Ray's driver sends a trial its stop cut short back to wait (``pruned`` -> ``stopped``)
    in_another_process(f"""
        from pathlib import Path
        from hpsweep import runs
        record = runs.TrialRecord.load(Path({first.run_dir!r}) / runs.TRIAL_FILE)
        record.finish("stopped", error="the sweep stopped while it ran")
    """)
    with ledger.locked():  # the same ledger, a moment later: not the record it read before
        claim = ledger.claim()
    assert isinstance(claim, Claim) and claim.again is not None and claim.again.id == first.id
    claim.lease.release()
    assert runs.read_trials(swept)[0].state == "running"  # claimed: no other worker takes it too


def test_a_trial_finished_on_another_host_counts_at_once(swept: Path) -> None:
    ledger = Ledger(swept, n_trials=4)
    with ledger.locked():
        claim = ledger.claim()
    assert isinstance(claim, Claim) and claim.again is None  # one trial still to run
    claim.lease.release()
    in_another_process(f"""
        from pathlib import Path
        from hpsweep import runs
        runs.TrialRecord(id="ray-7", number=7, backend="ray", params={{}}, run_dir={str(swept / "run-ray-7")!r},
                         objective=0.5).finish("complete")
    """)
    assert ledger.finished() == 4
    with ledger.locked():
        assert ledger.claim() == "done"


def test_a_record_edited_by_hand_is_read_as_it_is_now(swept: Path, tmp_path: Path) -> None:
    ledger = Ledger(swept, n_trials=3)
    assert ledger.finished() == 3
    path = Path(runs.read_trials(swept)[1].run_dir) / runs.TRIAL_FILE
    data = json.loads(path.read_text())
    data.update(state="failed", error="marked failed by hand: its data was wrong")
    path.write_text(json.dumps(data))  # in place, no journal line: not how hpsweep writes

    assert runs.read_trials(swept)[1].state == "failed"
    assert Ledger(swept, n_trials=3).finished() == 2  # the next command's ledger
    # ... and the same command runs the trial it now lacks
    hpsweep_cli("run", tmp_path / "space.py", "--n-trials", "3", "--pruner", "none", check=True)
    assert [r.state for r in runs.read_trials(swept)] == [
        "complete",
        "failed",
        "complete",
        "complete",
    ]
