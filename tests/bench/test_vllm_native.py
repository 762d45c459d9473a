"""vLLM's own tiering on the CPU backend through our shim (`benchmarks/baselines/vllm_native.py`),
in process on real SmolLM2: a prompt reloaded through vLLM's OffloadingConnector gives the same
greedy tokens as the same prompt served from vLLM's device prefix cache (the engine without
offloading) at the same hit length, from its host tier and, once the host tier has evicted it,
from its fs tier (a promotion). A full recompute is not the reference: its matmul shapes differ.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.multiturn import configs, scrape
from kvtier.integrations.vllm.serving.launch import in_process_env
from tests.integrations.prompts import PROMPTS

pytestmark = pytest.mark.slow

BLOCK_SIZE = 32
CHUNK_BYTES = 30 * 2 * 3 * 64 * 4 * BLOCK_SIZE  # SmolLM2 float32: 30 layers, K and V, 3 heads x 64
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"


@pytest.fixture(scope="module")
def vllm_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with in_process_env(tmp_path_factory.mktemp("vllm")) as tmp:
        yield tmp


def _llm(host_chunks: int, fs_dir: Path | None) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvtier.tools.models import prepare_smollm2

    extra: dict[str, Any] = {**configs.NATIVE_SPEC, "cpu_bytes_to_use": host_chunks * CHUNK_BYTES}
    if fs_dir is not None:
        extra["secondary_tiers"] = [{"type": "fs", "root_dir": str(fs_dir)}]
    transfer = KVTransferConfig(**configs.native_connector_config(extra))
    return LLM(model=str(prepare_smollm2(quiet=True)), dtype="float32", enforce_eager=True,
               block_size=BLOCK_SIZE, num_gpu_blocks_override=64, kv_cache_memory_bytes=65 * CHUNK_BYTES,
               max_model_len=1024, max_num_seqs=4, seed=0, disable_log_stats=False,
               kv_transfer_config=transfer)


def _ask(llm: Any, text: str) -> tuple[list[int], int]:
    from vllm import SamplingParams

    out = llm.generate([text], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                       use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def _cached_by_source() -> dict[str, float]:
    """vLLM's cached prompt tokens by source so far (the engine runs in this process: its counters
    are in this process's registry)."""
    from prometheus_client import REGISTRY, generate_latest

    return scrape.by_label(scrape.parse(generate_latest(REGISTRY).decode()), CACHED_BY_SOURCE, "source")


def _reload_matches_device_hit(llm: Any, text: str, evict: list[str]) -> dict[str, float]:
    """Serve `text`, then again (device prefix cache), then the `evict` prompts, clear the device
    cache and serve `text` a third time (reloaded); the third equals the second. The counters'
    change over the reload, by source."""
    _ask(llm, text)
    device_tokens, device_hit = _ask(llm, text)
    assert device_hit > 0
    for other in evict:
        _ask(llm, other)
    before = _cached_by_source()
    assert llm.reset_prefix_cache()
    reload_tokens, reload_hit = _ask(llm, text)
    after = _cached_by_source()
    assert reload_hit == device_hit
    assert reload_tokens == device_tokens
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def test_host_tier_reload_gives_the_device_hit_tokens(vllm_tmp: Path) -> None:
    llm = _llm(64, None)
    try:
        moved = _reload_matches_device_hit(llm, PROMPTS["lighthouse"], [])
        assert moved.get("host", 0) > 0 and moved.get("device", 0) == 0
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_fs_tier_reload_after_host_eviction_gives_the_device_hit_tokens(vllm_tmp: Path) -> None:
    llm = _llm(8, vllm_tmp / "fs")
    try:
        evict = [PROMPTS[name] for name in ("bread", "library", "birds", "railway")]
        moved = _reload_matches_device_hit(llm, PROMPTS["lighthouse"], evict)
        assert moved.get("disk", 0) > 0
    finally:
        llm.llm_engine.engine_core.shutdown()
