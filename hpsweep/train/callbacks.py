"""Callbacks around the training loop, and the built-in ones (early stopping, metrics, the
progress bar, NEFTune's noise).

A callback subclasses `TrainerCallback` and overrides the events it cares about; each event
receives ``(args, state, control, **kwargs)`` and may set flags on `TrainerControl`. A callback
with state to keep across a resume implements `state_dict` / `load_state_dict`: the state is
saved in every checkpoint's trainer_state.json and handed back on resume.

    >>> class StopAtLoss(TrainerCallback):
    ...     def on_evaluate(self, args, state, control, metrics, **kwargs):
    ...         if metrics["eval_loss"] < 0.1:
    ...             control.should_training_stop = True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from hpsweep.errors import UserError
from hpsweep.train.metrics import SPEED_SUFFIXES, metric_value

EVENTS = (
    "on_init_end",
    "on_train_begin",
    "on_epoch_begin",
    "on_step_begin",
    "on_before_backward",
    "on_after_backward",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_substep_end",
    "on_step_end",
    "on_evaluate",
    "on_prediction_step",
    "on_save",
    "on_log",
    "on_epoch_end",
    "on_exception",
    "on_train_end",
    "on_predict",
)
#: Other names an event answers to, so that callbacks written against either name run:
#: transformers' ``on_pre_optimizer_step`` is also called ``on_before_optimizer_step``.
ALIASES = {"on_pre_optimizer_step": ("on_before_optimizer_step",)}


class EvalPrediction(NamedTuple):
    """What ``compute_metrics`` receives: stacked predictions (logits) and labels, as numpy."""

    predictions: Any
    label_ids: Any


class EvalLoopOutput(NamedTuple):
    """What ``Trainer.evaluation_loop`` returns, as transformers' does: the predictions and labels
    (None when not gathered or absent), the ``<prefix>_*`` metrics and the number of samples."""

    predictions: Any
    label_ids: Any
    metrics: dict[str, float]
    num_samples: int


class PredictionOutput(NamedTuple):
    """What ``Trainer.predict`` returns, as transformers' does: the predictions, the labels (None
    when the dataset has none) and the metrics (``test_*``)."""

    predictions: Any
    label_ids: Any
    metrics: dict[str, float]


@dataclass
class TrainerState:
    """Progress of one training run; saved as trainer_state.json in each checkpoint."""

    global_step: int = 0
    epoch: float = 0.0
    max_steps: int = 0
    num_train_epochs: int = 0
    steps_per_epoch: int = 0
    num_evaluations: int = 0
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    best_model_checkpoint: str | None = None
    trial_number: int | None = None
    trial_params: dict[str, Any] | None = None
    callbacks: dict[str, Any] = field(default_factory=dict)
    # transformers' fields that its callbacks read
    best_global_step: int | None = None
    logging_steps: int | None = None  # the arguments' *_steps (None where unset)
    eval_steps: int | None = None
    save_steps: int | None = None
    train_batch_size: int | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None  # a sweep's run folder
    num_input_tokens_seen: int = 0  # counted under include_num_input_tokens_seen

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainerState:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def evaluations(self) -> list[dict[str, Any]]:
        """The evaluations in ``log_history``: the entries with ``eval_*`` metrics (with or without
        ``eval_loss``: several eval datasets log ``eval_<name>_loss``; a custom `prediction_step`
        may give no loss)."""
        return [h for h in self.log_history if any(k.startswith("eval_") for k in h)]

    def eval_metrics(self, *, best: bool = False) -> dict[str, float]:
        """The latest evaluation's metrics; with ``best``, those of the best checkpoint's evaluation."""
        evals = self.evaluations()
        if not evals:
            return {}
        chosen = evals[-1]
        if best and self.best_model_checkpoint:
            # checkpoint-<step>
            step = int(Path(self.best_model_checkpoint).name.rpartition("-")[2])
            chosen = next((h for h in reversed(evals) if h["step"] == step), chosen)
        return {k: v for k, v in chosen.items() if k not in ("epoch", "step")}


@dataclass
class TrainerControl:
    """Flags callbacks set to steer the loop; the loop resets them after acting on them."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_evaluate: bool = False
    should_save: bool = False
    should_log: bool = False


