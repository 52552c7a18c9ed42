"""``--processes-per-trial 2``: each trial trains over two gloo processes on this CPU machine.

A user's session: a space file, the command line, then what is on disk. Each space file here has
a callback that writes, from every process of a trial, where that process's training ended
(``rank-<RANK>.json`` in the run folder), so the tests can see that both processes stopped.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from support import RANK_LOG, hpsweep_cli, rank_steps, write_space
from support.sweep_invariants import SLOW_ARGS, SLOW_TRIALS, wait_for

from hpsweep import runs

TRAIN, BATCH = 256, 32  # the tiny space file's training set and per-process batch


def training_losses(record: runs.TrialRecord) -> list[tuple[int, float]]:
    """(step, loss) of each logged training loss, as the trial's last checkpoint holds them."""
    state = json.loads(
        (Path(record.run_dir) / record.checkpoint / "trainer_state.json").read_text()
    )
    return [(h["step"], h["loss"]) for h in state["log_history"] if "loss" in h]


def session_processes(sid: int) -> list[int]:
    """Processes still running in session ``sid`` (the command and anything it started)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def run_in_session(*args: str, env: dict | None = None) -> subprocess.Popen:
    """``hpsweep ARGS`` in its own session, as in a terminal: Ctrl-C reaches its whole process group."""
    return subprocess.Popen(
        [sys.executable, "-m", "hpsweep.cli", *map(str, args)],
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_processes_train_what_one_does_with_twice_the_batch(tmp_path: Path) -> None:
    # Plain SGD, no dropout, a mean loss and 256 samples in batches of 32 x 2 = 64: averaging the two
    # processes' gradients is the gradient of the 64-sample batch, so the weights must agree.
    space = write_space(
        tmp_path,
        space='{"learning_rate": hpsweep.Categorical([0.1])}',
        extra_args=', optim="sgd"',
        extra=RANK_LOG,
    )
    hpsweep_cli(
        "run",
        space,
        "--n-trials",
        "1",
        "--processes-per-trial",
        "2",
        "--output-dir",
        tmp_path / "two",
        check=True,
    )
    hpsweep_cli(
        "run",
        space,
        "--n-trials",
        "1",
        "--set",
        f"per_device_train_batch_size={2 * BATCH}",
        "--output-dir",
        tmp_path / "one",
        check=True,
    )
    two, one = runs.read_trials(tmp_path / "two")[0], runs.read_trials(tmp_path / "one")[0]

    steps = 2 * math.ceil(TRAIN / (BATCH * 2))  # 2 epochs of the effective batch
    assert rank_steps(two) == {"rank-0": steps, "rank-1": steps}
    state = json.loads((Path(two.run_dir) / two.checkpoint / "trainer_state.json").read_text())
    assert state["global_step"] == steps and two.checkpoint == f"checkpoint-{steps}"
    assert two.user_attrs["processes"] == 2 and two.state == "complete"
    # one checkpoint folder per save, written whole by one process; nothing temporary left
    assert [p.name for p in runs.checkpoints(Path(two.run_dir))] == [
        f"checkpoint-{steps // 2}",
        f"checkpoint-{steps}",
    ]
    assert not [p for p in Path(two.run_dir).iterdir() if p.name.startswith(".")]

    ours, theirs = (
        load_file(tmp_path / "two" / "best" / "model.safetensors"),
        load_file(tmp_path / "one" / "best" / "model.safetensors"),
    )
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-6, rtol=0)
    # evaluation covers the whole eval set across both processes: the same metrics as one process
    assert [h["step"] for h in two.history] == [h["step"] for h in one.history]
    for a, b in zip(two.history, one.history):
        assert (
            abs(a["eval_loss"] - b["eval_loss"]) < 1e-5 and a["eval_accuracy"] == b["eval_accuracy"]
        )
    # the logged training loss is the mean over both processes' batches, which is the loss of the
    # 64-sample batch one process computes (not the first process's 32 samples alone)
    ours, theirs = training_losses(two), training_losses(one)
    assert [step for step, _ in ours] == [step for step, _ in theirs] == [steps // 2, steps]
    for (_, a), (_, b) in zip(ours, theirs):
        assert abs(a - b) < 1e-5, (ours, theirs)


def test_a_prune_decision_stops_both_processes_at_the_same_step(tmp_path: Path) -> None:
    model_init = """
