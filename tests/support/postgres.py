"""A real PostgreSQL server for the tests: Debian's ``postgresql`` package (``.ci/run`` installs
it), a fresh cluster in a temp folder, listening on 127.0.0.1 only, with a password user.

PostgreSQL refuses to run as root; as root the server runs as the package's ``postgres`` user.
`Postgres.restart` stops the server for a while and starts it again on the same port, as a
database restart or failover does to a running sweep.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from support import free_port

USER = "hp"
PASSWORD = "hppass-s3cret"  # tests assert that it never reaches any output


def _bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        raise RuntimeError(f"PostgreSQL's {name} is missing: apt-get install postgresql")
    return found[-1]


@dataclass
class Postgres:
    root: Path
    port: int

    @property
    def data(self) -> Path:
        return self.root / "data"

    def url(self, database: str = "sweeps", *, password: bool = True) -> str:
        auth = f"{USER}:{PASSWORD}" if password else USER
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{database}"

    def _run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        if os.geteuid() == 0:
            cmd = ("runuser", "-u", "postgres", "--", *cmd)
        return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=120)

    def start(self) -> None:
        self._run(
            _bin("pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.root / "server.log"),
            "-w",
            "-o",
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off",
            "start",
        )

    def stop(self) -> None:
        self._run(
            _bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop", check=False
        )

    def restart(self, down_s: float) -> None:
        """Stop the server (as a crash or failover does: no goodbye to clients), wait, start it."""
        self.stop()
        time.sleep(down_s)
        self.start()

    def sql(self, statement: str, database: str = "postgres") -> str:
        out = self._run(
            _bin("psql"),
            "-h",
            str(self.root),
            "-p",
            str(self.port),
            "-U",
            "postgres",
            "-d",
            database,
            "-Atc",
            statement,
        )
        return out.stdout.strip()

    def create_database(self, name: str) -> str:
        self.sql(f"CREATE DATABASE {name} OWNER {USER}")
        return self.url(name)


@contextlib.contextmanager
def postgres_server() -> Iterator[Postgres]:
    """A running server with the user ``hp`` (password `PASSWORD`) and a database ``sweeps``."""
    root = Path(tempfile.mkdtemp(prefix="hpsweep-pg-"))
    if os.geteuid() == 0:
        entry = pwd.getpwnam("postgres")
        os.chown(root, entry.pw_uid, entry.pw_gid)
    os.chmod(root, 0o700)
    server = Postgres(root, free_port())
    try:
        server._run(
            _bin("initdb"), "-D", str(server.data), "-U", "postgres", "--auth-local=trust",
            "--auth-host=scram-sha-256", "-E", "UTF8",
        )  # fmt: skip
        server.start()
        server.sql(f"CREATE USER {USER} PASSWORD '{PASSWORD}'")
        server.create_database("sweeps")
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
