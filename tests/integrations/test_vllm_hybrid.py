"""Real vLLM (CPU backend, in-process) with vLLM's hybrid KV cache manager on, on tiny random-weight
models built locally (`kvtier.tools.tiny_models`, float32):

- ``gemma3``: three sliding-window layers (window 64 = 2 blocks) and one full-attention layer (four
  KV cache groups);
- ``mistral-sliding``: every layer slides (one sliding-window group);
- ``deepseek-v2``: MLA, one latent row of 576 values per token (CPU_MLA: 16-token blocks; vLLM
  turns its own prefix caching off on CPU, so kvtier's reload is the only reuse).

For each: a prompt, `reset_prefix_cache()`, then a longer prompt sharing its prefix reloads that
prefix from the host tier, and from fs after host eviction; the reloaded pages are byte-identical to
the stored ones, sliding-window pages are loaded only for the window before the hit point, and
greedy tokens (and their logprobs within 1e-4; MLA: 2e-3, see `LOGPROB_TOLERANCE`) equal a run
computed from scratch. For gemma3 the
run from scratch is an engine without kvtier, which also shows kvtier leaves the device cache as
many blocks (HMA stays on); for the single-group models it is the same engine with kvtier's load
and store skipped, after a device cache reset.
"""

from __future__ import annotations

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
from tests.integrations.shared_helpers import settle

pytestmark = pytest.mark.slow

TAIL = " Answer in one sentence, then stop."
HOST_TOKENS = 320  # the host tier holds about two and a half prompts
BLOCK = {"gemma3": 32, "mistral-sliding": 32, "deepseek-v2": 16}
SCRATCH = {"kvtier": {"skip_load": True, "skip_store": True}}
LOGPROB_TOLERANCE = {"deepseek-v2": 2e-3}
"""vLLM's MLA attends a prefill whose prefix is cached by up-projecting the cached latents in
context chunks merged by log-sum-exp, a whole prefill in one pass: logprobs differ by up to 8e-4
(measured) with byte-identical latents."""


@dataclass(frozen=True)
class Result:
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    cached: int


@dataclass
class Engine:
    """A kvtier engine on one tiny model, with the runs from scratch of `longer(name)`."""

    name: str
    llm: Any
    reference: dict[str, Result]
    reference_blocks: int | None = None


def options(name: str) -> dict[str, Any]:
    return {
        "enforce_eager": True,
        "block_size": BLOCK[name],
        "dtype": "float32",
        "kv_cache_memory_bytes": 8 << 20,
        "max_model_len": 512,
        "max_num_seqs": 2,
        "seed": 0,
    }


