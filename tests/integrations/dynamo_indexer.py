"""NVIDIA Dynamo's standalone KV indexer as a test peer: a real router's view of an engine's KV events.

`python -m dynamo.indexer` (PyPI `ai-dynamo-runtime`, a test dependency that `scripts/setup.sh`
installs) subscribes to vLLM's ZMQ KV events and answers `POST /query {"token_ids", "model_name"}`
with, per worker, how many leading tokens of the query it holds: `gpu` (device), `cpu` (device or
host), `disk` (any tier), cumulative. It hashes each block's `token_ids` itself and drops a batch it
cannot decode whole. It misses the first batch after it connects (vLLM publishes a batch only for a
step with events), so a test sends batches until one is seen.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.serve_helpers import stop_process

MODEL = "kvtier-test"
WORKER = "1"
NOTHING = {"gpu": 0, "cpu": 0, "disk": 0}


def require_indexer() -> None:
    """Skip, saying why, where Dynamo's indexer is not installed."""
    if importlib.util.find_spec("dynamo.indexer") is None:
        pytest.skip("Dynamo's KV indexer is not installed (scripts/setup.sh installs "
                    "ai-dynamo-runtime==1.6.1 with --no-deps)")


class Indexer:
    """One `python -m dynamo.indexer` process watching worker 1 at `endpoint` (vLLM's ZMQ publisher),
    for blocks of `block_size` tokens; its log goes to `log_path`."""

    def __init__(self, endpoint: str, block_size: int, port: int, log_path: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dynamo.indexer", "--port", str(port), "--threads", "1",
                 "--block-size", str(block_size), "--model-name", MODEL,
                 "--workers", f"{WORKER}={endpoint}"],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.query([1])
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise AssertionError(f"the indexer did not start: {self.log()}") from None
                time.sleep(0.05)

    def query(self, token_ids: list[int]) -> dict[str, int]:
        """Leading tokens of `token_ids` worker 1 holds: {"gpu", "cpu", "disk"} (cumulative)."""
        body = json.dumps({"token_ids": token_ids, "model_name": MODEL}).encode()
        req = urllib.request.Request(f"{self.url}/query", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as reply:
            answer: dict[str, Any] = json.loads(reply.read())
        held = answer.get("instances", {}).get(WORKER, {})
        return {k: int(held.get(k, 0)) for k in NOTHING}

    def reaches(self, token_ids: list[int], expected: dict[str, int], timeout_s: float) -> bool:
        """Whether the indexer reports `expected` for `token_ids` within `timeout_s` (events
        arrive asynchronously)."""
        deadline = time.monotonic() + timeout_s
        while self.query(token_ids) != expected:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def wait_for(self, token_ids: list[int], expected: dict[str, int], timeout_s: float = 10) -> None:
        """Wait until the indexer reports `expected` for `token_ids`; fail saying what it reports."""
        if not self.reaches(token_ids, expected, timeout_s):
            seen = self.query(token_ids)
            raise AssertionError(f"indexer reports {seen}, expected {expected}; {self.log()}")

    def log(self) -> str:
        """The tail of the indexer's own log."""
        return self.log_path.read_text(errors="replace")[-3000:]

    def close(self) -> None:
        stop_process(self.proc)
