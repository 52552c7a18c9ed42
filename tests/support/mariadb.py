"""A real MariaDB server for the tests (the ``mysql+pymysql://`` storage): Debian's
``mariadb-server`` package (``.ci/run`` installs it), a fresh data folder in a temp folder,
listening on 127.0.0.1 only, with the same password user as `support.postgres`.

As root the server runs as the package's ``mysql`` user, as PostgreSQL runs as ``postgres``.
"""

from __future__ import annotations

import contextlib
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
from support.postgres import PASSWORD, USER


@dataclass
class MariaDB:
    root: Path
    port: int

    @property
    def socket(self) -> str:
        return str(self.root / "mysqld.sock")

    def sql(self, statement: str) -> str:
        out = subprocess.run(
            ["mariadb", f"--socket={self.socket}", "-uroot", "-N", "-e", statement],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return out.stdout.strip()

    def create_database(self, name: str) -> str:
        self.sql(f"CREATE DATABASE {name}")
        return f"mysql+pymysql://{USER}:{PASSWORD}@127.0.0.1:{self.port}/{name}"


@contextlib.contextmanager
def mariadb_server() -> Iterator[MariaDB]:
    """A running server with the user ``hp`` (password `PASSWORD`), allowed every database."""
    if shutil.which("mariadbd") is None and not Path("/usr/sbin/mariadbd").exists():
        raise RuntimeError("MariaDB's server is missing: apt-get install mariadb-server")
    root = Path(tempfile.mkdtemp(prefix="hpsweep-mariadb-"))
    user = ["--user=mysql"] if os.geteuid() == 0 else []
    if os.geteuid() == 0:
        entry = pwd.getpwnam("mysql")
        os.chown(root, entry.pw_uid, entry.pw_gid)
    server = MariaDB(root, free_port())
    data = root / "data"
    subprocess.run(
        ["mariadb-install-db", "--no-defaults", *user, f"--datadir={data}", "--skip-test-db",
         "--auth-root-authentication-method=socket"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    proc = subprocess.Popen(
        ["/usr/sbin/mariadbd", "--no-defaults", *user, f"--datadir={data}",
         f"--socket={server.socket}", f"--port={server.port}", "--bind-address=127.0.0.1",
         f"--pid-file={root / 'mysqld.pid'}", "--skip-name-resolve",
         "--innodb-flush-log-at-trx-commit=0", f"--log-error={root / 'server.log'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                server.sql("SELECT 1")
                break
            except subprocess.CalledProcessError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        "MariaDB did not start: " + (root / "server.log").read_text()[-2000:]
                    ) from None
                time.sleep(0.3)
        server.sql(f"CREATE USER '{USER}'@'%' IDENTIFIED BY '{PASSWORD}'")
        server.sql(f"GRANT ALL PRIVILEGES ON *.* TO '{USER}'@'%'")
        yield server
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(root, ignore_errors=True)
