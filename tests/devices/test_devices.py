"""Placement: which GPUs each running trial sees, how many run at once, and what is refused.

The planning rules are pure functions over a GPU count, tested here with counts a CPU machine
does not have; the CLI tests fake the count with ``HPSWEEP_FAKE_GPUS`` and check that each
worker trained with the ``CUDA_VISIBLE_DEVICES`` the plan gave it (the trials themselves run on
the CPU: no CUDA here).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from support import hpsweep_cli, write_space

import hpsweep
from hpsweep import devices, runs
from hpsweep.errors import UserError

FOUR = ["0", "1", "2", "3"]


def plan(
    n_jobs: int = 1, gpus: list[str] = FOUR, cores: int = 16, **resources: float
) -> devices.Placement:
    ppt = int(resources.pop("ppt", 1))
    return devices.plan(
        n_jobs=n_jobs, resources=resources or None, processes_per_trial=ppt, gpus=gpus, cores=cores
    )


def refusal(**kwargs: float) -> str:
    with pytest.raises(UserError) as info:
        plan(**kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_each_trial_gets_its_own_gpu_by_default() -> None:
    p = plan(n_jobs=4)
    assert p.resources["gpu"] == 1 and p.slots == 4 and p.note is None
    assert p.gpus == (("0",), ("1",), ("2",), ("3",))
    assert [p.env(slot)["CUDA_VISIBLE_DEVICES"] for slot in range(4)] == FOUR
    assert p.threads == 4  # 16 cores over 4 trials at once


def test_half_a_gpu_packs_two_trials_per_gpu_after_spreading_them() -> None:
    assert plan(n_jobs=2, gpus=["0"], gpu=0.5).gpus == (("0",), ("0",))
    assert plan(n_jobs=4, gpus=["0", "1"], gpu=0.5).gpus == (("0",), ("1",), ("0",), ("1",))
    assert plan(n_jobs=3, gpus=["0"], gpu=0.25).gpus == (("0",),) * 3


def test_whole_gpus_per_trial_are_disjoint_groups() -> None:
    assert plan(n_jobs=2, gpu=2).gpus == (("0", "1"), ("2", "3"))
    # a data-parallel trial takes one GPU per process by default
    p = plan(n_jobs=2, ppt=2)
    # per trial
    assert p.resources["gpu"] == 2 and p.gpus == (("0", "1"), ("2", "3")) and p.threads == 8


def test_more_trials_than_fit_run_as_many_as_fit_and_say_so() -> None:
    p = plan(n_jobs=4, gpus=["0", "1"], gpu=1)
    assert p.slots == 2 and p.gpus == (("0",), ("1",))
    assert p.note is not None and "2 trials run at once" in p.note and "--n-jobs 4" in p.note
    assert plan(n_jobs=5, gpus=["0", "1"], gpu=0.5).slots == 4


def test_cpu_threads_are_split_between_the_trials_that_run_at_once() -> None:
    assert plan(n_jobs=2, gpus=[], cores=8).threads == 4
    assert plan(n_jobs=3, gpus=[], cores=2).threads == 1  # never 0
    assert plan(n_jobs=1, gpus=[], cores=8, cpu=3).threads == 3  # cpu=N is N threads per trial
    assert plan(n_jobs=1, gpus=[], cores=2, cpu=8).threads == 2  # never more threads than cores
    cpu_only = plan(n_jobs=2, gpus=[], cores=8)
    assert cpu_only.gpus is None and "CUDA_VISIBLE_DEVICES" not in cpu_only.env(0)
    assert cpu_only.resources == {"gpu": 0}


def test_gpu_zero_on_a_gpu_machine_hides_the_gpus_as_ray_does() -> None:
    p = plan(n_jobs=2, gpu=0)
    assert (
        p.slots == 2
        and p.env(0)["CUDA_VISIBLE_DEVICES"] == ""
        and p.env(1)["CUDA_VISIBLE_DEVICES"] == ""
    )


def test_requests_the_machine_cannot_meet_are_one_line_naming_the_fix() -> None:
    assert "this machine has 1" in refusal(gpus=["0"], gpu=2) and "gpu=1" in refusal(
        gpus=["0"], gpu=2
    )
    assert "no GPU" in refusal(gpus=[], gpu=1) and "gpu=0" in refusal(gpus=[], gpu=1)
    assert "gpu=1 or gpu=2" in refusal(gpu=1.5)
    assert "give gpu=2" in refusal(ppt=2, gpu=1)
    assert "one per process" in refusal(gpus=["0"], ppt=2)  # the default for 2 processes is 2 GPUs
    assert "cpu=N,gpu=F" in refusal(memory=4)
    assert "number >= 0" in refusal(gpu=-1)


def test_a_remote_cluster_is_placed_by_its_own_scheduler() -> None:
    p = devices.plan(n_jobs=8, resources={"gpu": 4, "cpu": 64}, gpus=[], cores=2, local=False)
    assert p.slots == 8 and p.resources == {"gpu": 4, "cpu": 64}
    # no gpu= given: the cluster's GPUs decide once connected (the Ray backend), not this machine's
    assert devices.plan(
        n_jobs=2, resources={"cpu": 1}, gpus=["0"], cores=2, local=False
    ).resources == {"cpu": 1}
    with pytest.raises(UserError):  # the shape is still checked
        devices.plan(n_jobs=1, resources={"gpu": 1.5}, gpus=[], cores=2, local=False)


def test_visible_gpus_follow_the_fake_count_and_cuda_visible_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HPSWEEP_FAKE_GPUS", "3")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.visible_gpus() == ["0", "1", "2"]
    # a scheduler restricted us: its ids, its order
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert devices.visible_gpus() == ["2", "0"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert devices.visible_gpus() == []
    monkeypatch.setenv("HPSWEEP_FAKE_GPUS", "two")
    with pytest.raises(UserError):
        devices.visible_gpus()


def test_a_gpu_request_on_this_cpu_machine_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HPSWEEP_FAKE_GPUS", raising=False)
    if devices.visible_gpus():
        pytest.skip("needs a machine where CUDA sees no GPU")
    space = write_space(tmp_path)
    with pytest.raises(UserError, match="CUDA sees no GPU"):
        hpsweep.run(space, n_trials=1, resources_per_trial={"gpu": 1})
    monkeypatch.setenv("HPSWEEP_FAKE_GPUS", "1")
    with pytest.raises(UserError, match="this machine has 1"):
        hpsweep.run(space, n_trials=1, resources_per_trial={"gpu": 2})
    assert not (tmp_path / "out").exists()


def devices_by_worker(out: Path) -> dict[int, set[str]]:
    seen: dict[int, set[str]] = defaultdict(set)
    for r in runs.read_trials(out):
        seen[r.user_attrs["pid"]].add(",".join(r.user_attrs["devices"]))
    return seen


def test_each_worker_trains_on_the_gpu_it_was_placed_on(tmp_path: Path) -> None:
    space = write_space(tmp_path, epochs=20)  # trials long enough that both workers get one
    proc = hpsweep_cli(
        "run",
        space,
        "--n-trials",
        "4",
        "--n-jobs",
        "4",
        "--pruner",
        "none",
        env={"HPSWEEP_FAKE_GPUS": "2"},
        check=True,
    )
    assert "2 trials run at once" in proc.stderr  # 4 asked, 2 GPUs with the default gpu=1
    seen = devices_by_worker(tmp_path / "out")
    assert len(seen) == 2 and all(len(ids) == 1 for ids in seen.values())
    assert sorted(next(iter(ids)) for ids in seen.values()) == [
        "0",
        "1",
    ]  # one worker per GPU, never swapped
    for r in runs.read_trials(tmp_path / "out"):
        assert r.user_attrs["processes"] == 1 and r.user_attrs["threads"] >= 1


def test_half_a_gpu_puts_two_workers_on_one_gpu(tmp_path: Path) -> None:
    space = write_space(tmp_path, epochs=20)  # trials long enough that both workers get one
    hpsweep_cli(
        "run",
        space,
        "--n-trials",
        "4",
        "--n-jobs",
        "2",
        "--resources-per-trial",
        "gpu=0.5",
        "--pruner",
        "none",
        env={"HPSWEEP_FAKE_GPUS": "1"},
        check=True,
    )
    seen = devices_by_worker(tmp_path / "out")
    assert len(seen) == 2 and all(ids == {"0"} for ids in seen.values())
