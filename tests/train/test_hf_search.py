"""`Trainer.hyperparameter_search` called as Hugging Face's users call it, on each backend: a
transformers model whose size comes from ``model_init(trial)``, the search space as each backend
writes it natively (Optuna's define-by-run ``hp_space``, Ray Tune domains, a W&B sweep config),
``hp_name``, ``compute_objective``, several directions, and the keywords transformers' docs and
Ray's Hugging Face example hand a backend's library. Each test runs a real sweep of a few trials
of a two-weight model fitting a line.

The Ray tests share one local Ray cluster (a head node with two CPUs and a Ray client server);
their sweeps join it as ``address=HOST:PORT`` or over the Ray client, ``ray://HOST:PORT``."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from support.ray_nodes import Cluster, ray_nodes
from torch import nn

from hpsweep import Trainer, TrainingArguments, UserError, runs

# --- a line to fit: y = 2x + 3, by a transformers model with a slope and an intercept --------------


class LineConfig(transformers.PretrainedConfig):
    model_type = "hpsweep-line"

    def __init__(self, slope: float = 0.0, intercept: float = 0.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.slope, self.intercept = slope, intercept


class LineModel(transformers.PreTrainedModel):
    """``slope * x + intercept``; returns ``(loss, prediction)`` as transformers' models do."""

    config_class = LineConfig

    def __init__(self, config: LineConfig) -> None:
        super().__init__(config)
        self.slope = nn.Parameter(torch.tensor(float(config.slope)))
        self.intercept = nn.Parameter(torch.tensor(float(config.intercept)))
        self.post_init()

    def forward(self, x, labels=None):
        y = self.slope * x + self.intercept
        return (y,) if labels is None else (nn.functional.mse_loss(y, labels), y)


