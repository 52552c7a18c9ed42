"""A study's database that may go away for a while: every call waits for it to come back.

A restart or failover of the database (seconds to a few minutes) must pause a sweep, not end it
(docs/many-machines.md). `RetryingStorage` wraps the Optuna storage a worker uses; a call
that finds the database unreachable says so once, in one line, and tries again every second until
it answers or `PATIENCE_S` pass. Everything else is Optuna's: the wrapper adds no caching and
changes no call.

A write whose answer was lost with the connection may have been made: telling a trial's end again
then finds it finished, which is taken as done.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import optuna
from optuna.storages import BaseStorage
from optuna.storages._heartbeat import BaseHeartbeat

from hpsweep.errors import UserError

#: How long a worker waits for its database before the sweep stops (it can be run again).
PATIENCE_S = 600.0
RETRY_S = 1.0

#: Calls that `BaseStorage` builds out of others (by reading every trial) and that Optuna's
#: storages may answer themselves (its cache: from the cache or with one query): passed on.
_SHORTCUTS = ("get_best_trial", "get_n_trials", "get_trial_id_from_study_id_trial_number")
_HEARTBEAT_CALLS = (
    "record_heartbeat",
    "_get_stale_trial_ids",
    "get_heartbeat_interval",
    "get_heartbeat_stale_trial_callback",
)


def unreachable(exc: BaseException | None) -> bool:
    """Whether ``exc`` says the database cannot be reached now (not that a call was wrong).
    Optuna raises its own ``StorageInternalError`` from the driver's error: the cause decides."""
    while isinstance(exc, optuna.exceptions.StorageInternalError):
        exc = exc.__cause__
    if exc is None:
        return False
    try:
        import sqlalchemy.exc as sa
    except ImportError:  # pragma: no cover - optuna requires sqlalchemy
        sa = None
    if sa is not None and isinstance(exc, (sa.OperationalError, sa.InterfaceError)):
        return True
    if sa is not None and isinstance(exc, sa.DBAPIError) and exc.connection_invalidated:
        return True
    try:
        import grpc
    except ImportError:
        return False
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE


class RetryingStorage(BaseStorage, BaseHeartbeat):
    """``inner`` (an Optuna storage), waiting out the database's absences.

    Args:
        inner: the storage to call.
        label: how messages name the database (its URL without the password).
    """

    def __init__(self, inner: BaseStorage, label: str) -> None:
        self._inner = inner
        self._label = label
        self._lock = threading.Lock()
        self._down_since: float | None = None
        #: When the database last came back (monotonic), or None: callers that judge others'
        #: heartbeats wait a grace period after it.
        self.back_at: float | None = None

    @property
    def inner(self) -> BaseStorage:
        return self._inner

    def _call(self, name: str, args: tuple, kwargs: dict) -> Any:
        waited = False
        while True:
            try:
                result = getattr(self._inner, name)(*args, **kwargs)
            except optuna.exceptions.UpdateFinishedTrialError:
                if waited and name == "set_trial_state_values":
                    return True  # our first try was written before the connection broke
                raise
            except Exception as exc:
                if not unreachable(exc):
                    raise
                waited = True
                self._wait(exc)
                continue
            if waited:
                self._back()
            return result

    def _wait(self, exc: BaseException) -> None:
        with self._lock:
            now = time.monotonic()
            if self._down_since is None:
                self._down_since = now
                print(
                    f"hpsweep: the study's database {self._label} is unreachable "
                    f"({type(exc).__name__}); trials pause until it is back",
                    file=sys.stderr,
                    flush=True,
                )
            elif now - self._down_since > PATIENCE_S:
                raise UserError(
                    f"the study's database {self._label} has been unreachable for "
                    f"{now - self._down_since:.0f} s; bring it back and run the same command again"
                )
        time.sleep(RETRY_S)

    def _back(self) -> None:
        with self._lock:
            if self._down_since is None:
                return
            now = time.monotonic()
            print(
                f"hpsweep: the study's database is back after {now - self._down_since:.0f} s; "
                "trials go on",
                file=sys.stderr,
                flush=True,
            )
            self._down_since = None
            self.back_at = now

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def _patient(name: str) -> Any:
    def call(self: RetryingStorage, *args: Any, **kwargs: Any) -> Any:
        return self._call(name, args, kwargs)

    call.__name__ = name
    return call


def _heartbeat_call(name: str) -> Any:
    # Optuna's storage proxy has no heartbeat: then the wrapper has none either
    def call(self: RetryingStorage, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(self._inner, BaseHeartbeat):
            return None
        return self._call(name, args, kwargs)

    call.__name__ = name
    return call


for _name in (*sorted(BaseStorage.__abstractmethods__), *_SHORTCUTS):
    setattr(RetryingStorage, _name, _patient(_name))
for _name in _HEARTBEAT_CALLS:
    setattr(RetryingStorage, _name, _heartbeat_call(_name))
RetryingStorage.__abstractmethods__ = frozenset()
