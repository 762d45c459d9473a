"""Real vLLM (CPU backend, in-process) on real SmolLM2 with the KVTierConnector: the reload oracle.

A request whose prefix is reloaded from a kvtier tier after `reset_prefix_cache()` must give the
same greedy tokens as the same request served from vLLM's own device prefix cache at the same hit
length, and the reloaded device KV must be byte-identical to the KV vLLM originally computed.
(A full recompute is not the reference: its matmul shapes differ, so its last bits may too.)

`reset_prefix_cache()` frees the device blocks but leaves their bytes: each reload test then poisons
the whole device KV cache (`poison`), so a load that copied nothing into a block vLLM happens to
reuse cannot pass the byte and output checks; `test_the_oracle_catches_a_load_that_copies_nothing`
shows that it does not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integrations.conftest import BLOCK_SIZE, connector_halves
from tests.integrations.kv_spy import KVSpy
from tests.integrations.prompts import PROMPTS
from tests.integrations.shared_helpers import settle

pytestmark = pytest.mark.slow

CHUNK = BLOCK_SIZE  # blocks_per_chunk = 1
ROW_BYTES = 30 * 2 * 3 * CHUNK * 64 * 2  # SmolLM2: 30 layers, 3 KV heads, head_dim 64, bf16
HOST_SLOTS = 6  # two prompts of 3 chunks


@dataclass(frozen=True)
class Result:
    prompt: list[int]
    tokens: list[int]
    cached: int


@pytest.fixture(scope="module")
def llm(make_llm: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    fs_dir: Path = tmp_path_factory.mktemp("fs")
    return make_llm(
        {
            "cpu_bytes_to_use": HOST_SLOTS * ROW_BYTES,
            "secondary_tiers": [{"type": "fs", "root_dir": str(fs_dir)}],
        }
    )


@pytest.fixture
def spy(llm: Any) -> Iterator[KVSpy]:
    with pytest.MonkeyPatch.context() as mp:
        yield KVSpy(connector_halves(llm)[1], mp)


def generate(llm: Any, prompt: str | list[int], max_tokens: int = 8, skip_load: bool = False) -> Result:
    """Greedy `max_tokens` tokens for a text prompt or a list of token ids, alone in the engine;
    `skip_load`: kvtier loads nothing for it."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": {"kvtier": {"skip_load": True}}} if skip_load else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra)
    request = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    out = llm.generate([request], params, use_tqdm=False)[0]
    return Result(list(out.prompt_token_ids), list(out.outputs[0].token_ids), out.num_cached_tokens)


def host_loads(scheduler: Any) -> float:
    """Chunks copied host → device so far (kvtier's transfer metric)."""
    return scheduler.manager.metrics.value("kvtier_transfer_chunks_total", tier="host", op="load")


