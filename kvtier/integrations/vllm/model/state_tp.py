"""How vLLM 0.32 shards a recurrent layer's states over tensor-parallel ranks, as the sections of
`kvtier.format.state_shards` (rows along each state part's first canonical axis).

Read from vLLM's layers; the section order is the order of the conv weight's shards, which is the
order of the conv state's channels on every rank:

- Gated delta net (`QwenGatedDeltaNetAttention`, `gdn/qwen_gdn_linear_attn.py`): the conv channels
  are q, k, v (`key_dim`, `key_dim`, `value_dim`), each split evenly over the ranks (the conv
  weight's `mamba_v2_sharded_weight_loader` with `(key_dim, 0, False)` twice and `(value_dim, 0,
  False)`); the recurrent state `[num_v_heads, head_v_dim, head_k_dim]` is split by v heads
  (`MambaStateShapeCalculator.gated_delta_net_state_shape`).
- Mamba2 (`MambaMixer2`, `mamba_mixer2.py`): the conv channels are x (`intermediate_size` =
  `num_heads * head_dim`), B and C (`n_groups * d_state` each). x is split evenly; B and C are
  split by groups when tp divides `n_groups`, and otherwise (vLLM allows only `n_groups` 1 then)
  every rank holds the whole group (`extra_groups_for_head_shards`; the loader's
  `duplicate_groups` reads rank 0's shard on every rank). The SSM state `[num_heads, head_dim,
  d_state]` is split by heads (`mamba2_state_shape`).

The canonical (whole-model) shapes are the model's own at TP=1: the model class's
`get_mamba_state_shape_from_config`, asked with `tensor_parallel_size` 1. Every section is then
checked against the engine's own per-rank shapes: a model whose shapes do not fit these rules is
refused with a ConfigError naming both.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.errors import ConfigError
from kvtier.format.state_shards import Section, StateShard

if TYPE_CHECKING:
    from vllm.config import VllmConfig

Shape = tuple[int, ...]


def whole_model_state_shapes(vllm_config: VllmConfig) -> tuple[Shape, ...]:
    """The model's recurrent state shapes at TP=1, in vLLM's orientation (as `MambaSpec.shapes`)."""
    from vllm.model_executor.models.registry import ModelRegistry

    model_config = vllm_config.model_config
    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
    shapes_of = getattr(model_cls, "get_mamba_state_shape_from_config", None)
    if shapes_of is None:
        raise ConfigError("tensor_parallel_size", vllm_config.parallel_config.tensor_parallel_size,
                          f"1 for {model_config.architecture}: vLLM gives no state shapes for it")
    config = copy.copy(vllm_config)
    parallel = copy.copy(vllm_config.parallel_config)
    object.__setattr__(parallel, "tensor_parallel_size", 1)
    object.__setattr__(config, "parallel_config", parallel)
    return tuple(tuple(shape) for shape in shapes_of(config))


def state_sections(
    kind: str, local: Sequence[Shape], whole: Sequence[Shape], tp_size: int
) -> tuple[tuple[Section, ...], ...]:
    """The sections of each state part (conv, then recurrent/SSM state) of a `kind` ("gdn",
    "mamba2") layer; shapes in canonical orientation (channels first), `local` one rank's and
    `whole` the model's. ConfigError when the engine's shapes are not these sections' shards."""
    if len(whole) != 2 or len(local) != 2:
        raise ConfigError("model", (tuple(local), tuple(whole)), "a conv state and one recurrent state")
    conv, state = whole
    if kind == "gdn":
        value = state[0] * state[1]  # num_v_heads * head_v_dim
        key = (conv[0] - value) // 2
        conv_sections = (Section(key), Section(key), Section(value))
    elif kind == "mamba2":
        inner = state[0] * state[1]  # num_heads * head_dim
        groups = (conv[0] - inner) // 2
        local_groups = (local[0][0] - inner // tp_size) // 2
        replicated = tp_size > 1 and local_groups == groups
        conv_sections = (Section(inner), Section(groups, replicated), Section(groups, replicated))
    else:
        raise ConfigError("model", kind, "a gdn or mamba2 state")
    sections = (conv_sections, (Section(state[0]),))
    shard = StateShard(sections, tp_size)
    for p, (mine, full) in enumerate(zip(local, whole, strict=True)):
        if shard.canonical_rows(p) != full[0] or (shard.local_rows(p), *full[1:]) != tuple(mine):
            raise ConfigError(
                "tensor_parallel_size", tp_size,
                f"a degree whose {kind} state shards kvtier knows: part {p} is {tuple(mine)} on a rank "
                f"and {tuple(full)} whole, not the shard of sections {sections[p]}",
            )
    return sections
