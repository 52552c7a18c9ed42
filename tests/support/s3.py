"""A local S3-compatible server for the tests: moto's server on 127.0.0.1, the one stand-in
allowed for object storage. Clients (boto3, pyarrow, s3fs, Ray's workers) reach it through
``AWS_ENDPOINT_URL`` and dummy credentials, as they would reach a real S3-compatible endpoint."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from support import free_port


@dataclass
class S3Server:
    endpoint: str
    #: What a client needs in its environment to use the server.
    env: dict[str, str]

    def make_bucket(self, name: str) -> None:
        import boto3

        boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region_name=self.env["AWS_DEFAULT_REGION"],
        ).create_bucket(Bucket=name)


@contextlib.contextmanager
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server on a free port of 127.0.0.1, stopped on the way out."""
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
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",  # no lookups of an instance's credentials
    }
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's S3 server did not start on port {port}") from None
                time.sleep(0.1)
        yield S3Server(endpoint, env)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
