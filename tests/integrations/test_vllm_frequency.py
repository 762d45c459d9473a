"""Real vLLM (CPU, float32, in-process) with the `frequency` admission policy (`min_seen` 2), a host
tier of 4 chunks and an fs tier: a chunk seen once waits on host probation and reaches the fs tier
only when a later request reuses it; one-off prompts on probation push out each other, never the
reused prefix; a chunk that extends the reused prefix waits on (warm) probation too; outputs never
change."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.conftest import connector_halves
from tests.integrations.engine_steps import generate
from tests.integrations.shared_helpers import settle
from tests.integrations.test_vllm_admission import fs_files
from tests.integrations.test_vllm_tiers import CHUNK, ROW_BYTES, tokens

pytestmark = pytest.mark.slow

ONE_OFFS = ("bread", "library", "birds", "railway", "chess")


@pytest.fixture(scope="module")
def llm(make_llm: Callable[..., Any], fs_dir: Path) -> Any:
    return make_llm({"cpu_bytes_to_use": 4 * ROW_BYTES, "blocks_per_chunk": 2,
                     "admission_policy": "frequency",
                     "secondary_tiers": [{"type": "fs", "root_dir": str(fs_dir)}]}, dtype="float32")


def test_fs_only_after_reuse_and_one_offs_never_evict_the_hot_prefix(llm: Any, fs_dir: Path) -> None:
    scheduler, _ = connector_halves(llm)
    m = scheduler.manager.metrics.value
    host = scheduler.manager.host
    prompt = tokens(llm, "lighthouse")
    keys = scheduler.hasher.keys(prompt)
    hit = (len(prompt) - 1) // CHUNK * CHUNK

    generate(llm, prompt)  # first sighting: on host probation, nothing to fs
    settle(scheduler)
    assert host.lookup(keys) == len(keys) and all(host.on_probation(k) for k in keys)
    assert fs_files(fs_dir, keys) == []
    assert m("kvtier_rejected_chunks_total", tier="fs", reason="frequency") == len(keys)
    ref = generate(llm, prompt)  # vLLM's own device prefix cache; kvtier counts a second sighting
    assert ref.num_cached_tokens == hit
    settle(scheduler)
    assert not any(host.on_probation(k) for k in keys)  # reused: settled, cascaded once
    assert len(fs_files(fs_dir, keys)) == len(keys)
    assert m("kvtier_transfer_chunks_total", tier="fs", op="store") == len(keys)

    one_offs = 0
    for name in ONE_OFFS:  # 1-2 chunks each, on probation: they push out each other only
        one_offs += len(scheduler.hasher.keys(generate(llm, tokens(llm, name)).prompt_token_ids))
    settle(scheduler)
    assert one_offs > 4 - len(keys)  # more than the host tier's room beside the hot prefix
    assert host.lookup(keys) == len(keys)
    last = scheduler.hasher.keys(tokens(llm, ONE_OFFS[-1]))
    assert host.lookup(last) == len(last) and host.on_probation(last[0])
    assert m("kvtier_probation_chunks_total", tier="host", reason="frequency") == len(keys) + one_offs
    assert m("kvtier_transfer_chunks_total", tier="fs", op="store") == len(keys)  # no one-off
    assert llm.reset_prefix_cache()
    again = generate(llm, prompt)
    assert again.kv_transfer_params["kvtier"]["tokens"]["host"] == hit
    assert again.outputs[0].token_ids == ref.outputs[0].token_ids

    # A request that continues the reused prefix: its new chunks wait on warm probation, and
    # reach the fs tier when a later request reuses them.
    longer = [*prompt[:hit], *tokens(llm, "garden")]
    new = scheduler.hasher.keys(longer)[len(keys):]
    first = generate(llm, longer)
    settle(scheduler)
    assert all(host.on_probation(k) for k in new) and fs_files(fs_dir, new) == []
    assert first.kv_transfer_params["kvtier"]["tokens"]["recomputed"] == len(longer) - hit
    assert llm.reset_prefix_cache()
    second = generate(llm, longer)
    settle(scheduler)
    assert second.kv_transfer_params["kvtier"]["tokens"]["host"] == (len(longer) - 1) // CHUNK * CHUNK
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert len(fs_files(fs_dir, new)) == len(new)