def generate(llm: Any, prompt: str, max_tokens: int = 6, scratch: bool = False) -> Result:
    """Greedy tokens for `prompt`, alone in the engine, with each token's logprob; `scratch`:
    kvtier neither loads nor stores."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": SCRATCH} if scratch else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, extra_args=extra)
    done = llm.generate([prompt], params, use_tqdm=False)[0]
    out = done.outputs[0]
    logprobs = [entry[tok].logprob for tok, entry in zip(out.token_ids, out.logprobs, strict=True)]
    return Result(list(done.prompt_token_ids), list(out.token_ids), logprobs, done.num_cached_tokens)


def num_blocks(llm: Any) -> int:
    return int(llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.num_blocks)


def longer(name: str) -> str:
    return PROMPTS[name] + TAIL


@pytest.fixture(scope="module", params=sorted(BLOCK))
def engine(
    request: pytest.FixtureRequest, vllm_env: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    from vllm import LLM

    from kvtier.tools.tiny_models import build_tiny_model

    name = request.param
    model = str(build_tiny_model(name))
    found = Engine(name, None, {})
    if name == "gemma3":
        # The engine without kvtier runs first and alone: vLLM keeps one KV connector per process.
        plain = LLM(model=model, **options(name))
        found.reference = {p: generate(plain, longer(p)) for p in ("lighthouse", "bread")}
        found.reference_blocks = num_blocks(plain)
        plain.llm_engine.engine_core.shutdown()
    config = {
        "cpu_bytes_to_use": HOST_TOKENS // BLOCK[name] * _row_bytes(model, BLOCK[name]),
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path_factory.mktemp("fs"))}],
    }
    found.llm = LLM(model=model, kv_transfer_config=transfer_config(config), **options(name))
    # vLLM allocates its KV cache uninitialised, and a block's unwritten slots may still hold what
    # an earlier engine of this process left there (NaN patterns included), which CPU MLA reads:
    # start from zeros, as in a fresh process.
    for kv in connector_halves(found.llm)[1].transfer.layer_tensors:
        kv.zero_()
    if not found.reference:
        found.reference = {p: generate(found.llm, longer(p), scratch=True) for p in ("lighthouse", "bread")}
        found.llm.reset_prefix_cache()
    yield found
    found.llm.llm_engine.engine_core.shutdown()


def _row_bytes(model: str, block: int) -> int:
    import json

    config = json.loads((Path(model) / "config.json").read_text())
    if "kv_lora_rank" in config:
        return config["num_hidden_layers"] * block * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4
    layers, heads, dim = config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]
    return layers * 2 * heads * block * dim * 4


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
        """Every reloaded page equals the stored one; the pages of every chunk were loaded, but
        sliding-window pages only for the chunks in the window before the hit point (64 tokens:
        the last two chunks)."""
        for i, key in enumerate(keys):
            in_window = i >= len(keys) - 2
            expected = {layer for layer, kind in enumerate(kinds) if in_window or "sliding" not in kind}
            assert set(self.loaded[key]) == expected, (i, kinds)
            assert set(self.stored[key]) == set(range(len(kinds)))
            for layer in expected:
                assert self.loaded[key][layer] == self.stored[key][layer], (i, layer)


@pytest.fixture
def spy(engine: Engine) -> Iterator[PageSpy]:
    with pytest.MonkeyPatch.context() as mp:
        yield PageSpy(connector_halves(engine.llm)[1], mp)



def loads(scheduler: Any, tier: str) -> float:
    return scheduler.manager.metrics.value("kvtier_transfer_chunks_total", tier=tier, op="load")


def reload_check(engine: Engine, spy: PageSpy, name: str, tier: str, evict: tuple[str, ...] = ()) -> None:
    """Store PROMPTS[name], optionally evict it from the host tier, reset the device prefix cache,
    then serve it with a tail: its prefix must come back from `tier`, exactly."""
    llm = engine.llm
    scheduler, _ = connector_halves(llm)
    first = generate(llm, PROMPTS[name], max_tokens=1)
    chunk = scheduler.geometry.chunk_tokens
    keys = scheduler.hasher.keys(first.prompt)[: (len(first.prompt) - 1) // chunk]
    assert len(keys) >= 3
    settle(scheduler)
    assert all(scheduler.manager.host.contains(k) for k in keys)
    for filler in evict:
        generate(llm, PROMPTS[filler], max_tokens=1)
        settle(scheduler)
    if evict:
        assert not any(scheduler.manager.host.contains(k) for k in keys), "the fillers did not evict"
    before = loads(scheduler, tier)

    llm.reset_prefix_cache()
    again = generate(llm, longer(name))

    assert again.cached == len(keys) * chunk
    assert loads(scheduler, tier) - before == len(keys)
    ref = engine.reference[name]
    assert again.prompt == ref.prompt
    assert again.tokens == ref.tokens
    tolerance = LOGPROB_TOLERANCE.get(engine.name, 1e-4)
    assert max(abs(a - b) for a, b in zip(again.logprobs, ref.logprobs, strict=True)) < tolerance
    spy.check(keys, scheduler.geometry.layout.kinds)


def test_the_device_cache_keeps_as_many_blocks_as_without_kvtier(engine: Engine) -> None:
    config = engine.llm.llm_engine.vllm_config
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
    scheduler = connector_halves(engine.llm)[0]
    kinds, layout = scheduler.geometry.layout.kinds, scheduler.geometry.layout
    if engine.name == "gemma3":
        assert num_blocks(engine.llm) == engine.reference_blocks
        assert kinds == ("sliding_window:64",) * 3 + ("attention",)
    elif engine.name == "mistral-sliding":
        assert kinds == ("sliding_window:64",) * 2
    else:
        assert kinds == ("mla_latent:576",) * 2 and layout.latent
        assert layout.row_bytes == 2 * 16 * 576 * 4  # one latent row per token and layer
        assert config.cache_config.enable_prefix_caching is False  # kvtier is the only reuse


def test_a_longer_prompt_reloads_the_prefix_from_the_host_tier(engine: Engine, spy: PageSpy) -> None:
    reload_check(engine, spy, "lighthouse", "host")


def test_a_longer_prompt_reloads_the_prefix_from_fs_after_host_eviction(engine: Engine, spy: PageSpy) -> None:
    reload_check(engine, spy, "bread", "fs", evict=("library", "birds", "railway"))
