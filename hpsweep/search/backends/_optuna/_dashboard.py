"""optuna-dashboard on a sweep's study, found from the sweep's home (``hpsweep dashboard DIR``).

The user names the sweep as every other command does, by its home; the study is found from the
sweep's own records: the folder's journal (``DIR/study.journal``) or, for a study kept in a
database, ``--storage`` (or ``$HPSWEEP_STORAGE``); the study is the one ``DIR/.study`` names, or
the one that keeps its sweep at this home (`._study_ledger.HOME`). The dashboard writes through
the same storage as the sweep (a journal's appends under `._journal.JournalLock`), so its
buttons and notes are what any other writer's are: the sweep goes on (docs/watching.md).
"""

from __future__ import annotations

import socketserver
import sys
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import optuna

from hpsweep import runs
from hpsweep.errors import UserError
from hpsweep.search.backends._optuna._storages import (
    StorageSpec,
    cause,
    open_storage,
    parse_storage,
    storage_error,
)
from hpsweep.search.backends._optuna._study_ledger import HOME
from hpsweep.search.checks import STUDY_FILE

#: optuna-dashboard's own default port.
DEFAULT_PORT = 8080


def serve_dashboard(
    home_spec: str,
    *,
    storage: Any = None,
    study_name: str | None = None,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    ready: Callable[[str], None] | None = None,
) -> None:
    """Serve optuna-dashboard on the study of the sweep at ``home_spec`` until interrupted;
    ``ready`` is called with the study's page once the server listens."""
    try:
        import optuna_dashboard
    except ModuleNotFoundError:
        raise UserError(
            "hpsweep dashboard needs optuna-dashboard; install it with: "
            "pip install 'hpsweep[dashboard]'"
        ) from None
    home = runs.open_home(home_spec)
    parsed = sweep_storage(home, storage)
    opened = _open(parsed)
    study = sweep_study(opened, home, parsed, study_name)
    server = _listen(host, port, optuna_dashboard.wsgi(opened))
    with server:
        shown = f"[{host}]" if ":" in host else host
        page = f"http://{shown}:{server.server_port}/dashboard/studies/{study._study_id}"
        (ready or _say)(page)
        server.serve_forever()


def sweep_storage(home: runs.Home, storage: Any) -> StorageSpec:
    """Where the sweep's study is: ``storage`` when given, else the journal in its folder."""
    if storage:
        return parse_storage(storage, home.local)
    if home.remote:
        raise UserError(
            f"{home.url} keeps no study: a sweep at an object store keeps it in a database; give "
            "--storage (the sweep's own, e.g. postgresql://USER@HOST/DB) or set HPSWEEP_STORAGE"
        )
    parsed = parse_storage(None, home.local)
    if not parsed.path.exists():
        what = "no such folder" if not home.local.is_dir() else f"no {parsed.path.name} in it"
        raise UserError(
            f"{home.local}: {what}; give the --output-dir of a sweep, and --storage for a sweep "
            "whose study is in a database"
        )
    return parsed


def sweep_study(
    storage: optuna.storages.BaseStorage,
    home: runs.Home,
    parsed: StorageSpec,
    study_name: str | None,
) -> optuna.study.FrozenStudy:
    """The sweep's study in ``storage``: ``study_name``, else the one ``DIR/.study`` names, else
    the one kept at this home, else the storage's only study."""
    studies = storage.get_all_studies()
    named = study_name or _named_in(home)
    if named is not None:
        found = [s for s in studies if s.study_name == named]
    else:
        found = [s for s in studies if s.user_attrs.get(HOME) == home.url] or studies
    if len(found) == 1:
        return found[0]
    names = ", ".join(sorted(s.study_name for s in studies)) or "none"
    what = f"no study {named!r}" if named is not None else f"{len(found)} studies"
    raise UserError(f"{parsed.label} holds {what} (it has: {names}); give --study-name")


def _named_in(home: runs.Home) -> str | None:
    try:
        return (home.local / STUDY_FILE).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def _open(parsed: StorageSpec) -> optuna.storages.BaseStorage:
    """The storage, or one line saying why it cannot be opened (`._storages`)."""
    try:
        return open_storage(parsed)
    except UserError:
        raise
    except Exception as exc:
        if cause(exc) is None:
            raise
        raise storage_error(parsed, exc) from None


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    """One thread per request, as optuna-dashboard's own command serves."""

    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No line per request: the terminal shows the sweep's page and nothing else."""


def _listen(host: str, port: int, app: Any) -> WSGIServer:
    try:
        return make_server(host, port, app, server_class=_Server, handler_class=_Quiet)
    except OSError as exc:
        raise UserError(
            f"cannot listen on {host}:{port} ({exc.strerror}); give another --port or --host"
        ) from None


def _say(page: str) -> None:
    print(f"hpsweep: optuna-dashboard at {page} (Ctrl-C to stop)", file=sys.stderr, flush=True)
