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
from hpsweep.search.backends._optuna._study_ledger import StudyLedger
from hpsweep.search.ledger import Ledger
from hpsweep.search.ledger_base import Claim, LedgerSession, TrialLedger, Verdict
from hpsweep.trial import Trial


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
    with ledger.locked() as session:
        assert session.claim() is Verdict.DONE
    first = runs.read_trials(swept)[0]
    # Ray's driver sends a trial its stop cut short back to wait (``pruned`` -> ``stopped``)
    in_another_process(f"""
        from pathlib import Path
        from hpsweep import runs
        record = runs.TrialRecord.load(Path({first.run_dir!r}) / runs.TRIAL_FILE)
        record.finish("stopped", error="the sweep stopped while it ran")
    """)
    with ledger.locked() as session:  # the same ledger, a moment later: not the record it read
        claim = session.claim()
    assert isinstance(claim, Claim) and claim.again is not None and claim.again.id == first.id
    claim.lease.release()
    assert runs.read_trials(swept)[0].state == "running"  # claimed: no other worker takes it too


def test_a_trial_finished_on_another_host_counts_at_once(swept: Path) -> None:
    ledger = Ledger(swept, n_trials=4)
    with ledger.locked() as session:
        claim = session.claim()
    assert isinstance(claim, Claim) and claim.again is None  # one trial still to run
    claim.lease.release()
    in_another_process(f"""
        from pathlib import Path
        from hpsweep import runs
        runs.TrialRecord(id="ray-7", number=7, backend="ray", params={{}}, run_dir={str(swept / "run-ray-7")!r},
                         objective=0.5).finish("complete")
    """)
    assert ledger.finished() == 4
    with ledger.locked() as session:
        assert session.claim() is Verdict.DONE


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


# --- what executor backends (Ray's driver and workers, W&B's agent) ask of the ledger -------------


def recorded(out: Path, number: int, state: str, **fields) -> runs.TrialRecord:
    record = runs.TrialRecord(
        id=str(number), number=number, backend="ray", params={}, run_dir=str(out / f"run-{number}")
    )
    record.finish(state, **fields)
    return record


def test_a_new_trial_takes_a_number_no_record_or_live_lease_has(tmp_path: Path) -> None:
    for number, state in enumerate(["complete", "failed", "stopped"]):
        recorded(tmp_path, number, state)
    ledger = Ledger(tmp_path, n_trials=None)
    with ledger.locked() as session:
        claim = session.claim_new(numbered=True, prefer=1)  # 1 is taken: the next free
        assert isinstance(claim, Claim) and claim.number == 3
        claim.lease.bind("3", number=claim.number)
        assert session.next_number() == 4 and session.next_number(prefer=7) == 7
    claim.lease.release()  # never recorded: its number is free again
    with ledger.locked() as session:
        assert session.next_number() == 3


def test_trials_waiting_to_run_again_hold_places_only_for_an_executor_that_reruns(
    tmp_path: Path,
) -> None:
    recorded(tmp_path, 0, "complete")
    recorded(tmp_path, 1, "stopped")
    ledger = Ledger(tmp_path, n_trials=2)
    with ledger.locked() as session:
        assert session.needed() == 0 and session.claim_new() is Verdict.WAIT
        claim = session.claim_new(waiting_run_again=False)  # W&B's server cannot run it again
    assert isinstance(claim, Claim)
    claim.lease.release()


def test_settling_a_round_reruns_what_the_stop_cut_short_and_fails_a_trial_that_keeps_dying(
    tmp_path: Path,
) -> None:
    stopped_at = recorded(tmp_path, 0, "pruned").finished_at + 1  # pruned before the stop
    cut = recorded(tmp_path, 1, "pruned")
    cut.finished_at = stopped_at + 1  # ended by the stop: Tune says "pruned" all the same
    cut.save()
    dying = runs.TrialRecord(
        id="2", number=2, backend="ray", params={}, run_dir=str(tmp_path / "run-2")
    )
    dying.save()  # running, its worker dead
    ledger = Ledger(tmp_path, n_trials=3)
    with ledger.locked() as session:
        session.settle(
            ["0", "1", "2"], stopped_at=stopped_at, lost={"2"}, lost_error="died {times}x"
        )
    states = {r.id: r.state for r in runs.read_trials(tmp_path)}
    assert states == {"0": "pruned", "1": "stopped", "2": "stopped"}  # the first death: again
    with ledger.locked() as session:
        session.settle(["2"], lost={"2"}, lost_error="died {times}x")
    [failed] = [r for r in runs.read_trials(tmp_path) if r.state == "failed"]
    assert failed.id == "2" and failed.error == "died 2x"


def test_a_trial_its_executor_stopped_by_raising_is_restated(tmp_path: Path) -> None:
    record = recorded(tmp_path, 0, "failed", error="KeyboardInterrupt")
    (Path(record.run_dir) / "error.log").write_text("Traceback ...")
    with Ledger(tmp_path, n_trials=1).locked() as session:
        session.restate("0", "pruned")
    [again] = runs.read_trials(tmp_path)
    assert again.state == "pruned" and again.error is None
    assert not (Path(record.run_dir) / "error.log").exists()


# --- the seam: one protocol, a session for what needs the lock, one claim sequence --------------

#: What runs only under the files ledger's lock.
LOCKED_ONLY = (
    "reap",
    "claim",
    "claim_new",
    "claim_trial",
    "next_number",
    "needed",
    "settle",
    "restate",
    "fail_unrecorded",
)


def test_both_homes_are_trial_ledgers_whose_lock_yields_a_session(tmp_path: Path) -> None:
    for ledger in (Ledger(tmp_path, n_trials=3), StudyLedger(tmp_path, n_trials=3)):
        assert isinstance(ledger, TrialLedger)
        assert not hasattr(ledger, "reap")  # reaping needs the lock: only its session reaps
        with ledger.locked() as session:
            assert isinstance(session, LedgerSession) and callable(session.reap)


def test_what_needs_the_lock_is_reached_only_through_the_session(tmp_path: Path) -> None:
    recorded(tmp_path, 0, "stopped")
    ledger = Ledger(tmp_path, n_trials=1)
    assert not [name for name in LOCKED_ONLY if hasattr(ledger, name)]
    with ledger.locked() as session:
        assert session.next_number() == 1 and session.needed() == 0
    with pytest.raises(RuntimeError, match="take the lock again"):
        session.claim()  # kept past its block: refused, not run without the lock
    assert runs.read_trials(tmp_path)[0].state == "stopped"  # nothing was claimed


def test_a_claim_whose_trial_is_not_made_gives_its_place_back(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path, n_trials=1)

    def new(session):
        return session.claim_new(numbered=True)

    def broken(claim: Claim) -> Trial:
        raise ValueError("the backend could not make the trial")

    with pytest.raises(ValueError):
        ledger.take_trial(new, broken)
    assert ledger.take_trial(new, lambda claim: None) is Verdict.DONE  # nothing more to try
    assert ledger.live() == []  # both places given back
    claimed = ledger.take_trial(new, lambda claim: Trial(claim.number))
    assert [lease.number for lease in ledger.live()] == [claimed.trial.number] == [0]
    assert ledger.take_trial(new, lambda claim: Trial(claim.number)) is Verdict.WAIT  # 1 runs
    claimed.claim.lease.release()
