"""Bursts of promotions (real vLLM, CPU, float32): many requests whose prefixes are only in the fs
tier arrive at once, with a host tier far smaller than their prefixes together.

Each request's prefix must go fs → host → device, and the host tier holds a tenth to an eighth of
them: the prefixes stream through it a batch at a time, each waiting for the rows the others
release (a stream starved of room gives up the rest of its prefix, which is recomputed). Two
shapes: two tenants (cache_salt) sending every prompt whole (14 requests) into 4 host rows, and
sixteen tenants sending four prompts of three chunks (64 requests, 192 chunks) into 19.

A first pass computes every prompt (nothing is cached anywhere yet: the answers of vLLM alone) and
fills the fs tier; after both caches are reset, every request is added before the engine takes a
step. Nothing may deadlock (no token for `STALL_S` is a deadlock; a loaded machine only slows the
burst), every answer is the first pass's, more comes back from fs than the host tier holds at once,
what was not promoted is recomputed (and only that: every request's split adds up to its prompt),
and once the tier jobs are done no host row is pinned and the host tier's invariants hold
(`check()`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.conftest import BLOCK_SIZE, connector_halves, running_llm
from tests.integrations.prompts import PROMPTS
from tests.integrations.shared_helpers import settle

pytestmark = pytest.mark.slow

CHUNK = BLOCK_SIZE  # blocks_per_chunk = 1
ROW_BYTES = 30 * 2 * 3 * CHUNK * 64 * 4  # SmolLM2: 30 layers, 3 KV heads, head_dim 64, float32
STALL_S = 120.0


@dataclass(frozen=True)
class Burst:
    """One shape of burst: `tenants` salts times the first `prompts` prompts, each cut to
    `chunks_per_prompt` chunks (None: all its whole chunks) plus one token."""

    name: str
    tenants: int
    prompts: int
    chunks_per_prompt: int | None
    host_slots: int
    max_tokens: int
    seed_batch: int
    """Requests computed at once in the first pass: each batch's prefixes reach fs before the next
    evicts them from the host tier."""
    engine: dict[str, Any]


BURSTS = (
    Burst("2-tenants", tenants=2, prompts=len(PROMPTS), chunks_per_prompt=None, host_slots=4,
          max_tokens=4, seed_batch=1, engine={"max_num_seqs": 16, "num_gpu_blocks_override": 128}),
    Burst("64-requests", tenants=16, prompts=4, chunks_per_prompt=3, host_slots=19, max_tokens=3,
          seed_batch=4, engine={"max_num_seqs": 64, "num_gpu_blocks_override": 128,
                                "kv_cache_memory_bytes": 130 * ROW_BYTES}),
)


@pytest.fixture(scope="module", params=BURSTS, ids=[b.name for b in BURSTS])
def burst_llm(request: pytest.FixtureRequest, vllm_env: Path,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Burst, Any]]:
    """The burst's shape and its engine, the only one up while its test runs."""
    burst: Burst = request.param
    fs_dir = tmp_path_factory.mktemp("fs")
    with running_llm({"cpu_bytes_to_use": burst.host_slots * ROW_BYTES,
                      "secondary_tiers": [{"type": "fs", "root_dir": str(fs_dir)}]},
                     dtype="float32", **burst.engine) as llm:
        yield burst, llm


def burst_requests(burst: Burst, llm: Any) -> list[dict[str, Any]]:
    tokenizer = llm.get_tokenizer()
    prompts = []
    for text in list(PROMPTS.values())[: burst.prompts]:
        ids = tokenizer.encode(text)
        chunks = (len(ids) - 1) // CHUNK if burst.chunks_per_prompt is None else burst.chunks_per_prompt
        assert len(ids) > chunks * CHUNK
        prompts.append(ids[: chunks * CHUNK + 1])
    return [{"prompt_token_ids": ids, "cache_salt": f"t{t}"}
            for t in range(burst.tenants) for ids in prompts]


def run_at_once(llm: Any, requests: list[dict[str, Any]], params: Any) -> list[Any]:
    """Add every request before the engine takes a step, then step until all finished; fails the
    test when no request gets a token for `STALL_S` (a deadlock)."""
    engine = llm.llm_engine
    for i, request in enumerate(requests):
        engine.add_request(f"burst-{i}", request, params)
    outs: dict[str, Any] = {}
    tokens: dict[str, int] = {}
    deadline = time.monotonic() + STALL_S
    while len(outs) < len(requests):
        for out in engine.step():
            n = len(out.outputs[0].token_ids) if out.outputs else 0
            if n > tokens.get(out.request_id, 0) or out.finished:
                deadline = time.monotonic() + STALL_S
            tokens[out.request_id] = n
            if out.finished:
                outs[out.request_id] = out
        assert time.monotonic() < deadline, (
            f"no token for {STALL_S} s, {len(outs)} of {len(requests)} finished: a deadlock")
    return [outs[f"burst-{i}"] for i in range(len(requests))]


def test_a_burst_of_fs_promotions_into_a_small_host_tier(burst_llm: tuple[Burst, Any]) -> None:
    from vllm import SamplingParams

    burst, llm = burst_llm
    scheduler, _ = connector_halves(llm)
    manager, metrics = scheduler.manager, scheduler.accounting.metrics
    params = SamplingParams(temperature=0.0, max_tokens=burst.max_tokens)
    requests = burst_requests(burst, llm)
    chunks = sum((len(r["prompt_token_ids"]) - 1) // CHUNK for r in requests)
    assert chunks >= 8 * burst.host_slots
    computed = []
    for i in range(0, len(requests), burst.seed_batch):
        computed += llm.generate(requests[i : i + burst.seed_batch], params, use_tqdm=False)
        settle(scheduler)
    for out in computed:  # nothing came from kvtier: these are vLLM alone's answers
        split = out.kv_transfer_params["kvtier"]["tokens"]
        assert split["host"] == split["fs"] == 0, split
    fs_loads = metrics.value("kvtier_transfer_chunks_total", tier="fs", op="load")
    assert scheduler.reset_cache() and llm.reset_prefix_cache()  # the prefixes are only in fs now

    outs = run_at_once(llm, requests, params)

    assert [o.outputs[0].token_ids for o in outs] == [c.outputs[0].token_ids for c in computed]
    splits = [o.kv_transfer_params["kvtier"]["tokens"] for o in outs]
    for request, split in zip(requests, splits, strict=True):
        assert sum(split.values()) == len(request["prompt_token_ids"]), split
        assert split["fs"] % CHUNK == 0 and split["recomputed"] >= 1, split
    promoted = sum(s["fs"] for s in splits)
    assert promoted > 2 * burst.host_slots * CHUNK, splits  # streamed: more than fits at once
    loads = metrics.value("kvtier_transfer_chunks_total", tier="fs", op="load") - fs_loads
    assert loads >= promoted // CHUNK
    settle(scheduler)
    assert manager.host.stats().pinned == 0
    manager.host.check()
    partial = sum(0 < s["fs"] + s["host"] < len(r["prompt_token_ids"]) - 1
                  for r, s in zip(requests, splits, strict=True))
    print(f"{len(requests)} requests, {chunks} prefix chunks, host {burst.host_slots} slots: "
          f"{promoted // CHUNK} chunks promoted from fs, {partial} requests partly promoted (the "
          f"rest of their prefix recomputed)")
