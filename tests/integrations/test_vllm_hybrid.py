"""Real vLLM (CPU backend, in-process) with vLLM's hybrid KV cache manager on, on tiny random-weight
sliding-window models built locally (`kvtier.tools.tiny_models`, float32, window 64 = 2 blocks):

- ``gemma3``: three sliding-window layers and one full-attention layer (four KV cache groups);
- ``mistral-sliding``: every layer slides (one sliding-window group).

For each: kvtier leaves the device cache as many blocks as vLLM has without it (HMA stays on); a
prompt, `reset_prefix_cache()`, then a longer prompt sharing its prefix reloads that prefix from
the host tier, and from fs after host eviction; the reloaded pages are byte-identical to the stored
ones, sliding-window pages are loaded only for the window before the hit point, and greedy tokens
(and their logprobs within 1e-4) equal a run computed from scratch by an engine without kvtier.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.integrations.vllm.launch import transfer_config
from kvtier.layout import SKIP_BLOCK
from tests.integrations.conftest import connector_halves
from tests.integrations.prompts import PROMPTS

pytestmark = pytest.mark.slow

BLOCK = 32
HOST_SLOTS = 10
TAIL = " Answer in one sentence, then stop."
OPTIONS: dict[str, Any] = {
    "enforce_eager": True,
    "block_size": BLOCK,
    "dtype": "float32",
    "kv_cache_memory_bytes": 8 << 20,
    "max_model_len": 512,
    "max_num_seqs": 2,
    "seed": 0,
}


@dataclass(frozen=True)
class Result:
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    cached: int


@dataclass
class Engine:
    """A kvtier engine on one tiny model, with what an engine without kvtier computed."""

    name: str
    llm: Any
    reference_blocks: int
    reference: dict[str, Result]


def generate(llm: Any, prompt: str, max_tokens: int = 6) -> Result:
    """Greedy tokens for `prompt`, alone in the engine, with each token's logprob."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)
    done = llm.generate([prompt], params, use_tqdm=False)[0]
    out = done.outputs[0]
    logprobs = [entry[tok].logprob for tok, entry in zip(out.token_ids, out.logprobs, strict=True)]
    return Result(list(done.prompt_token_ids), list(out.token_ids), logprobs, done.num_cached_tokens)


def num_blocks(llm: Any) -> int:
    return int(llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.num_blocks)


def longer(name: str) -> str:
    return PROMPTS[name] + TAIL


@pytest.fixture(scope="module", params=["gemma3", "mistral-sliding"])
def engine(
    request: pytest.FixtureRequest, vllm_env: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    from vllm import LLM

    from kvtier.tools.tiny_models import build_tiny_model

    model = str(build_tiny_model(request.param))
    # The reference engine runs first and alone: vLLM keeps one KV connector per process.
    plain = LLM(model=model, enable_prefix_caching=False, **OPTIONS)
    reference = {p: generate(plain, longer(p)) for p in ("lighthouse", "bread")}
    reference_blocks = num_blocks(plain)
    plain.llm_engine.engine_core.shutdown()
    row_bytes = _row_bytes(model)
    config = {
        "cpu_bytes_to_use": HOST_SLOTS * row_bytes,
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path_factory.mktemp("fs"))}],
    }
    llm = LLM(model=model, kv_transfer_config=transfer_config(config), **OPTIONS)
    yield Engine(request.param, llm, reference_blocks, reference)
    llm.llm_engine.engine_core.shutdown()


def _row_bytes(model: str) -> int:
    import json

    config = json.loads((Path(model) / "config.json").read_text())
    layers, heads, dim = config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]
    return layers * 2 * heads * BLOCK * dim * 4