def model_init(trial):
    net = Net()
    if trial.number == 1:  # a hopeless trial: logits a thousand times too large
        net.net[2].weight.data.mul_(1000.0)
    return net
"""
    space = write_space(
        tmp_path,
        model_init=model_init,
        epochs=3,
        objective="eval_loss",
        direction="minimize",
        extra=RANK_LOG,
    )
    # successive halving keeps, at the first evaluation, only a trial as good as the best so far
    hpsweep_cli(
        "run", space, "--n-trials", "2", "--pruner", "sha", "--processes-per-trial", "2", check=True
    )
    good, hopeless = runs.read_trials(tmp_path / "out")
    epoch = math.ceil(TRAIN / (BATCH * 2))
    assert good.state == "complete" and rank_steps(good) == {
        "rank-0": 3 * epoch,
        "rank-1": 3 * epoch,
    }
    assert hopeless.state == "pruned" and len(hopeless.history) == 1
    assert rank_steps(hopeless) == {
        "rank-0": epoch,
        "rank-1": epoch,
    }  # both stopped after the first evaluation
    # The evaluation that pruned it writes no checkpoint: the processes agreed before saving.
    assert runs.checkpoints(Path(hopeless.run_dir)) == [] and runs.checkpoints(Path(good.run_dir))


def test_ctrl_c_stops_every_process_and_the_same_command_resumes_the_trial(tmp_path: Path) -> None:
    space = write_space(
        tmp_path, epochs=3, extra=SLOW_TRIALS.format(step_s=0.25) + RANK_LOG, extra_args=SLOW_ARGS
    )
    argv = ["run", str(space), "--n-trials", "1", "--processes-per-trial", "2", "--pruner", "none"]
    out = tmp_path / "out"
    proc = run_in_session(*argv)
    assert wait_for(lambda: len(runs.checkpoints(out / "run-0")) >= 1, timeout=180), (
        proc.communicate()
    )
    # what a terminal's Ctrl-C does: every process in the group gets it
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert wait_for(lambda: not session_processes(proc.pid), timeout=10), (
        "processes of the trial outlived the command"
    )
    stopped = runs.read_trials(out)[0]
    assert stopped.state == "stopped"
    assert not (
        out / "run-0" / "rank-0.json"
    ).exists()  # neither process got to the end of training

    hpsweep_cli(*argv, check=True)
    again = runs.read_trials(out)[0]
    steps = 3 * math.ceil(TRAIN / (BATCH * 2))
    assert again.state == "complete" and again.attempts == 2
    assert again.resumed_from and Path(again.resumed_from).parent == out / "run-0"
    assert rank_steps(again) == {"rank-0": steps, "rank-1": steps}
    assert [p.name for p in runs.checkpoints(out / "run-0")] == [
        f"checkpoint-{s}" for s in range(4, steps + 1, 4)
    ]


def test_an_error_in_one_process_fails_only_its_trial_in_one_line(tmp_path: Path) -> None:
    model_init = """
import os
class OutOfMemoryOnRank1(Net):
    def forward(self, x, labels):
        if os.environ.get("RANK") == "1":  # as a GPU would, with a batch too big for it
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB. GPU 1 has a total "
                                              "capacity of 79.10 GiB of which 1.00 GiB is free.\\nSee the docs")
        return super().forward(x, labels)

def model_init(trial):
    return OutOfMemoryOnRank1() if trial.number == 0 else Net()
