"""The `Trainer` methods that are transformers' API around the loop rather than the loop itself:
the reporting conveniences run_glue.py-style scripts end a run with (``log_metrics``,
``save_metrics``, ``save_state``), callback management (``add_callback``, ``pop_callback``, ...),
the optimizer helpers (``get_decay_parameter_names``, ``get_optimizer_cls_and_kwargs``) and the
helpers that overrides copied from transformers call.

`TransformersTrainerAPI` is a mixin of `Trainer`, as `Evaluation` and `Checkpointing` are: it
reads the trainer's ``args``, ``state``, model, optimizer and callback handler, and nothing else.
"""

from __future__ import annotations

import contextlib
import datetime
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpsweep.errors import UserError
from hpsweep.runs import read_json, write_json
from hpsweep.train import optim
from hpsweep.train.callbacks import CallbackHandler, TrainerCallback
from hpsweep.train.hf_compat.args import as_training_arguments


class TransformersTrainerAPI:
    """transformers' ``Trainer`` methods besides the loop, for scripts and overrides written for it."""

    callback_handler: CallbackHandler  # the trainer's callbacks (``.callbacks``), as transformers

    # --- the process -------------------------------------------------------------------------------

    def is_world_process_zero(self) -> bool:
        """Whether this process reports for the run: the only one, or the first of a data-parallel
        trial."""
        from accelerate import PartialState

        return PartialState().is_main_process

    def is_local_process_zero(self) -> bool:
        """Whether this process is the first on its machine."""
        from accelerate import PartialState

        return PartialState().is_local_main_process

    # --- reporting ---------------------------------------------------------------------------------

    def metrics_format(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """``metrics`` as transformers prints them: floats to 4 decimals, ``*_runtime`` as
        h:mm:ss.cc."""
        return {key: _shown(key, value) for key, value in metrics.items()}

    def log_metrics(self, split: str, metrics: Mapping[str, Any]) -> None:
        """Print ``metrics`` under ``***** <split> metrics *****``, one aligned line each, in
        transformers' format (`metrics_format`)."""
        if not self.is_world_process_zero():
            return
        shown = self.metrics_format(metrics)
        key_width = max((len(str(k)) for k in shown), default=0)
        value_width = max((len(str(v)) for v in shown.values()), default=0)
        print(f"***** {split} metrics *****")
        for key in sorted(shown):
            print(f"  {key: <{key_width}} = {shown[key]:>{value_width}}")

    def save_metrics(self, split: str, metrics: Mapping[str, Any], combined: bool = True) -> None:
        """Write ``<output_dir>/<split>_results.json`` and, with ``combined``, merge the same
        metrics into ``all_results.json``, as transformers does; each file is written whole or not
        at all."""
        if not self.is_world_process_zero():
            return
        folder = Path(self.args.output_dir)
        write_json(folder / f"{split}_results.json", dict(metrics), indent=4, sort_keys=True)
        if combined:
            merged = {**read_json(folder / "all_results.json"), **metrics}
            write_json(folder / "all_results.json", merged, indent=4, sort_keys=True)

    def save_state(self) -> None:
        """Write the trainer state to ``<output_dir>/trainer_state.json`` (what every checkpoint
        holds)."""
        if not self.is_world_process_zero():
            return
        write_json(Path(self.args.output_dir) / "trainer_state.json", self.state.to_dict())

    # --- callbacks ---------------------------------------------------------------------------------

    def add_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """Add a callback (an instance, or a class to instantiate), here and in every trial of a
        sweep."""
        callback = callback() if isinstance(callback, type) else callback
        # transformers warns too
        if any(type(cb) is type(callback) for cb in self.callback_handler.callbacks):
            warnings.warn(
                f"add_callback: this Trainer already has a {type(callback).__name__}; both will "
                "run (remove_callback removes the first)",
                stacklevel=2,
            )
        self.user_callbacks.append(callback)
        self.callback_handler.add(callback)

    def pop_callback(
        self, callback: TrainerCallback | type[TrainerCallback]
    ) -> TrainerCallback | None:
        """Remove ``callback`` (an instance, or the first one of a class) and return it; None if
        there is none."""
        found = next(
            (
                cb
                for cb in self.callback_handler.callbacks
                if (isinstance(cb, callback) if isinstance(callback, type) else cb == callback)
            ),
            None,
        )
        if found is not None:
            self.callback_handler.remove(found)
            self.user_callbacks = [cb for cb in self.user_callbacks if cb is not found]
        return found

    def remove_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """Remove ``callback`` (an instance, or the first one of a class), as `pop_callback` does."""
        self.pop_callback(callback)

    # --- the optimizer -----------------------------------------------------------------------------

    def get_decay_parameter_names(self, model: Any) -> list[str]:
        """The names of ``model``'s params that take weight decay (transformers' rule: not biases,
        not norms), for a `create_optimizer` override that builds its own param groups."""
        return optim.decay_parameter_names(model)

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: Any, model: Any = None) -> tuple[type, dict[str, Any]]:
        """The optimizer class ``args.optim`` names and its keyword arguments (learning rate,
        betas, ...), as transformers returns them; with ``model``, the default takes torch's fused
        kernel where the params have one, as the default `create_optimizer` does."""
        params = [p for p in model.parameters() if p.requires_grad] if model is not None else None
        return optim.optimizer_cls_and_kwargs(as_training_arguments(args), params)

    # --- helpers transformers' overrides call -------------------------------------------------------

    def get_num_trainable_parameters(self) -> int:
        """How many parameters of the model train."""
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def get_learning_rates(self) -> list[float]:
        """The learning rate of each of the optimizer's param groups now."""
        if self.optimizer is None:
            raise UserError(
                "the trainer has no optimizer yet; call get_learning_rates during or after train()"
            )
        return [group["lr"] for group in self.optimizer.param_groups]

    def num_examples(self, dataloader: Any) -> int:
        """The number of samples ``dataloader`` reads: its dataset's length, else its batches times
        the batch size."""
        try:
            return len(dataloader.dataset)
        except (AttributeError, TypeError):
            return len(dataloader) * self.args.per_device_train_batch_size

    def compute_loss_context_manager(self) -> contextlib.AbstractContextManager:
        """What transformers' ``training_step`` wraps ``compute_loss`` in; a no-op, as there:
        accelerate applies mixed precision to the model's forward (a ``training_step`` copied from
        transformers runs)."""
        return self.autocast_smart_context_manager()

    def autocast_smart_context_manager(
        self, cache_enabled: bool | None = True
    ) -> contextlib.AbstractContextManager:
        """transformers' autocast helper: a no-op, as there, because accelerate does the
        autocast."""
        return contextlib.nullcontext()


def _shown(key: str, value: Any) -> Any:
    """One metric as transformers prints it."""
    if "_runtime" in key and isinstance(value, (int, float)):
        return f"{datetime.timedelta(seconds=int(value))}.{int(abs(value - int(value)) * 100):02d}"
    return round(value, 4) if isinstance(value, float) else value
