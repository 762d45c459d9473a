"""A burst of 64 promotions (real vLLM, CPU, float32): 64 requests whose prefixes are only in the
fs tier arrive at once, with a host tier a tenth of their prefixes' size.

Sixteen tenants (cache_salt) send the same four short prompts (three 32-token chunks and one more
token each): 64 distinct prefixes, 192 chunks, for a host tier of 19 rows. The first pass computes
every prompt (nothing is cached anywhere yet: the answers of vLLM alone) and fills the fs tier; after
both caches are reset, the 64 requests arrive at once. Nothing may deadlock (no token for
`STALL_S` is a deadlock; a loaded machine only slows the burst), every answer is the first
pass's, more comes back from fs than the host tier holds at once, what was not promoted is
recomputed (and only that: every request's split adds up to its prompt), and once the tier jobs
are done no host row is pinned and the host tier's invariants hold.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.conftest import BLOCK_SIZE, connector_halves
from tests.integrations.prompts import PROMPTS
from tests.integrations.shared_helpers import settle

pytestmark = pytest.mark.slow

CHUNK = BLOCK_SIZE  # blocks_per_chunk = 1
CHUNKS_PER_PROMPT = 3
ROW_BYTES = 30 * 2 * 3 * CHUNK * 64 * 4  # SmolLM2: 30 layers, 3 KV heads, head_dim 64, float32
TENANTS = tuple(f"t{i}" for i in range(16))
TEXTS = tuple(PROMPTS.values())[:4]
REQUESTS = len(TENANTS) * len(TEXTS)
HOST_SLOTS = REQUESTS * CHUNKS_PER_PROMPT // 10
MAX_TOKENS = 3
SEED_BATCH = 4  # 12 chunks a batch: each batch's prefixes reach fs before the next evicts them
STALL_S = 120.0


@pytest.fixture(scope="module")
def llm(make_llm: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    fs_dir: Path = tmp_path_factory.mktemp("fs")
    return make_llm({"cpu_bytes_to_use": HOST_SLOTS * ROW_BYTES,
                     "secondary_tiers": [{"type": "fs", "root_dir": str(fs_dir)}]},
                    dtype="float32", max_num_seqs=REQUESTS, num_gpu_blocks_override=128,
                    kv_cache_memory_bytes=130 * ROW_BYTES)


def _requests(llm: Any) -> list[dict[str, Any]]:
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer.encode(text)[: CHUNKS_PER_PROMPT * CHUNK + 1] for text in TEXTS]
    assert all(len(i) == CHUNKS_PER_PROMPT * CHUNK + 1 for i in ids)
    return [{"prompt_token_ids": i, "cache_salt": tenant} for tenant in TENANTS for i in ids]


def test_64_fs_promotions_at_once_into_a_host_tier_a_tenth_their_size(llm: Any) -> None:
    from vllm import SamplingParams

    scheduler, _ = connector_halves(llm)
    manager, metrics = scheduler.manager, scheduler.accounting.metrics
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    requests = _requests(llm)
    assert len(requests) == 64 and HOST_SLOTS == 19
    computed = []
    for i in range(0, len(requests), SEED_BATCH):
        computed += llm.generate(requests[i:i + SEED_BATCH], params, use_tqdm=False)
        settle(scheduler)
    for out in computed:  # nothing came from kvtier: these are vLLM alone's answers
        split = out.kv_transfer_params["kvtier"]["tokens"]
        assert split["host"] == split["fs"] == 0, split
    fs_loads = metrics.value("kvtier_transfer_chunks_total", tier="fs", op="load")
    assert scheduler.reset_cache() and llm.reset_prefix_cache()  # the prefixes are only in fs now

    engine = llm.llm_engine
    for i, request in enumerate(requests):  # all at once, before the engine takes a step
        engine.add_request(f"burst-{i}", request, params)
    outs: dict[str, Any] = {}
    tokens: dict[str, int] = {}
    start = last_progress = time.monotonic()
    while len(outs) < len(requests):
        for out in engine.step():
            n = len(out.outputs[0].token_ids) if out.outputs else 0
            if n > tokens.get(out.request_id, 0) or out.finished:
                last_progress = time.monotonic()
            tokens[out.request_id] = n
            if out.finished:
                outs[out.request_id] = out
        # A deadlock shows as no token at all for a long while; a loaded machine only slows.
        stalled = time.monotonic() - last_progress
        assert stalled < STALL_S, f"no token for {STALL_S} s, {len(outs)} of 64 finished: deadlock"
    took = time.monotonic() - start
    ordered = [outs[f"burst-{i}"] for i in range(len(requests))]

    assert [o.outputs[0].token_ids for o in ordered] == [c.outputs[0].token_ids for c in computed]
    splits = [o.kv_transfer_params["kvtier"]["tokens"] for o in ordered]
    for request, split in zip(requests, splits, strict=True):
        assert sum(split.values()) == len(request["prompt_token_ids"]), split
        assert split["fs"] % CHUNK == 0 and split["recomputed"] >= 1, split
    promoted = sum(s["fs"] for s in splits)
    assert promoted > 2 * HOST_SLOTS * CHUNK, splits  # streamed through the host tier
    assert metrics.value("kvtier_transfer_chunks_total", tier="fs", op="load") - fs_loads >= promoted // CHUNK
    partial = sum(0 < s["fs"] + s["host"] < CHUNKS_PER_PROMPT * CHUNK for s in splits)
    settle(scheduler)
    assert manager.host.stats().pinned == 0
    manager.host.check()
    print(f"{REQUESTS} requests, host {HOST_SLOTS} slots: {promoted // CHUNK} of "
          f"{REQUESTS * CHUNKS_PER_PROMPT} prefix chunks promoted from fs, {partial} requests partly "
          f"promoted (the rest of their prefix recomputed), burst {took:.1f} s")
