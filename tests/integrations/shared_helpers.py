"""A vLLM engine instance that stays up in its own process, for tests where two instances must run
at once (a p2p holder), and helpers the test process and that child share.

`EngineProcess` starts `python -m tests.integrations.shared_helpers` in a new session (so a signal
to its process group reaches the engine and its tier processes together) and talks to it over
stdin/stdout, one JSON line each way. The child reads a setup line (`model`, `extra_config`, `llm`),
builds an in-process engine with the KVTierConnector, answers `{"ready": true}`, then serves
requests until stdin closes: `{"generate": [{"prompt": [ids], "max_tokens": n, "cache_salt": s},
...]}` (greedy, one
at a time, waiting after each until its tier jobs are done) answers a list of
`{"tokens", "cached", "kvtier"}`, and `{"stats": TIER}` answers every `TierCounter` of that tier as
its metrics hold it (0 for what it never counted). The caller
sets vLLM's environment first (`conftest.vllm_env`); the child inherits it.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from kvtier.integrations.vllm.serving.launch import transfer_config
from kvtier.ops.metrics import TierCounter
from tests.integrations.conftest import connector_halves

REPLY = "@kvtier-engine@ "
"""Marks the child's answers on stdout (vLLM may print there too)."""
ROOT = Path(__file__).resolve().parents[2]


def settle(scheduler: Any, timeout_s: float = 20.0) -> None:
    """Poll the connector's manager until no tier job is in flight."""
    deadline = time.monotonic() + timeout_s
    while scheduler.manager.in_flight:
        if time.monotonic() > deadline:
            raise AssertionError("tier jobs did not finish")
        time.sleep(0.02)
        scheduler.manager.poll()


def result_of(out: Any) -> dict[str, Any]:
    """A finished request's generated tokens, vLLM's cached-token count and kvtier's split."""
    return {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens,
            "kvtier": (out.kv_transfer_params or {}).get("kvtier")}