def reference(llm: Any, prompt: str) -> tuple[Result, int, list[bytes]]:
    """Serve `prompt` once (computed, stored) and again from vLLM's device prefix cache; return the
    second result, the hit length and the keys of the hit's chunks."""
    scheduler, _ = connector_halves(llm)
    first = generate(llm, prompt)
    ref = generate(llm, prompt)
    hit = (len(first.prompt) - 1) // CHUNK * CHUNK
    assert hit >= 3 * CHUNK
    assert ref.cached == hit
    return ref, hit, scheduler.hasher.keys(first.prompt)[: hit // CHUNK]


POISON = 7.0
"""What `poison` writes in every element of the device KV cache (exact in bf16 and float32)."""


def poison(llm: Any) -> None:
    """Overwrite every block of every layer's device KV with `POISON`. Only between requests (after
    `reset_prefix_cache()`, nothing running): no live block is touched."""
    for tensor in connector_halves(llm)[1].transfer.layer_tensors:
        tensor.fill_(POISON)


def reset_and_poison(llm: Any) -> None:
    assert llm.reset_prefix_cache()
    poison(llm)


def test_reload_from_host_tier_matches_device_prefix_cache(llm: Any, spy: KVSpy) -> None:
    scheduler, _ = connector_halves(llm)
    ref, hit, keys = reference(llm, PROMPTS["lighthouse"])
    assert all(scheduler.manager.host.contains(k) for k in keys)
    loads = host_loads(scheduler)

    reset_and_poison(llm)
    again = generate(llm, PROMPTS["lighthouse"])

    assert again.cached == hit
    assert host_loads(scheduler) - loads == len(keys)
    assert again.tokens == ref.tokens
    for key in keys:
        assert spy.loaded[key] == spy.stored[key]
        assert spy.sync[key]  # on CPU the host tier's loads feed their own step's forward pass
    assert scheduler.manager.host.stats().pinned == 0  # released when the workers reported the copy


def test_reload_from_fs_tier_after_host_eviction(llm: Any, spy: KVSpy) -> None:
    scheduler, _ = connector_halves(llm)
    host, manager = scheduler.manager.host, scheduler.manager
    ref, hit, keys = reference(llm, PROMPTS["bread"])
    for filler in ("library", "birds", "railway"):
        settle(scheduler)
        if not any(host.contains(k) for k in keys):
            break
        generate(llm, PROMPTS[filler], max_tokens=1)
    assert not any(host.contains(k) for k in keys), "the fillers did not evict the prompt"
    settle(scheduler)
    fs_loads = manager.metrics.value("kvtier_transfer_chunks_total", tier="fs", op="load")

    reset_and_poison(llm)
    again = generate(llm, PROMPTS["bread"])

    assert again.cached == hit
    assert manager.metrics.value("kvtier_transfer_chunks_total", tier="fs", op="load") - fs_loads == len(keys)
    settle(scheduler)
    assert host.stats().pinned == 0  # the promotion's hold was released once the request loaded
    assert again.tokens == ref.tokens
    for key in keys:
        assert spy.loaded[key] == spy.stored[key]
        assert spy.sync[key]  # promoted first, then loaded from the host tier alone


def test_decode_chunks_of_one_turn_are_reloaded_in_the_next(llm: Any, spy: KVSpy) -> None:
    scheduler, _ = connector_halves(llm)
    turn1 = generate(llm, PROMPTS["chess"], max_tokens=40)
    history = turn1.prompt + turn1.tokens
    keys = scheduler.hasher.keys(history[: len(history) - 1])  # the last token's KV is not computed
    assert len(keys) * CHUNK > len(turn1.prompt) // CHUNK * CHUNK, "no chunk was filled in decode"
    assert all(scheduler.manager.host.contains(k) for k in keys)
    turn2 = history + llm.get_tokenizer().encode(" Summarise.", add_special_tokens=False)
    hit = (len(turn2) - 1) // CHUNK * CHUNK
    assert hit == len(keys) * CHUNK
    settle(scheduler)
    loads = host_loads(scheduler)

    reset_and_poison(llm)
    again = generate(llm, turn2)
    ref = generate(llm, turn2)  # vLLM's own device prefix cache, same hit length

    assert again.cached == ref.cached == hit
    assert host_loads(scheduler) - loads == len(keys)
    assert again.tokens == ref.tokens
    for key in keys:
        assert spy.loaded[key] == spy.stored[key]


def test_a_batch_mixing_a_reload_and_a_miss(llm: Any) -> None:
    from vllm import SamplingParams

    scheduler, _ = connector_halves(llm)
    _, hit, keys = reference(llm, PROMPTS["birds"])
    settle(scheduler)
    loads = host_loads(scheduler)
    reset_and_poison(llm)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    outs = llm.generate([PROMPTS["birds"], PROMPTS["garden"]], params, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [hit, 0]
    assert host_loads(scheduler) - loads == len(keys)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    garden = scheduler.hasher.keys(list(outs[1].prompt_token_ids))
    settle(scheduler)
    assert all(scheduler.manager.host.contains(k) for k in garden)


def test_the_oracle_catches_a_load_that_copies_nothing(
    llm: Any, spy: KVSpy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host → device copy that reports success but copies nothing (a fault only a patch causes):
    the poisoned blocks fail both the byte check and the output check."""
    scheduler, worker = connector_halves(llm)
    ref, hit, keys = reference(llm, PROMPTS["railway"])
    settle(scheduler)
    reset_and_poison(llm)
    monkeypatch.setattr(worker.transfer, "load", lambda block_ids, slots: True)

    again = generate(llm, PROMPTS["railway"])

    assert again.cached == hit  # vLLM believed the load
    dtype = worker.transfer.layer_tensors[0].dtype
    pattern = torch.full((1,), POISON, dtype=dtype).view(torch.uint8).numpy().tobytes()
    for key in keys:  # the blocks kept the poison: the byte check fails
        assert spy.loaded[key] != spy.stored[key]
        written = b"".join(spy.written(key))
        assert written == pattern * (len(written) // len(pattern))
    assert again.tokens != ref.tokens


def test_a_failed_synchronous_load_is_recomputed(
    llm: Any, spy: KVSpy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A synchronous load whose copy fails (a fault only a patch causes) is reported by block: vLLM
    drops what the step computed for the request and recomputes it, and its output is the output
    computed without kvtier."""
    scheduler, worker = connector_halves(llm)
    prompt = PROMPTS["library"]
    first = generate(llm, prompt)
    keys = scheduler.hasher.keys(first.prompt)[: (len(first.prompt) - 1) // CHUNK]
    settle(scheduler)
    assert keys and all(scheduler.manager.host.contains(k) for k in keys)
    reset_and_poison(llm)
    scratch = generate(llm, prompt, skip_load=True)
    assert scratch.cached == 0
    reset_and_poison(llm)
    failed = scheduler.manager.metrics.value("kvtier_failures_total", tier="host", op="load")
    monkeypatch.setattr(worker.transfer, "load", lambda block_ids, slots: False)

    again = generate(llm, prompt)

    assert all(spy.sync[k] for k in keys)
    assert scheduler.manager.metrics.value("kvtier_failures_total", tier="host", op="load") > failed
    assert again.tokens == scratch.tokens
    settle(scheduler)
    assert scheduler.manager.host.stats().pinned == 0


def test_vllm_keeps_its_hybrid_kv_cache_manager_on(llm: Any) -> None:
    """kvtier supports HMA, so vLLM does not switch it off for kvtier's sake."""
    config = llm.llm_engine.vllm_config
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
