"""A real S3-compatible server for the tests: moto's server on 127.0.0.1, reached through
``AWS_ENDPOINT_URL`` as boto3 (and s3fs) read it, with dummy credentials.

    with s3_server() as s3:
        s3.make_bucket("sweeps")
        hpsweep_cli("run", space, "--output-dir", "s3://sweeps/a", env=s3.env)
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from support import free_port

#: Tests assert that it never reaches any output.
SECRET = "s3-secret-never-printed"


@dataclass
class S3Server:
    endpoint: str
    #: What a subprocess (or this process, through monkeypatch) needs to reach the server.
    env: dict[str, str] = field(default_factory=dict)

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region_name=self.env["AWS_DEFAULT_REGION"],
        )

    def make_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every key in ``bucket`` under ``prefix``, sorted."""
        pages = (
            self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        )
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


@contextlib.contextmanager
def s3_server() -> Iterator[S3Server]:
    """Start ``python -m moto.server`` on a free port; stopped (and its buckets gone) on exit."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    try:
        _wait_for(port, proc)
        yield S3Server(endpoint, env)
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        proc.kill()  # nothing, once it has exited
        proc.wait()


def _wait_for(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("moto's server exited at start: pip install 'moto[server]'")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.1)
    raise RuntimeError(f"moto's server did not listen on 127.0.0.1:{port} within {timeout:.0f} s")