def flow_on_step(args: Any, state: TrainerState, control: TrainerControl) -> None:
    """Hugging Face's ``DefaultFlowCallback`` after each optimizer step, before the callbacks'
    ``on_step_end`` (it is the first of transformers' callbacks): log, evaluate and save on the
    ``*_steps`` schedule (log at step 1 too with ``logging_first_step``, evaluate from step
    ``eval_delay`` on), and stop at ``max_steps``, evaluating and saving there on a steps schedule."""
    step = state.global_step
    control.should_log |= args.logging_strategy == "steps" and step % args.logging_steps == 0
    control.should_log |= step == 1 and args.logging_first_step
    evaluates = args.eval_strategy == "steps" and args.eval_delay <= step
    control.should_evaluate |= evaluates and step % args.eval_steps == 0
    control.should_save |= args.save_strategy == "steps" and step % args.save_steps == 0
    if step >= state.max_steps:
        control.should_training_stop = True
        control.should_evaluate |= evaluates
        control.should_save |= args.save_strategy == "steps"


def flow_on_epoch(args: Any, state: TrainerState, control: TrainerControl) -> None:
    """``DefaultFlowCallback`` at an epoch's end: the ``epoch`` schedule, evaluating from ``eval_delay`` on."""
    control.should_log |= args.logging_strategy == "epoch"
    control.should_evaluate |= args.eval_strategy == "epoch" and args.eval_delay <= state.epoch
    control.should_save |= args.save_strategy == "epoch"


