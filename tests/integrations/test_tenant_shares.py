"""Tenant shares (`tenants`) on a real vLLM engine (CPU, float32, in-process): a tenant's working
set within its share survives another tenant's flood of one-off prompts at three times the host
tier, reloads from the host tier with the output of vLLM's own device prefix cache, and the
per-tenant metrics count it under the config's label. The same flood without shares, and the
eviction order itself, are covered through the planner (`tests/engine/test_planner_tenants.py`)
and the host tier (`tests/host/test_host_tenants.py`)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from tests.integrations.conftest import BLOCK_SIZE, connector_halves
from tests.integrations.shared_helpers import settle

pytestmark = pytest.mark.slow

ROW_BYTES = 30 * 2 * 3 * BLOCK_SIZE * 64 * 4  # SmolLM2: 30 layers, 3 KV heads, head_dim 64, float32
HOST_SLOTS = 8
SHARES = {"alice": 0.5, "bob": 0.375, "default": 0.0625}  # caps of 4, 3 and 0.5 rows: sum 1
WORKING_CHUNKS = 3
FLOOD = 8  # one-off prompts of 3 chunks: 24 chunks, 3 times the host tier


def prompt(rng: random.Random) -> list[int]:
    """`WORKING_CHUNKS` whole chunks of random token ids and one more token."""
    return [rng.randrange(1000, 40000) for _ in range(WORKING_CHUNKS * BLOCK_SIZE + 1)]


def salted(llm: Any, ids: list[int], salt: str) -> Any:
    """`ids` served for tenant `salt` (greedy, 4 tokens); then its tier jobs finish."""
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids, "cache_salt": salt}],
                       SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    settle(connector_halves(llm)[0])
    return out


def test_a_working_set_within_its_share_reloads_from_host_after_a_flood(
        make_llm: Callable[..., Any]) -> None:
    llm = make_llm({"cpu_bytes_to_use": HOST_SLOTS * ROW_BYTES, "tenants": SHARES}, dtype="float32")
    metrics = connector_halves(llm)[0].accounting.metrics
    rng = random.Random(0)
    working = prompt(rng)
    hit = WORKING_CHUNKS * BLOCK_SIZE
    salted(llm, working, "alice")
    ref = salted(llm, working, "alice")  # vLLM's own device prefix cache, at the host hit's length
    assert ref.num_cached_tokens == hit

    for _ in range(FLOOD):
        salted(llm, prompt(rng), "bob")
    assert llm.reset_prefix_cache()  # the device cache would serve alice: out of the way
    again = salted(llm, working, "alice")

    assert again.kv_transfer_params["kvtier"]["tokens"] == {
        "device": 0, "host": hit, "recomputed": len(working) - hit}
    assert again.outputs[0].token_ids == ref.outputs[0].token_ids
    assert metrics.value("kvtier_tenant_prompt_tokens_total", tenant="t1", source="host") == hit
    assert metrics.value("kvtier_tenant_prompt_tokens_total", tenant="t2", source="host") == 0
    held = {t: metrics.value("kvtier_tenant_bytes", tenant=t, tier="host") for t in ("t1", "t2")}
    assert held == {"t1": WORKING_CHUNKS * ROW_BYTES, "t2": (HOST_SLOTS - WORKING_CHUNKS) * ROW_BYTES}
