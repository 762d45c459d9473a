"""The KV geometry of the model vLLM serves (`kvtier.engine.geometry.EngineGeometry`), read from
vLLM's config: chunk keys' model fingerprint and the canonical layout.

Both halves of the connector compute it from the same vLLM config, so the scheduler (which sizes
host rows and hashes keys) and every worker (which copies bytes) agree without talking. Called once
per connector, at construction.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.engine.geometry import EngineGeometry
from kvtier.errors import ConfigError
from kvtier.format.keys import ModelFingerprint
from kvtier.format.layout import CanonicalLayout
from kvtier.integrations.vllm.model.groups import layer_groups
from kvtier.integrations.vllm.model.kv_dtype import stored_kv_dtype
from kvtier.integrations.vllm.model.state_groups import state_groups

if TYPE_CHECKING:
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def model_name(model: str, served_model_name: str | list[str] | None) -> str:
    """The model's name in chunk keys: the same on every machine serving the same model.

    `served_model_name` when the user set one (vLLM fills it with `model` otherwise; a list gives
    its first name). Else, for a local directory, its basename plus a hash of its `config.json`
    (so two machines with the same model at different paths share chunks, and two different
    models in same-named directories do not); else `model` itself (a hub id).
    """
    served = served_model_name[0] if isinstance(served_model_name, list) else served_model_name
    if served and served != model:
        return served
    path = Path(model)
    config = path / "config.json"
    if not config.is_file():
        return model
    digest = hashlib.sha256(config.read_bytes()).hexdigest()[:16]
    return f"{path.resolve().name}@config-{digest}"


def refuse_context_parallel(parallel: ParallelConfig) -> None:
    """ConfigError when vLLM shards a request's tokens across ranks (decode or prefill context
    parallelism): each rank then holds part of a block's tokens, while a kvtier chunk is every
    token of its blocks, written by one rank per head shard."""
    for key in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(parallel, key, 1)
        if size != 1:
            raise ConfigError(key, size, "1: kvtier does not hold KV sharded by tokens across ranks")


def engine_geometry(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, blocks_per_chunk: int,
    chunk_tokens: int | None = None,
) -> EngineGeometry:
    """Read the geometry from vLLM's config; ConfigError for a cache kvtier cannot hold yet.

    `chunk_tokens`, when given, sets the chunk size instead of `blocks_per_chunk`. Supported: KV
    cache groups of full and sliding-window attention or MLA (`groups.layer_groups`),
    with gated-delta-net and Mamba2 state groups beside them (`states.state_groups`), K and V of
    the same head size (MLA: one latent), a KV cache dtype `kv_dtype.stored_kv_dtype` holds
    (unquantized or fp8), no context parallelism (`refuse_context_parallel`).
    """
    refuse_context_parallel(vllm_config.parallel_config)
    found = layer_groups(kv_cache_config)
    spec = found.spec
    if spec.head_size_v != spec.head_size and not found.latent:
        raise ConfigError("model", (spec.head_size, spec.head_size_v), "K and V head sizes differ")
    cache = vllm_config.cache_config
    kv_dtype = stored_kv_dtype(cache.cache_dtype, spec.dtype, cache.kv_cache_dtype_skip_layers)
    model = vllm_config.model_config
    layer_names = found.layer_names
    kinds = found.layer_kinds if found.hybrid else ()
    num_kv_heads = 1 if found.latent else model.get_total_num_kv_heads()
    if chunk_tokens is not None:
        if chunk_tokens % spec.block_size:
            raise ConfigError("chunk_tokens", chunk_tokens,
                              f"a multiple of the engine's block size ({spec.block_size} tokens)")
        blocks_per_chunk = chunk_tokens // spec.block_size
    chunk_tokens = spec.block_size * blocks_per_chunk
    layout = CanonicalLayout(
        num_layers=len(layer_names),
        num_kv_heads=num_kv_heads,
        head_dim=spec.head_size,
        chunk_tokens=chunk_tokens,
        dtype=kv_dtype,
        layer_kinds=kinds,
        latent=found.latent,
    )
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    states = state_groups(vllm_config, kv_cache_config, layout.row_bytes)
    extra = [("layer_kinds", ",".join(kinds))] if kinds else []
    if states is not None:
        layout = dataclasses.replace(layout, segments=states.layout.describe())
        extra.append(("states", states.layout.describe()))
    fingerprint = ModelFingerprint(
        model=model_name(model.model, model.served_model_name),
        revision=str(model.revision or ""),
        dtype=str(model.dtype),
        kv_dtype=str(kv_dtype),
        num_layers=len(layer_names),
        num_kv_heads=num_kv_heads,
        head_dim=spec.head_size,
        quantization=str(model.quantization or ""),
        extra=tuple(sorted(extra)),
    )
    return EngineGeometry(
        fingerprint=fingerprint,
        layout=layout,
        block_size=spec.block_size,
        blocks_per_chunk=blocks_per_chunk,
        layer_names=layer_names,
        tp_size=tp_size,
        layer_groups=found.layer_groups,
        group_ids=found.group_ids,
        states=states,
    )
