"""Which number a sweep optimises, by Hugging Face's rule; trials read like HF's params dict; and
Optuna's pytorch_simple example, moved to a space file, runs as a sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support import ROOT, hpsweep_cli, write_space
from torch import nn

import hpsweep
from hpsweep import TrainingArguments, UserError, runs


def data(n: int, seed: int) -> torch.utils.data.TensorDataset:
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.TensorDataset(
        x, (x @ torch.randn(8, 4, generator=torch.Generator().manual_seed(0))).argmax(-1)
    )


class Net(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))

    def forward(self, x, labels):
        logits = self.net(x)
        return nn.functional.cross_entropy(logits, labels), logits


def two_metrics(p: hpsweep.EvalPrediction) -> dict:
    right = p.predictions.argmax(-1) == p.label_ids
    return {"accuracy": float(right.mean()), "errors": float((~right).sum())}


def trainer(out: Path, **kw) -> hpsweep.Trainer:
    args = TrainingArguments(
        str(out), num_train_epochs=1, per_device_train_batch_size=32, disable_tqdm=True
    )
    return hpsweep.Trainer(
        model_init=lambda trial: Net(trial.get("hidden", 16) if trial else 16),
        args=args,
        train_dataset=data(96, 1),
        eval_dataset=data(64, 2),
        **kw,
    )


SPACE = {"learning_rate": hpsweep.Float(1e-3, 1e-1, log=True)}


def test_without_compute_metrics_the_objective_is_the_eval_loss(tmp_path: Path, capsys) -> None:
    best = trainer(tmp_path).hyperparameter_search(space=SPACE, n_trials=2, show_progress=False)
    assert "hpsweep: optimising eval_loss (minimize)" in capsys.readouterr().out
    assert best.objective == best.run_summary["metrics"]["eval_loss"]


def test_with_compute_metrics_the_objective_is_the_sum_of_its_metrics(
    tmp_path: Path, capsys
) -> None:
    best = trainer(tmp_path, compute_metrics=two_metrics).hyperparameter_search(
        space=SPACE, n_trials=2, direction="maximize", show_progress=False
    )
    assert "the sum of compute_metrics' eval metrics" in capsys.readouterr().out
    metrics = best.run_summary["metrics"]
    # no eval_loss
    assert best.objective == pytest.approx(metrics["eval_accuracy"] + metrics["eval_errors"])


def test_a_lambda_objective_is_named_objective_where_the_sweep_shows_it(
    tmp_path: Path, capsys
) -> None:
    """compute_objective=lambda m: ..., as Hugging Face's docs write it: the sweep's line, the trial
    records (the table, report and MLflow read them) and the best run name it "objective", not "<lambda>"."""
    best = trainer(tmp_path, compute_metrics=two_metrics).hyperparameter_search(
        space=SPACE,
        n_trials=2,
        direction="maximize",
        compute_objective=lambda m: m["eval_accuracy"],
    )
    printed = capsys.readouterr()
    assert "hpsweep: optimising objective(metrics) (maximize)" in printed.out
    assert "<lambda>" not in printed.out + printed.err
    records = runs.read_trials(tmp_path)
    assert len(records) == 2 and {r.objective_name for r in records} == {"objective"}
    assert best.run_summary["objective_name"] == "objective"
    assert best.objective == best.run_summary["metrics"]["eval_accuracy"]


def test_transformers_optuna_keywords_are_taken_as_create_study_and_optimize_take_them(
    tmp_path: Path,
) -> None:
    """transformers hands its Optuna users' keywords to create_study (storage, study_name, sampler,
    pruner, load_if_exists) and optimize (timeout, n_jobs, gc_after_trial)."""
    import optuna

    def hp_space(trial):
        return {"learning_rate": trial.suggest_float("learning_rate", 1e-3, 1e-1, log=True)}

    storage = f"sqlite:///{tmp_path / 'hf.db'}"
    for n in (2, 3):  # the second call continues the study, as load_if_exists=True asks
        trainer(tmp_path / "out").hyperparameter_search(
            hp_space=hp_space,
            n_trials=n,
            backend="optuna",
            storage=storage,
            study_name="hf",
            load_if_exists=True,
            sampler=optuna.samplers.TPESampler(seed=3),
            pruner=optuna.pruners.NopPruner(),
            timeout=600,
            n_jobs=1,
            gc_after_trial=True,
            show_progress=False,
        )
        study = optuna.load_study(study_name="hf", storage=storage)
        assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * n
    assert len(runs.read_trials(tmp_path / "out")) == 3


def squared_errors(p: hpsweep.EvalPrediction) -> dict:
    wrong = p.predictions.argmax(-1) != p.label_ids
    return {"mse": float(wrong.mean()), "errors": float(wrong.sum())}


@pytest.mark.parametrize(
    ("compute_metrics", "keywords", "scores"),
    [
        # transformers' default objective, the sum of compute_metrics', with its default direction
        (two_metrics, {}, "accuracy looks"),
        (two_metrics, {"objective": "eval_accuracy"}, "eval_accuracy looks"),
        (two_metrics, {"compute_objective": lambda m: m["eval_accuracy"]}, "eval_accuracy looks"),
    ],
)
def test_minimising_what_looks_like_a_score_says_so_first_with_the_fix(
    tmp_path: Path, capsys, compute_metrics, keywords: dict, scores: str
) -> None:
    trainer(tmp_path, compute_metrics=compute_metrics).hyperparameter_search(
        space=SPACE, n_trials=1, show_progress=False, **keywords
    )
    printed = capsys.readouterr()
    first = printed.out.splitlines()[0]
    assert first.startswith("hpsweep: optimising ") and "(minimize); warning: " in first, first
    assert f"{scores} like a score" in first and 'pass direction="maximize"' in first
    assert "warning" not in printed.err


@pytest.mark.parametrize(
    ("compute_metrics", "keywords"),
    [
        (None, {}),  # eval_loss
        (squared_errors, {}),  # the sum of errors
        (squared_errors, {"objective": "eval_mse"}),
        (two_metrics, {"direction": "maximize"}),
    ],
)
def test_minimising_a_loss_or_maximising_a_score_says_nothing_more(
    tmp_path: Path, capsys, compute_metrics, keywords: dict
) -> None:
    trainer(tmp_path, compute_metrics=compute_metrics).hyperparameter_search(
        space=SPACE, n_trials=1, show_progress=False, **keywords
    )
    printed = capsys.readouterr()
    assert printed.out.startswith("hpsweep: optimising ")
    assert "warning" not in printed.out + printed.err


def test_maximising_the_eval_loss_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    for objective in (None, "eval_loss"):
        with pytest.raises(
            UserError,
            match="direction='maximize' with the objective eval_loss.*direction='minimize'",
        ):
            trainer(tmp_path).hyperparameter_search(
                space=SPACE, direction="maximize", objective=objective
            )
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_a_space_file_maximising_without_metrics_is_refused_in_one_line(tmp_path: Path) -> None:
    space = write_space(tmp_path, objective=None, extra="compute_metrics = None")
    proc = hpsweep_cli("run", space, "--n-trials", "1")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "would maximise the loss" in proc.stderr and not (tmp_path / "out").exists()


def test_an_optuna_style_objective_in_a_space_file_is_refused_with_the_fix(tmp_path: Path) -> None:
    space = write_space(tmp_path, extra="def objective(trial):\n    return 0.0\n")
    proc = hpsweep_cli("run", space, "--n-trials", "1")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert (
        "objective(trial) is not a function of the metrics" in proc.stderr
        and "rename" in proc.stderr
    )


def test_model_init_and_hp_name_index_the_trial_like_a_dict(tmp_path: Path) -> None:
    seen = []

    def model_init(config):
        if config is None:
            return Net()
        seen.append((config["hidden"], "hidden" in config, dict(config.items()) == config.params))
        return Net(config["hidden"])

    args = TrainingArguments(
        str(tmp_path), num_train_epochs=1, per_device_train_batch_size=32, disable_tqdm=True
    )
    best = hpsweep.Trainer(
        model_init=model_init, args=args, train_dataset=data(64, 1), eval_dataset=data(64, 2)
    ).hyperparameter_search(
        space={"hidden": hpsweep.Categorical([8, 16])},
        n_trials=2,
        show_progress=False,
        hp_name=lambda params: f"hidden-{params['hidden']}-of-{len(params)}",
    )
    assert len(seen) == 2 and all(ok and inside for _, inside, ok in seen)
    assert Path(best.run_dir).name.startswith(f"hidden-{best.hyperparameters['hidden']}-of-1")
    with pytest.raises(KeyError, match="no param 'dropout'.*trial.get"):
        hpsweep.Trial(0, {"hidden": 8})["dropout"]


def test_optunas_pytorch_simple_example_runs_as_a_space_file(tmp_path: Path) -> None:
    proc = hpsweep_cli(
        "run",
        ROOT / "search_spaces" / "optuna_pytorch_simple.py",
        "--n-trials",
        "2",
        "--output-dir",
        tmp_path,
        "--set",
        "num_train_epochs=2",
        check=True,
    )
    assert "optimising eval_accuracy (maximize)" in proc.stdout
    records = runs.read_trials(tmp_path)
    assert len(records) == 2 and all(r.state in ("complete", "pruned") for r in records)
    for r in records:
        assert (
            r.params["optimizer"] in ("Adam", "RMSprop", "SGD") and 1 <= r.params["n_layers"] <= 3
        )
        args = json.loads(next(Path(r.run_dir).glob("checkpoint-*/training_args.json")).read_text())
        assert (
            args["optim"] == r.params["optimizer"].lower()
            and args["learning_rate"] == r.params["lr"]
        )
    best = json.loads((tmp_path / "best_run.json").read_text())
    assert best["objective"] == best["run_summary"]["metrics"]["eval_accuracy"]
