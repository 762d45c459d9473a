"""Reaching a real `kvtier serve` over HTTP on loopback, and the config written for vLLM's tiering
that the `kvtier serve` tests give it."""

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


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> None:
    """Terminate `proc` and wait for it; killed if it outlives `grace_s`. Idempotent."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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


SEED_CONFIG = {"kv_connector_extra_config": {
    "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 26, "block_size": 256,
    "eviction_policy": "arc", "store_threshold": 2,
    "secondary_tiers": [{"type": "fs", "root_dir": "ROOT", "n_read_threads": 8,
                         "backpressure": {"backpressure_cls": "EMABackpressureDetector"}}]}}
"""The seed's config for vLLM's tiering (no connector name), with keys kvtier maps and ignores."""


def seed_config(root: Path, **top: Any) -> dict[str, Any]:
    """`SEED_CONFIG` with its fs tier under `root` and the top-level keys `top`."""
    raw = json.loads(json.dumps(SEED_CONFIG).replace("ROOT", str(root)))
    return {**top, **raw}
