"""Clean shutdown: on every orderly way an engine stops, kvtier's host region leaves /dev/shm and its
tier processes exit within seconds. One of the servers started here is also `kvtier serve` as a
vLLM user starts it, with vLLM's tiering config and no device-memory flag: it answers a chat and
exposes kvtier_ metrics before it is stopped. The other is scraped by a real Prometheus before it
is stopped: every query of the Grafana dashboard returns data after a short workload.

- a real `kvtier serve` server stopped with SIGTERM (`kill PID`) or SIGINT to its process group
  (Ctrl-C): vLLM's API server SIGKILLs its engine core a moment after its SIGTERM, so only the
  region's reaper can remove the region then;
- an in-process engine dropped and garbage-collected without a shutdown (an engine shut down is
  checked by every module's `make_llm` teardown, see `conftest.py`).
A script ending with vLLM's default engine-core process up (vLLM's client finalizer SIGTERMs it,
with a 5 s grace) and an owner SIGKILLed are covered by the reaper's own test
(`tests/host/test_reaper.py`): whatever ends the owner, its region goes.
"""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.bench.multiturn.vllm_server import stop_process_group
from kvtier.host.reaper import owner_alive, start_time
from kvtier.host.region import SHM_DIR
from kvtier.integrations.vllm.serving.launch import isolated_env, transfer_config
from tests.integrations.conftest import BLOCK_SIZE, _model_path, connector_halves
from tests.integrations.prometheus_helpers import PROMETHEUS, Prometheus, dashboard_exprs
from tests.integrations.serve_helpers import free_port, http_get, seed_config, wait_healthy

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 5.0
ROW_BYTES = 30 * 2 * 3 * 32 * 64 * 4  # SmolLM2 float32, one 32-token block per chunk
DASHBOARD = ROOT / "docs" / "grafana" / "kvtier.json"
DEVICE_BLOCKS = 9
"""The "int" server's device cache: 8 blocks of 32 tokens besides vLLM's null block, its
`--max-model-len` 256."""
PROMPT_A = list(range(1000, 1128))
"""4 chunks of token ids; `PROMPT_B` (7) after it leaves only A's first block on the device."""
PROMPT_B = list(range(2000, 2224))


def _children() -> dict[int, list[int]]:
    """ppid -> pids of every process now."""
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        out.setdefault(ppid, []).append(int(name))
    return out


def _tree(pid: int) -> list[int]:
    """`pid` and all its descendants now."""
    children, found, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _regions_of(pids: list[int]) -> list[str]:
    prefixes = tuple(f"kvtier-{p}-" for p in pids)
    return [n for n in os.listdir(SHM_DIR) if n.startswith(prefixes)]


def _tier_processes(pids: list[int]) -> list[tuple[int, int]]:
    """(pid, start time) of the kvtier tier processes among `pids`."""
    found = []
    for p in pids:
        started = start_time(p)
        if started is not None and "kvtier.tiers.runner" in _cmdline(p):
            found.append((p, started))
    return found


def _assert_all_gone(regions: list[str], tiers: list[tuple[int, int]], what: str) -> float:
    """Wait until no region in `regions` exists, no process in `tiers` lives, and no process names
    one of the regions (its reaper); return how long it took. Fails after `GONE_WITHIN_S`."""
    t0 = time.monotonic()
    while True:
        left_regions = [r for r in regions if os.path.exists(os.path.join(SHM_DIR, r))]
        left_tiers = [p for p, s in tiers if owner_alive(p, s)]
        left_reapers = [p for p in _tree(1) if any(r in _cmdline(p) for r in regions)]
        if not (left_regions or left_tiers or left_reapers):
            return time.monotonic() - t0
        assert time.monotonic() - t0 < GONE_WITHIN_S, (
            f"{what}: after {GONE_WITHIN_S} s, regions {left_regions}, tier processes {left_tiers}, "
            f"reapers {left_reapers} are left")
        time.sleep(0.1)


# -- a real `kvtier serve` server ------------------------------------------------------------------