class PageSpy:
    """Each layer's device bytes of each chunk (by key) when the worker stores it and after it
    loads it; a load records only the layers whose group holds blocks for the chunk."""

    def __init__(self, worker: Any, mp: pytest.MonkeyPatch) -> None:
        self.stored: dict[bytes, dict[int, bytes]] = {}
        self.loaded: dict[bytes, dict[int, bytes]] = {}
        plan, tensors = worker.transfer.plan, worker.transfer.layer_tensors
        bpc = plan.blocks_per_chunk
        save, start_load = worker.save, worker.start_load

        def pages(ids: tuple[int, ...]) -> dict[int, bytes]:
            out = {}
            for layer, kv in enumerate(tensors):
                group = plan.layer_groups[layer]
                blocks = list(ids[group * bpc : (group + 1) * bpc])
                if SKIP_BLOCK not in blocks:
                    out[layer] = kv[blocks].contiguous().view(torch.uint8).numpy().tobytes()
            return out

        def spy_save(meta: Any) -> None:
            for job in meta.stores:
                for key, ids in zip(job.keys, job.block_ids, strict=True):
                    self.stored[key] = pages(ids)
            save(meta)

        def spy_load(meta: Any) -> None:
            start_load(meta)
            for job in meta.loads:
                for key, ids in zip(job.keys, job.block_ids, strict=True):
                    self.loaded[key] = pages(ids)

        mp.setattr(worker, "save", spy_save)
        mp.setattr(worker, "start_load", spy_load)

    def check(self, keys: list[bytes], kinds: tuple[str, ...]) -> None:
        """Every reloaded page equals the stored one; full-attention pages of every chunk and
        sliding-window pages of the chunks in the window before the hit point (64 tokens: the
        last two) were loaded, no other."""
        for i, key in enumerate(keys):
            in_window = i >= len(keys) - 2
            expected = {layer for layer, kind in enumerate(kinds) if in_window or kind == "attention"}
            assert set(self.loaded[key]) == expected, (i, kinds)
            assert set(self.stored[key]) == set(range(len(kinds)))
            for layer in expected:
                assert self.loaded[key][layer] == self.stored[key][layer], (i, layer)


@pytest.fixture
def spy(engine: Engine) -> Iterator[PageSpy]:
    with pytest.MonkeyPatch.context() as mp:
        yield PageSpy(connector_halves(engine.llm)[1], mp)


def settle(scheduler: Any, timeout_s: float = 20.0) -> None:
    """Wait until every cascade and promotion finished."""
    deadline = time.monotonic() + timeout_s
    while scheduler.manager.in_flight:
        assert time.monotonic() < deadline, "tier jobs did not finish"
        time.sleep(0.02)
        scheduler.manager.poll()


def loads(scheduler: Any, tier: str) -> float:
    return scheduler.manager.metrics.value("kvtier_transfer_chunks_total", tier=tier, op="load")


def reload_check(engine: Engine, spy: PageSpy, name: str, tier: str, evict: tuple[str, ...] = ()) -> None:
    """Store PROMPTS[name], optionally evict it from the host tier, reset the device prefix cache,
    then serve it with a tail: its prefix must come back from `tier`, exactly."""
    llm = engine.llm
    scheduler, _ = connector_halves(llm)
    first = generate(llm, PROMPTS[name], max_tokens=1)
    keys = scheduler.hasher.keys(first.prompt)[: (len(first.prompt) - 1) // BLOCK]
    assert len(keys) >= 3
    settle(scheduler)
    assert all(scheduler.manager.host.contains(k) for k in keys)
    for filler in evict:
        generate(llm, PROMPTS[filler], max_tokens=1)
        settle(scheduler)
    if evict:
        assert not any(scheduler.manager.host.contains(k) for k in keys), "the fillers did not evict"
    before = loads(scheduler, tier)

    assert llm.reset_prefix_cache()
    again = generate(llm, longer(name))

    assert again.cached == len(keys) * BLOCK
    assert loads(scheduler, tier) - before == len(keys)
    ref = engine.reference[name]
    assert again.prompt == ref.prompt
    assert again.tokens == ref.tokens
    assert max(abs(a - b) for a, b in zip(again.logprobs, ref.logprobs, strict=True)) < 1e-4
    spy.check(keys, scheduler.geometry.layout.kinds)


def test_the_device_cache_keeps_as_many_blocks_as_without_kvtier(engine: Engine) -> None:
    assert engine.llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert num_blocks(engine.llm) == engine.reference_blocks
    kinds = connector_halves(engine.llm)[0].geometry.layout.kinds
    assert "sliding_window:64" in kinds
    assert ("attention" in kinds) == (engine.name == "gemma3")


def test_a_longer_prompt_reloads_the_prefix_from_the_host_tier(engine: Engine, spy: PageSpy) -> None:
    reload_check(engine, spy, "lighthouse", "host")


def test_a_longer_prompt_reloads_the_prefix_from_fs_after_host_eviction(engine: Engine, spy: PageSpy) -> None:
    reload_check(engine, spy, "bread", "fs", evict=("library", "birds", "railway"))