"""
    space = write_space(tmp_path, model_init=model_init, epochs=1)
    proc = run_in_session("run", space, "--n-trials", "1", "--processes-per-trial", "2")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert not session_processes(proc.pid)
    failed, complete = runs.read_trials(tmp_path / "out")
    assert complete.state == "complete"  # the sweep went on with another trial
    assert failed.state == "failed" and "\n" not in failed.error
    assert failed.error.startswith(
        "OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB."
    )
    assert "--resources-per-trial gpu=1" in failed.error and failed.error.endswith(
        "(in data-parallel process 1)"
    )
    log = (Path(failed.run_dir) / "error.log").read_text()
    assert "OutOfMemoryOnRank1" in log or "forward" in log  # the failing process's own traceback
    # the failing process ended its trial at once (not at the process group's timeout)
    assert failed.finished_at <= complete.started_at


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return sorted(found)


def test_no_process_of_a_trial_outlives_a_kill_9(tmp_path: Path) -> None:
    space = write_space(
        tmp_path, epochs=3, extra=SLOW_TRIALS.format(step_s=0.25), extra_args=SLOW_ARGS
    )
    argv = ["run", str(space), "--n-trials", "2", "--processes-per-trial", "2", "--pruner", "none"]
    out = tmp_path / "out"
    proc = run_in_session(*argv)
    assert wait_for(lambda: len(runs.checkpoints(out / "run-0")) >= 1, timeout=180), (
        proc.communicate()
    )
    ranks = children(proc.pid)  # the trial's two processes, forked by the command (rank 0 first)
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGKILL)  # as the OOM killer would
    assert wait_for(lambda: runs.read_trials(out)[0].state == "failed", timeout=60), (
        proc.communicate()
    )
    assert "data-parallel process 1 of 2 was killed by signal 9" in runs.read_trials(out)[0].error
    # rank 0 was stopped
    assert wait_for(lambda: not any(p in children(proc.pid) for p in ranks), timeout=20)

    assert wait_for(lambda: len(runs.checkpoints(out / "run-1")) >= 1, timeout=180), (
        proc.communicate()
    )
    assert len(children(proc.pid)) == 2  # the next trial's two processes
    proc.kill()  # kill -9 of the command: its trial's processes die with it
    proc.communicate(timeout=60)
    assert wait_for(lambda: not session_processes(proc.pid), timeout=20), (
        "processes of the trial outlived the command"
    )

    hpsweep_cli(*argv, check=True)  # and the same command finishes the sweep
    records = runs.read_trials(out)
    assert [r.state for r in records] == ["failed", "complete", "complete"]
    assert records[1].attempts == 2 and records[1].resumed_from


def test_several_eval_dataset_factories_load_once_for_both_processes(tmp_path: Path) -> None:
    loads = tmp_path / "loads"
    loads.mkdir()
    counted = f"""
