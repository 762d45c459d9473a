"""A device prefix-cache hit that ends inside a kvtier chunk, on a real engine (in-process, SmolLM2
float32, chunks of two 32-token engine blocks).

vLLM's device hit is a whole number of engine blocks, so with `blocks_per_chunk` > 1 it often ends
inside a chunk. kvtier then continues from that chunk: it offers the tokens up to the end of the
last chunk it holds, and its load writes every block of those chunks but the ones the device holds
(left unwritten: other requests may be reading them). The answer is the one vLLM's own prefix cache
gives at the same hit length, and every block kvtier wrote holds the bytes it stored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.integrations.conftest import BLOCK_SIZE, connector_halves
from tests.integrations.kv_spy import KVSpy
from tests.integrations.prompts import PROMPTS
from tests.integrations.shared_helpers import settle

pytestmark = pytest.mark.slow

CHUNK = 2 * BLOCK_SIZE


@pytest.fixture(scope="module")
def llm(make_llm: Callable[..., Any]) -> Any:
    return make_llm({"cpu_bytes_to_use": 16 << 20, "blocks_per_chunk": 2}, dtype="float32")


def test_a_device_hit_inside_a_chunk_is_continued_from_the_host_tier(
    llm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm import SamplingParams

    scheduler, worker = connector_halves(llm)
    assert scheduler.geometry.chunk_tokens == CHUNK
    spy = KVSpy(worker, monkeypatch)
    ids: list[int] = llm.get_tokenizer().encode(PROMPTS["lighthouse"] + " " + PROMPTS["bread"])
    prompt = ids[: (len(ids) - 1) // CHUNK * CHUNK + 1]  # the device's hit ends on a chunk boundary
    hit = len(prompt) - 1
    assert hit >= 2 * CHUNK
    params = SamplingParams(temperature=0.0, max_tokens=8)

    def run(tokens: list[int]) -> Any:
        return llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)[0]

    run(prompt)  # computed, stored in the host tier
    device = run(prompt)  # vLLM's own prefix cache, the reference
    assert device.num_cached_tokens == hit
    settle(scheduler)
    assert llm.reset_prefix_cache()
    for tensor in worker.transfer.layer_tensors:
        tensor.fill_(7.0)  # a block the load should have written and did not fails the checks
    run(prompt[: BLOCK_SIZE + 8])  # the device now holds the first engine block only
    loads = scheduler.manager.metrics.value("kvtier_transfer_chunks_total", tier="host", op="load")

    again = run(prompt)

    assert again.num_cached_tokens == hit
    assert again.kv_transfer_params["kvtier"]["tokens"] == {
        "device": BLOCK_SIZE, "host": hit - BLOCK_SIZE, "recomputed": 1}
    assert again.outputs[0].token_ids == device.outputs[0].token_ids
    keys = scheduler.hasher.keys(prompt)
    assert scheduler.manager.metrics.value(
        "kvtier_transfer_chunks_total", tier="host", op="load") - loads == len(keys)
    assert spy.loaded[keys[0]][0] is None  # the block the device held was left alone
    for key in keys:
        written = spy.written(key)
        assert written == spy.stored[key][-len(written):]
