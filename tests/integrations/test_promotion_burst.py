"""A burst of promotions (real vLLM, CPU, float32): many requests whose prefixes are only in the fs
tier arrive at once, with a host tier far smaller than their prefixes together.

Each request's prefix must go fs → host → device, and the host tier holds an eighth of them: the
prefixes stream through it a batch at a time, each waiting for the rows the others release (a
stream starved of room gives up the rest of its prefix, which is recomputed). Nothing may deadlock
(the burst completes in bounded time), every request gets the answer of a full compute, more comes
back from fs than the host tier holds at once, no host row stays pinned once the tier jobs are done,
and the host tier's invariants hold (`check()`).
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.conftest import BLOCK_SIZE, connector_halves
from tests.integrations.prompts import PROMPTS
from tests.integrations.shared_helpers import settle

pytestmark = pytest.mark.slow

CHUNK = BLOCK_SIZE  # blocks_per_chunk = 1
ROW_BYTES = 30 * 2 * 3 * CHUNK * 64 * 4  # SmolLM2: 30 layers, 3 KV heads, head_dim 64, float32
HOST_SLOTS = 4
TENANTS = ("t1", "t2")  # the same prompts under two salts: twice the distinct prefixes
MAX_TOKENS = 4
BURST_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def llm(make_llm: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    fs_dir: Path = tmp_path_factory.mktemp("fs")
    return make_llm({"cpu_bytes_to_use": HOST_SLOTS * ROW_BYTES,
                     "secondary_tiers": [{"type": "fs", "root_dir": str(fs_dir)}]},
                    dtype="float32", max_num_seqs=16, num_gpu_blocks_override=128)


def _requests(llm: Any) -> list[dict[str, Any]]:
    tokenizer = llm.get_tokenizer()
    out = []
    for tenant in TENANTS:
        for text in PROMPTS.values():
            ids = tokenizer.encode(text)
            out.append({"prompt_token_ids": ids[: (len(ids) - 1) // CHUNK * CHUNK + 1],
                        "cache_salt": tenant})
    return out


def test_a_burst_of_fs_promotions_into_a_small_host_tier(llm: Any) -> None:
    from vllm import SamplingParams

    scheduler, _ = connector_halves(llm)
    manager, metrics = scheduler.manager, scheduler.accounting.metrics
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    requests = _requests(llm)
    chunks = sum((len(r["prompt_token_ids"]) - 1) // CHUNK for r in requests)
    assert chunks >= 8 * HOST_SLOTS
    computed = []
    for request in requests:  # one at a time: each prefix reaches fs before the next evicts it
        computed.append(llm.generate([request], params, use_tqdm=False)[0])
        settle(scheduler)
    fs_loads = metrics.value("kvtier_transfer_chunks_total", tier="fs", op="load")
    assert scheduler.reset_cache() and llm.reset_prefix_cache()  # the prefixes are only in fs now

    outs: list[Any] = []
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            outs.extend(llm.generate(requests, params, use_tqdm=False))
        except BaseException as e:  # the engine's own failure, reported below
            errors.append(e)

    burst = threading.Thread(target=serve, daemon=True)
    start = time.monotonic()
    burst.start()
    burst.join(BURST_TIMEOUT_S)
    assert not burst.is_alive(), f"the burst did not finish in {BURST_TIMEOUT_S} s"
    took = time.monotonic() - start
    assert not errors, traceback.format_exception(errors[0])

    assert [o.outputs[0].token_ids for o in outs] == [c.outputs[0].token_ids for c in computed]
    splits = [o.kv_transfer_params["kvtier"]["tokens"] for o in outs]
    promoted = sum(s["fs"] for s in splits)
    assert promoted > 0, splits
    assert promoted > 2 * HOST_SLOTS * CHUNK, splits  # streamed: more than fits at once
    assert metrics.value("kvtier_transfer_chunks_total", tier="fs", op="load") - fs_loads >= promoted // CHUNK
    settle(scheduler)
    assert manager.host.stats().pinned == 0
    manager.host.check()
    print(f"{len(requests)} requests, {chunks} prefix chunks, host {HOST_SLOTS} slots: "
          f"{promoted // CHUNK} chunks promoted from fs, burst {took:.1f} s")