class _Server:
    """`kvtier serve` on the test model: `flags` for kvtier, then vLLM's; `plain` drops every
    device-memory and block-size flag (and `VLLM_CPU_KVCACHE_SPACE`), leaving those to serve.
    `prometheus`: the Prometheus scraping it, if one does."""

    def __init__(self, tmp: Path, flags: list[str], plain: bool) -> None:
        self.port = free_port()
        self.prometheus: Prometheus | None = None
        self.log_path = tmp / "server.log"
        env = {**os.environ, **isolated_env(tmp, in_process=False)}
        args = ["--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "smol",
                "--dtype", "float32", "--max-num-seqs", "2"]
        if plain:
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)
            args += ["--max-model-len", "1024"]
        else:
            args += ["--kv-cache-memory-bytes", str(DEVICE_BLOCKS * ROW_BYTES), "--block-size", "32",
                     "--max-model-len", "256"]
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvtier.cli", "serve", str(_model_path()), *flags, "--", *args],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)

    def wait_up(self, deadline: float) -> None:
        wait_healthy(self.proc, self.port, self.log_path, deadline)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, _Server]]:
    """Two servers started side by side (their start-up, mostly imports, overlaps): "term", given
    a config written for vLLM's tiering and no device-memory flag, and "int", given kvtier's flags
    (a host tier of 22 chunks, an fs tier, `frequency` admission) and vLLM's sizes, and scraped
    from its start by Prometheus where the binary is installed."""
    term, other = tmp_path_factory.mktemp("serve-term"), tmp_path_factory.mktemp("serve-int")
    config = term / "config.json"
    config.write_text(json.dumps(seed_config(term / "kv", kv_connector="OffloadingConnector")))
    extra = other / "extra.json"
    extra.write_text(json.dumps({"admission_policy": "frequency", "tier_restart_backoff_s": 0.2}))
    started = {
        "term": _Server(term, ["--kv-offloading-size", "0.0625", "--config", str(config)], plain=True),
        "int": _Server(other, ["--cpu-gb", "0.03125", "--fs", str(other / "fs"), "--config", str(extra)],
                       plain=False),
    }
    try:
        if PROMETHEUS is not None:
            started["int"].prometheus = Prometheus(other, f"127.0.0.1:{started['int'].port}")
        deadline = time.monotonic() + 400  # ~40 s idle; minutes when the 2 cores are shared
        for server in started.values():
            server.wait_up(deadline)
        yield started
    finally:
        for server in started.values():
            stop_process_group(server.proc, 20.0)
            if server.prometheus is not None:
                server.prometheus.close()


def test_a_server_given_no_device_memory_flag_serves(servers: dict[str, _Server]) -> None:
    """vLLM's CPU backend with its defaults would reserve 92% of memory and compile for minutes:
    `kvtier serve` given a vLLM tiering config and no size or eager flag starts and serves."""
    server = servers["term"]
    base = f"http://127.0.0.1:{server.port}"
    reply = json.loads(http_get(f"{base}/v1/chat/completions", {
        "model": "smol", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}))
    assert "Paris" in reply["choices"][0]["message"]["content"]
    assert reply["usage"]["prompt_tokens"] > 0
    assert "kvtier_" in http_get(f"{base}/metrics")
    text = server.log_path.read_text()
    for said in ("kvtier: device KV cache", "kvtier: --enforce-eager",
                 "(vLLM OffloadingConnector config -> KVTierConnector)", "kvtier: memory plan: ",
                 '"blocks_per_chunk": 2', "--kv-transfer-config '"):
        assert said in text, said


def _complete(base: str, prompt: list[int]) -> None:
    body = {"model": "smol", "prompt": prompt, "max_tokens": 1}
    reply = json.loads(http_get(f"{base}/v1/completions", body))
    assert reply["usage"]["prompt_tokens"] == len(prompt)


