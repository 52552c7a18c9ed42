"""One `SearchOptions` per search: the command line's flags and the Python API's keywords build
the same options, and the backend reads them without changing them."""

from __future__ import annotations

import pickle
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest
from support.tiny_model import FourClassNet, four_class_rows

from hpsweep import Float, TrainingArguments
from hpsweep.cli.commands import build_parser, search_options
from hpsweep.search.options import SearchOptions
from hpsweep.search.sweep import prepare
from hpsweep.train.trainer import Trainer


def test_the_command_line_and_the_api_build_the_same_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hpsweep run``'s flags and `hpsweep.run`'s (or ``hyperparameter_search``'s) keywords for
    the same search are the same options; a flag left out means what a keyword left out means."""
    monkeypatch.delenv("HPSWEEP_STORAGE", raising=False)
    journal = str(tmp_path / "study.journal")
    flags = "--n-trials 3 --timeout 60 --study-name s --sampler random --pruner none --seed 7"
    flags += " --n-jobs 2 --resources-per-trial cpu=1 --max-failed-trials 2 --storage " + journal
    from_flags = search_options(build_parser().parse_args(["run", "space.py", *flags.split()]))
    from_keywords = SearchOptions.from_keywords(
        n_trials=3,
        timeout=60,
        study_name="s",
        sampler="random",
        pruner="none",
        seed=7,
        n_jobs=2,
        resources_per_trial={"cpu": 1},
        max_failed_trials=2,
        storage=journal,
    )
    assert from_flags == from_keywords
    plain = search_options(build_parser().parse_args(["run", "space.py"]))
    assert plain == SearchOptions.from_keywords(backend="optuna", n_trials=20, study_name=None)


def sweep_config(trial: object) -> dict:
    """An ``hp_space`` as Hugging Face's W&B users write it: W&B's own sweep config."""
    lr = {"distribution": "log_uniform_values", "min": 1e-3, "max": 1e-1}
    return {"method": "random", "parameters": {"learning_rate": lr}}


def test_a_backend_reads_the_options_and_cannot_change_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W&B's sweep config is adopted as the options it stands for before the backend is made:
    the backend, the trials and the sweep callbacks read one frozen object; the options the user
    built stay as they were, and nothing is written before the sweep starts."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", "")
    out = tmp_path / "out"
    trainer = Trainer(
        model_init=FourClassNet,
        args=TrainingArguments(output_dir=str(out)),
        train_dataset=four_class_rows(32, 1),
        eval_dataset=four_class_rows(32, 2),
    )
    asked = SearchOptions.from_keywords(hp_space=sweep_config, backend="wandb", name="lr-sweep")
    settings, job, backend = prepare(trainer, asked)
    assert backend.settings is settings and job.hp_space is None
    assert settings.space == {"learning_rate": Float(1e-3, 1e-1, log=True)}
    assert (settings.sampler, settings.hp_space, settings.output_dir) == ("random", None, out)
    assert (asked.hp_space, asked.space, asked.sampler) == (sweep_config, None, None)
    with pytest.raises(FrozenInstanceError):
        backend.settings.sampler = "bayes"  # type: ignore[misc]
    with pytest.raises(TypeError):
        backend.settings.options["name"] = "another"  # type: ignore[index]
    kept = pickle.loads(pickle.dumps(settings))  # as a sweep callback that keeps them travels
    assert (kept.options, kept.space, kept.output_dir) == (settings.options, settings.space, out)
    assert not out.exists()
