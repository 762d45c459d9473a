"""A benchmark's vLLM server leaves nothing in /dev/shm (slow: one real server, ~1 minute).

vLLM's engine core and worker create shared-memory message queues (`psm_*`, 160 and 240 MiB) that
only Python's resource tracker in the server's process group removes, once the group has exited;
a SIGKILL of the group used to leave them behind. Here the server is given no time to exit on
SIGTERM, so `VLLMServer.stop` has to kill its group and remove what it left. The check is
robust to other processes' entries: it follows the entries this server's processes held."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench.multiturn.presets import kv_bytes_per_token
from kvtier.bench.multiturn.vllm_server import ServerSettings, VLLMServer, http_get
from kvtier.bench.process_group import SHM_DIR, group_members, shm_held
from kvtier.tools.models import prepare_smollm2


@pytest.mark.slow
def test_a_killed_benchmark_server_leaves_nothing_in_dev_shm(tmp_path: Path) -> None:
    model = prepare_smollm2(quiet=True)
    block_bytes = kv_bytes_per_token(model, "float32") * 32
    settings = ServerSettings(model, "smol", 32, 14, 384, 1, block_bytes)
    server = VLLMServer(settings, tmp_path / "vllm.log", stop_timeout_s=0.0)
    with server:
        assert server.proc is not None
        pgid = server.proc.pid
        assert '"object":"list"' in http_get(f"{server.base_url}/v1/models").replace(" ", "")
        held = {name for pid in group_members(pgid) for name, _ in shm_held(pid)}
    queues = {name for name in held if name.startswith("psm_")}
    assert len(queues) >= 2, held  # the engine's message queues, which the test follows
    assert not group_members(pgid)
    assert not [name for name in held if (SHM_DIR / name).exists()]
    removal = [line for line in (tmp_path / "vllm.log").read_text().splitlines()
               if line.startswith("kvtier: removed from /dev/shm")]
    assert len(removal) == 1 and all(name in removal[0] for name in queues), removal
