"""save_only_model: checkpoints that hold the model alone (a third of the disk with AdamW), and
what a trial stopped with them does: it starts again, and trains what an uninterrupted one trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import hpsweep_cli, timeless, write_space
from support.sweep_invariants import (
    SLOW_ARGS,
    SLOW_TRIALS,
    checkpoints_in,
    start,
    violations,
    wait_for,
)

import hpsweep
from hpsweep import UserError, runs

MODEL_ONLY = {"model.safetensors", "trainer_state.json", "training_args.json"}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir())


def test_a_sweep_keeps_the_model_alone_in_each_checkpoint_and_a_loadable_best(
    tmp_path: Path,
) -> None:
    space = write_space(tmp_path, extra_args=", save_only_model=True")
    hpsweep_cli("run", space, "--n-trials", "2", "--pruner", "none", "--seed", "0", check=True)
    full = write_space(tmp_path, name="full.py", output_dir=str(tmp_path / "full"))
    hpsweep_cli("run", full, "--n-trials", "2", "--pruner", "none", "--seed", "0", check=True)
    out = tmp_path / "out"
    records = runs.read_trials(out)
    assert [r.state for r in records] == ["complete", "complete"] and violations(
        out, 2, model_only=True
    ) == []
    for r in records:
        kept = runs.checkpoints(Path(r.run_dir))
        assert len(kept) == 2 and all({p.name for p in c.iterdir()} == MODEL_ONLY for c in kept)
    top = max(records, key=lambda r: r.objective)
    best = load_file(out / "best" / "model.safetensors")
    final = load_file(Path(top.run_dir) / top.checkpoint / "model.safetensors")
    assert best.keys() == final.keys() and all(torch.equal(best[k], final[k]) for k in final)
    # the same trials with full checkpoints: AdamW's two moments are twice the weights
    full_record = runs.read_trials(tmp_path / "full")[0]
    full_checkpoint = Path(full_record.run_dir) / full_record.checkpoint
    assert "optimizer.pt" in {p.name for p in full_checkpoint.iterdir()}
    assert folder_bytes(Path(records[0].run_dir) / records[0].checkpoint) < 0.5 * folder_bytes(
        full_checkpoint
    )


def test_a_trial_stopped_with_model_only_checkpoints_starts_again_and_trains_what_an_uninterrupted_one_does(
    tmp_path: Path,
) -> None:
    space = write_space(
        tmp_path,
        epochs=1,
        extra=SLOW_TRIALS.format(step_s=0.03),
        extra_args=SLOW_ARGS + ", save_only_model=True",
    )
    out, ref = tmp_path / "out", tmp_path / "ref"
    # one thread pinned: the two sweeps' trials then round alike whatever else the machine runs
    same = ("--n-trials", "2", "--pruner", "none", "--seed", "0", "--resources-per-trial", "cpu=1")
    proc = start("run", space, *same)
    assert wait_for(lambda: checkpoints_in(out) >= 1), proc.communicate()
    proc.kill()
    proc.communicate()
    cut = [r for r in runs.read_trials(out) if r.state == "running"]
    assert len(cut) == 1 and runs.checkpoints(Path(cut[0].run_dir))

    hpsweep_cli("run", space, *same, check=True)
    assert violations(out, 2, model_only=True) == []
    again = next(r for r in runs.read_trials(out) if r.id == cut[0].id)
    assert again.state == "complete" and again.attempts == 2 and again.resumed_from is None
    hpsweep_cli("run", space, *same, "--output-dir", ref, check=True)
    uninterrupted = next(r for r in runs.read_trials(ref) if r.number == again.number)
    assert uninterrupted.params == again.params
    assert [timeless(h) for h in uninterrupted.history] == [timeless(h) for h in again.history]
    a = load_file(Path(again.run_dir) / again.checkpoint / "model.safetensors")
    b = load_file(Path(uninterrupted.run_dir) / uninterrupted.checkpoint / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in b)
    # the earlier attempt's checkpoints went: the folder holds this attempt's alone
    steps = [int(c.name.split("-")[1]) for c in runs.checkpoints(Path(again.run_dir))]
    assert steps == [
        int(c.name.split("-")[1]) for c in runs.checkpoints(Path(uninterrupted.run_dir))
    ]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x, labels):
        logits = self.lin(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def data(n: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())


def test_a_run_does_not_resume_from_the_model_alone_and_loads_its_best_model(
    tmp_path: Path,
) -> None:
    args = hpsweep.TrainingArguments(
        output_dir=str(tmp_path),
        num_train_epochs=3,
        save_only_model=True,
        learning_rate=0.1,
        load_best_model_at_end=True,
        disable_progress=True,
    )
    trainer = hpsweep.Trainer(
        model_init=Net, args=args, train_dataset=data(64, 1), eval_dataset=data(32, 2)
    )
    trainer.train()
    best = Path(trainer.state.best_model_checkpoint)
    assert {p.name for p in best.iterdir()} == MODEL_ONLY
    saved = load_file(best / "model.safetensors")
    # the best, loaded at the end
    assert all(torch.equal(saved[k], v) for k, v in trainer.model.state_dict().items())
    # transformers would go on with a new optimizer and schedule: a different run; hpsweep says so
    with pytest.raises(
        UserError, match=r"holds the model alone \(save_only_model=True\) and cannot resume"
    ):
        trainer.train(resume_from_checkpoint=True)


def test_transformers_arguments_with_save_only_model_convert(tmp_path: Path) -> None:
    import transformers

    hf_args = transformers.TrainingArguments(str(tmp_path), save_only_model=True, report_to="none")
    assert hpsweep.Trainer(model_init=Net, args=hf_args).args.save_only_model is True


def test_pbt_which_goes_on_from_other_trials_checkpoints_refuses_them(tmp_path: Path) -> None:
    space = write_space(tmp_path, extra_args=", save_only_model=True")
    proc = hpsweep_cli("run", space, "--backend", "ray", "--scheduler", "pbt", "--n-trials", "2")
    assert proc.returncode == 2 and "set save_only_model=False" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
