"""`TrialReporter`: the callback through which a training run reports to its trial and is pruned."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hpsweep.train.callbacks import TrainerCallback, TrainerControl, TrainerState

#: Keys of ``Trial.user_attrs`` that say where a running trial's files and runs are, for a
#: backend to show them (Optuna's study forwards them as user attributes, for optuna-dashboard):
#: the run folder, the latest checkpoint (set here) and the MLflow run (set by the MLflow tracker).
RUN_DIR = "run_dir"
CHECKPOINT = "checkpoint"
MLFLOW_RUN_ID = "mlflow_run_id"


class TrialReporter(TrainerCallback):
    """Reports each evaluation to the `Trial` and stops the run when the backend prunes it.

    A trial that `reads_checkpoints` (Ray: Tune keeps the checkpoint with the result) gets the
    report once the evaluation's checkpoint is on disk. Any other trial is told right after the
    evaluation, before a checkpoint is written: one pruned there writes none (as in Hugging
    Face's Trainer, which raises ``TrialPruned`` before saving), since nothing resumes a pruned
    trial, and the loop's checkpoints are written off the training thread.

    The run's last evaluation is reported but never offered for pruning: the trial has done all
    its work by then, so it is complete (recorded so) and stopping it would save nothing.

    The metrics reported carry the evaluation's training ``step``, the one axis of a sweep: the
    backend keys its intermediate values by it, as every logger does (docs/watching.md).

    It also notes in the trial's ``user_attrs`` where the run's files are (`RUN_DIR`,
    `CHECKPOINT`), for the backend to show with the next report.
    """

    def __init__(self, trial: Any, objective: Callable[[Mapping[str, float]], Any]) -> None:
        self.trial = trial
        self.objective = objective
        self.pruned = False
        self.reads_checkpoints = getattr(trial, "reads_checkpoints", True)
        self._pending: tuple[int, dict[str, float], Any, bool] | None = None

    def on_train_begin(
        self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.trial.user_attrs[RUN_DIR] = str(args.output_dir)

    def on_evaluate(
        self,
        args: Any,
        state: TrainerState,
        control: TrainerControl,
        *,
        metrics: Mapping[str, float],
        **kwargs: Any,
    ) -> None:
        # The last evaluation: training reached max_steps, or stops after this evaluation anyway
        # (an earlier callback such as early stopping said so), or runs after training ended.
        last = control.should_training_stop or state.global_step >= state.max_steps
        reported = {**metrics, "step": state.global_step}
        self._pending = (state.num_evaluations, reported, self.objective(metrics), last)
        if not (control.should_save and self.reads_checkpoints):
            self._deliver(control, None)
            if self.pruned:
                # the pruned evaluation's checkpoint would never be read
                control.should_save = False

    def on_save(
        self,
        args: Any,
        state: TrainerState,
        control: TrainerControl,
        *,
        checkpoint: str,
        **kwargs: Any,
    ) -> None:
        self.trial.user_attrs[CHECKPOINT] = str(checkpoint)
        if self._pending is not None:
            self._deliver(control, checkpoint)

    def _deliver(self, control: TrainerControl, checkpoint: str | None) -> None:
        step, metrics, value, last = self._pending  # type: ignore[misc]
        self._pending = None
        self.trial.report(step, metrics, value, checkpoint)
        if not last and self.trial.should_prune():
            self.pruned = True
            control.should_training_stop = True
