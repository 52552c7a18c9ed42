"""The sweep folder's Optuna study is Optuna's journal file: it must survive what stops a sweep."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import optuna
from support import hpsweep_cli, load_sweep_study

from hpsweep import runs
from hpsweep.search.backends._optuna._journal import JournalLock


def test_an_append_cut_short_is_dropped_and_the_same_command_goes_on(
    tmp_path: Path, space_file: Path
) -> None:
    hpsweep_cli("run", space_file, "--n-trials", "2", "--pruner", "none", check=True)
    journal = tmp_path / "out" / "study.journal"
    whole = journal.read_bytes()
    with open(journal, "ab") as f:  # what a full disk or kill -9 in the middle of an append leaves
        f.write(b'{"op_code":4,"worker_id":"x","trial_id":1,"par')
    hpsweep_cli("run", space_file, "--n-trials", "4", "--pruner", "none", check=True)
    assert journal.read_bytes().startswith(whole) and journal.read_bytes().endswith(b"\n")
    # Optuna's own reader: it refuses lines after a torn one
    study = load_sweep_study(tmp_path / "out")
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 4
    assert [r.number for r in runs.read_trials(tmp_path / "out")] == [0, 1, 2, 3]


HOLD = """
import sys, time
from pathlib import Path
from hpsweep.search.backends._optuna._journal import JournalLock
JournalLock(Path(sys.argv[1])).acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_the_journal_lock_dies_with_a_process_killed_while_holding_it(tmp_path: Path) -> None:
    journal = tmp_path / "study.journal"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(journal)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        assert (tmp_path / "study.journal.lock").is_symlink()  # Optuna's own lock, held too
        mine = JournalLock(journal)
        taken = threading.Event()
        waiter = threading.Thread(target=lambda: (mine.acquire(), taken.set()), daemon=True)
        waiter.start()
        assert not taken.wait(0.5)  # a real lock: the holder keeps others out
        os.kill(holder.pid, signal.SIGKILL)
        # taken at once, not after Optuna's symlink lock's 30 s grace period
        assert taken.wait(5)
        mine.release()
        assert not (tmp_path / "study.journal.lock").exists()
    finally:
        holder.kill()
        holder.wait()


#: Another program's writer, as Optuna's own ``JournalFileBackend`` appends (its default lock, a
#: symlink), caught in the middle of an append: half a line written, the rest when told.
SLOW_OPTUNA_WRITER = """
import sys
from optuna.storages.journal import JournalFileSymlinkLock
lock = JournalFileSymlinkLock(sys.argv[1])
lock.acquire()
with open(sys.argv[1], "ab") as f:
    f.write(b'{"op_code":0,"worker_id":"w","study_name":"theirs",')
    f.flush()
    print("half", flush=True)
    sys.stdin.readline()
    f.write(b'"directions":[1]}\\n')
lock.release()
"""


def test_a_writer_holding_optunas_own_lock_is_waited_for_and_its_line_never_cut(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "study.journal"
    journal.touch()
    writer = subprocess.Popen(
        [sys.executable, "-c", SLOW_OPTUNA_WRITER, str(journal)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout.readline() == "half\n"
        mine = JournalLock(journal)
        taken = threading.Event()
        waiter = threading.Thread(target=lambda: (mine.acquire(), taken.set()), daemon=True)
        waiter.start()
        # hpsweep waits on the same lock: the half line is a live writer's, not a torn tail
        assert not taken.wait(0.5)
        writer.communicate("go\n", timeout=30)
        assert taken.wait(10)
        mine.release()
    finally:
        writer.kill()
        writer.wait()
    assert journal.read_bytes().endswith(b'"directions":[1]}\n')
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(journal))
    )
    assert [s.study_name for s in storage.get_all_studies()] == ["theirs"]
