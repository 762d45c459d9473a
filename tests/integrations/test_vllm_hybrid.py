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

from kvtier.integrations.vllm.serving.launch import transfer_config
from tests.integrations.conftest import connector_halves
from tests.integrations.prompts import PROMPTS
from tests.integrations.reload_helpers import TAIL, Result, Spy, generate, reload_check

pytestmark = pytest.mark.slow

HOST_TOKENS = 320  # the host tier holds about two and a half prompts
BLOCK = {"gemma3": 32, "mistral-sliding": 32, "deepseek-v2": 16}
LOGPROB_TOLERANCE = {"deepseek-v2": 2e-3}
MLA_BACKEND = {"deepseek-v2": {"attention_backend": "CPU_MLA"}}
"""On a CPU with AMX tiles vLLM picks its AMX_MLA backend, which takes bf16 weights only; these
float32 models name the reference CPU_MLA backend, which every x86 CPU runs."""
"""vLLM's MLA attends a prefill whose prefix is cached by up-projecting the cached latents in
context chunks merged by log-sum-exp, a whole prefill in one pass: logprobs differ by up to 8e-4
(measured) with byte-identical latents."""


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
        **MLA_BACKEND.get(name, {}),
    }


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


@pytest.fixture
def spy(engine: Engine) -> Iterator[Spy]:
    with pytest.MonkeyPatch.context() as mp:
        yield Spy(connector_halves(engine.llm)[1], mp)


def check(engine: Engine, spy: Spy, name: str, tier: str, evict: tuple[str, ...] = ()) -> None:
    """PROMPTS[name]'s prefix comes back from `tier` (after `evict`'s prompts), exactly."""
    reload_check(engine.llm, spy, PROMPTS[name], engine.reference[name], tier,
                 fillers=tuple(PROMPTS[f] for f in evict), tolerance=LOGPROB_TOLERANCE.get(engine.name, 1e-4))


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


def test_a_longer_prompt_reloads_the_prefix_from_the_host_tier(engine: Engine, spy: Spy) -> None:
    check(engine, spy, "lighthouse", "host")


def test_a_longer_prompt_reloads_the_prefix_from_fs_after_host_eviction(engine: Engine, spy: Spy) -> None:
    check(engine, spy, "bread", "fs", evict=("library", "birds", "railway"))