def line_rows(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    y = 2 * x + 3 + 0.1 * torch.randn(n, generator=g)
    return [{"x": xi, "labels": yi} for xi, yi in zip(x, y)]


def close_enough(p) -> dict:
    """The share of predictions within 0.5 of the label, as "accuracy" (higher is better)."""
    predictions = np.asarray(p.predictions).reshape(-1)
    return {"accuracy": float((np.abs(predictions - p.label_ids) <= 0.5).mean())}


def line_trainer(out: Path, model_init, **kw) -> Trainer:
    compute_metrics = kw.pop("compute_metrics", None)
    args = TrainingArguments(
        str(out),
        learning_rate=0.1,
        num_train_epochs=kw.pop("num_train_epochs", 2),
        per_device_train_batch_size=16,
        eval_strategy="epoch",
        save_strategy="epoch",
        logging_steps=1,
        disable_tqdm=True,
        report_to="none",
        **kw,
    )
    return Trainer(
        model_init=model_init,
        args=args,
        train_dataset=line_rows(64, 1),
        eval_dataset=line_rows(32, 2),
        compute_metrics=compute_metrics,
    )


def model_suggesting_its_line(trial):
    """transformers' Optuna users suggest model params inside model_init (None: no trial yet)."""
    slope = trial.suggest_int("slope", -4, 4) if trial is not None else 0
    intercept = trial.suggest_int("intercept", -4, 4) if trial is not None else 0
    return LineModel(LineConfig(slope=slope, intercept=intercept))


def model_from_config(config):
    """transformers' Ray and W&B users read the sampled params like a dict."""
    config = config or {}
    return LineModel(LineConfig(slope=config.get("slope", 0), intercept=config.get("intercept", 0)))


def line_name(params) -> str:
    return f"line_s{params['slope']}_i{params['intercept']}"


def finished(out: Path, n: int) -> list[runs.TrialRecord]:
    records = runs.read_trials(out)
    assert [r.state for r in records] == ["complete"] * n, [(r.state, r.error) for r in records]
    return records


# --- Optuna ----------------------------------------------------------------------------------------


def test_params_suggested_in_model_init_name_the_runs_and_the_best_is_kept(tmp_path: Path) -> None:
    out = tmp_path / "out"
    trainer = line_trainer(
        out, model_suggesting_its_line, load_best_model_at_end=True, run_name="line"
    )
    best = trainer.hyperparameter_search(
        direction="minimize",
        hp_space=lambda trial: {},
        hp_name=lambda trial: line_name(trial.params),
        n_trials=3,
        show_progress=False,
    )
    records = finished(out, 3)
    for r in records:
        assert set(r.params) == {"slope", "intercept"}
        assert Path(r.run_dir).name.startswith(line_name(r.params)), r.run_dir
    assert best.objective == min(r.objective for r in records)
    assert best.hyperparameters == next(r.params for r in records if r.id == best.run_id)
    kept = LineModel.from_pretrained(best.checkpoint)  # a transformers model, loadable as it is
    assert isinstance(kept, LineModel) and (out / "best" / "config.json").exists()


@pytest.mark.parametrize("keyword", ["direction", "directions"])
def test_two_directions_return_the_pareto_front(tmp_path: Path, keyword: str) -> None:
    """transformers' test passes ``direction=[...]``; its docs page shows ``directions=[...]``
    (Optuna's create_study keyword), which transformers itself fails on. Both are the same here."""
    out = tmp_path / "out"
    trainer = line_trainer(out, model_suggesting_its_line, compute_metrics=close_enough)
    front = trainer.hyperparameter_search(
        hp_space=lambda trial: {},
        n_trials=3,
        compute_objective=lambda m: (m["eval_loss"], m["eval_accuracy"]),
        show_progress=False,
        **{keyword: ["minimize", "maximize"]},
    )
    records = finished(out, 3)
    assert isinstance(front, list) and front
    for member in front:
        loss, accuracy = member.objective
        # no trial is at least as good on both and better on one
        assert not any(
            (r.objective[0] <= loss and r.objective[1] >= accuracy)
            and (r.objective[0] < loss or r.objective[1] > accuracy)
            for r in records
        )


def test_direction_and_directions_that_disagree_are_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    with pytest.raises(UserError, match="direction='maximize' and directions=.* disagree"):
        line_trainer(out, model_suggesting_its_line).hyperparameter_search(
            hp_space=lambda trial: {},
            direction="maximize",
            directions=["minimize", "maximize"],
            n_trials=2,
        )
    assert not out.exists()


def test_evaluation_in_half_precision_scores_every_trial(tmp_path: Path) -> None:
    out = tmp_path / "out"
    trainer = line_trainer(out, model_suggesting_its_line, fp16_full_eval=True)
    best = trainer.hyperparameter_search(
        hp_space=lambda trial: {}, n_trials=2, direction="minimize", show_progress=False
    )
    records = finished(out, 2)
    assert all(np.isfinite(r.objective) and len(r.history) == 2 for r in records)
    assert best.objective == min(r.objective for r in records)


# --- Weights & Biases ------------------------------------------------------------------------------


def sweep_config(trial) -> dict:
    return {
        "method": "random",
        "metric": {"name": "objective", "goal": "minimize"},
        "parameters": {
            "slope": {"distribution": "int_uniform", "min": -4, "max": 4},
            "intercept": {"values": [-2, 0, 2]},
        },
    }


def test_a_wandb_sweep_config_runs_offline_and_sweep_id_continues_it(
    tmp_path: Path, offline_wandb: None
) -> None:
    out = tmp_path / "out"
    trainer = line_trainer(out, model_from_config)
    kwargs = dict(
        hp_space=sweep_config,
        backend="wandb",
        direction="minimize",
        project="line-fits",
        entity="line-team",
        metric="eval/loss",
        show_progress=False,
    )
    best = trainer.hyperparameter_search(n_trials=2, **kwargs)
    first = finished(out, 2)
    assert set(best.hyperparameters) == {"slope", "intercept"}
    assert (out / ".study").read_text().strip() == "line-fits"  # W&B's project
    import wandb

    wandb.teardown()  # W&B's service writes the offline runs' files after they finish
    offline = [
        next(d.glob("run-*.wandb")).read_bytes() for d in (out / "wandb").glob("offline-run-*")
    ]
    # where `wandb sync` uploads them
    assert len(offline) == 2 and all(b"line-fits" in f and b"line-team" in f for f in offline)

    sweep_id = json.loads((out / "wandb_sweep.json").read_text())["sweep_id"]
    best = trainer.hyperparameter_search(n_trials=3, sweep_id=sweep_id, **kwargs)
    records = finished(out, 3)
    assert {r.id: r.finished_at for r in records if r.id in {f.id for f in first}} == {
        f.id: f.finished_at for f in first
    }  # the first two trials are the sweep's, untouched
    assert best.objective == min(r.objective for r in records)


def test_a_wandb_metric_is_the_objective_and_one_that_disagrees_is_refused(
    tmp_path: Path, offline_wandb: None, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    trainer = line_trainer(out, model_from_config, compute_metrics=close_enough)
    with pytest.raises(UserError, match="metric='eval/loss' and the objective .* disagree"):
        trainer.hyperparameter_search(
            hp_space=sweep_config,
            backend="wandb",
            metric="eval/loss",
            compute_objective=lambda m: m["eval_accuracy"],
            n_trials=1,
        )
    assert not out.exists()
    best = trainer.hyperparameter_search(
        hp_space=sweep_config,
        backend="wandb",
        metric="eval/accuracy",
        direction="maximize",
        n_trials=1,
        show_progress=False,
    )
    assert "hpsweep: optimising eval_accuracy (maximize)" in capsys.readouterr().out
    [record] = finished(out, 1)
    assert record.objective_name == "eval_accuracy"
    assert best.objective == record.metrics["eval_accuracy"]


# --- Ray Tune --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A Ray head node with two CPUs, without token authentication (a Ray client server does not
    pass one on), and its Ray client server."""
    with ray_nodes(workers=0, token=False, head_cpus=2) as c:
        yield c


def tune_domains(trial) -> dict:
    from ray import tune

    return {"slope": tune.randint(-4, 4), "intercept": tune.randint(-4, 4)}


def search_on_ray(cluster_address: str, out: Path, n_trials: int) -> list[runs.TrialRecord]:
    trainer = line_trainer(out, model_from_config)
    best = trainer.hyperparameter_search(
        hp_space=tune_domains,
        hp_name=line_name,
        backend="ray",
        n_trials=n_trials,
        direction="minimize",
        address=cluster_address,
        resources_per_trial={"cpu": 1, "gpu": 0},
        show_progress=False,
    )
    records = finished(out, n_trials)
    for r in records:
        assert -4 <= r.params["slope"] < 4 and -4 <= r.params["intercept"] < 4
        assert Path(r.run_dir).name.startswith(line_name(r.params)), r.run_dir
    assert best.objective == min(r.objective for r in records)
    return records


def test_ray_tune_domains_with_model_init_and_hp_name_reading_the_config(
    cluster: Cluster, tmp_path: Path
) -> None:
    search_on_ray(cluster.address, tmp_path / "out", n_trials=3)


def test_the_same_ray_search_over_a_ray_client_connection(cluster: Cluster, tmp_path: Path) -> None:
    """Over ``ray://``, Tune runs each round's driver as an actor on the cluster; hpsweep's rounds
    each make one, and every trial still records itself in this machine's output folder."""
    try:
        records = search_on_ray(cluster.client_address, tmp_path / "out", n_trials=2)
    except UserError as error:
        # Ray's client server now and then fails to start the per-client server it joins us to
        # ("Initialization failure from server"), before anything is written; a failed join leaves
        # the process able to join again, which this second try also checks
        if "Initialization failure from server" not in str(error):
            raise
        records = search_on_ray(cluster.client_address, tmp_path / "again", n_trials=2)
    assert all(r.user_attrs.get("ray_node_id") for r in records)


class SlowLine(LineModel):
    """Slow enough that two trials train side by side, for PBT to compare them."""

    def forward(self, x, labels=None):
        time.sleep(0.1)
        return super().forward(x, labels)


def slow_model_from_config(config):
    config = config or {}
    return SlowLine(LineConfig(slope=config.get("slope", 0)))


def test_rays_hugging_face_pbt_example_restores_trials_from_checkpoints_it_kept(
    cluster: Cluster, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    """Ray's own pbt_transformers example, with its keywords: PBT over weight_decay,
    learning_rate and per_device_train_batch_size, ``checkpoint_config`` keeping one checkpoint
    (which makes transformers' PBT fail: the checkpoint a trial is to restore from is gone),
    a CLIReporter, ``local_dir`` and ``name``. PBT compares trials that train side by side:
    ``max_concurrent_trials=2`` (hpsweep runs one trial at a time unless told)."""
    from ray import tune
    from ray.tune import CheckpointConfig, CLIReporter
    from ray.tune.schedulers import PopulationBasedTraining

    out, ray_results = tmp_path / "out", tmp_path / "ray_results"
    trainer = line_trainer(out, slow_model_from_config, compute_metrics=close_enough)
    pbt = PopulationBasedTraining(
        time_attr="training_iteration",
        metric="eval_accuracy",
        mode="max",
        perturbation_interval=1,
        hyperparam_mutations={
            "weight_decay": tune.uniform(0.0, 0.3),
            "learning_rate": tune.uniform(1e-2, 1e-1),
            "per_device_train_batch_size": [8, 16, 32],
        },
    )
    reporter = CLIReporter(
        parameter_columns={"weight_decay": "w_decay", "learning_rate": "lr"},
        metric_columns=["eval_accuracy", "eval_loss", "training_iteration"],
    )
    trainer.hyperparameter_search(
        hp_space=lambda _: {
            "per_device_train_batch_size": 16,
            "num_train_epochs": tune.choice([3, 4]),
            "slope": tune.randint(-4, 4),
        },
        backend="ray",
        n_trials=4,
        direction="maximize",
        address=cluster.address,
        resources_per_trial={"cpu": 1, "gpu": 0},
        max_concurrent_trials=2,
        scheduler=pbt,
        checkpoint_config=CheckpointConfig(
            num_to_keep=1, checkpoint_score_attribute="training_iteration"
        ),
        stop=None,
        progress_reporter=reporter,
        local_dir=str(ray_results),
        name="tune_transformer_pbt",
        log_to_file=True,
        show_progress=False,
    )
    printed = capfd.readouterr()
    records = finished(out, 4)
    restored = [r for r in records if r.user_attrs.get("ray_restores", 0) > 0]
    assert restored, "PBT restored no trial from a checkpoint"
    for r in restored:  # the evaluations before the restore came back with the checkpoint
        assert r.history[0]["epoch"] == 1
    for r in records:
        for checkpoint in runs.checkpoints(Path(r.run_dir)):
            # each checkpoint trained with the learning rate and weight decay its arguments name,
            # the ones PBT mutated included, not those of the checkpoint it went on from
            args = runs.read_json(checkpoint / "training_args.json")
            optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=True)
            decaying, *_ = groups = optimizer["param_groups"]
            assert all(g["initial_lr"] == pytest.approx(args["learning_rate"]) for g in groups)
            assert decaying["weight_decay"] == pytest.approx(args["weight_decay"])
    settings = [
        {(a["learning_rate"], a["weight_decay"]) for a in map(runs.read_json, args_files)}
        for args_files in (
            Path(r.run_dir).glob("checkpoint-*/training_args.json") for r in restored
        )
    ]
    assert any(len(pairs) > 1 for pairs in settings), (
        "no restored trial trained on after PBT mutated it"
    )
    assert "num_to_keep=1: PopulationBasedTraining restores trials" in printed.err
    assert "w_decay" in printed.out and "eval_accuracy" in printed.out  # the reporter's table
    experiments = [p.name for p in ray_results.iterdir()]
    assert experiments and all(n.startswith("tune_transformer_pbt-") for n in experiments)


def test_a_resume_with_another_learning_rate_and_weight_decay_trains_with_them(
    tmp_path: Path,
) -> None:
    """What PBT does to a trial, on a plain run: it goes on from a checkpoint with another learning
    rate and weight decay (here from none, which the checkpoint's optimizer holds in one param
    group, to some, in two), which take over from the checkpoint's."""
    out = tmp_path / "run"
    line_trainer(out, model_from_config).train()
    checkpoint = runs.latest_checkpoint(out)
    again = line_trainer(out, model_from_config, num_train_epochs=4)
    again.args = again.args.replace(learning_rate=0.05, weight_decay=0.2)
    again.train(resume_from_checkpoint=str(checkpoint))
    assert again.state.global_step == 16
    decaying, *_ = groups = again.optimizer.param_groups
    assert all(g["initial_lr"] == pytest.approx(0.05) for g in groups)
    assert decaying["weight_decay"] == 0.2


def stopped_search(cluster: Cluster, out: Path, epochs: int, n_trials: int, **keywords) -> list:
    line_trainer(out, model_from_config, num_train_epochs=epochs).hyperparameter_search(
        hp_space=tune_domains,
        backend="ray",
        n_trials=n_trials,
        address=cluster.address,
        show_progress=False,
        **keywords,
    )
    return finished(out, n_trials)


def test_a_tune_stop_ends_trials_complete_and_tune_keeps_the_checkpoints_asked_for(
    cluster: Cluster, tmp_path: Path
) -> None:
    ray_results = tmp_path / "ray_results"
    records = stopped_search(
        cluster,
        tmp_path / "out",
        epochs=4,
        n_trials=2,
        stop={"training_iteration": 2},
        keep_checkpoints_num=1,
        storage_path=str(ray_results),
    )
    for r in records:  # stopped after its second evaluation, with that evaluation's objective
        assert len(r.history) == 2 and r.objective == r.history[-1]["eval_loss"]
    [experiment] = ray_results.iterdir()
    for trial in (p for p in experiment.iterdir() if p.is_dir()):
        assert len(list(trial.glob("checkpoint_*"))) == 1, sorted(trial.iterdir())

    # a function of (trial_id, result), here true at the first evaluation
    [record] = stopped_search(
        cluster,
        tmp_path / "out-fn",
        epochs=3,
        n_trials=1,
        stop=lambda _, result: "objective" in result,
    )
    assert len(record.history) == 1


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"stop": "TimeoutStopper"}, "ends the whole run .*give those"),
        ({"stop": {"training_iteration": "2"}}, "'training_iteration' needs a number"),
        ({"checkpoint_freq": 2}, "set save_strategy"),
        ({"keep_checkpoints_num": 0}, "give a count of 1 or more"),
        ({"progress_reporter": "table"}, "give a ray.tune.CLIReporter"),
    ],
)
def test_tune_keywords_that_cannot_be_honoured_are_one_line_before_ray_starts(
    tmp_path: Path, keywords: dict, message: str
) -> None:
    from ray.tune.stopper import TimeoutStopper

    if keywords.get("stop") == "TimeoutStopper":
        keywords = {"stop": TimeoutStopper(60)}
    out = tmp_path / "out"
    with pytest.raises(UserError, match=message):
        line_trainer(out, model_from_config).hyperparameter_search(
            hp_space=tune_domains, backend="ray", n_trials=2, **keywords
        )
    assert not out.exists()
