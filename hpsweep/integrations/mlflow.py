"""Track a sweep in MLflow: one parent run per sweep, one nested child run per trial.

    >>> hpsweep.run("space.py", sweep_callbacks=[MLflowTracker("http://127.0.0.1:5000")])

The parent run holds the study name, backend, space and search settings; each child holds the
trial's params, every evaluation's metrics by step, the objective, the duration, the trial
number and its final state (tag ``hpsweep.state``: complete / pruned / failed / stopped). The
best trial is tagged ``hpsweep.best=true``. The tracker is picklable and carries the parent run
id, so trials running in other processes or on Ray nodes log into the same parent.

Tracking is not worth losing trials for: when the server cannot be reached the sweep warns once
and goes on without tracking, unless ``fatal=True``. Params whose names look like credentials,
values that hold a secret from the environment, and environment variables are never logged.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

from hpsweep.errors import UserError
from hpsweep.redaction import describe, redact_url, scrub
from hpsweep.search.job import SweepCallback
from hpsweep.train.callbacks import TrainerCallback

logger = logging.getLogger("hpsweep.mlflow")

#: MLflow's own defaults retry for minutes; a sweep should not wait that long for tracking.
QUICK_HTTP = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
_ENV_LOCK = threading.RLock()
_WARNED: set[str] = set()  # tracking URIs warned about in this process
_RUN_STATUS = {
    "complete": "FINISHED",
    "pruned": "FINISHED",
    "failed": "FAILED",
    "stopped": "KILLED",
}


class MLflowTracker(SweepCallback):
    """Log a sweep to MLflow (``hpsweep run --mlflow [URI]``).

    Args:
        tracking_uri: the tracking server or store; ``None``: ``MLFLOW_TRACKING_URI``, else MLflow's
            local default.
        experiment_name: the MLflow experiment; default ``MLFLOW_EXPERIMENT_NAME``, else the study name.
        fatal: stop the sweep (a `UserError`) when tracking fails, instead of warning and going on.
        log_best_checkpoint: upload the sweep's ``best/`` folder as an artifact of the parent run.
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        *,
        experiment_name: str | None = None,
        fatal: bool = False,
        log_best_checkpoint: bool = False,
    ) -> None:
        self.tracking_uri = tracking_uri or None
        self.experiment_name = experiment_name
        self.fatal = fatal
        self.log_best_checkpoint = log_best_checkpoint
        self.parent_run_id: str | None = None
        self.experiment_id: str | None = None
        self.output_dir: str | None = None
        self.home: str | None = None
        self.disabled = False
        self._client_obj: Any = None
        self._logged_params: dict[str, set[str]] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client_obj"] = None  # rebuilt where the trial runs
        return state

    # --- the sweep (main process) -------------------------------------------------------------------

    def on_sweep_begin(self, settings: Any) -> None:
        self.tracking_uri = _resolve_uri(self.tracking_uri)
        self.output_dir = str(Path(settings.output_dir).resolve())
        # The sweep as every machine names it: an object-store home's URL, not this machine's
        # staging folder, so that all the machines of a sweep share one parent run.
        home = str(getattr(settings, "home_url", self.output_dir))
        self.home = redact_url(home) if "://" in home else str(Path(home).resolve())
        name = (
            self.experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or settings.study_name
        )
        key = hashlib.sha1(f"{self.home}|{settings.study_name}".encode()).hexdigest()[:16]
        self._call(
            "create the sweep's parent run", lambda c: self._start_parent(c, name, key, settings)
        )

    def _start_parent(self, client: Any, name: str, key: str, settings: Any) -> None:
        experiment = client.get_experiment_by_name(name)
        self.experiment_id = (
            experiment.experiment_id if experiment else client.create_experiment(name)
        )
        found = client.search_runs(
            [self.experiment_id], f"tags.`hpsweep.sweep_key` = '{key}'", max_results=1
        )
        if found:  # a sweep continued in the same folder keeps its parent run
            self.parent_run_id = found[0].info.run_id
            client.update_run(self.parent_run_id, status="RUNNING")
            return
        backend = getattr(settings, "backend", None)
        tags = {
            "hpsweep.sweep_key": key,
            "hpsweep.role": "sweep",
            "hpsweep.study_name": settings.study_name,
            "hpsweep.output_dir": self.home,
        }
        if backend:
            tags["hpsweep.backend"] = backend
        run = client.create_run(self.experiment_id, run_name=settings.study_name, tags=tags)
        self.parent_run_id = run.info.run_id
        _log_params(client, self.parent_run_id, _sweep_params(settings, backend))

    def on_sweep_end(self, best: Any, records: list[Any], interrupted: bool) -> None:
        if self.disabled or self.parent_run_id is None:
            return
        self._call(
            "finish the sweep's parent run",
            lambda c: self._finish_parent(c, best, records, interrupted),
        )

    def _finish_parent(self, client: Any, best: Any, records: list[Any], interrupted: bool) -> None:
        from mlflow.entities import Metric

        parent = self.parent_run_id
        best_ids = {b.run_id for b in (best if isinstance(best, list) else [best] if best else [])}
        run_of = {r.id: r.user_attrs.get("mlflow_run_id") for r in records}
        record_of = {r.user_attrs.get("mlflow_run_id"): r for r in records}
        best_runs = {run_of[i] for i in best_ids if run_of.get(i)}
        children = client.search_runs(
            [self.experiment_id], f"tags.`mlflow.parentRunId` = '{parent}'", max_results=5000
        )
        for child in children:
            if child.info.status == "RUNNING":  # the trial's own ending never reached MLflow
                record = record_of.get(child.info.run_id)
                if record is not None and record.state in ("complete", "pruned", "failed"):
                    # Its process lost the call (a worker's tracking turned off by a slow request,
                    # a dropped connection): the record on disk says how the trial ended.
                    self._finish_child(client, child.info.run_id, record, logged=child.data.params)
                else:
                    client.set_tag(child.info.run_id, "hpsweep.state", "stopped")
                    client.update_run(child.info.run_id, status="KILLED")
            was_best = child.data.tags.get("hpsweep.best") == "true"
            is_best = child.info.run_id in best_runs
            if was_best != is_best:
                client.set_tag(child.info.run_id, "hpsweep.best", "true" if is_best else "false")
        if records:
            client.set_tag(parent, "hpsweep.backend", records[0].backend)
        states = [r.state for r in records]
        for state in ("complete", "pruned", "failed"):
            client.set_tag(parent, f"hpsweep.n_{state}", str(states.count(state)))
        if best and not isinstance(best, list):
            client.set_tag(parent, "hpsweep.best_run_id", run_of.get(best.run_id) or "")
            client.set_tag(
                parent, "hpsweep.best_trial_number", str(best.run_summary.get("number", ""))
            )
            if isinstance(best.objective, (int, float)):
                client.log_batch(
                    parent, metrics=[Metric("best_objective", float(best.objective), _now(), 0)]
                )
            if (
                self.log_best_checkpoint
                and self.output_dir
                and (Path(self.output_dir) / "best").is_dir()
            ):
                client.log_artifacts(parent, str(Path(self.output_dir) / "best"), "best")
        client.set_terminated(parent, status="KILLED" if interrupted else "FINISHED")

    # --- one trial (the process that runs it) --------------------------------------------------------

    def trial_callbacks(self, trial: Any, record: Any) -> list[TrainerCallback]:
        if self.disabled or self.parent_run_id is None:
            return []
        run_id = self._call(
            f"start the run of trial {record.number}", lambda c: self._start_child(c, record)
        )
        if run_id is None:
            return []
        record.user_attrs["mlflow_run_id"] = run_id  # saved in trial.json at the trial's end
        return [_TrialLogger(self, run_id)]

    def _start_child(self, client: Any, record: Any) -> str:
        tags = {
            "mlflow.parentRunId": self.parent_run_id,
            "hpsweep.trial_number": str(record.number),
            "hpsweep.trial_id": str(record.id),
            "hpsweep.backend": record.backend,
            "hpsweep.state": "running",
            "hpsweep.run_dir": record.run_dir,
        }
        run = client.create_run(self.experiment_id, run_name=Path(record.run_dir).name, tags=tags)
        run_id = run.info.run_id
        params = scrub(record.params)
        _log_params(client, run_id, params)
        self._logged_params[run_id] = set(params)
        return run_id

    def on_trial_end(self, record: Any) -> None:
        run_id = record.user_attrs.get("mlflow_run_id")
        if self.disabled or not run_id:
            return
        self._call(
            f"finish the run of trial {record.number}",
            lambda c: self._finish_child(c, run_id, record),
        )

    def _finish_child(
        self, client: Any, run_id: str, record: Any, logged: Collection[str] | None = None
    ) -> None:
        """End the child run as ``record`` ended: its params sampled define-by-run inside model_init
        (those not ``logged`` yet: by default, those this process logged), objective, duration,
        state."""
        from mlflow.entities import Metric, RunTag

        logged = self._logged_params.get(run_id, set()) if logged is None else logged
        _log_params(
            client, run_id, {k: v for k, v in scrub(record.params).items() if k not in logged}
        )
        metrics = []
        objective = record.objective
        values = (
            objective
            if isinstance(objective, list)
            else [objective]
            if objective is not None
            else []
        )
        for i, value in enumerate(values):
            metrics.append(
                Metric(
                    "objective" if len(values) == 1 else f"objective_{i}", float(value), _now(), 0
                )
            )
        if record.duration_s is not None:
            metrics.append(Metric("duration_s", float(record.duration_s), _now(), 0))
        tags = [
            RunTag("hpsweep.state", record.state),
            RunTag("hpsweep.objective_name", record.objective_name),
        ]
        if record.error:
            tags.append(RunTag("hpsweep.error", str(record.error)[:1000]))
        client.log_batch(run_id, metrics=metrics, tags=tags)
        with _env({"MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}):
            client.set_terminated(run_id, status=_RUN_STATUS.get(record.state, "FINISHED"))

    def log_metrics(self, run_id: str, metrics: Mapping[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        now = _now()
        batch = [
            Metric(k, float(v), now, step)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        ]
        if batch and not self.disabled:
            self._call("log metrics", lambda c: c.log_batch(run_id, metrics=batch))

    # --- failures -----------------------------------------------------------------------------------

    def _client(self) -> Any:
        if self._client_obj is None:
            from mlflow.tracking import MlflowClient

            self._client_obj = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client_obj

    def _call(self, what: str, fn: Callable[[Any], Any]) -> Any:
        try:
            with _env(QUICK_HTTP, keep_user=True), _quiet_http():
                return fn(self._client())
        except UserError:
            raise
        except Exception as exc:
            self._failed(what, exc)
            return None

    def _failed(self, what: str, exc: Exception) -> None:
        uri = redact_url(self.tracking_uri or "")
        reason = _short_reason(exc)
        if self.fatal:
            raise UserError(
                f"MLflow tracking at {uri} failed to {what} ({reason}); start the tracking server "
                "or fix --mlflow, or drop --mlflow-fatal to go on without tracking"
            ) from None
        self.disabled = True
        if uri not in _WARNED:
            _WARNED.add(uri)
            logger.warning(
                f"hpsweep: warning: MLflow tracking at {uri} failed to {what} ({reason}); "
                "the sweep goes on without tracking (add --mlflow-fatal to stop instead)"
            )


class _TrialLogger(TrainerCallback):
    """Logs every evaluation's metrics, and the training loss, with the training step: all that
    the trainer logs (`Trainer.log`, which `evaluate` calls too)."""

    def __init__(self, tracker: MLflowTracker, run_id: str) -> None:
        self.tracker = tracker
        self.run_id = run_id

    def on_log(
        self, args: Any, state: Any, control: Any, *, logs: Mapping[str, float], **kwargs: Any
    ) -> None:
        self.tracker.log_metrics(self.run_id, logs, state.global_step)


# --- helpers ------------------------------------------------------------------------------------------


def _resolve_uri(uri: str | None) -> str:
    """The URI as every process will see it: local paths made absolute (Ray nodes, other cwds)."""
    if not uri:
        uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        import mlflow

        uri = mlflow.get_tracking_uri()
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str(Path(uri[len("sqlite:///") :]).resolve())
    if "://" not in uri and not uri.startswith(("databricks", "file:")):
        return str(Path(uri).resolve())
    return uri


def _sweep_params(settings: Any, backend: str | None) -> dict[str, Any]:
    params: dict[str, Any] = {
        "backend": backend,
        "study_name": settings.study_name,
        "objective": settings.objective_name,
        "direction": ",".join(settings.directions),
        "n_trials": settings.n_trials,
        "timeout": settings.timeout,
        "n_jobs": settings.n_jobs,
        "sampler": settings.sampler,
        "pruner": settings.pruner,
        "scheduler": settings.scheduler,
        "seed": settings.seed,
        "storage": describe(settings.storage) if settings.storage else None,
    }
    if settings.space is not None:
        params.update({f"space.{name}": repr(dist) for name, dist in settings.space.items()})
    else:
        params["space"] = f"define-by-run: {getattr(settings.hp_space, '__name__', 'hp_space')}"
    return scrub({k: v for k, v in params.items() if v is not None})


def _log_params(client: Any, run_id: str, params: Mapping[str, Any]) -> None:
    from mlflow.entities import Param

    items = [Param(str(k), str(v)[:6000]) for k, v in params.items()]
    for start in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
        client.log_batch(run_id, params=items[start : start + 100])


def _now() -> int:
    import time

    return int(time.time() * 1000)


def _short_reason(exc: Exception) -> str:
    text = str(exc)
    if "Connection refused" in text or "NewConnectionError" in text:
        return "connection refused"
    if "timed out" in text.lower() or "timeout" in text.lower():
        return "timed out"
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first[:200]}"


@contextlib.contextmanager
def _env(values: Mapping[str, str], keep_user: bool = False) -> Iterator[None]:
    """Set environment variables for one MLflow call (MLflow reads its HTTP settings from there)."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in values}
        for key, value in values.items():
            if not (keep_user and saved[key] is not None):
                os.environ[key] = value
        try:
            yield
        finally:
            for key, old in saved.items():
                if old is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = old


@contextlib.contextmanager
def _quiet_http() -> Iterator[None]:
    """urllib3 logs each retry as a warning; our one warning says it all."""
    noisy = [logging.getLogger(n) for n in ("urllib3.connectionpool", "mlflow.utils.rest_utils")]
    levels = [n.level for n in noisy]
    for n in noisy:
        n.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for n, level in zip(noisy, levels):
            n.setLevel(level)
