"""vLLM's own OffloadingConnector configs loaded by vLLM directly: `kv_transfer_config` naming
KVTierConnector with the seeds' extra config as written. The connector maps it with the one mapping
`kvtier serve` uses, logging a line per key mapped or ignored (at INFO on vLLM's own logger) and a
warning where vLLM's `block_size` is below the engine's block; it then checks its host tier
against the machine's memory (the engine's device cache as vLLM sized it, the weights, the
reserve) before it builds anything. Fast tests drive `read_config` and `engine_plan` with stand-in
configs; one slow test starts a real engine with the second seed's config (CPU backend).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.errors import ConfigError
from kvtier.host.budget import GIB
from kvtier.integrations.vllm.connector import EXTRA, read_config, settings_log
from kvtier.integrations.vllm.host_memory import engine_plan
from tests.host.helpers import machine_of
from tests.integrations.conftest import BLOCK_SIZE, connector_halves
from tests.integrations.prompts import PROMPTS
from tests.integrations.seed_configs import MULTI_TIER, TIERING, extra
from tests.integrations.shared_helpers import settle

HEAD = f"kvtier: {EXTRA} (vLLM OffloadingConnector config -> KVTierConnector): "


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.LogCaptureFixture]:
    """`caplog`, listening on the connector's settings logger itself (a child of vLLM's logger,
    which does not propagate to the root logger `caplog` listens on once vLLM set up logging)."""
    monkeypatch.setattr(settings_log, "propagate", False)
    settings_log.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger=settings_log.name)
    try:
        yield caplog
    finally:
        settings_log.removeHandler(caplog.handler)


def said(logged: pytest.LogCaptureFixture, level: int) -> list[str]:
    """The settings lines logged at `level`, the mapping's head cut off."""
    return [r.getMessage().removeprefix(HEAD) for r in logged.records
            if r.name == settings_log.name and r.levelno == level]


def test_first_seed_maps_with_a_line_per_key(logged: pytest.LogCaptureFixture) -> None:
    config = read_config(extra(TIERING), 128, announce=True)
    assert config.cpu_bytes_to_use == 107374182400 and config.blocks_per_chunk == 1
    [fs] = config.secondary_tiers
    assert (fs.type, fs.options) == ("fs", {"root_dir": "/mnt/kv-cache"})
    assert said(logged, logging.INFO) == [
        "spec_name TieringOffloadingSpec -> KVTierConnector", "cpu_bytes_to_use kept",
        "secondary_tiers[0] fs -> fs (root_dir kept)"]
    assert said(logged, logging.WARNING) == []


@pytest.mark.parametrize(("engine_block", "warned"), [(32, True), (128, True), (16, False)])
def test_second_seeds_block_size_16_is_one_engine_block(
    logged: pytest.LogCaptureFixture, engine_block: int, warned: bool
) -> None:
    """16 tokens: below the CPU backend's blocks (32 and up), one engine block per chunk with a
    warning naming both sizes; on CUDA's 16-token blocks, exactly one block, no warning."""
    config = read_config(extra(MULTI_TIER), engine_block, announce=True)
    assert config.blocks_per_chunk == 1 and config.eviction_policy == "lru"
    [fs] = config.secondary_tiers
    assert fs.options == {"root_dir": "/mnt/kv_cache", "n_read_threads": 32, "n_write_threads": 16}
    assert said(logged, logging.INFO) == [
        "spec_name TieringOffloadingSpec -> KVTierConnector",
        f"block_size 16 -> blocks_per_chunk 1 (engine blocks of {engine_block} tokens)",
        "cpu_bytes_to_use kept", "eviction_policy kept",
        "secondary_tiers[0] fs -> fs (root_dir, n_read_threads, n_write_threads kept)"]
    warnings = said(logged, logging.WARNING)
    assert warnings == ([f"kvtier: warning: block_size 16 is below the engine's block of "
                         f"{engine_block} tokens: a chunk is one engine block ({engine_block} "
                         "tokens), the smallest unit kvtier moves"] if warned else [])


def test_block_sizes_above_the_engines_map_to_multiples_or_are_refused() -> None:
    seed = {**extra(MULTI_TIER), "block_size": 96}
    assert read_config(seed, 32, announce=False).blocks_per_chunk == 3
    with pytest.raises(ConfigError) as e:
        read_config({**seed, "block_size": 48}, 32, announce=False)
    assert e.value.key == "block_size" and e.value.value == 48
    assert "48 tokens is not a multiple of the engine's block size, 32 tokens" in str(e.value)


def test_kvtiers_own_config_is_read_as_it_is_and_its_keys_survive_a_vllm_one(
    logged: pytest.LogCaptureFixture,
) -> None:
    own = {"cpu_bytes_to_use": 1 << 20, "admission_policy": "frequency"}
    assert read_config(own, 32, announce=True).admission_policy == ("frequency",)
    assert logged.records == []
    mixed = {**own, "spec_name": "CPUOffloadingSpec", "store_threshold": 2}
    config = read_config(mixed, 32, announce=True)
    assert config.admission_policy == ("frequency",)
    assert said(logged, logging.INFO)[-2:] == ["admission_policy kept", "store_threshold ignored"]


def engine(device: str, tensors: list[int], *, tp: int = 1, offload_gb: float = 0.0,
           model: str = "org/model") -> tuple[Any, Any]:
    """Stand-ins for the `VllmConfig` and `KVCacheConfig` a connector is built with."""
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        device_config=SimpleNamespace(device_type=device),
        offload_config=SimpleNamespace(uva=SimpleNamespace(cpu_offload_gb=offload_gb)),
        model_config=SimpleNamespace(model=model))
    return vllm_config, SimpleNamespace(kv_cache_tensors=[SimpleNamespace(size=s) for s in tensors])


