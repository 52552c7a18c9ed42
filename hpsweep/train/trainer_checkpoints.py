"""Checkpoints of a `Trainer` run: the ``checkpoint-<step>`` folders the loop writes (in the
background, atomically) and resumes from, and ``save_model``'s weights. The files and their
atomic writing live in `hpsweep.runs`; this mixin hands them the trainer's state.

`Checkpointing` is a mixin of `Trainer`, as `Evaluation` is: it reads the trainer's ``args``,
``state``, ``accelerator``, model, optimizer, scheduler, callback handler and the run's writer
(``run_state``). `load_checkpoint` is the training loop's resume, on the same public attributes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpsweep import runs
from hpsweep.train.accelerator import bare_model
from hpsweep.train.arguments import TrainingArguments
from hpsweep.train.callbacks import CallbackHandler, TrainerState
from hpsweep.train.hf_compat.components import save_processing_class
from hpsweep.train.run_state import LoopTrainer, RunState


class Checkpointing:
    """`Trainer.save_checkpoint`, `Trainer.save_model`, and the model a trainer holds after a
    search."""

    callback_handler: CallbackHandler
    run_state: RunState
    # what `model` holds: set through its setter; until then, none
    _model: Any = None
    _best_run: runs.BestRun | None = None

    @property
    def model(self) -> Any:
        """The model. After `hyperparameter_search`, until another is set or trained, the best
        trial's: ``model_init`` with its params and the weights of ``best/``, built when first asked
        for (`evaluate`, `predict`, `save_model` or ``trainer.model``), so that a search whose
        trainer is not used again (the command line's) does not pay for it."""
        best = self._best_run
        if best is not None and self._model is None:
            from hpsweep.trial import Trial

            model = self.call_model_init(
                Trial(best.run_summary.get("number", 0), best.hyperparameters, id=best.run_id)
            )
            runs.load_weights(model, _best_weights(best))
            self._model, self._best_run = model, None
        return self._model

    @model.setter
    def model(self, value: Any) -> None:
        self._model, self._best_run = value, None

    def _hold_best_model(self, best: runs.BestRun) -> None:
        """After a search: `model` is the best trial's from now on (when its weights are on disk)."""
        if _best_weights(best) is not None:
            self.model = self.model_wrapped = None
            self._best_run = best

    def save_checkpoint(self, wait: bool = True) -> Path:
        """Write ``checkpoint-<step>`` atomically, then rotate old ones (never the best).

        ``wait=False`` (the training loop's checkpoints) copies the state now and writes it on a
        background thread, returning before the files are on disk: the next checkpoint and the end
        of training wait for them. The run's last checkpoint is written before this returns. When an
        ``on_save`` callback reads the folder (by default: see `TrainerCallback.reads_checkpoints`)
        the checkpoint is written before it is called.
        """
        final = checkpoint_dir(self.args, self.state)
        self.state.callbacks = self.callback_handler.state_dicts()
        acc = self.accelerator
        # The run's last checkpoint is written here: no step is left to overlap with its write, so
        # the copy that lets training go on, and the hand-off to a thread, would only cost time.
        state, control = self.state, self.control
        background = (
            not wait
            and state.global_step < state.max_steps
            and not control.should_training_stop
            and not self.callback_handler.reads_checkpoints()
            and acc.num_processes == 1
        )
        writer = self.run_state.writer
        # data-parallel processes hold the same weights: the first writes them
        if acc.is_main_process:
            snapshot = runs.snapshot_checkpoint(
                model=bare_model(self.model_wrapped),
                optimizer=self.optimizer,
                scheduler=self.lr_scheduler,
                state=self.state.to_dict(),
                args=self.args.to_dict(),
                scaler=acc.scaler,
                copy=background,
                model_only=self.args.save_only_model,
            )
            best = self.state.best_model_checkpoint
            writer.submit(
                final,
                snapshot,
                limit=self.args.save_total_limit,
                keep=Path(best) if best else None,
                background=background,
            )
        if acc.num_processes > 1:
            acc.wait_for_everyone()  # the others may read it next (the best model, the final checkpoint)
        self.callback_handler.fire(
            "on_save", self.args, self.state, self.control, checkpoint=str(final)
        )
        return final

    def save_model(self, output_dir: str | Path | None = None) -> None:
        """Weights only (safetensors, plus config.json for Hugging Face models) and the processing
        class, in ``output_dir`` (``args.output_dir`` by default, as in transformers)."""
        output_dir = Path(output_dir if output_dir is not None else self.args.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        model = bare_model(self.model_wrapped) if hasattr(self, "accelerator") else self.model
        runs.save_weights(model, output_dir, quiet=self.args.disable_progress)
        save_processing_class(self.processing_class, output_dir)


def checkpoint_dir(args: TrainingArguments, state: TrainerState) -> Path:
    """The folder of the checkpoint a run writes at its current step."""
    return Path(args.output_dir) / f"{runs.CHECKPOINT_PREFIX}{state.global_step}"


def load_checkpoint(trainer: LoopTrainer, folder: Path) -> Any:
    """Restore ``trainer``'s weights, optimizer, scheduler (+ fp16 scaler), state and callback
    state from ``folder``; returns the RNG state, which the loop sets when its batches start."""
    acc = trainer.accelerator
    state, rng_state = runs.read_checkpoint(
        folder,
        model=bare_model(trainer.model_wrapped),
        optimizer=trainer.optimizer,
        scheduler=trainer.lr_scheduler,
        scaler=acc.scaler,
    )
    saved = TrainerState.from_dict(state)
    for name in (
        "global_step",
        "epoch",
        "num_evaluations",
        "log_history",
        "best_metric",
        "best_model_checkpoint",
        "callbacks",
    ):
        setattr(trainer.state, name, getattr(saved, name))
    trainer.callback_handler.load_state_dicts(saved.callbacks)
    _take_new_arguments(trainer, runs.read_json(folder / "training_args.json"))
    return rng_state


def _take_new_arguments(trainer: LoopTrainer, before: dict[str, Any]) -> None:
    """A run resumed with another learning rate or weight decay than its checkpoint's (Ray
    Tune's PBT goes on from another trial's checkpoint with mutated ones, which is what its
    users ask of it): the new ones reach the optimizer and its schedule, which the
    checkpoint's state would otherwise bring back. (A new batch size goes on from the
    checkpoint's step, as in transformers: the steps of the new size count the epochs.) A
    resume with the arguments the checkpoint was written with is left as it is, bit for bit."""
    args, optimizer = trainer.args, trainer.optimizer
    scheduler = getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler)
    old_lr = before.get("learning_rate")
    if old_lr and args.learning_rate != old_lr:
        ratio = args.learning_rate / old_lr
        for group in optimizer.param_groups:
            for key in ("lr", "initial_lr"):
                if key in group:
                    group[key] *= ratio
        for key in ("base_lrs", "_last_lr"):
            if getattr(scheduler, key, None) is not None:
                setattr(scheduler, key, [lr * ratio for lr in getattr(scheduler, key)])
    if before.get("weight_decay", args.weight_decay) != args.weight_decay:
        model = bare_model(trainer.model_wrapped)
        decay = set(trainer.get_decay_parameter_names(model))
        ids = {id(p) for name, p in model.named_parameters() if name in decay}
        for group in optimizer.param_groups:
            if any(id(p) in ids for p in group["params"]):
                group["weight_decay"] = args.weight_decay


def _best_weights(best: runs.BestRun) -> Path | None:
    """Where the best run's weights are: the sweep's ``best/``, else the checkpoint it came from."""
    for folder in (
        Path(best.run_dir).parent / runs.BEST_DIR,
        Path(best.checkpoint) if best.checkpoint else None,
    ):
        if folder is not None and any(
            (folder / name).exists()
            for name in ("model.safetensors", "model.safetensors.index.json")
        ):
            return folder
    return None
