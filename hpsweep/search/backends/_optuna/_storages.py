"""Where an Optuna study lives: ``--storage`` (``storage=`` in the Python API), parsed and opened.

The kinds (docs/many-machines.md, "Storages"): a journal file (the default, ``DIR/study.journal``), an
SQLite file (``sqlite:///...``, and where hpsweep 0.1 kept its studies), an SQL database
(``postgresql://``, ``mysql+pymysql://``), Optuna's storage proxy (``grpc://HOST:PORT``) for
many workers on one database, or an ``optuna.storages.BaseStorage`` from the Python API.

- Every message names the storage by its `StorageSpec.label`: the URL with its password as
  ``***``, after the place the user wrote it (``--storage``, or the environment variable a
  `StorageFromEnv` names). Credentials come from the URL or the driver's environment
  (``PGPASSWORD``).
- A database storage holds one connection per process (``pool_size=1``, no overflow), so a
  sweep's connections are machines x ``--n-jobs``. Opening it costs what bare Optuna's opening
  costs: one storage and one schema check (`_sql`). A short connection first reads the tables'
  schema stamp; only a database without one (new, or another process setting it up) gets
  Optuna's set-up of the tables, which takes a second connection while holding the first and so
  runs without a pool. `_check_schema` compares the stamp with the installed Optuna's schema.
- A failure is one line (`storage_error`): a missing driver names its package, and an
  unreachable server, a refused password and a missing database each say what to fix, at once.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

import optuna
from optuna.trial import FrozenTrial

from hpsweep.errors import UserError, did_you_mean
from hpsweep.redaction import describe, redact_url
from hpsweep.search.backends._optuna._journal import journal_storage

#: The study of a sweep folder: Optuna's journal file (an append-only log of the study's changes).
STUDY_FILE = "study.journal"
#: hpsweep 0.1 kept the study in SQLite; a folder holding one goes on with it.
LEGACY_STUDY_FILE = "study.db"
#: SQLAlchemy's names for the SQL databases Optuna supports (``NAME[+DRIVER]://``).
SQL_DIALECTS = ("postgresql", "mysql", "mariadb")
SCHEMES = ("sqlite", *SQL_DIALECTS, "grpc")
#: Tries to open a study while processes starting together race to create its tables.
OPEN_TRIES = 6
#: How long a process waits for the storage proxy before saying nothing answers there.
GRPC_READY_S = 5.0
#: PostgreSQL's connect timeout when the URL sets none (libpq would wait for TCP's minutes).
CONNECT_TIMEOUT_S = 10
#: ``host:port`` or ``user:password@host:port/db`` given without a scheme
SERVER_ADDRESS = re.compile(r"([^/@\s]+@)?(\[[0-9A-Fa-f:.]+\]|[\w.-]+):\d{1,5}(/\S*)?")
#: What to install for each module a storage imports on first use.
DRIVERS = {
    "psycopg": "the PostgreSQL driver: pip install 'hpsweep[postgres]'",
    "psycopg2": "the PostgreSQL driver psycopg2: pip install psycopg2-binary, or write "
    "postgresql:// and pip install 'hpsweep[postgres]'",
    "MySQLdb": "a MySQL driver: pip install 'hpsweep[mysql]' and write mysql+pymysql://",
    "pymysql": "the MySQL driver: pip install 'hpsweep[mysql]'",
    "grpc": "gRPC for the storage proxy: pip install 'hpsweep[grpc]'",
    "google": "gRPC for the storage proxy: pip install 'hpsweep[grpc]'",
}

Kind = Literal["journal", "sqlite", "sql", "grpc", "object"]
#: Where a storage URL is written unless it says otherwise (`StorageFromEnv`).
FLAG = "--storage"


class StorageFromEnv(str):
    """A storage URL read from the environment variable ``variable``: the messages about it name
    that variable, which is what the user has to fix, not ``--storage``."""

    variable: str

    def __new__(cls, url: str, variable: str) -> StorageFromEnv:
        self = super().__new__(cls, url)
        self.variable = variable
        return self

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return StorageFromEnv, (str(self), self.variable)


@dataclass(frozen=True)
class StorageSpec:
    """A parsed ``--storage``: its kind, its URL (a journal's absolute path; ``""`` for an object)
    and its label, the URL with the password as ``***``, which is all any message shows."""

    kind: Kind
    url: str
    label: str
    #: the storage object given to the Python API (kind "object")
    obj: Any = None
    #: the process that parsed it: a forked worker gives an object's SQL engine new connections
    pid: int = field(default_factory=os.getpid)
    #: where the user wrote it: ``--storage`` or an environment variable's name
    source: str = FLAG

    @property
    def path(self) -> Path:
        return Path(self.url)

    @property
    def where(self) -> str:
        """The storage as the user wrote it, password hidden: ``--storage URL`` or ``VAR=URL``."""
        return _where(self.source, self.label)


def _where(source: str, label: str) -> str:
    return f"{source} {label}" if source.startswith("--") else f"{source}={label}"


def parse_storage(spec: Any, output_dir: Path) -> StorageSpec:
    """``spec`` as given to ``--storage`` / ``storage=``; no spec is ``DIR/study.journal`` (or a
    ``DIR/study.db`` from hpsweep 0.1). Refuses, in one line, what is no storage hpsweep opens."""
    if spec is None or spec == "":
        return _default(output_dir)
    if isinstance(spec, optuna.storages.BaseStorage):
        return StorageSpec("object", "", describe(spec), obj=spec)
    if not isinstance(spec, (str, os.PathLike)):
        raise UserError(
            f"storage={type(spec).__name__} is no storage: give a journal file's path, a URL "
            "(postgresql://..., grpc://HOST:PORT) or an optuna.storages.BaseStorage"
        )
    text = os.fspath(spec)
    label, source = redact_url(text), getattr(spec, "variable", FLAG)
    where = _where(source, label)
    if "://" not in text:
        if SERVER_ADDRESS.fullmatch(text):
            raise UserError(
                f"{where} names a server but not its kind; write "
                f"postgresql://USER@{_hostport(text)}/DATABASE, mysql+pymysql://..., or "
                f"grpc://{_hostport(text)} for Optuna's storage proxy (a journal file is a path)"
            )
        path = Path(text).expanduser().resolve()
        return StorageSpec("journal", str(path), str(path), source=source)
    scheme = text.split("://", 1)[0].lower()
    dialect = scheme.split("+", 1)[0]
    if dialect == "sqlite":
        return StorageSpec("sqlite", text, label, source=source)
    if dialect in SQL_DIALECTS:
        return StorageSpec("sql", text, label, source=source)
    if scheme == "grpc":
        _grpc_address(text, where)
        return StorageSpec("grpc", text, label, source=source)
    raise UserError(
        f"{where}: {scheme}:// is no storage hpsweep opens{did_you_mean(dialect, SCHEMES)}; give a journal file's "
        "path, sqlite:///FILE, postgresql://..., mysql+pymysql://... or grpc://HOST:PORT"
    )


def _default(output_dir: Path) -> StorageSpec:
    legacy = output_dir / LEGACY_STUDY_FILE
    if legacy.exists() and not (output_dir / STUDY_FILE).exists():
        url = f"sqlite:///{legacy.resolve()}"  # a sweep begun by hpsweep 0.1 goes on there
        return StorageSpec("sqlite", url, url)
    path = str((output_dir / STUDY_FILE).resolve())
    return StorageSpec("journal", path, path)


def _hostport(text: str) -> str:
    return text.rpartition("@")[2].partition("/")[0]


def _grpc_address(url: str, where: str) -> tuple[str, int]:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or parts.path.strip("/"):
        raise UserError(
            f"{where}: the storage proxy is named grpc://HOST:PORT, e.g. grpc://10.0.0.5:13000"
        )
    return parts.hostname, port


# --- opening -------------------------------------------------------------------------------------


def open_storage(
    parsed: StorageSpec,
    *,
    heartbeat_interval: int | None = None,
    grace_period: int | None = None,
    stale_callback: Callable[[optuna.Study, FrozenTrial], None] | None = None,
) -> optuna.storages.BaseStorage:
    """The Optuna storage ``parsed`` names, connected. Raises what the storage raised (turn it
    into one line with `storage_error`), or a `UserError` for a journal that cannot be written.
    ``heartbeat_interval``, ``grace_period`` and ``stale_callback`` (run for each trial whose
    heartbeat went stale) go to an SQL database's `RDBStorage`."""
    if parsed.kind == "journal":
        try:
            return journal_storage(parsed.path)
        except OSError as exc:
            raise UserError(
                f"the study's journal {parsed.label} cannot be written ({exc.strerror}); "
                f"give {parsed.source} a path in a writable folder"
            ) from None
    if parsed.kind == "object":
        return _own_object(parsed)
    if parsed.kind == "grpc":
        return _grpc_proxy(parsed)
    if parsed.kind == "sqlite":
        # Several processes write one SQLite file: wait for its lock instead of failing.
        storage = optuna.storages.RDBStorage(
            parsed.url, engine_kwargs={"connect_args": {"timeout": 120}}
        )
        _fast_sqlite(storage)
        return storage
    return _sql(parsed, heartbeat_interval, grace_period, stale_callback)


def _sql(
    parsed: StorageSpec,
    heartbeat_interval: int | None,
    grace_period: int | None,
    stale_callback: Callable[[optuna.Study, FrozenTrial], None] | None,
) -> optuna.storages.RDBStorage:
    """The study's tables, created if missing, then one connection for this process. It is not
    pinged before each use (a round trip per transaction): a database restarted under a long
    sweep fails the next call on the old connection, which SQLAlchemy then drops, and the
    worker's `RetryingStorage` makes the call again on a fresh one."""
    connect: dict[str, Any] = {}
    if parsed.url.startswith("postgresql") and "connect_timeout" not in parse_qs(
        urlsplit(parsed.url).query
    ):
        connect["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_S}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        schema = _stamped_schema(parsed.url, connect)
        if schema is None:
            _create_tables(parsed.url, connect)
        storage = optuna.storages.RDBStorage(
            parsed.url,
            {"pool_size": 1, "max_overflow": 0, **connect},
            skip_compatibility_check=True,  # `_check_schema` instead, on one connection
            skip_table_creation=True,
            heartbeat_interval=heartbeat_interval,
            grace_period=grace_period,
            heartbeat_stale_trial_callback=stale_callback,
        )
    _check_schema(storage, parsed, schema)
    return storage


def _stamped_schema(url: str, connect: dict[str, Any]) -> str | None:
    """The schema version Optuna's tables in ``url`` are stamped with, or None before they are
    (a new database, or another process still setting it up), read over one connection.

    Optuna stamps the version last when it sets up the tables, and while none is stamped it takes a
    second connection while holding the first, which a pool of one never hands out (it would wait
    30 s and fail); once one is, opening the storage on a pool of one needs nothing more."""
    import sqlalchemy
    from alembic.migration import MigrationContext
    from sqlalchemy.pool import NullPool

    engine = sqlalchemy.create_engine(url, poolclass=NullPool, **connect)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


def _create_tables(url: str, connect: dict[str, Any]) -> None:
    """Optuna's set-up of the study's tables and their schema stamp (what `optuna.create_study`
    does on a new database), without a pool: each connection is closed after use."""
    from sqlalchemy.pool import NullPool

    setup = optuna.storages.RDBStorage(
        url, {"poolclass": NullPool, **connect}, skip_compatibility_check=True
    )
    setup.engine.dispose()


#: The schema version the installed Optuna writes, once read (reading it parses Optuna's
#: migration scripts; the installed package does not change while the process runs).
_HEAD_SCHEMA: list[str] = []


def _check_schema(
    storage: optuna.storages.RDBStorage, parsed: StorageSpec, current: str | None = None
) -> None:
    """Refuse tables of another schema version than the installed Optuna's, with the fix.
    ``current``: the version already read from the tables (None: read it now)."""
    current = current or storage.get_current_version()
    if not _HEAD_SCHEMA:
        _HEAD_SCHEMA.append(storage.get_head_version())
    head = _HEAD_SCHEMA[0]
    if current == head:
        return
    fix = (
        "upgrade this Optuna: pip install -U optuna"
        if current not in storage.get_all_versions()
        else f"upgrade the tables once: optuna storage upgrade --storage '{parsed.label}' "
        "(with the real password)"
    )
    raise UserError(
        f"{parsed.where}: its study tables have schema {current}, this Optuna reads {head}; {fix}"
    )


def _grpc_proxy(parsed: StorageSpec) -> optuna.storages.BaseStorage:
    host, port = _grpc_address(parsed.url, parsed.where)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        proxy = optuna.storages.GrpcStorageProxy(host=host, port=port)
    try:
        proxy.wait_server_ready(timeout=GRPC_READY_S)
    except BaseException:
        proxy.close()
        raise
    return proxy


def _own_object(parsed: StorageSpec) -> optuna.storages.BaseStorage:
    """The storage object as it is; in a forked ``--n-jobs`` worker, an SQL engine's pooled
    connections are the parent's sockets, so the worker opens its own (SQLAlchemy's rule)."""
    storage = parsed.obj
    if os.getpid() != parsed.pid and isinstance(storage, optuna.storages.RDBStorage):
        storage.engine.dispose(close=False)
    return storage


def _fast_sqlite(storage: optuna.storages.RDBStorage) -> None:
    """Write-ahead logging without an fsync per commit.

    Every report is a commit; with SQLite's defaults each one waits for the disk (~7 ms here,
    ~20 per trial). In WAL mode with synchronous=NORMAL a commit survives a crash of the
    process (what a sweep must survive) and needs no fsync; only a power cut may lose the last
    commits. Readers no longer block the writer either, which helps --n-jobs.
    """
    import sqlalchemy

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    sqlalchemy.event.listen(storage.engine, "connect", on_connect)
    storage.engine.dispose()  # connections opened while the storage set itself up get the pragmas too


# --- failures ------------------------------------------------------------------------------------

#: (cause, a pattern of the driver's message that means it), most specific first
_CAUSES = (
    ("no-password", r"no password supplied"),
    ("password", r"password authentication failed|access denied for user"),
    ("no-user", r'role "[^"]*" does not exist'),
    ("no-database", r'database "[^"]*" does not exist|unknown database'),
    ("refused", r"connection refused|can't connect to"),
    ("timeout", r"timeout expired|timed out"),
    ("no-host", r"failed to resolve host|could not translate host name|name or service not known"),
    ("sqlite-file", r"unable to open database file"),
    ("unknown-driver", r"can't load plugin"),
)


def cause(exc: BaseException) -> str | None:
    """What went wrong opening a storage, as one of `storage_error`'s causes: ``"driver"``,
    ``"proxy"``, a connection's cause from `_CAUSES`, ``"other"`` for anything else the storage
    raised (a race between processes creating the tables: worth another try), or None when
    ``exc`` did not come from the storage at all."""
    chain = _chain(exc)
    if any(_missing_driver(e) for e in chain):
        return "driver"
    if any(isinstance(e, ConnectionError) and "GRPC" in str(e) for e in chain):
        return "proxy"
    if not any(_from_storage(e) for e in chain):
        return None
    text = " ".join(str(e) for e in chain).lower()
    for name, pattern in _CAUSES:
        if re.search(pattern, text):
            return name
    return "other"


def retryable(exc: BaseException) -> bool:
    """Whether another try may succeed: processes starting together race to create the tables;
    a refused password, a missing database or driver will not change in a second."""
    return cause(exc) == "other"


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__, getattr(e, "orig", None)]
    return seen


def _missing_driver(exc: BaseException) -> bool:
    """An import the storage needed: a driver hpsweep knows, or one Optuna failed to import."""
    return isinstance(exc, ImportError) and (
        (exc.name or "").split(".")[0] in DRIVERS or "DB access module" in str(exc)
    )


def _from_storage(exc: BaseException) -> bool:
    module = type(exc).__module__
    return module.startswith(
        ("sqlalchemy", "psycopg", "pymysql", "MySQLdb", "sqlite3", "grpc")
    ) or (isinstance(exc, optuna.exceptions.StorageInternalError))


def storage_error(parsed: StorageSpec, exc: BaseException) -> UserError:
    """``exc``, raised opening ``parsed``, as one line naming the storage (password as ``***``),
    the problem and the fix."""
    name = cause(exc)
    where = parsed.where
    if name == "driver":
        module = (
            next((e.name for e in _chain(exc) if isinstance(e, ImportError) and e.name), None)
            or "?"
        )
        need = DRIVERS.get(module.split(".")[0], f"the package {module!r}: pip install {module}")
        return UserError(f"{where} needs {need}")
    if name == "proxy":
        return UserError(
            f"{where}: no Optuna storage proxy answers there (waited {GRPC_READY_S:g} s); start "
            "one (optuna.storages.run_grpc_proxy_server) or fix the host and port"
        )
    return UserError(f"{where}: {_connection_problem(name, parsed, exc)}")


def _connection_problem(name: str | None, parsed: StorageSpec, exc: BaseException) -> str:
    url = urlsplit(parsed.url)
    user, database = url.username or "(default)", url.path.strip("/")
    server = f"{url.hostname or 'the default host'}" + (f":{url.port}" if url.port else "")
    mysql = parsed.url.startswith(("mysql", "mariadb"))
    create = (
        f"CREATE DATABASE {database}"
        if mysql
        else f"createdb -h {url.hostname or 'HOST'} -p {url.port or 5432} -U {user} {database}"
    )
    problems = {
        "no-password": f"the server wants a password for user {user!r} and none was given; put it "
        "in the URL (USER:PASSWORD@HOST) or in PGPASSWORD",
        "password": f"the server refused user {user!r}: the password is wrong; check the URL's "
        "password or PGPASSWORD",
        "no-user": f"the server has no user {user!r}; create it or fix the user in the URL",
        "no-database": f"database {database!r} does not exist on {server}; create it once "
        f"before the sweep ({create}), or fix the URL",
        "refused": f"nothing accepts connections at {server} (connection refused); start the "
        "database or fix the host and port",
        "timeout": f"{server} did not answer within {CONNECT_TIMEOUT_S} s; check the host, the "
        "port and the firewall",
        "no-host": f"the host {url.hostname!r} is not known; fix the host in the URL",
        "sqlite-file": "cannot be opened (unable to open database file); check the URL: its "
        "folder must exist and be writable",
        "unknown-driver": "SQLAlchemy has no such driver; write postgresql:// (psycopg) or "
        "mysql+pymysql://",
    }
    return problems.get(
        name or "",
        f"cannot be opened ({type(exc).__name__}); check the URL and that the database is reachable",
    )