class EngineProcess:
    """One engine in a child process (see the module docstring). `close` is idempotent."""

    def __init__(self, model: Path, extra_config: dict[str, Any], llm_args: dict[str, Any],
                 log_path: Path) -> None:
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.integrations.shared_helpers"], cwd=ROOT,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                env=dict(os.environ), start_new_session=True,
            )
        self._replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()
        self._send({"model": str(model), "extra_config": extra_config, "llm": llm_args})
        self._ready = False

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        if not self._ready:
            assert self._reply(timeout_s) == {"ready": True}
            self._ready = True

    def generate(self, requests: list[tuple[list[int], int]], timeout_s: float = 120.0,
                 cache_salt: str | None = None) -> list[dict[str, Any]]:
        """Serve (prompt, max_tokens) requests one after the other (with `cache_salt`: a tenant's);
        their results in order."""
        self.wait_ready()
        self._send({"generate": [{"prompt": p, "max_tokens": n, "cache_salt": cache_salt}
                                 for p, n in requests]})
        results: list[dict[str, Any]] = self._reply(timeout_s)
        return results

    def tier_counts(self, tier: str, timeout_s: float = 30.0) -> dict[TierCounter, float]:
        """Every `TierCounter` of `tier` in the child's metrics, after a fresh report of the tier."""
        self.wait_ready()
        self._send({"stats": tier})
        counts: dict[str, float] = self._reply(timeout_s)
        return {TierCounter(name): value for name, value in counts.items()}

    def signal(self, sig: signal.Signals) -> None:
        """Send `sig` to the engine and its tier processes (the child's process group)."""
        os.killpg(self.proc.pid, sig)

    def freeze(self, timeout_s: float = 10.0) -> None:
        """SIGSTOP the engine and its tier processes; return once every thread of each is stopped.

        `killpg` returns as soon as the signal is queued: one thread per process is woken to start
        the group stop, and the others (a p2p serving thread woken by a request) keep running
        until that thread has been scheduled and stopped them: milliseconds on a loaded machine
        (18 ms seen here), time enough to serve a load."""
        self.signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while not all(state in STOPPED for state in _group_thread_states(self.proc.pid)):
            if time.monotonic() > deadline:
                raise AssertionError(f"process group {self.proc.pid} did not stop in {timeout_s} s")
            time.sleep(0.001)

    def unread_tcp_bytes(self) -> int:
        """Bytes peers sent to the engine or its tier processes that wait unread in their TCP
        receive queues, on connections they accepted or that wait in their listening sockets'
        backlogs. A frozen instance reads nothing: a request sent to it piles up there."""
        inodes = set()
        for pid in _group_pids(self.proc.pid):
            with contextlib.suppress(FileNotFoundError, PermissionError):
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    with contextlib.suppress(OSError):
                        link = os.readlink(f"/proc/{pid}/fd/{fd}")
                        if link.startswith("socket:["):
                            inodes.add(link[len("socket:[") : -1])
        rows = _tcp_sockets()
        listening = {local for local, state, _, inode in rows if state == TCP_LISTEN and inode in inodes}
        return sum(unread for local, state, unread, inode in rows
                   if state != TCP_LISTEN and (inode in inodes or (inode == "0" and local in listening)))

    def close(self) -> None:
        """Shut the engine down (stdin closed), or SIGKILL it if it does not exit in time."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.signal(signal.SIGKILL)  # tier processes the engine left behind, if any
        self.proc.wait()

    def _send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            if line.startswith(REPLY):
                self._replies.put(line[len(REPLY):])
        self._replies.put(None)

    def _reply(self, timeout_s: float) -> Any:
        try:
            line = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            line = None
        if line is None:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise AssertionError(f"the engine process gave no answer (exit {self.proc.poll()}):\n{tail}")
        return json.loads(line)


STOPPED = frozenset("TtZX")
"""/proc thread states of a thread that runs no code: stopped, traced, zombie, dead."""


TCP_LISTEN = "0A"
"""The state of a listening socket in /proc/net/tcp."""


def _group_pids(pgid: int) -> list[str]:
    """The pids of the processes in process group `pgid`."""
    return [pid for pid in filter(str.isdigit, os.listdir("/proc"))
            if _stat_fields(f"/proc/{pid}/stat")[2:3] == [str(pgid)]]


def _group_thread_states(pgid: int) -> list[str]:
    """The /proc state letter of every thread of every process in process group `pgid`."""
    states = []
    for pid in _group_pids(pgid):
        with contextlib.suppress(FileNotFoundError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                states += _stat_fields(f"/proc/{pid}/task/{tid}/stat")[:1]
    return states


def _tcp_sockets() -> list[tuple[str, str, int, str]]:
    """(local address, state, bytes unread in its receive queue, inode) of every TCP socket of
    this network namespace; inode "0" for a connection still in a listening socket's backlog."""
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                rows.append((fields[1], fields[3], int(fields[4].split(":")[1], 16), fields[9]))
    return rows


def _stat_fields(path: str) -> list[str]:
    """The fields of a /proc stat file after the command name (state, ppid, pgrp, ...); [] when
    the process is gone."""
    try:
        with open(path) as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return []
    return stat[stat.rindex(")") + 2 :].split()


def _answer(message: Any) -> None:
    print(REPLY + json.dumps(message), flush=True)


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    setup = json.loads(sys.stdin.readline())
    transfer = transfer_config(setup["extra_config"])
    llm = LLM(model=setup["model"], kv_transfer_config=transfer, **setup["llm"])
    scheduler, _ = connector_halves(llm)
    _answer({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        if "stats" in request:
            tier = scheduler.manager.tiers[request["stats"]]
            seen = tier.stats_version
            tier.request_stats()
            while tier.stats_version == seen:
                time.sleep(0.01)
                tier.poll()
            counts = tier.metrics.tier_counts(tier.name)
            _answer({counter.value: counts[counter] for counter in TierCounter})
            continue
        results = []
        for item in request["generate"]:
            params = SamplingParams(temperature=0.0, max_tokens=item["max_tokens"])
            prompt = TokensPrompt(prompt_token_ids=item["prompt"])
            if item.get("cache_salt") is not None:
                prompt["cache_salt"] = item["cache_salt"]
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            settle(scheduler)
            results.append(result_of(out))
        _answer(results)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
