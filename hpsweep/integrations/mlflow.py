"""Track a sweep in MLflow: one parent run per sweep, one nested child run per trial.

    >>> hpsweep.run("space.py", sweep_callbacks=[MLflowTracker("http://127.0.0.1:5000")])

The parent run holds the study name, backend, space and search settings; each child holds the
trial's params, every evaluation's metrics by step, the objective, the duration, the trial
number and its final state (tag ``hpsweep.state``: complete / pruned / failed / stopped). The
best trial is tagged ``hpsweep.best=true``. The tracker is picklable and carries the parent run
id, so trials running in other processes or on Ray nodes log into the same parent.

Tracking is not worth losing trials for: when the server cannot be reached the sweep warns once
and goes on without tracking, unless ``fatal=True``. A store MLflow refuses outright (its folder
store, which MLflow 3 opens only for those who opt in, an unknown scheme) is the user's to fix:
one line with MLflow's own words, before any trial. Params whose names look like credentials,
values that hold a secret from the environment, environment variables and the tracking URI's
password are never logged or printed.

A sweep continued with tracking logs, at its end, the finished trials it holds that no child run
of its parent names (those run before ``--mlflow`` was given), once each.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from hpsweep.errors import UserError
from hpsweep.redaction import HIDDEN, describe, redact_url, scrub
from hpsweep.search.job import SweepCallback
from hpsweep.search.trial_reporter import MLFLOW_RUN_ID
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
#: How a trial that has ended is recorded; a trial still running logs itself when it ends.
ENDED = ("complete", "pruned", "failed")
#: The reasons a call fails that say the store is away, not wrong.
LOST = ("connection refused", "timed out")


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
        self.disabled = False  # a sweep run again from Python tries its tracking again
        self._open_store()
        if self.disabled:
            return
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
        self.experiment_id = _experiment_id(client, name)
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
        children = self._children(client)
        run_of = self._log_untracked(client, records, children)
        best_ids = {b.run_id for b in (best if isinstance(best, list) else [best] if best else [])}
        best_runs = {run_of[i] for i in best_ids if run_of.get(i)}
        self._settle_children(client, children, records, best_runs)
        self._sum_up(client, best, records, run_of)
        client.set_terminated(self.parent_run_id, status="KILLED" if interrupted else "FINISHED")

    def _children(self, client: Any) -> list[Any]:
        """Every child run of the sweep's parent, page by page."""
        children: list[Any] = []
        token = None
        while True:
            page = client.search_runs(
                [self.experiment_id],
                f"tags.`mlflow.parentRunId` = '{self.parent_run_id}'",
                max_results=1000,
                page_token=token,
            )
            children += page
            token = page.token
            if not token:
                return children

    def _log_untracked(
        self, client: Any, records: list[Any], children: list[Any]
    ) -> dict[str, str]:
        """Log each ended trial that no child names (it ran before tracking was asked for) as a
        child of its own, marked best below like any other; returns each record's child run."""
        tracked = {c.data.tags.get("hpsweep.trial_id"): c.info.run_id for c in children}
        mine = {c.info.run_id for c in children}
        run_of = {}
        for record in records:
            own = record.user_attrs.get("mlflow_run_id")
            if own in mine:
                run_of[record.id] = own
            elif record.id in tracked:
                run_of[record.id] = tracked[record.id]
            elif record.state in ENDED:
                run_of[record.id] = self._log_ended(client, record)
        return run_of

    def _log_ended(self, client: Any, record: Any) -> str:
        """A child for a trial that ended untracked: what its own run would have logged, from its
        record (params, each evaluation's metrics at its step, objective, duration, state)."""
        from mlflow.entities import Metric

        run_id = self._start_child(client, record, start_time=_ms(record.started_at))
        metrics = [
            Metric(name, float(value), _ms(record.finished_at) or _now(), int(point["step"]))
            for point in record.history
            if isinstance(point.get("step"), int)
            for name, value in point.items()
            if name != "step" and _is_number(value)
        ]
        for start in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            client.log_batch(run_id, metrics=metrics[start : start + 1000])
        self._finish_child(client, run_id, record, end_time=_ms(record.finished_at))
        return run_id

    def _settle_children(
        self, client: Any, children: list[Any], records: list[Any], best_runs: set[str]
    ) -> None:
        """Each child's ending as its record has it, and the best mark on the best trial's alone."""
        record_of = {r.user_attrs.get("mlflow_run_id"): r for r in records}
        for child in children:
            if child.info.status == "RUNNING":  # the trial's own ending never reached MLflow
                record = record_of.get(child.info.run_id)
                if record is not None and record.state in ENDED:
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
        for run_id in best_runs - {c.info.run_id for c in children}:  # logged just now
            client.set_tag(run_id, "hpsweep.best", "true")

    def _sum_up(self, client: Any, best: Any, records: list[Any], run_of: dict[str, str]) -> None:
        """The parent's tags: the backend, the count of each ending and the best trial."""
        from mlflow.entities import Metric

        parent = self.parent_run_id
        if records:
            client.set_tag(parent, "hpsweep.backend", records[0].backend)
        states = [r.state for r in records]
        for state in ENDED:
            client.set_tag(parent, f"hpsweep.n_{state}", str(states.count(state)))
        if not best or isinstance(best, list):
            return
        client.set_tag(parent, "hpsweep.best_run_id", run_of.get(best.run_id) or "")
        client.set_tag(parent, "hpsweep.best_trial_number", str(best.run_summary.get("number", "")))
        if isinstance(best.objective, (int, float)):
            client.log_batch(
                parent, metrics=[Metric("best_objective", float(best.objective), _now(), 0)]
            )
        folder = Path(self.output_dir) / "best" if self.output_dir else None
        if self.log_best_checkpoint and folder is not None and folder.is_dir():
            client.log_artifacts(parent, str(folder), "best")

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
        trial.user_attrs[MLFLOW_RUN_ID] = run_id  # the backend shows it (optuna-dashboard)
        return [_TrialLogger(self, run_id)]

    def _start_child(self, client: Any, record: Any, start_time: int | None = None) -> str:
        tags = {
            "mlflow.parentRunId": self.parent_run_id,
            "hpsweep.trial_number": str(record.number),
            "hpsweep.trial_id": str(record.id),
            "hpsweep.backend": record.backend,
            "hpsweep.state": "running",
            "hpsweep.run_dir": record.run_dir,
        }
        run = client.create_run(
            self.experiment_id, run_name=Path(record.run_dir).name, tags=tags, start_time=start_time
        )
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
        self,
        client: Any,
        run_id: str,
        record: Any,
        logged: Collection[str] | None = None,
        end_time: int | None = None,
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
            client.set_terminated(
                run_id, status=_RUN_STATUS.get(record.state, "FINISHED"), end_time=end_time
            )

    def log_metrics(self, run_id: str, metrics: Mapping[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        now = _now()
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if _is_number(v)]
        if batch and not self.disabled:
            self._call("log metrics", lambda c: c.log_batch(run_id, metrics=batch))

    # --- failures -----------------------------------------------------------------------------------

    def _client(self) -> Any:
        if self._client_obj is None:
            from mlflow.tracking import MlflowClient

            # MLflow opens the store here: a new SQLite one gets its tables, once for all
            with _first_use_lock(self.tracking_uri or ""):
                self._client_obj = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client_obj

    def _open_store(self) -> None:
        """Open the store before any trial: one that MLflow refuses is one line with MLflow's
        own reason and fix, tracking failures fatal or not; nothing is tracked to it. A database
        store that does not answer is a server down, as with any other call."""
        try:
            with self._calling():
                self._client()
        except Exception as exc:
            if _reason(exc) in LOST:
                self._failed("open the tracking store", exc)
                return
            raise UserError(
                f"MLflow refuses the tracking store {redact_url(self.tracking_uri or '')}: "
                f"{self._reason(exc).rstrip('.')}; do as MLflow says, or give --mlflow another store "
                "(http://HOST:PORT, sqlite:///FILE)"
            ) from None

    @contextlib.contextmanager
    def _calling(self) -> Iterator[None]:
        """How each MLflow call runs: quick HTTP retries, no retry warnings, and no run link
        printed when it would show the URI's password."""
        secret = redact_url(self.tracking_uri or "") != (self.tracking_uri or "")
        hide_link = {"MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"} if secret else {}
        with _env(QUICK_HTTP, keep_user=True), _env(hide_link), _quiet_http():
            yield

    def _call(self, what: str, fn: Callable[[Any], Any]) -> Any:
        try:
            with self._calling():
                return fn(self._client())
        except UserError:
            raise
        except Exception as exc:
            self._failed(what, exc)
            return None

    def _reason(self, exc: Exception) -> str:
        return _without_password(_reason(exc), self.tracking_uri or "")

    def _failed(self, what: str, exc: Exception) -> None:
        uri = redact_url(self.tracking_uri or "")
        reason = self._reason(exc)
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


def _experiment_id(client: Any, name: str) -> str:
    """The experiment ``name``, created if missing; another machine may create it first."""
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


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


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else int(seconds * 1000)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _reason(exc: Exception) -> str:
    """Why an MLflow call failed, on one line: a lost connection in two words (the HTTP stack's
    text runs to pages), anything else in full, since MLflow's messages end with their fix."""
    text = str(exc)
    if "connection refused" in text.lower() or "NewConnectionError" in text:
        return LOST[0]
    if "timed out" in text.lower() or "timeout" in text.lower():
        return LOST[1]
    text = " ".join(text.split())
    return text if type(exc).__module__.startswith("mlflow") else f"{type(exc).__name__}: {text}"


def _without_password(text: str, uri: str) -> str:
    """``text`` with the password of ``uri`` as ``***`` wherever MLflow quoted it."""
    try:
        password = urlsplit(uri).password
    except ValueError:
        password = None
    text = text.replace(uri, redact_url(uri)) if uri else text
    for secret in {password, unquote(password or "")} - {None, ""}:
        text = text.replace(secret, HIDDEN)
    return text


@contextlib.contextmanager
def _first_use_lock(uri: str) -> Iterator[None]:
    """Hold a lock beside a SQLite store while MLflow opens it: MLflow creates a new store's
    tables on first use, and two processes doing that at once leave one of them failing. The
    store's folder is made first, as MLflow would; where no lock file can be made there, MLflow's
    own error says why."""
    path = uri[len("sqlite:///") :].partition("?")[0] if uri.startswith("sqlite:///") else ""
    try:
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            handle = open(f"{path}.lock", "a")
        else:
            handle = None
    except OSError:
        handle = None
    if handle is None:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


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