import os
def _counted(name, seed):
    def factory():
        with open(os.path.join({str(loads)!r}, name), "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        return _data(64, seed)
    return factory
eval_dataset = {{"near": _counted("near", 2), "far": _counted("far", 3)}}
"""
    space = write_space(tmp_path, objective="eval_far_accuracy", extra=counted)
    hpsweep_cli("run", space, "--n-trials", "2", "--processes-per-trial", "2", check=True)
    records = runs.read_trials(tmp_path / "out")
    assert [r.state for r in records] == ["complete", "complete"]
    assert all(
        "eval_near_accuracy" in h and "eval_far_accuracy" in h for r in records for h in r.history
    )
    # each factory ran once, in the search's process; the ranks inherited what it loaded
    assert [len((loads / name).read_text().split()) for name in ("near", "far")] == [1, 1]


PROCESS_LOG = """
import json, os, time
class _ProcessLog(hpsweep.TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        with args.main_process_first(local=False, desc="a datasets.map"):
            entered = time.monotonic()
            time.sleep(0.5)  # the main process's work: the other waits for it
        seen = {name: getattr(args, name) for name in ("world_size", "process_index", "local_process_index",
                                                       "should_log", "should_save", "n_gpu")}
        with open(os.path.join(args.output_dir, f"process-{os.environ['RANK']}.json"), "w") as f:
            json.dump({**seen, "device": args.device.type, "entered": entered, "left": time.monotonic()}, f)
callbacks = [_ProcessLog()]
"""


def test_each_process_of_a_trial_sees_its_rank_in_the_arguments_and_the_main_one_goes_first(
    tmp_path: Path,
) -> None:
    space = write_space(
        tmp_path, space='{"learning_rate": hpsweep.Categorical([0.1])}', extra=PROCESS_LOG, epochs=1
    )
    hpsweep_cli("run", space, "--n-trials", "1", "--processes-per-trial", "2", check=True)
    run_dir = Path(runs.read_trials(tmp_path / "out")[0].run_dir)
    main, other = (json.loads((run_dir / f"process-{rank}.json").read_text()) for rank in (0, 1))
    assert {
        k: main[k] for k in ("world_size", "process_index", "should_save", "should_log", "device")
    } == {
        "world_size": 2,
        "process_index": 0,
        "should_save": True,
        "should_log": True,
        "device": "cpu",
    }
    assert (other["world_size"], other["process_index"], other["local_process_index"]) == (2, 1, 1)
    assert (
        not other["should_save"]
        and not other["should_log"]
        and main["n_gpu"] == other["n_gpu"] == 0
    )
    # it entered the block once the main process had done its work
    assert other["entered"] >= main["entered"] + 0.5


DDP_LOG = """
import gc, json, os
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

class Unused(Net):
    def __init__(self, hidden=16):
        super().__init__(hidden)
        self.spare = torch.nn.Linear(8, 4)  # never in the loss
        self.register_buffer("mark", torch.zeros(()))

def model_init(trial):
    return Unused()

class _DDPLog(hpsweep.TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model.mark.fill_(int(os.environ["RANK"]))  # DDP broadcasts rank 0's buffers when told to
    def on_train_end(self, args, state, control, model=None, **kwargs):
        wrapper = next(o for o in gc.get_objects() if isinstance(o, DistributedDataParallel))
        group = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        seen = {"mark": model.mark.item(), "backend": dist.get_backend(),
                "timeout_s": group.options._timeout.total_seconds(),
                "bucket_bytes": wrapper.bucket_bytes_cap, "find_unused": wrapper.find_unused_parameters}
        with open(os.path.join(args.output_dir, f"ddp-{os.environ['RANK']}.json"), "w") as f:
            json.dump(seen, f)
callbacks = [_DDPLog()]
"""


def test_ddp_fields_set_the_process_group_and_distributed_data_parallel(tmp_path: Path) -> None:
    # a model with a parameter outside the loss trains only with ddp_find_unused_parameters=True
    space = write_space(
        tmp_path,
        space='{"ddp_find_unused_parameters": hpsweep.Categorical([False, True])}',
        model_init="",
        extra=DDP_LOG,
        epochs=1,
        extra_args=', ddp_backend="gloo", ddp_timeout=90, ddp_bucket_cap_mb=1, '
        "ddp_broadcast_buffers=False",
    )
    argv = ["run", space, "--n-trials", "2", "--sampler", "grid", "--processes-per-trial", "2"]
    hpsweep_cli(*argv, check=True)
    records = {
        r.params["ddp_find_unused_parameters"]: r for r in runs.read_trials(tmp_path / "out")
    }
    assert records[False].state == "failed" and "find_unused_parameters" in records[False].error
    assert records[True].state == "complete"
    run_dir = Path(records[True].run_dir)
    ranks = [json.loads((run_dir / f"ddp-{rank}.json").read_text()) for rank in (0, 1)]
    for rank, seen in enumerate(ranks):
        assert seen["mark"] == rank  # ddp_broadcast_buffers=False: each process keeps its own
        assert (seen["backend"], seen["timeout_s"]) == ("gloo", 90)
        assert (seen["bucket_bytes"], seen["find_unused"]) == (1024 * 1024, True)
    # a backend this torch lacks is one line before any process starts
    refused = hpsweep_cli(*argv, "--set", "ddp_backend=mpi", "--output-dir", tmp_path / "mpi")
    assert refused.returncode == 2 and "\n" not in refused.stderr.strip()
    assert "ddp_backend='mpi' is not available" in refused.stderr
