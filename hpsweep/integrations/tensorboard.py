"""Feed each trial of a sweep to TensorBoard (``report_to="tensorboard"``): one run per trial.

Each trial writes its event files into its own run folder, so that

    $ tensorboard --logdir DIR

shows one run per trial, named by its folder (``run-3``). Every log of the training run is a
scalar at the training step, named as transformers' ``TensorBoardCallback`` names it
(``train/loss``, ``eval/accuracy``), and an ended trial's params and objective are written as
HParams, so that the HParams tab compares the trials. A trial that runs again from a checkpoint
hides what its earlier run wrote after that checkpoint (TensorBoard's purge step), so that no step
is shown twice.

The writers live in the process that trains the trial (each ``--n-jobs`` worker, each Ray node);
the tracker that travels there holds none. transformers' own ``TensorBoardCallback`` is not what
writes here: it needs transformers, which a sweep does not, writes no HParams, and opens its
writer without a purge step, so a trial that runs again would show its steps twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpsweep import runs
from hpsweep.redaction import scrub
from hpsweep.search.job import SweepCallback
from hpsweep.train.callbacks import TrainerCallback, TrainerControl, TrainerState
from hpsweep.trial import Trial

#: The states in which a trial's HParams are final; a stopped trial runs again and writes them then.
ENDED = ("complete", "pruned", "failed")


class TensorBoardTracker(SweepCallback):
    """One TensorBoard run per trial, in the trial's run folder (``report_to="tensorboard"``)."""

    def __init__(self) -> None:
        self._writers: dict[str, EventWriter] = {}  # run folder -> its writer, in this process

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_writers": {}}

    def trial_callbacks(self, trial: Trial, record: runs.TrialRecord) -> list[TrainerCallback]:
        writer = self._writers[record.run_dir] = EventWriter(Path(record.run_dir))
        return [writer]

    def on_trial_end(self, record: runs.TrialRecord) -> None:
        # A data-parallel trial logged from its first rank's process: the HParams get a writer here.
        writer = self._writers.pop(record.run_dir, None) or EventWriter(Path(record.run_dir))
        try:
            if record.state in ENDED:
                writer.write_hparams(record)
        finally:
            writer.close()


class EventWriter(TrainerCallback):
    """Writes one trial's logs, from the process that logs them (a data-parallel trial's first)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.writer: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "writer": None}

    def on_train_begin(
        self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if state.is_world_process_zero:
            # Hides an earlier run's events from the first step this run logs: after its
            # checkpoint when it resumes, from step 0 (an evaluation on start) otherwise.
            self._open(purge_step=state.global_step + 1 if state.global_step else 0)

    def on_log(
        self,
        args: Any,
        state: TrainerState,
        control: TrainerControl,
        *,
        logs: Mapping[str, Any],
        **kwargs: Any,
    ) -> None:
        if not state.is_world_process_zero:
            return
        writer = self._open()
        for name, value in logs.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                writer.add_scalar(tag(name), value, state.global_step)
        writer.flush()

    def write_hparams(self, record: runs.TrialRecord) -> None:
        """The trial's params and objective, as the HParams tab reads them, at its last step."""
        from torch.utils.tensorboard.summary import hparams

        writer = self._open()
        params = {name: _hparam(value) for name, value in scrub(record.params).items()}
        metrics = objective_metrics(record)
        step = int(record.history[-1].get("step", 0)) if record.history else 0
        for summary in hparams(params, metrics):
            writer.file_writer.add_summary(summary, step)
        for name, value in metrics.items():
            writer.add_scalar(name, value, step)
        writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def _open(self, purge_step: int | None = None) -> Any:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.run_dir), purge_step=purge_step)
        return self.writer


def tag(name: str) -> str:
    """A logged name as transformers' TensorBoard and W&B callbacks show it: ``eval_loss`` ->
    ``eval/loss``, ``test_accuracy`` -> ``test/accuracy``, ``loss`` -> ``train/loss``."""
    for prefix in ("eval", "test"):
        if name.startswith(f"{prefix}_"):
            return f"{prefix}/{name[len(prefix) + 1 :]}"
    return f"train/{name}"


def objective_metrics(record: runs.TrialRecord) -> dict[str, float]:
    """The trial's objective as HParams metrics (``hparams/<objective>``, one per direction);
    none for a trial that has none (pruned or failed)."""
    if record.objective is None:
        return {}
    values = record.objective if isinstance(record.objective, list) else [record.objective]
    if len(values) == 1:
        return {f"hparams/{record.objective_name}": float(values[0])}
    return {f"hparams/{record.objective_name}_{i}": float(v) for i, v in enumerate(values)}


def _hparam(value: Any) -> Any:
    """A param as HParams takes it: a number, a string, a bool or None; anything else as text."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
