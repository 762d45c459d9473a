"""Real Redis and Valkey servers for tests and benchmarks, and the fixtures built on them.

`RedisServer` runs `redis-server` (or `valkey-server`, same options) on a free loopback port and a
unix socket, in its own directory, with persistence off (`--save "" --appendonly no`). `kill`
stops it with SIGKILL; `start` again reuses the same port and socket, as a restarted server would.

Fixtures: `redis_server` and `valkey_server` (one server per test session; each skips its tests
where its binary is not installed, which fails them in CI: tests/optional.py),
`redis_tier_options` / `valkey_tier_options` (the redis tier's options for a fresh key prefix per
test) and `redis_server_factory` (servers with extra options, stopped after the test).
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.bench.chaos.services import answers_ping, free_ports

READY_TIMEOUT_S = 10.0


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    return free_ports(1)[0]


class RedisServer:
    """One server process with its own directory, port and unix socket."""

    def __init__(self, binary: str, root: Path, *extra: str) -> None:
        self.binary = binary
        self.root = root
        self.extra = extra
        self.port = free_port()
        self.socket_path = str(root / "redis.sock")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.socket_path}"

    def start(self) -> None:
        """Start the server and wait until it answers on its port."""
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.root),
            "--save", "", "--appendonly", "no", "--unixsocket", self.socket_path,
            "--unixsocketperm", "700", "--daemonize", "no", *self.extra,
        ]
        with open(self.root / "server.log", "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not answers_ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                tail = (self.root / "server.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{self.binary} did not start on port {self.port}:\n{tail}")
            time.sleep(0.01)

    def kill(self) -> None:
        """SIGKILL the server (a crash: nothing is kept). Idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()
        with contextlib.suppress(FileNotFoundError):
            Path(self.socket_path).unlink()


def start_server(binary_name: str, *extra: str) -> RedisServer:
    """A started server from `binary_name` on PATH, in a fresh short temp dir (unix socket paths
    are limited to 107 bytes). The caller kills it and removes `root`."""
    binary = shutil.which(binary_name)
    if binary is None:
        raise FileNotFoundError(f"{binary_name} is not installed")
    server = RedisServer(binary, Path(tempfile.mkdtemp(prefix="kvtier-redis-")), *extra)
    try:
        server.start()
    except BaseException:
        shutil.rmtree(server.root, ignore_errors=True)
        raise
    return server


def stop_server(server: RedisServer) -> None:
    server.kill()
    shutil.rmtree(server.root, ignore_errors=True)


def require(binary_name: str) -> None:
    """Skip the calling test where `binary_name` is not installed (a failure in CI)."""
    if shutil.which(binary_name) is None:
        pytest.skip(f"{binary_name} is not installed")


def _session_server(binary_name: str) -> Iterator[RedisServer]:
    require(binary_name)
    server = start_server(binary_name)
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    yield from _session_server("redis-server")


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[RedisServer]:
    yield from _session_server("valkey-server")


def fresh_prefix() -> str:
    return f"kvtier-test-{secrets.token_hex(6)}"


@pytest.fixture
def redis_tier_options(redis_server: RedisServer) -> dict[str, object]:
    """The redis tier's options for a fresh, empty namespace on the session's redis-server."""
    return {"url": redis_server.url, "key_prefix": fresh_prefix()}


@pytest.fixture
def valkey_tier_options(valkey_server: RedisServer) -> dict[str, object]:
    """The redis tier's options for a fresh, empty namespace on the session's valkey-server."""
    return {"url": valkey_server.url, "key_prefix": fresh_prefix()}


@pytest.fixture
def redis_server_factory() -> Iterator[Callable[..., RedisServer]]:
    """Start redis-servers with extra options (e.g. "--maxmemory", "4mb"); all stopped afterwards."""
    require("redis-server")
    started: list[RedisServer] = []

    def start(*extra: str) -> RedisServer:
        server = start_server("redis-server", *extra)
        started.append(server)
        return server

    yield start
    for server in started:
        stop_server(server)