def test_the_connector_refuses_the_first_seeds_host_tier_on_a_cpu_machine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The device cache is what vLLM allocated (per worker, times TP); weight files count twice."""
    machine_of(monkeypatch, tmp_path, 24 * GIB)
    (tmp_path / "model.safetensors").write_bytes(b"\0" * (1 << 20))
    seed = read_config(extra(TIERING), 128, announce=False)
    plan = engine_plan(*engine("cpu", [GIB // 2, GIB // 2], tp=2, model=str(tmp_path)),
                       seed.cpu_bytes_to_use, seed.os_reserve_bytes)
    with pytest.raises(ConfigError) as e:
        plan.check("cpu_bytes_to_use", seed.cpu_bytes_to_use)
    assert ("cpu_bytes_to_use = 107374182400 is invalid: the host tier over-commits this machine's "
            "memory: MemTotal 24.00 GiB - vLLM's device KV cache 2.00 GiB - weights and processes "
            "2.00 GiB - host tier 100.00 GiB = -80.00 GiB left, under the 2.40 GiB") in str(e.value)
    assert plan.needs[1] == ("weights and processes", 2 * GIB + 2 * (1 << 20))
    fits = engine_plan(*engine("cpu", [GIB], model=str(tmp_path)), 8 * GIB, None)
    fits.check("cpu_bytes_to_use", 8 * GIB)


def test_on_a_gpu_only_offloaded_weights_and_the_processes_take_host_memory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    machine_of(monkeypatch, tmp_path, 24 * GIB)
    plan = engine_plan(*engine("cuda", [40 * GIB], tp=2, offload_gb=4.0), 10 * GIB, GIB)
    assert plan.needs == (("vLLM's processes", 2 * GIB),
                          ("weights offloaded by --cpu-offload-gb", 8 * GIB))
    plan.check("cpu_bytes_to_use", 10 * GIB)
    over = engine_plan(*engine("cuda", [40 * GIB], tp=2, offload_gb=4.0), 13 * GIB + 1, GIB)
    with pytest.raises(ConfigError, match=r"= 1\.00 GiB left, under the 1\.00 GiB"):
        over.check("cpu_bytes_to_use", 13 * GIB + 1)


@pytest.mark.slow
def test_second_seeds_config_runs_an_engine_loaded_by_vllm_directly(
    make_llm: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second seed's extra config given to vLLM as KVTierConnector's own, on the CPU backend
    (engine blocks of 32 tokens): its `block_size` 16 becomes one engine block per chunk, with the
    warning; its fs tier, thread counts as written, brings a prompt back once the host copy and the
    device cache are gone, with the answer vLLM's own prefix cache gave. Changed from the seed:
    `cpu_bytes_to_use` (10 GiB, a region pre-touched at start, is 16 MiB on a shared test machine)
    and `root_dir` (/mnt/kv_cache is a temp dir). The settings lines are read as the logger that puts
    them in vLLM's own log output handles them: an engine's start may set up vLLM's logging again,
    which drops the handlers of vLLM's loggers (`logged`'s among them), and vLLM's own handlers write
    to the stream they found then, in a test session an earlier test's captured output."""
    from vllm import SamplingParams

    seed = extra(MULTI_TIER)
    seed["cpu_bytes_to_use"] = 16 << 20
    seed["secondary_tiers"][0]["root_dir"] = str(tmp_path / "kv_cache")
    records: list[logging.LogRecord] = []
    handle = settings_log.handle

    def keep(record: logging.LogRecord) -> None:
        records.append(record)
        handle(record)

    monkeypatch.setattr(settings_log, "handle", keep)
    llm = make_llm(seed, dtype="float32")
    scheduler, _ = connector_halves(llm)
    assert scheduler.geometry.blocks_per_chunk == 1 and scheduler.geometry.chunk_tokens == BLOCK_SIZE
    lines = [(r.levelname, r.getMessage()) for r in records]
    for level, line in [
        ("INFO", f"{HEAD}block_size 16 -> blocks_per_chunk 1 (engine blocks of {BLOCK_SIZE} tokens)"),
        ("INFO", f"{HEAD}secondary_tiers[0] fs -> fs (root_dir, n_read_threads, n_write_threads kept)"),
        ("INFO", "kvtier: memory plan: MemTotal "),
        ("WARNING", f"kvtier: warning: block_size 16 is below the engine's block of {BLOCK_SIZE} "
                    f"tokens: a chunk is one engine block ({BLOCK_SIZE} tokens)")]:
        assert any(lv == level and line in text for lv, text in lines), (line, lines)

    ids: list[int] = llm.get_tokenizer().encode(PROMPTS["birds"])
    prompt = ids[: (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE + 1]
    params = SamplingParams(temperature=0.0, max_tokens=6)

    def run() -> Any:
        return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]

    run()  # computed, stored to the host tier and cascaded to fs
    device_hit = run()
    settle(scheduler)
    assert scheduler.reset_cache() and llm.reset_prefix_cache()
    reloaded = run()
    split = reloaded.kv_transfer_params["kvtier"]["tokens"]
    assert split["fs"] == len(prompt) - 1, split
    assert reloaded.outputs[0].token_ids == device_hit.outputs[0].token_ids
