"""Real vLLM (CPU, float32, in-process) with the `priority` admission policy and an fs tier: chunks of
low-priority requests stay in the host tier and never reach the fs tier (no file, counted as
rejected), those of high-priority requests do, and the priority never changes an output."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.conftest import connector_halves
from tests.integrations.engine_steps import generate
from tests.integrations.shared_helpers import settle
from tests.integrations.test_vllm_tiers import CHUNK, ROW_BYTES, tokens

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(make_llm: Callable[..., Any], fs_dir: Path) -> Any:
    return make_llm({"cpu_bytes_to_use": 16 * ROW_BYTES, "blocks_per_chunk": 2,
                     "admission_policy": ["priority"],
                     "secondary_tiers": [{"type": "fs", "root_dir": str(fs_dir)}]}, dtype="float32")


def fs_files(fs_dir: Path, keys: list[bytes]) -> list[Path]:
    names = {k.hex() for k in keys}
    return [p for p in fs_dir.rglob("*") if p.name in names]


def test_low_priority_chunks_never_reach_the_fs_tier(llm: Any, fs_dir: Path) -> None:
    scheduler, _ = connector_halves(llm)
    m = scheduler.manager.metrics.value
    low_prompt, high_prompt = tokens(llm, "lighthouse"), tokens(llm, "bread")
    low_keys = scheduler.hasher.keys(low_prompt)
    high_keys = scheduler.hasher.keys(high_prompt)

    generate(llm, low_prompt, priority=10)
    settle(scheduler)
    assert fs_files(fs_dir, low_keys) == []
    assert all(scheduler.manager.host.contains(k) for k in low_keys)  # the host tier admits 0+
    assert m("kvtier_rejected_chunks_total", tier="fs", reason="priority") == len(low_keys)
    assert m("kvtier_transfer_chunks_total", tier="fs", op="store") == 0

    generate(llm, high_prompt, priority=80)
    settle(scheduler)
    assert len(fs_files(fs_dir, high_keys)) == len(high_keys)
    assert m("kvtier_admitted_chunks_total", tier="fs") == len(high_keys)
    assert m("kvtier_transfer_chunks_total", tier="fs", op="store") == len(high_keys)
    assert fs_files(fs_dir, low_keys) == []

    ref = generate(llm, low_prompt, priority=80)  # vLLM's own device prefix cache
    hit = (len(low_prompt) - 1) // CHUNK * CHUNK
    assert ref.num_cached_tokens == hit
    outputs = []
    for priority in (10, 80):
        assert llm.reset_prefix_cache()
        again = generate(llm, low_prompt, priority=priority)
        assert again.kv_transfer_params["kvtier"]["tokens"]["host"] == hit
        outputs.append(again.outputs[0].token_ids)
    assert outputs == [ref.outputs[0].token_ids] * 2
    settle(scheduler)
    assert fs_files(fs_dir, low_keys) == []  # host hits are not stored again