def _restart_a_killed_tier(server: _Server, deadline: float) -> None:
    """SIGKILL the server's tier process, then send tiny requests (engine steps notice the death and
    restart it) until its metrics show the tier up again after a restart."""
    [(pid, _)] = _tier_processes(_tree(server.proc.pid))
    os.kill(pid, signal.SIGKILL)
    base = f"http://127.0.0.1:{server.port}"
    while True:
        _complete(base, [1, 2, 3])
        samples = {s.name: s.value for f in text_string_to_metric_families(http_get(f"{base}/metrics"))
                   for s in f.samples if s.name in ("kvtier_tier_up", "kvtier_tier_restarts")}
        if samples.get("kvtier_tier_up") == 1 and samples.get("kvtier_tier_restarts", 0) >= 1:
            return
        assert time.monotonic() < deadline, f"tier not restarted: {samples}"
        time.sleep(0.2)


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (`make setup` installs Debian's)")
def test_a_real_prometheus_gets_data_for_every_dashboard_query(servers: dict[str, _Server]) -> None:
    """Prometheus scrapes the "int" server every second through a short workload: a prompt, another
    that pushes its tail off the device, the first again (host hits; its chunks leave probation and
    cascade to fs), then a killed fs tier process (a failure, a restart). Every PromQL expression of
    docs/grafana/kvtier.json, Grafana's variables replaced, returns data; the workload's own
    signals are not zero."""
    server = servers["int"]
    prom = server.prometheus
    assert prom is not None
    base = f"http://127.0.0.1:{server.port}"
    began, deadline = time.time(), time.monotonic() + 120
    for prompt in (PROMPT_A, PROMPT_B, PROMPT_A):
        _complete(base, prompt)
    _restart_a_killed_tier(server, deadline)
    prom.wait_scraped(max(time.time(), began + 2), deadline)  # every series scraped twice
    settled = time.monotonic() + 10
    while empty := [(title, expr) for title, expr in dashboard_exprs(DASHBOARD)
                    if not prom.query(prom.evaluable(expr))]:
        print(f"{len(empty)} queries without data yet: {empty}")
        if time.monotonic() > settled:
            break
        time.sleep(0.5)
    names = {name for _, expr in empty for name in re.findall(r"\bkvtier_\w+", expr)}
    exposed = [line for line in http_get(f"{base}/metrics").splitlines() if line.startswith(tuple(names))]
    assert not empty, (empty, {name: prom.query(name) for name in names}, exposed, prom.query("up[10s]"))
    for expr in ('kvtier_prompt_tokens_total{source="host"}', "kvtier_probation_chunks_total",
                 "kvtier_probation_reused_chunks_total", 'kvtier_transfer_bytes_total{op="store"}'):
        [sample] = prom.query(f"sum({expr})")
        assert float(sample["value"][1]) > 0, expr


@pytest.mark.parametrize(("name", "sig", "group"), [
    ("term", signal.SIGTERM, False),  # `kill PID`, a service manager's stop
    ("int", signal.SIGINT, True),  # Ctrl-C: the terminal signals the whole foreground group
])
def test_server_stopped_by_a_signal_leaves_nothing(
    servers: dict[str, _Server], name: str, sig: signal.Signals, group: bool,
) -> None:
    server = servers[name]
    reply = http_get(f"http://127.0.0.1:{server.port}/v1/completions", {
        "model": "smol", "prompt": "The capital of France is " * 12, "max_tokens": 4})
    assert '"text"' in reply
    tree = _tree(server.proc.pid)
    regions, tiers = _regions_of(tree), _tier_processes(tree)
    assert len(regions) == 1, (regions, tree)
    assert len(tiers) == 1, tiers
    (os.killpg if group else os.kill)(server.proc.pid, sig)
    server.proc.wait(30)
    took = _assert_all_gone(regions, tiers, f"kvtier serve after {sig.name}")
    print(f"{sig.name}: region and tier process gone {took:.2f} s after the server exited")


# -- an in-process engine --------------------------------------------------------------------------


def _extra(fs_dir: Path) -> dict[str, Any]:
    return {"cpu_bytes_to_use": 8 * ROW_BYTES,
            "secondary_tiers": [{"type": "fs", "root_dir": str(fs_dir)}]}


def _parts(llm: Any) -> tuple[list[str], list[tuple[int, int]]]:
    manager = connector_halves(llm)[0].manager
    regions = [manager.region.name]
    tiers = [(t.pid, start_time(t.pid)) for t in manager.tiers.values()]
    assert all(s is not None for _, s in tiers) and len(tiers) == 1
    return regions, tiers


def test_llm_garbage_collected_leaves_nothing(vllm_env: Path, tmp_path: Path) -> None:
    from vllm import LLM

    llm = LLM(model=str(_model_path()), kv_transfer_config=transfer_config(_extra(tmp_path)),
              dtype="float32", enforce_eager=True, block_size=BLOCK_SIZE,
              num_gpu_blocks_override=64, kv_cache_memory_bytes=64 << 20, max_model_len=1024)
    regions, tiers = _parts(llm)
    del llm
    gc.collect()
    _assert_all_gone(regions, tiers, "LLM garbage-collected")

