"""Feed each trial of a sweep to Weights & Biases (``report_to="wandb"``): one W&B run per trial,
grouped by the sweep.

Each run is named by the trial's run folder and holds the trial's params in its config; every log
of the training run (the training loss, each evaluation) is a row at the training step, named as
transformers' ``WandbCallback`` names it (``train/loss``, ``eval/accuracy``). The runs go to the
project ``WANDB_PROJECT`` (default: the study's name), in the group that names the sweep's home,
with their files under ``DIR/wandb/``; with ``WANDB_MODE=offline`` they stay there for
``wandb sync DIR/wandb/offline-run-*``. A trial that runs again from a checkpoint goes on in the
same run (its id is kept in the checkpoint), and W&B keeps no step twice. Under
``--backend wandb`` every trial already is a W&B run: the logs go into it.

transformers' own ``WandbCallback`` does not fit a sweep run this way: it finishes the active run
when a trial begins (the W&B backend's own run), groups by the trial's folder rather than the
sweep, and logs on its own step counter.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpsweep import runs
from hpsweep.errors import UserError
from hpsweep.integrations.tensorboard import tag
from hpsweep.redaction import redact_url, scrub
from hpsweep.search.job import SweepCallback
from hpsweep.train.callbacks import TrainerCallback, TrainerControl, TrainerState
from hpsweep.trial import Trial

#: W&B's limit on a group's name; a longer home keeps its end, which tells sweeps apart.
GROUP_CHARS = 128
#: How a run ends, by the trial's state: a stopped trial runs again (in the same run) later.
EXIT_CODES = {"complete": 0, "pruned": 0, "failed": 1, "stopped": 130}


class WandbRuns(SweepCallback):
    """One W&B run per trial, grouped by the sweep (``report_to="wandb"``)."""

    def __init__(self) -> None:
        self.project: str | None = None
        self.group: str | None = None
        self._loggers: dict[str, RunLogger] = {}  # run folder -> its logger, in this process

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_loggers": {}}

    def on_sweep_begin(self, settings: Any) -> None:
        self.project = os.environ.get("WANDB_PROJECT") or settings.study_name
        home = str(settings.home_url)
        home = redact_url(home) if "://" in home else str(Path(home).resolve())
        self.group = home[-GROUP_CHARS:]

    def trial_callbacks(self, trial: Trial, record: runs.TrialRecord) -> list[TrainerCallback]:
        logger = self._loggers[record.run_dir] = RunLogger(
            project=self.project,
            group=self.group,
            run_dir=record.run_dir,
            config=scrub(record.params),
            in_backend_run=record.backend == "wandb",
        )
        return [logger]

    def on_trial_end(self, record: runs.TrialRecord) -> None:
        logger = self._loggers.pop(record.run_dir, None)
        if logger is not None:
            logger.finish(record)


class RunLogger(TrainerCallback):
    """Logs one trial's training run to its W&B run, from the process that logs (a data-parallel
    trial's first). The run's id is the state it keeps in checkpoints."""

    def __init__(
        self,
        *,
        project: str | None,
        group: str | None,
        run_dir: str,
        config: Mapping[str, Any],
        in_backend_run: bool,
    ) -> None:
        self.project, self.group, self.run_dir = project, group, run_dir
        self.config = dict(config)
        self.in_backend_run = in_backend_run
        self.run_id: str | None = None
        self.run: Any = None
        self._made_in = os.getpid()  # the process whose `finish` ends the run with the trial

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "run": None}

    def state_dict(self) -> dict[str, Any] | None:
        return {"run_id": self.run_id} if self.run_id else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_id = state.get("run_id")

    def on_train_begin(
        self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not state.is_world_process_zero or self.run is not None:
            return
        if self.in_backend_run:
            self.run = _active_run()  # none in a data-parallel trial's processes: nothing logged
        else:
            self.run = self._start()
            self.run_id = self.run.id

    def on_log(
        self,
        args: Any,
        state: TrainerState,
        control: TrainerControl,
        *,
        logs: Mapping[str, Any],
        **kwargs: Any,
    ) -> None:
        if self.run is None:
            return
        row = {
            tag(name): value
            for name, value in logs.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        self.run.log(row, step=state.global_step)

    def on_train_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # A data-parallel trial's first process exits without ending what it opened, and the
        # sweep's process cannot reach its run: it ends here, with its training.
        if self.run is not None and os.getpid() != self._made_in and not self.in_backend_run:
            self.run.finish()
            self.run = None

    def finish(self, record: runs.TrialRecord) -> None:
        """End the run as the trial ended (the W&B backend ends its own runs)."""
        run, self.run = self.run, None
        if run is None or self.in_backend_run:
            return
        if record.state == "pruned":
            run.tags = (*run.tags, "pruned")  # W&B has no pruned state; a tag keeps it findable
        if record.objective is not None:
            run.summary["objective"] = record.objective
        run.finish(exit_code=EXIT_CODES.get(record.state, 1))

    def _start(self) -> Any:
        import wandb

        try:
            return wandb.init(
                project=self.project,
                group=self.group,
                name=Path(self.run_dir).name,
                id=self.run_id,
                resume="allow" if self.run_id else None,
                dir=str(Path(self.run_dir).parent),
                config=self.config,
                reinit="create_new",  # leaves any other run (the user's own) as it is
                settings=wandb.Settings(silent=True, console="off"),
            )
        except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UserError(
                f"report_to='wandb' could not start a W&B run ({first.rstrip('.')}): log in "
                "(`wandb login` or WANDB_API_KEY), or set WANDB_MODE=offline to sync the runs later"
            ) from None


def _active_run() -> Any:
    """The W&B backend's run of the trial training in this process (None in another process)."""
    import wandb

    return wandb.run
