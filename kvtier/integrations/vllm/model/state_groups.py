"""vLLM's recurrent-state KV cache groups (gated delta net, Mamba2), as kvtier state segments.

vLLM keeps a gated-delta-net or Mamba2 layer's state (conv state, then the recurrent/SSM state) in
a `MambaSpec` group:
one block holds one state, and with prefix caching on (`mamba_cache_mode` "align") the state after
a block boundary is kept in the block that ends there. Each step, the scheduler names the boundary
states it just committed (`scheduler_output.kv_connector_block_state.boundary_state_offloads`:
request → `(group, block id, boundary tokens)`); those blocks hold their state until the end of
the step, so kvtier copies them in that step's `wait_for_save`. On a hit of T tokens vLLM allocates
the block at index `T / block_size - 1` of each state group for the state at T (the others are its
null block), and kvtier loads the state there. The canonical format is `kvtier.format.state_rows`.

Held: GDN and Mamba2 groups (`MambaAttentionBackendEnum.GDN_ATTN`, `MAMBA2`) in "align" mode, at
any TP degree vLLM runs them with: the canonical format is the whole model's state, and each rank
copies its shard of it (`state_tp.py` says how vLLM shards them). Other state groups (Mamba1, short
conv, linear attention, ...) are refused by `groups.layer_groups`. vLLM 0.32's CPU Mamba2 layer asks
for a mid-prefill checkpoint its CPU chunk scan does not produce and crashes on the first prefill
with prefix caching on (`notes/vllm-hybrid.md`); kvtier does not work around it (the tests do,
in-process, and say so).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from kvtier.engine.geometry import StateGroups
from kvtier.errors import ConfigError
from kvtier.format.state_rows import StateLayout, StatePart
from kvtier.format.state_shards import Section, StateShard
from kvtier.integrations.vllm.model.state_tp import state_sections, whole_model_state_shapes
from kvtier.transfer.state_copier import StateCopier

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec, MambaSpec

HELD_STATE_TYPES = {"GDN_ATTN": "gdn", "MAMBA2": "mamba2"}
"""vLLM's `MambaAttentionBackendEnum` names whose states kvtier holds → kvtier's kind name."""


def held_state(spec: KVCacheSpec) -> bool:
    """Whether `spec` is a recurrent-state group kvtier holds as state segments."""
    from vllm.v1.kv_cache_interface import MambaSpec

    return isinstance(spec, MambaSpec) and spec.mamba_type.name in HELD_STATE_TYPES


def state_groups(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, row_bytes: int
) -> StateGroups | None:
    """The recurrent-state groups kvtier holds (None: the model has none); ConfigError for a
    configuration whose states kvtier cannot store."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.model_executor.models.utils import extract_layer_index

    found = [
        (name, g, cast("MambaSpec", group.kv_cache_spec))
        for g, group in enumerate(kv_cache_config.kv_cache_groups)
        if held_state(group.kv_cache_spec)
        for name in group.layer_names
    ]
    if not found:
        return None
    found.sort(key=lambda item: extract_layer_index(item[0]))
    spec = found[0][2]
    if spec.mamba_cache_mode != "align":
        raise ConfigError("mamba_cache_mode", spec.mamba_cache_mode, "'align' (vLLM sets it with "
                          "enable_prefix_caching): kvtier stores the states vLLM keeps at block boundaries")
    for _, _, other in found[1:]:
        if (other.shapes, other.dtypes, other.block_size) != (spec.shapes, spec.dtypes, spec.block_size):
            raise ConfigError("model", (spec.shapes, other.shapes), "the same state shape in every layer")
    conv_first = is_conv_state_dim_first()
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    kind = HELD_STATE_TYPES[spec.mamba_type.name]

    def canonical(shapes: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        return [tuple(reversed(s)) if i == 0 and not conv_first else tuple(s) for i, s in enumerate(shapes)]

    local = canonical(spec.shapes)
    whole = local
    sections: tuple[tuple[Section, ...], ...] = ()
    if tp_size > 1 and spec.tp_replicated:  # every rank holds the whole state
        sections = tuple((Section(shape[0], replicated=True),) for shape in local)
    elif tp_size > 1:
        whole = canonical(whole_model_state_shapes(vllm_config))
        sections = state_sections(kind, local, whole, tp_size)
    parts = [
        StatePart(shape, dtype, transposed=i == 0 and not conv_first)
        for i, (shape, dtype) in enumerate(zip(whole, spec.dtypes, strict=True))
    ]
    layout = StateLayout(
        kind=kind,
        layers=tuple(extract_layer_index(name) for name, _, _ in found),
        parts=tuple(parts),
        row_bytes=row_bytes,
    )
    return StateGroups(
        layout=layout,
        layer_names=tuple(name for name, _, _ in found),
        group_ids=tuple(g for _, g, _ in found),
        block_size=spec.block_size,
        sections=sections,
        tp_size=tp_size,
    )


def state_views(layout: StateLayout, shard: StateShard, pages: torch.Tensor) -> list[torch.Tensor]:
    """A recurrent layer's state tensors `[num_blocks, *engine_shape]` on one rank (its `shard`),
    one per part, in the raw page view vLLM 0.32 hands the connector (`[num_blocks, 1, 1,
    page_bytes]` int8: each block's page holds the parts end to end, as `MambaBase.bind_kv_cache`
    unpacks it)."""
    shapes = [part.engine_shape(shard.local_rows(p)) for p, part in enumerate(layout.parts)]
    sizes = [math.prod(shape) * part.dtype.itemsize for shape, part in zip(shapes, layout.parts, strict=True)]
    raw = pages.reshape(pages.shape[0], -1) if pages.dim() > 2 else pages
    if raw.dim() != 2 or raw.element_size() != 1 or raw.shape[1] < sum(sizes):
        raise ValueError(f"kvtier: state pages {tuple(pages.shape)} {pages.dtype} are not "
                         f"[num_blocks, 1, 1, >= {sum(sizes)}] bytes")
    views = []
    offset = 0
    for part, shape, size in zip(layout.parts, shapes, sizes, strict=True):
        views.append(raw[:, offset : offset + size].view(part.dtype).view(-1, *shape))
        offset += size
    return views


class StateWorker:
    """One rank's state tensors and their copier; the worker half hands the copier to its transfer,
    which runs the state copies as it runs the chunks'."""

    def __init__(self, groups: StateGroups, kv_caches: dict[str, Any], tp_rank: int = 0) -> None:
        """`kv_caches`: vLLM's layer name → KV cache, on TP rank `tp_rank`. Raises ValueError when
        a recurrent layer's is missing or too small for its states."""
        missing = [name for name in groups.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"kvtier: no state tensors for layers {missing}")
        shard = groups.shard(tp_rank)
        tensors = [state_views(groups.layout, shard, kv_caches[name]) for name in groups.layer_names]
        self.copier = StateCopier(groups.layout, tensors, shard)
