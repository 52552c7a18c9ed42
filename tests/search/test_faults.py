"""Fault injection: random ``kill -9`` / SIGINT moments across single and ``--n-jobs 2`` sweeps,
each followed by the same command, checking every invariant of docs/guarantees.md.

CI runs a few moments (``HPSWEEP_FAULT_MOMENTS``, default 2: one per mode). The full run prints
a table and is what docs/guarantees.md reports:

    HPSWEEP_FAULT_MOMENTS=40 python -m pytest tests/search/test_faults.py -m faults -s
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
from support import hpsweep_cli, slow_space
from support.sweep_invariants import alive, finished_at, start, violations, worker_pids

MOMENTS = int(os.environ.get("HPSWEEP_FAULT_MOMENTS", "2"))
N_TRIALS = 4


@pytest.mark.faults
def test_random_interruptions_break_no_invariant(tmp_path: Path) -> None:
    rng = random.Random(int(os.environ.get("HPSWEEP_FAULT_SEED", "0")))
    rows = []
    for i in range(MOMENTS):
        n_jobs = 1 if i % 2 == 0 else 2
        how = rng.choice([signal.SIGKILL, signal.SIGINT])
        delay = rng.uniform(0.5, 8.0)
        folder = tmp_path / f"m{i}"
        folder.mkdir()
        space, out = slow_space(folder), folder / "out"
        argv = ["run", str(space), "--n-trials", str(N_TRIALS), "--n-jobs", str(n_jobs)]
        proc = start(*argv)
        time.sleep(delay)
        workers = worker_pids(out) - {proc.pid}
        proc.send_signal(how)
        proc.communicate(timeout=120)
        time.sleep(1.0)
        found = [f"worker {pid} outlived the command" for pid in workers if alive(pid)]
        before = finished_at(out)
        rerun = hpsweep_cli(*argv)
        if rerun.returncode != 0:
            found.append(
                f"rerun exited {rerun.returncode}: {rerun.stderr.strip().splitlines()[-1:]}"
            )
        else:
            found += violations(out, N_TRIALS, before=before)
        rows.append(
            (
                i,
                f"--n-jobs {n_jobs}",
                signal.Signals(how).name,
                f"{delay:.1f}s",
                len(found),
                "; ".join(found),
            )
        )
    print("\n| # | mode | signal | after | violations | detail |\n|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")
    assert [r for r in rows if r[4]] == []
