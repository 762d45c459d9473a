"""Start and stop one vLLM OpenAI-compatible server for one benchmark configuration.

`VLLMServer` is a context manager: it picks a free loopback port, starts
`python -m vllm.entrypoints.openai.api_server` (with the configuration's `--kv-transfer-config`,
kvtier's or a baseline connector's, when it has one;
`kvtier.integrations.vllm.serving.serve.vllm_command`) in its own session and process group, isolated in a
private temp dir (`kvtier.integrations.vllm.serving.launch.isolated_env`), with the baselines' tree
on its `PYTHONPATH` when it loads a baseline, with its output appended to `log_path`, and waits for
`/health`. On exit, on an error and on Ctrl-C it stops the whole process group
(`kvtier.bench.process_group.stop_process_group`: SIGTERM, SIGKILL of what is left after
`stop_timeout_s` but Python's resource tracker, which then unlinks what vLLM registered with it,
then removal of the shared-memory entries still left), so nothing it started is left running or
in /dev/shm.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from kvtier.bench.engine_log import open_log
from kvtier.bench.multiturn.configs import baselines_root
from kvtier.bench.process_group import stop_process_group
from kvtier.errors import KVTierError
from kvtier.integrations.vllm.serving.launch import connector_config, isolated_env
from kvtier.integrations.vllm.serving.serve import vllm_command


@dataclass(frozen=True)
class ServerSettings:
    """The engine flags of one server (vLLM's names); the connector is kvtier's (its extra config,
    `kvtier`) or a baseline's (its whole kv-transfer-config, `connector`), at most one of them."""

    model: Path
    served_name: str
    block_size: int
    device_blocks: int
    max_model_len: int
    max_num_seqs: int
    block_bytes: int
    dtype: str = "float32"
    kvtier: dict[str, Any] | None = None
    extra_args: tuple[str, ...] = field(default=())
    connector: dict[str, Any] | None = None

    def kv_transfer_config(self) -> dict[str, Any] | None:
        """The engine's whole kv-transfer-config (JSON object), None for vLLM alone."""
        if self.kvtier is not None:
            return connector_config(self.kvtier)
        if self.connector is not None:
            return dict(self.connector)
        return None

    def vllm_args(self, port: int) -> list[str]:
        return ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", self.served_name,
                "--dtype", self.dtype, "--enforce-eager", "--max-model-len", str(self.max_model_len),
                "--block-size", str(self.block_size),
                "--num-gpu-blocks-override", str(self.device_blocks),
                "--kv-cache-memory-bytes", str((self.device_blocks + 1) * self.block_bytes),
                "--max-num-seqs", str(self.max_num_seqs), "--seed", "0", *self.extra_args]

    def argv(self, port: int) -> list[str]:
        transfer = self.kv_transfer_config()
        if transfer is None:
            return [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                    "--model", str(self.model), *self.vllm_args(port)]
        return vllm_command(str(self.model), transfer, self.vllm_args(port))

    def env(self, tmp_dir: Path) -> dict[str, str]:
        """The server's environment: ours, isolated under `tmp_dir`, with the baselines' tree first on
        `PYTHONPATH` when the configuration loads a baseline connector."""
        env = {**os.environ, **isolated_env(tmp_dir, in_process=False)}
        if self.connector is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(baselines_root()), env.get("PYTHONPATH"))
                                                if p)
        return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode())


class VLLMServer:
    """One server, started on `__enter__` and stopped (process group) on `__exit__`."""

    def __init__(self, settings: ServerSettings, log_path: Path, *, start_timeout_s: float = 300,
                 stop_timeout_s: float = 20) -> None:
        self.settings = settings
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._tmp: Path | None = None
        self._started = 0.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> VLLMServer:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _start(self) -> None:
        self._tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-server-"))
        self.port = free_port()
        env = self.settings.env(self._tmp)
        log = open_log(self.log_path)
        try:
            os.write(log, f"$ {json.dumps(self.settings.argv(self.port))}\n".encode())
            self._started = time.time()
            self.proc = subprocess.Popen(self.settings.argv(self.port), stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)
        finally:
            os.close(log)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise KVTierError(f"vLLM server exited with status {self.proc.returncode} while "
                                  f"starting; last lines of {self.log_path}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise KVTierError(f"vLLM server not healthy after {self.start_timeout_s:.0f} s; "
                                  f"see {self.log_path}:\n{self.log_tail()}")
            with contextlib.suppress(OSError):
                http_get(f"{self.base_url}/health", timeout=2)
                return
            time.sleep(0.5)

    def log_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    def stop(self) -> None:
        """Stop the server's process group (nothing of it left running or in /dev/shm) and remove
        its temp dir; idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None:
            removed = stop_process_group(proc, self.stop_timeout_s, self._started)
            if removed:
                with os.fdopen(open_log(self.log_path), "a") as text:
                    text.write(f"kvtier: removed from /dev/shm what the server left: "
                               f"{', '.join(removed)}\n")
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

