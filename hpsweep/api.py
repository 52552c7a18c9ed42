"""`hpsweep.run`: run the sweep a space file describes (what ``hpsweep run`` calls)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from hpsweep.errors import UserError
from hpsweep.search.options import SearchOptions
from hpsweep.search.space_file import SpaceFile, load_space_file


def run(
    space_file: str | Path,
    *,
    backend: str = "optuna",
    n_trials: int | None = 20,
    output_dir: str | Path | None = None,
    config: str | Path | None = None,
    set_args: Sequence[str] = (),
    study_name: str | None = None,
    **options: Any,
) -> Any:
    """Run the sweep described by ``space_file``; returns the `BestRun` (a list for multi-objective).

    Arguments are resolved command line > ``config`` file > the space file's ``args``. Other
    keyword options go to `Trainer.hyperparameter_search` (``timeout``, ``n_jobs``, ``sampler``,
    ``pruner``, ``scheduler``, ``storage``, ``resume``, ``seed``, ``address``,
    ``resources_per_trial``, ``processes_per_trial``, ``sweep_callbacks``, ``warm_start``,
    ``warm_start_best``: docs/warm-start.md; ``stop_when``: docs/stopping.md).
    """
    asked = SearchOptions.from_keywords(
        backend=backend, n_trials=n_trials, study_name=study_name, **options
    )
    return run_options(space_file, asked, output_dir=output_dir, config=config, set_args=set_args)


def run_options(
    space_file: str | Path,
    options: SearchOptions,
    *,
    output_dir: str | Path | None = None,
    config: str | Path | None = None,
    set_args: Sequence[str] = (),
) -> Any:
    """`run` with its search options built (the command line builds them from its flags): the
    space file gives the space, the direction, the objective and, when ``options`` name none,
    the study's name."""
    from hpsweep.search.sweep import search

    sf = load_space_file(space_file)
    trainer = space_file_trainer(sf, output_dir=output_dir, config=config, set_args=set_args)
    return search(trainer, with_space_file(options, sf))


def with_space_file(options: SearchOptions, sf: SpaceFile) -> SearchOptions:
    """``options`` with what the space file describes: its space (or define-by-run ``hp_space``),
    direction, objective and ``hp_name``; the study is named after the file unless named."""
    return replace(
        options,
        space=sf.space,
        hp_space=sf.hp_space if sf.space is None else None,
        direction=sf.direction,
        objective=sf.objective,
        hp_name=sf.hp_name,
        study_name=options.study_name or sf.path.stem,
    )


def space_file_trainer(
    sf: SpaceFile,
    *,
    output_dir: str | Path | None,
    config: str | Path | None,
    set_args: Sequence[str],
) -> Any:
    """The `Trainer` the space file describes, its arguments resolved command line > ``config``
    file > the space file's ``args``."""
    from hpsweep.train.arguments import TrainingArguments
    from hpsweep.train.trainer import Trainer

    args: TrainingArguments = sf.args
    if config is not None:
        if Path(config).is_dir():
            raise UserError(
                f"--config {config} is a folder; give a YAML or JSON file of TrainingArguments"
            )
        args = TrainingArguments.from_file(config, base=args)
    if set_args:
        args = args.with_overrides(list(set_args))
    if output_dir is not None:
        args = args.replace(output_dir=str(output_dir))
    return Trainer(
        model_init=sf.model_init,
        args=args,
        train_dataset=sf.train_dataset,
        eval_dataset=sf.eval_dataset,
        data_collator=sf.data_collator,
        compute_metrics=sf.compute_metrics,
        callbacks=sf.callbacks,
        processing_class=sf.processing_class,
        preprocess_logits_for_metrics=sf.preprocess_logits_for_metrics,
        compute_loss_func=sf.compute_loss_func,
    )
