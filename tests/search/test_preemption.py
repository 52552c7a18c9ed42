"""A trial stopped at every moment of its life, on many machines (docs/many-machines.md).

One trial, one machine after another: each machine is stopped, by ``kill -9`` (a dead machine) or
SIGTERM (a preempted one), at the next named moment of the trial (`hpsweep.faults`: the machine
waits at the moment until the signal comes, so the moment is exact, not a lucky sleep), and the
next machine takes the trial over. Where the trial has a complete checkpoint it resumes from it;
where it has none it starts over. The last machine finishes the sweep: the study holds exactly the
sweep's trial, COMPLETE, with nothing FAIL, WAITING or RUNNING, and the home holds its record.

Run on PostgreSQL with a folder home (what machines that mount one NFS folder share), and
through Optuna's storage proxy with an ``s3://`` home (the local S3 server). After ``kill -9``
the next machine waits for the trial's heartbeat to go stale (the 20 s grace) before it takes
it; after SIGTERM the stopped machine put it back itself.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from support import slow_space
from support.machines import Machine, postgres_proxy_and_bucket, sweep_args
from support.sweep_invariants import wait_for

from hpsweep import faults, runs

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning"),
]

STUDY = "moments"
FOLDER_MOMENTS = ("claimed", "recorded", "writing", "checkpointed", "ended")
BUCKET_MOMENTS = ("claimed", "recorded", "uploading", "checkpointed", "ended")


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_on_postgresql_a_trial_stopped_at_any_moment_is_finished_by_the_next_machine(
    pg, tmp_path, how
):
    url = pg.create_database(f"moments_{how.name.lower()}")
    home = tmp_path / "home"
    _stop_at_each_moment(tmp_path, url, url, str(home), FOLDER_MOMENTS, how, _FolderHome(home))


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_through_the_proxy_a_trial_stopped_at_any_moment_is_finished_by_the_next_machine(
    pg, tmp_path, monkeypatch, how
):
    name = f"moments_proxy_{how.name.lower()}"
    with postgres_proxy_and_bucket(pg, monkeypatch, name) as (url, database, s3):
        home = _BucketHome(s3, "sweeps", "moments")
        _stop_at_each_moment(tmp_path, url, database, home.url, BUCKET_MOMENTS, how, home)


def _stop_at_each_moment(
    tmp_path: Path,
    url: str,
    database: str,
    home_url: str,
    moments: tuple[str, ...],
    how: signal.Signals,
    home: _FolderHome | _BucketHome,
) -> None:
    # 16 steps, a checkpoint every 4: the first one comes while the trial trains
    space = slow_space(tmp_path, step_s=0.05)
    args = sweep_args(space, url, STUDY, home_url, 1)
    recorded = 0  # the runs of the trial that left a record
    for moment in moments:
        resumable = bool(home.complete_checkpoints())
        at = tmp_path / f"at-{moment}"
        env = {faults.AT_ENV: moment, faults.FILE_ENV: str(at)}
        machine = Machine(tmp_path, f"m-{moment}", *args, env=env)
        assert wait_for(at.exists, timeout=240), machine.finish(timeout=5)
        _stop(machine, how)
        # a process killed before its first write leaves nothing; a stopped one records that
        recorded += not (moment == "claimed" and how == signal.SIGKILL)
        _check_stopped_at(moment, how, home, database, recorded, resumable)

    code, output = Machine(tmp_path, "last", *args).finish()
    assert code == 0, output
    assert "Traceback" not in output
    trials = optuna.load_study(study_name=STUDY, storage=database).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE]
    record = home.record()
    assert record.state == "complete" and record.attempts == recorded + 1
    assert record.resumed_from and Path(record.resumed_from).name.startswith("checkpoint-")
    assert home.best_run_id() == record.id


def _stop(machine: Machine, how: signal.Signals) -> None:
    if how == signal.SIGKILL:
        os.killpg(machine.proc.pid, signal.SIGKILL)  # the machine is gone: no goodbye
        machine.proc.wait()
        return
    machine.proc.send_signal(signal.SIGTERM)  # the preemption notice a pod or a spot VM gets
    code, output = machine.finish(timeout=120)
    assert code == 128 + signal.SIGTERM, output
    assert "Traceback" not in output


def _check_stopped_at(
    moment: str,
    how: signal.Signals,
    home: _FolderHome | _BucketHome,
    database: str,
    recorded: int,
    resumable: bool,
) -> None:
    """What the run stopped at ``moment`` left where the next machine finds it; ``resumable``:
    whether a complete checkpoint was there when the run began."""
    [trial] = optuna.load_study(study_name=STUDY, storage=database).trials
    # a stopped machine puts its trial back itself; a dead one leaves it to be judged dead
    assert trial.state == (TrialState.RUNNING if how == signal.SIGKILL else TrialState.WAITING)
    record = home.record()
    if recorded == 0:
        assert record is None
        return
    assert record.attempts == recorded
    if moment == "claimed" and how == signal.SIGKILL:
        return  # the record is an earlier run's
    # the run resumed from a complete checkpoint if there was one, else it started over
    assert bool(record.resumed_from) == resumable, record
    ended = moment == "ended"
    assert record.state == (
        "complete" if ended else ("running" if how == signal.SIGKILL else "stopped")
    ), record
    complete = home.complete_checkpoints()
    if moment in ("recorded", "uploading") or (moment == "writing" and how == signal.SIGKILL):
        assert bool(complete) == resumable  # nothing whole was added
    if moment == "uploading" or (moment == "writing" and how == signal.SIGKILL):
        assert home.partial_checkpoint()  # half a checkpoint, which no machine takes for one
    if moment in ("checkpointed", "ended") or (moment == "writing" and how == signal.SIGTERM):
        assert complete  # a stopped process finishes the checkpoint it was writing


class _FolderHome:
    """The home as a folder every machine mounts."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def run_dir(self) -> Path | None:
        found = sorted(self.folder.glob("run-*"))
        return found[0] if found else None

    def record(self) -> runs.TrialRecord | None:
        run = self.run_dir()
        return runs.TrialRecord.load(run / runs.TRIAL_FILE) if run else None

    def complete_checkpoints(self) -> list[str]:
        run = self.run_dir()
        return [c.name for c in runs.checkpoints(run)] if run else []

    def partial_checkpoint(self) -> bool:
        run = self.run_dir()
        return bool(run and list(run.glob(".checkpoint-*.tmp-*")))

    def best_run_id(self) -> str | None:
        best = runs.read_best(self.folder)
        return best.run_id if best else None


class _BucketHome:
    """The home as a prefix in the local S3 server's bucket."""

    def __init__(self, s3, bucket: str, prefix: str) -> None:
        self.s3, self.bucket, self.prefix = s3, bucket, prefix
        self.url = f"s3://{bucket}/{prefix}"

    def record(self) -> runs.TrialRecord | None:
        records = runs.open_home(self.url).records()
        return records[0] if records else None

    def _keys(self) -> list[str]:
        return self.s3.keys(self.bucket, f"{self.prefix}/run-")

    def complete_checkpoints(self) -> list[str]:
        return [k.split("/")[-2] for k in self._keys() if k.endswith("/.complete")]

    def partial_checkpoint(self) -> bool:
        folders = {k.split("/")[-2] for k in self._keys() if "/checkpoint-" in k}
        return bool(folders - set(self.complete_checkpoints()))

    def best_run_id(self) -> str | None:
        import json

        data = self.s3.client().get_object(Bucket=self.bucket, Key=f"{self.prefix}/best_run.json")
        return json.loads(data["Body"].read())["run_id"]
