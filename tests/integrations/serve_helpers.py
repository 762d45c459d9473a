"""Reaching a real `kvtier serve` over HTTP on loopback."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, body: dict[str, Any] | None = None, timeout: float = 60) -> str:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return str(resp.read().decode())


def wait_healthy(proc: subprocess.Popen[bytes], port: int, log_path: Path, deadline: float) -> None:
    """Until the server `proc` started on `port` answers /health; fails the test, with the end of
    its log, if it exits first or `deadline` (monotonic) passes."""
    while True:
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, "server not up in time"
        try:
            http_get(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            time.sleep(1)
