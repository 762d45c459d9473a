"""vLLM's KV cache groups, seen as kvtier's model layers.

With vLLM's hybrid KV cache manager each KV cache group (a set of layers with one `KVCacheSpec`)
has its own block ids, all from one block pool, and every group's layer tensors alias one buffer.
kvtier's canonical row holds one page per model layer in model order (`kvtier.format.layout`); the group
of a layer only says which of a request's block-id lists addresses that layer's blocks. So the
stored format never depends on vLLM's group order.

What kvtier holds: full attention (`FullAttentionSpec`), sliding-window attention
(`SlidingWindowSpec`, or a `FullAttentionSpec` carrying `sliding_window` when the hybrid manager is
off) and MLA latents (`MLAAttentionSpec`, every layer), all layers with the same KV heads, head
size, dtype and block size, plus the recurrent-state groups `state_groups.py` holds (GDN, Mamba2),
which `layer_groups` leaves out: their layers are not attention layers, and `state_groups.py` reads them.
Any other group (Mamba1, short conv, ...) is refused at startup by `layer_groups`, with a ConfigError
naming the spec and its layers. With the hybrid
manager off vLLM merges every layer into one `FullAttentionSpec` carrying the model's window, so
every layer is then named sliding: such an engine shares chunks only with engines in the same mode.

Sliding-window groups free the blocks that left the window during a request: vLLM replaces them
with its null block (id 0). A chunk is stored only while every group still holds its blocks (the
step that completes it); a load leaves the null blocks alone (`SKIP_BLOCK`): vLLM needs only the
window before the hit point, and allocates blocks for that alone. Lookups stay prefix lookups: a
hit is the run of chunks past the device hit that the tiers hold whole (every layer), which every
group can serve. (A model whose layers all slide could be served from the window's chunks alone;
kvtier still asks for the whole run, and pins chunks it then does not copy.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from kvtier.errors import ConfigError
from kvtier.format.layout import FULL_ATTENTION
from kvtier.integrations.vllm.model.state_groups import held_state

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig, KVCacheSpec

SLIDING_WINDOW = "sliding_window"
MLA_LATENT = "mla_latent"


@dataclass(frozen=True)
class LayerGroups:
    """The attention layers in model order, the attention group of each (0..n-1), and what each
    holds; `group_ids[g]` is attention group g's index among all of vLLM's KV cache groups."""

    layer_names: tuple[str, ...]
    layer_groups: tuple[int, ...]
    layer_kinds: tuple[str, ...]
    spec: AttentionSpec
    latent: bool = False
    group_ids: tuple[int, ...] = ()

    @property
    def hybrid(self) -> bool:
        """Whether any layer is not plain full attention (its kinds then enter keys and layout)."""
        return any(kind != FULL_ATTENTION for kind in self.layer_kinds)


def layer_kind(spec: KVCacheSpec) -> str:
    """kvtier's name for what a layer of `spec` keeps: "attention", "sliding_window:W" or
    "mla_latent:D" (D values per token)."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    if isinstance(spec, MLAAttentionSpec):
        return f"{MLA_LATENT}:{spec.head_size}"
    window = getattr(spec, "sliding_window", None)
    return FULL_ATTENTION if window is None else f"{SLIDING_WINDOW}:{window}"


def layer_groups(kv_cache_config: KVCacheConfig) -> LayerGroups:
    """The layers kvtier copies; ConfigError naming what is missing for a group it cannot hold."""
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    indexed = [
        (g, group) for g, group in enumerate(kv_cache_config.kv_cache_groups)
        if not held_state(group.kv_cache_spec)
    ]
    groups = [group for _, group in indexed]
    if not groups:
        raise ConfigError("model", "no attention KV cache groups", "a model with attention layers")
    for group in groups:
        spec = group.kv_cache_spec
        if not isinstance(spec, FullAttentionSpec | SlidingWindowSpec):
            raise ConfigError(
                "model",
                f"{type(spec).__name__} layers {list(group.layer_names)}",
                "kvtier holds full-attention, sliding-window, MLA, gated-delta-net and Mamba2 KV "
                "cache groups only; "
                f"{type(spec).__name__} is not supported yet",
            )
    first = cast("AttentionSpec", groups[0].kv_cache_spec)
    latent = isinstance(first, MLAAttentionSpec)
    for group in groups[1:]:
        spec = group.kv_cache_spec
        if isinstance(spec, MLAAttentionSpec) != latent:
            raise ConfigError("model", "MLA and other attention layers", "kvtier holds MLA-only models")
        for attr in ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype"):
            if getattr(spec, attr) != getattr(first, attr):
                raise ConfigError(
                    "model",
                    f"{attr} {getattr(first, attr)} and {getattr(spec, attr)}",
                    "kvtier needs the same KV geometry in every KV cache group",
                )
    layers = sorted(
        (
            (name, g, layer_kind(group.kv_cache_spec))
            for g, group in enumerate(groups)
            for name in group.layer_names
        ),
        key=lambda item: extract_layer_index(item[0]),
    )
    return LayerGroups(
        layer_names=tuple(name for name, _, _ in layers),
        layer_groups=tuple(g for _, g, _ in layers),
        layer_kinds=tuple(kind for _, _, kind in layers),
        spec=first,
        latent=latent,
        group_ids=tuple(g for g, _ in indexed),
    )
