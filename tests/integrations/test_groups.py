"""vLLM's KV cache groups as kvtier layers (`groups.layer_groups`), from real vLLM spec objects:
layers in model order whatever the group order, each with its group and kind; MLA groups are
latent; recurrent-state groups kvtier holds (GDN, Mamba2) are left out, the attention groups
numbered 0..n-1 with their vLLM indices; a group kvtier cannot hold is refused with a ConfigError
naming the spec and its layers."""

from __future__ import annotations

import pytest
import torch
from vllm.config import ParallelConfig
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvtier.engine.geometry import NULL_BLOCK, load_blocks, store_blocks
from kvtier.errors import ConfigError
from kvtier.format.layout import SKIP_BLOCK
from kvtier.integrations.vllm.model.groups import layer_groups
from kvtier.integrations.vllm.model.read_geometry import refuse_context_parallel

GEOMETRY = {"block_size": 32, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}


def config(*groups: tuple[list[int], object]) -> KVCacheConfig:
    specs = [
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in layers], spec)  # type: ignore[arg-type]
        for layers, spec in groups
    ]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=specs)


def test_layers_are_in_model_order_with_their_group_and_kind() -> None:
    sliding = SlidingWindowSpec(**GEOMETRY, sliding_window=64)  # type: ignore[arg-type]
    found = layer_groups(config(([1, 3], sliding), ([0, 2], FullAttentionSpec(**GEOMETRY))))  # type: ignore[arg-type]
    assert found.layer_names == tuple(f"model.layers.{i}.self_attn.attn" for i in range(4))
    assert found.layer_groups == (1, 0, 1, 0)
    assert found.layer_kinds == ("attention", "sliding_window:64") * 2
    assert found.hybrid
    assert not layer_groups(config(([0, 1], FullAttentionSpec(**GEOMETRY)))).hybrid  # type: ignore[arg-type]


def test_groups_kvtier_cannot_hold_are_refused_by_name() -> None:
    mla = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.float32)
    found = layer_groups(config(([0, 1], mla)))
    assert found.latent and found.layer_kinds == ("mla_latent:576",) * 2
    with pytest.raises(ConfigError, match="MLA-only"):
        layer_groups(config(([0], mla), ([1], FullAttentionSpec(**GEOMETRY))))  # type: ignore[arg-type]
    mamba1 = MambaSpec(
        block_size=32, shapes=((4, 8),), dtypes=(torch.float32,), mamba_type=MambaAttentionBackendEnum.MAMBA1
    )
    full = FullAttentionSpec(**GEOMETRY)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"MambaSpec .* not supported yet"):
        layer_groups(config(([1], full), ([0], mamba1)))
    wider = FullAttentionSpec(**{**GEOMETRY, "head_size": 128})  # type: ignore[arg-type]
    sliding = SlidingWindowSpec(**GEOMETRY, sliding_window=64)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="head_size 64 and 128"):
        layer_groups(config(([0], sliding), ([1], wider)))


def test_gdn_and_mamba2_groups_are_left_to_the_state_segments() -> None:
    full = FullAttentionSpec(**GEOMETRY)  # type: ignore[arg-type]
    for kind in (MambaAttentionBackendEnum.GDN_ATTN, MambaAttentionBackendEnum.MAMBA2):
        shapes = ((3, 8), (2, 4, 4))
        state = MambaSpec(block_size=32, shapes=shapes, dtypes=(torch.float32,) * 2, mamba_type=kind)
        found = layer_groups(config(([0], state), ([2], full), ([1], state), ([3], full)))
        assert found.layer_names == ("model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn")
        assert found.layer_groups == (0, 1) and found.group_ids == (1, 3)
    with pytest.raises(ConfigError, match="no attention KV cache groups"):
        layer_groups(config(([0], state)))


def test_block_ids_group_by_group() -> None:
    ids = ([NULL_BLOCK, NULL_BLOCK, 7, 8], [1, 2, 3, 4])
    assert store_blocks(ids, 0, 2) is None  # the sliding group freed chunk 0's blocks
    assert store_blocks(ids, 1, 2) == (7, 8, 3, 4)
    assert store_blocks(ids, 2, 2) is None  # beyond the blocks allocated
    assert load_blocks(ids, 0, 2) == (SKIP_BLOCK, SKIP_BLOCK, 1, 2)
    assert load_blocks(([5, NULL_BLOCK],), 0, 2) == (5, SKIP_BLOCK)


@pytest.mark.parametrize("key", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallelism_is_refused_naming_its_key(key: str) -> None:
    """A rank holding part of each block's tokens cannot write whole chunks: refused at startup."""
    refuse_context_parallel(ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ConfigError, match=key):
        refuse_context_parallel(ParallelConfig(tensor_parallel_size=2, **{key: 2}))