class TrainerCallback:
    """Base class: every event is a no-op. Override the ones you need."""

    #: Set to True when `on_evaluate` needs ``eval_prediction`` (predictions and labels).
    needs_predictions: bool = False
    #: Whether `on_save` may read the checkpoint folder. Checkpoints are written in the background;
    #: the trainer waits for the folder to be on disk before calling `on_save` on a callback that
    #: reads it. Set it to False when `on_save` only notes the path (``checkpoint``).
    reads_checkpoints: bool = True

    def state_dict(self) -> dict[str, Any] | None:
        """State to save in checkpoints and hand back on resume; None when there is none."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""


def _noop(
    self: TrainerCallback, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
) -> None:
    return None


for _event in (*EVENTS, *(name for names in ALIASES.values() for name in names)):
    setattr(TrainerCallback, _event, _noop)


def _overrides(callback: Any, event: str) -> bool:
    """Whether ``callback``'s class defines ``event`` beyond a base class's no-op (ours, or that of
    transformers' ``TrainerCallback``, which a callback written for transformers subclasses)."""
    method = getattr(type(callback), event, _noop)
    return method is not _noop and not (
        getattr(method, "__module__", None) == "transformers.trainer_callback"
        and method.__qualname__ == f"TrainerCallback.{event}"
    )


class CallbackHandler:
    """Calls an event on every callback in order; skips callbacks that do not override it."""

    def __init__(
        self,
        callbacks: Sequence[TrainerCallback],
        context: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        self.callbacks = list(callbacks)
        self._context = context  # what every event hands its callbacks besides its own keywords
        self._listeners = {
            event: [
                getattr(cb, name)
                for cb in self.callbacks
                for name in (event, *ALIASES.get(event, ()))
                if _overrides(cb, name)
            ]
            for event in EVENTS
        }

    def add(self, callback: TrainerCallback) -> None:
        self.__init__([*self.callbacks, callback], self._context)  # type: ignore[misc]

    def remove(self, callback: TrainerCallback) -> None:
        self.__init__([cb for cb in self.callbacks if cb is not callback], self._context)  # type: ignore[misc]

    def listens(self, event: str) -> bool:
        """Whether a callback overrides ``event`` (so that firing it per batch costs nothing otherwise)."""
        return bool(self._listeners[event])

    # A transformers callback has none of hpsweep's attributes; it gets their defaults.
    def needs_predictions(self) -> bool:
        return any(getattr(cb, "needs_predictions", False) for cb in self.callbacks)

    def reads_checkpoints(self) -> bool:
        """Whether a callback's `on_save` may read the checkpoint folder (so it must be on disk)."""
        return any(
            getattr(cb, "reads_checkpoints", True)
            for cb in self.callbacks
            if _overrides(cb, "on_save")
        )

    def fire(
        self, event: str, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        if event == "on_evaluate":
            # counted where callbacks hear of it: an evaluate override's too
            state.num_evaluations += 1
        listeners = self._listeners[event]
        if listeners and self._context is not None:
            kwargs = {**self._context(), **kwargs}
        for listener in listeners:
            returned = listener(args, state, control, **kwargs)
            if returned is not None and returned is not control:
                _adopt(control, returned)
        return control

    def state_dicts(self) -> dict[str, Any]:
        """Callbacks' states by class name; a class of several keeps a list, as transformers does."""
        by_class: dict[str, list] = {}
        for cb in self.callbacks:
            by_class.setdefault(type(cb).__name__, []).append(_state(cb))
        return {
            name: states if len(states) > 1 else states[0]
            for name, states in by_class.items()
            if any(state is not None for state in states)
        }

    def load_state_dicts(self, states: Mapping[str, Any]) -> None:
        seen: dict[str, int] = {}
        for cb in self.callbacks:
            name = type(cb).__name__
            position = seen[name] = seen.get(name, -1) + 1
            saved = states.get(name)
            saved = saved if isinstance(saved, list) else [saved]  # a lone state is the first's
            state = saved[position] if position < len(saved) else None
            if state is None:
                continue
            if hasattr(cb, "load_state_dict"):
                cb.load_state_dict(state)
            elif _is_exportable(cb):
                for attribute, value in state.get("attributes", {}).items():
                    setattr(cb, attribute, value)


def _adopt(control: TrainerControl, returned: Any) -> None:
    """A callback that returns a control (ours or transformers') instead of setting flags on the one
    it was given: its flags become the loop's, all of them, as transformers' handler adopts it."""
    for name in TrainerControl.__dataclass_fields__:
        if hasattr(returned, name):
            setattr(control, name, bool(getattr(returned, name)))


def _is_exportable(callback: Any) -> bool:
    """Whether ``callback`` is a transformers ``ExportableState`` (``state()`` and ``from_state``)."""
    return callable(getattr(callback, "state", None)) and callable(
        getattr(type(callback), "from_state", None)
    )


def _state(callback: Any) -> dict[str, Any] | None:
    """A callback's ``state_dict()``, or the ``state()`` of a transformers ``ExportableState`` (its
    EarlyStoppingCallback keeps its patience counter there), or None. Unlike transformers, whose
    ``restore_callback_states_from_checkpoint`` is off by default, hpsweep restores it on every
    resume: a resumed trial must stop where the uninterrupted one would."""
    if hasattr(callback, "state_dict"):
        return callback.state_dict()
    try:
        return callback.state() if _is_exportable(callback) else None
    except NotImplementedError:  # ExportableState's own stub
        return None


def _event_method(event: str, *positional: str) -> Callable[..., TrainerControl]:
    """``handler.<event>(args, state, control, ...)``, as transformers' handler takes it (its
    ``on_evaluate`` and ``on_predict`` take ``metrics``, its ``on_log`` ``logs``, by position)."""

    def call(
        self: CallbackHandler,
        args: Any,
        state: TrainerState,
        control: TrainerControl,
        *values: Any,
        **kwargs: Any,
    ) -> TrainerControl:
        return self.fire(event, args, state, control, **dict(zip(positional, values)), **kwargs)

    call.__name__ = call.__qualname__ = event
    return call


#: The keywords transformers' handler takes by position after ``control``, per event.
_POSITIONAL = {"on_evaluate": ("metrics",), "on_predict": ("metrics",), "on_log": ("logs",)}
for _event in EVENTS:
    setattr(CallbackHandler, _event, _event_method(_event, *_POSITIONAL.get(_event, ())))


# --- built-in callbacks -----------------------------------------------------------------------------


class EarlyStoppingCallback(TrainerCallback):
    """Stop training when ``metric_for_best_model`` has not improved for ``patience`` evaluations
    of the same run: each run (each trial of a sweep) starts afresh, a resumed one where it stopped.

    Args:
        early_stopping_patience: evaluations without improvement before stopping.
        early_stopping_threshold: the least change that counts as an improvement.
    """

    def __init__(
        self, early_stopping_patience: int = 1, early_stopping_threshold: float = 0.0
    ) -> None:
        self.patience = early_stopping_patience
        self.threshold = early_stopping_threshold
        self.bad_evaluations = 0
        self.best: float | None = None

    def on_train_begin(
        self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # a new run (a sweep's trials share this instance); a resume restored its state
        if state.global_step == 0:
            self.bad_evaluations, self.best = 0, None

    def on_evaluate(
        self,
        args: Any,
        state: TrainerState,
        control: TrainerControl,
        *,
        metrics: Mapping[str, float],
        **kwargs: Any,
    ) -> None:
        name = args.metric_for_best_model or "eval_loss"
        value = metric_value(metrics, name, "metric_for_best_model")
        sign = 1 if args.greater_is_better else -1
        if self.best is None or sign * (value - self.best) > self.threshold:
            self.best, self.bad_evaluations = value, 0
        else:
            self.bad_evaluations += 1
            if self.bad_evaluations >= self.patience:
                control.should_training_stop = True

    def state_dict(self) -> dict[str, Any]:
        return {"bad_evaluations": self.bad_evaluations, "best": self.best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bad_evaluations, self.best = state["bad_evaluations"], state["best"]


class MetricCallback(TrainerCallback):
    """Add ``eval_<name>`` = ``metric_fn(predictions, labels)`` to every evaluation
    (``eval_<dataset>_<name>`` for each of several eval datasets; ``evaluate``'s
    ``metric_key_prefix`` in place of ``eval``).

    For metrics that are not differentiable (accuracy, F1, BLEU):

        >>> accuracy = MetricCallback(lambda p, y: float((p.argmax(-1) == y).mean()), name="accuracy")
    """

    needs_predictions = True

    def __init__(self, metric_fn: Callable[[Any, Any], float], name: str | None = None) -> None:
        self.metric_fn = metric_fn
        self.name = name or getattr(metric_fn, "__name__", "metric")

    def metrics(
        self,
        eval_prediction: EvalPrediction | Mapping[str, EvalPrediction | None] | None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """The metric of an evaluation's predictions, which `Trainer.evaluate` adds to its metrics
        before it logs them and announces them (``on_evaluate``): every callback sees it."""
        name = self.name.removeprefix("eval_")
        metrics = {}
        # several eval datasets: a prediction per dataset, and the metric of each (eval_<dataset>_<name>)
        parts = (
            eval_prediction.items()
            if isinstance(eval_prediction, Mapping)
            else [(None, eval_prediction)]
        )
        for dataset, prediction in parts:
            if prediction is None:
                raise UserError(
                    f"MetricCallback({self.name!r}) needs predictions, but the model's output has no "
                    "logits; return {'loss': ..., 'logits': ...} from forward"
                )
            key = (
                f"{metric_key_prefix}_{dataset}_{name}"
                if dataset is not None
                else f"{metric_key_prefix}_{name}"
            )
            metrics[key] = float(self.metric_fn(prediction.predictions, prediction.label_ids))
        return metrics


class ProgressCallback(TrainerCallback):
    """A rich progress bar over training steps, with the latest loss (plain training runs)."""

    def __init__(self) -> None:
        self._progress: Any = None

    def on_train_begin(
        self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        # redrawn at 2 Hz: rich's 10 Hz takes ~0.7% of a core from training in a terminal
        self._progress = Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            transient=True,
            refresh_per_second=2,
        )
        self._task = self._progress.add_task(
            "train", total=state.max_steps, completed=state.global_step, info=""
        )
        self._progress.start()

    def on_step_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._progress.update(self._task, completed=state.global_step)

    def on_log(
        self,
        args: Any,
        state: TrainerState,
        control: TrainerControl,
        *,
        logs: Mapping[str, float],
        **kwargs: Any,
    ) -> None:
        if self._progress is not None:
            self._progress.update(
                self._task,
                info=" ".join(
                    f"{k}={v:.4g}"
                    for k, v in logs.items()
                    if isinstance(v, float) and k != "epoch" and not k.endswith(SPEED_SUFFIXES)
                ),
            )

    def on_train_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    on_exception = on_train_end


class NEFTune(TrainerCallback):
    """transformers' ``neftune_noise_alpha``: NEFTune's noise on the model's input embeddings while it
    trains, through transformers' own hook (``transformers.integrations.neftune``), taken off when
    training ends or fails, so evaluation, checkpoints and the model afterwards see none. Every
    trainer has one; it does nothing while ``neftune_noise_alpha`` is None."""

    handle: Any = None

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        if args.neftune_noise_alpha is None:
            return
        if not hasattr(model, "get_input_embeddings"):
            raise UserError(
                f"neftune_noise_alpha={args.neftune_noise_alpha}: {type(model).__name__} has no "
                "get_input_embeddings() to add noise to (a transformers model has); unset it"
            )
        try:
            from transformers.integrations.neftune import activate_neftune
        except ImportError:
            raise UserError(
                "neftune_noise_alpha uses transformers' NEFTune hook: pip install transformers"
            ) from None
        self.handle = activate_neftune(model, args.neftune_noise_alpha)

    def on_train_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        if self.handle is not None:
            from transformers.integrations.neftune import deactivate_neftune

            deactivate_neftune(model, self.handle)
            self.handle = None

    on_exception = on_train_end
