"""`hpsweep.run`: run the sweep a space file describes (what ``hpsweep run`` calls)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpsweep.errors import UserError
from hpsweep.search.space_file import load_space_file


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
    ``resources_per_trial``, ``processes_per_trial``, ``sweep_callbacks``).
    """
    from hpsweep.train.arguments import TrainingArguments
    from hpsweep.train.trainer import Trainer

    sf = load_space_file(space_file)
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
    trainer = Trainer(
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
    return trainer.hyperparameter_search(
        space=sf.space,
        hp_space=sf.hp_space if sf.space is None else None,
        n_trials=n_trials,
        direction=sf.direction,
        objective=sf.objective,
        backend=backend,
        hp_name=sf.hp_name,
        study_name=study_name or sf.path.stem,
        **options,
    )
