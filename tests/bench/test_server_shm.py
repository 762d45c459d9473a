"""A benchmark's vLLM server leaves nothing in /dev/shm (slow: one real server, ~1 minute).
vLLM's engine core and worker create shared-memory message queues (`psm_*`, 160 and 240 MiB) and a
semaphore (`sem.mp-*`) that no process maps once the server is up; only Python's resource tracker
in the server's process group removes them, once the rest of the group has exited, and a SIGKILL
of the whole group used to leave them behind. Here the server is given no time to exit on SIGTERM,
so `VLLMServer.stop` has to kill the group, sparing its tracker, and remove what is left. The check
follows the queues this server's processes held, and every entry made in /dev/shm while it ran
that no process holds afterwards (the slow tests run one at a time)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.bench.multiturn.presets import kv_bytes_per_token
from kvtier.bench.multiturn.vllm_server import ServerSettings, VLLMServer, http_get
from kvtier.bench.process_group import SHM_DIR, group_members, shm_held, shm_held_by_anyone
from kvtier.tools.models import prepare_smollm2


@pytest.mark.slow
def test_a_killed_benchmark_server_leaves_nothing_in_dev_shm(tmp_path: Path) -> None:
    model = prepare_smollm2(quiet=True)
    block_bytes = kv_bytes_per_token(model, "float32") * 32
    settings = ServerSettings(model, "smol", 32, 14, 384, 1, block_bytes)
    server = VLLMServer(settings, tmp_path / "vllm.log", stop_timeout_s=0.0)
    before = set(os.listdir(SHM_DIR))
    with server:
        assert server.proc is not None
        pgid = server.proc.pid
        assert '"object":"list"' in http_get(f"{server.base_url}/v1/models").replace(" ", "")
        held = {name for pid in group_members(pgid) for name, _ in shm_held(pid)}
        made = set(os.listdir(SHM_DIR)) - before
    queues = {name for name in held if name.startswith("psm_")}
    assert len(queues) >= 2, held  # the engine's message queues, which the test follows
    assert any(name.startswith("sem.mp-") for name in made - held), made  # the unmapped semaphore
    assert not group_members(pgid)
    assert not [name for name in held if (SHM_DIR / name).exists()]
    in_use = {name for name, _ in shm_held_by_anyone()}
    left = [name for name in made if (SHM_DIR / name).exists() and name not in in_use]
    assert left == [], left
