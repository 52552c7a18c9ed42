"""The device paths on real GPUs: mixed precision, shared GPUs, NCCL trials, memory and OOM.

Every test here is marked ``gpu``: ``conftest.py`` skips them ("needs CUDA") where
``torch.cuda.is_available()`` is False, the one skip CI allows. Each space file's model writes,
on its first forward, the device and dtype it computed in (``probe-<pid>.json`` next to the space
file), so a test knows the trial really ran on a GPU, and in the precision it asked for.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import ROOT, hpsweep_cli, write_space

from hpsweep import runs

pytestmark = pytest.mark.gpu

PROBE = """
import json, os
class Probed(Net):
    seen = False
    def forward(self, x, labels):
        out = super().forward(x, labels)
        if not Probed.seen:
            Probed.seen = True
            with open(os.path.join({folder!r}, f"probe-{{os.getpid()}}.json"), "w") as f:
                json.dump({{"device": str(x.device), "dtype": str(out["logits"].dtype),
                           "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}}, f)
        return out

def model_init(trial):
    return Probed(hidden=trial.params.get("hidden", 16) if trial is not None else 16)
"""


def gpu_space(tmp_path: Path, **kwargs: object) -> Path:
    return write_space(tmp_path, model_init=PROBE.format(folder=str(tmp_path)), **kwargs)  # type: ignore[arg-type]


def probes(tmp_path: Path) -> list[dict[str, str]]:
    return [json.loads(p.read_text()) for p in sorted(tmp_path.glob("probe-*.json"))]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_mixed_precision_sweep_trains_on_the_gpu(tmp_path: Path, precision: str) -> None:
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("needs a GPU with bf16")
    space = gpu_space(tmp_path, epochs=3)
    hpsweep_cli(
        "run",
        space,
        "--n-trials",
        "3",
        "--pruner",
        "none",
        "--set",
        f"mixed_precision={precision}",
        check=True,
    )
    records = runs.read_trials(tmp_path / "out")
    assert [r.state for r in records] == ["complete"] * 3
    assert all(
        len(r.user_attrs["devices"]) == 1 and r.user_attrs["devices"] != ["cpu"] for r in records
    )
    assert all(
        p["device"].startswith("cuda")
        and p["dtype"] == f"torch.{'float16' if precision == 'fp16' else 'bfloat16'}"
        for p in probes(tmp_path)
    )
    for r in records:  # the scaler (fp16) kept the steps finite, and the weights are saved in fp32
        assert all(math.isfinite(h["eval_loss"]) for h in r.history)
        weights = load_file(Path(r.run_dir) / r.checkpoint / "model.safetensors")
        assert all(w.dtype == torch.float32 and torch.isfinite(w).all() for w in weights.values())
    assert max(r.objective for r in records) > 0.3  # above chance (0.25): it learned


def test_half_a_gpu_runs_two_trials_on_one_gpu(tmp_path: Path) -> None:
    space = gpu_space(tmp_path, epochs=20)  # trials long enough that both workers get one
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
        env={"CUDA_VISIBLE_DEVICES": "0"},
        check=True,
    )
    records = runs.read_trials(tmp_path / "out")
    assert [r.state for r in records] == ["complete"] * 4
    assert len({r.user_attrs["pid"] for r in records}) == 2
    assert all(r.user_attrs["devices"] == ["0"] for r in records)
    assert {p["visible"] for p in probes(tmp_path)} == {"0"} and all(
        p["device"] == "cuda:0" for p in probes(tmp_path)
    )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_nccl_processes_train_what_one_gpu_does_with_twice_the_batch(tmp_path: Path) -> None:
    space = write_space(
        tmp_path, space='{"learning_rate": hpsweep.Categorical([0.1])}', extra_args=', optim="sgd"'
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
        env={"CUDA_VISIBLE_DEVICES": "0,1"},
        check=True,
    )
    hpsweep_cli(
        "run",
        space,
        "--n-trials",
        "1",
        "--set",
        "per_device_train_batch_size=64",
        "--output-dir",
        tmp_path / "one",
        env={"CUDA_VISIBLE_DEVICES": "0"},
        check=True,
    )
    two, one = runs.read_trials(tmp_path / "two")[0], runs.read_trials(tmp_path / "one")[0]
    assert two.user_attrs["devices"] == ["0", "1"] and two.user_attrs["processes"] == 2
    assert one.user_attrs["devices"] == ["0"] and one.user_attrs["processes"] == 1
    state = json.loads((Path(two.run_dir) / two.checkpoint / "trainer_state.json").read_text())
    assert state["global_step"] == 2 * math.ceil(256 / 64)
    ours, theirs = (
        load_file(tmp_path / "two" / "best" / "model.safetensors"),
        load_file(tmp_path / "one" / "best" / "model.safetensors"),
    )
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-5, rtol=0)


def test_the_50th_trial_starts_with_the_gpu_memory_the_first_had(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "memory.py"),
            "--device",
            "cuda",
            "--trials",
            "50",
            "--json",
            str(out),
        ],
        check=True,
        timeout=1200,
    )
    rows = json.loads(out.read_text())["rows"]
    first, second, last = rows[0], rows[1], rows[-1]
    assert abs(last["cuda_allocated_mb"] - first["cuda_allocated_mb"]) < 1.0
    # cached blocks went back between trials
    assert last["cuda_reserved_mb"] <= first["cuda_reserved_mb"] + 2.0
    assert abs(last["rss_mb"] - second["rss_mb"]) < 20.0


def test_a_real_cuda_out_of_memory_error_fails_only_its_trial(tmp_path: Path) -> None:
    model_init = """
class TooBig(Net):
    def forward(self, x, labels):
        total = torch.cuda.get_device_properties(x.device).total_memory
        torch.empty(2 * total, dtype=torch.uint8, device=x.device)  # twice the GPU: a batch far too big
        return super().forward(x, labels)

def model_init(trial):
    return TooBig() if trial.number == 0 else Net()
"""
    space = write_space(tmp_path, model_init=model_init, epochs=1)
    hpsweep_cli("run", space, "--n-trials", "1", check=True)
    failed, complete = runs.read_trials(tmp_path / "out")
    assert failed.state == "failed" and complete.state == "complete"
    assert (
        failed.error.startswith("OutOfMemoryError: CUDA out of memory.")
        and "\n" not in failed.error
    )
    assert (
        "smaller per_device_train_batch_size" in failed.error
        and "--resources-per-trial gpu=1" in failed.error
    )


class _LoudNet(torch.nn.Module):
    """A loss a thousand times too large (and a learning rate as much smaller, see the test): the
    fp16 gradients overflow at accelerate's initial loss scale, so the scaler backs off and skips
    steps, as it does in real fp16 runs now and then."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
        )

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        return {
            "loss": torch.nn.functional.cross_entropy(logits.float(), labels) * 1e3,
            "logits": logits,
        }


def test_an_fp16_trial_resumed_from_a_checkpoint_ends_as_an_uninterrupted_one(
    tmp_path: Path,
) -> None:
    import hpsweep

    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=g)
    train = torch.utils.data.TensorDataset(x, (x @ torch.randn(8, 4, generator=g)).argmax(-1))

    def trainer(out: Path) -> hpsweep.Trainer:
        args = hpsweep.TrainingArguments(
            output_dir=str(out),
            num_train_epochs=3,
            per_device_train_batch_size=32,
            learning_rate=1e-5,
            optim="sgd",
            mixed_precision="fp16",
            eval_strategy="no",
            save_strategy="steps",
            save_steps=8,
            disable_progress=True,
        )
        return hpsweep.Trainer(model_init=_LoudNet, args=args, train_dataset=train)

    full = trainer(tmp_path / "full")
    full.train()
    assert full.accelerator.scaler is not None
    scaler = json.loads((tmp_path / "full" / "checkpoint-8" / runs.SCALER_FILE).read_text())
    assert scaler["scale"] < 65536.0  # accelerate's initial scale overflowed: steps were skipped

    # what a sweep does with a trial whose process was killed
    resumed = trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-8"))
    assert resumed.accelerator.scaler.state_dict() == full.accelerator.scaler.state_dict()
    assert resumed.state.global_step == full.state.global_step == 24
    ours, theirs = full.model.state_dict(), resumed.model.state_dict()
    for name in ours:
        torch.testing.assert_close(theirs[name], ours[name], atol=1e-6, rtol=0)
