"""What the request path knows of an engine's KV cache: its geometry and how chunks map to blocks.

An engine integration reads these from its engine's config once, at start (vLLM's:
`kvtier.integrations.vllm.model.read_geometry`); the scheduler side (which sizes host rows and hashes
keys) and every worker (which copies bytes) build the same geometry from the same config, so they
agree without talking. Everything here is plain data and arithmetic on block ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.format.keys import ModelFingerprint
from kvtier.format.layout import SKIP_BLOCK, CanonicalLayout
from kvtier.format.state_rows import StateLayout
from kvtier.format.state_shards import Section, StateShard

NULL_BLOCK = 0
"""The block id a KV cache group gives a position it holds no block at (freed by a sliding window,
or never allocated); an integration whose engine uses another id maps it to this one."""


@dataclass(frozen=True)
class StateGroups:
    """The recurrent layers in model order, the KV cache group of each, and their format;
    `sections` (default: each part whole) and `tp_size` say which shard of it each rank holds."""

    layout: StateLayout
    layer_names: tuple[str, ...]
    group_ids: tuple[int, ...]
    block_size: int
    sections: tuple[tuple[Section, ...], ...] = ()
    tp_size: int = 1

    def shard(self, rank: int) -> StateShard:
        """The rows of each state part TP rank `rank` holds."""
        if not self.sections:
            return StateShard.whole([part.shape[0] for part in self.layout.parts])
        return StateShard(self.sections, self.tp_size, rank)

    def load_blocks(self, block_ids: Sequence[Sequence[int]], tokens: int) -> tuple[int, ...] | None:
        """The block of each recurrent layer that is to hold the state at `tokens` (a hit point),
        from a request's per-group block ids; None when a group holds none there."""
        index = tokens // self.block_size - 1
        out = []
        for g in self.group_ids:
            ids = block_ids[g]
            if index >= len(ids) or ids[index] == NULL_BLOCK:
                return None
            out.append(ids[index])
        return tuple(out)


@dataclass(frozen=True)
class EngineGeometry:
    """What kvtier needs to know about the engine's KV cache.

    `layer_names` are the attention layers in model order (canonical page order in a host row);
    `layer_groups[l]` is the attention group whose block ids address layer l (empty: one group);
    `group_ids[g]` is attention group g's index among the engine's KV cache groups (empty: the
    same). `states`: the model's recurrent layers (gated delta net, Mamba2), stored as state
    segments.
    """

    fingerprint: ModelFingerprint
    layout: CanonicalLayout
    block_size: int
    blocks_per_chunk: int
    layer_names: tuple[str, ...]
    tp_size: int
    layer_groups: tuple[int, ...] = ()
    group_ids: tuple[int, ...] = ()
    states: StateGroups | None = None

    @property
    def chunk_tokens(self) -> int:
        return self.layout.chunk_tokens

    @property
    def one_group(self) -> bool:
        """One KV cache group and no recurrent state: the engine takes a failed load's block ids
        (with several groups, block ids are per group, and a failed load is reported by request)."""
        return len(set(self.layer_groups)) <= 1 and self.states is None

    def attention_ids(self, block_ids: Sequence[Sequence[int]]) -> Sequence[Sequence[int]]:
        """A request's block ids of the attention groups alone, from those of every group."""
        if self.states is None:
            return block_ids
        return [block_ids[g] for g in self.group_ids]


def store_blocks(ids: Sequence[Sequence[int]], chunk: int, blocks_per_chunk: int,
                 held: int | None = None) -> tuple[int, ...] | None:
    """Chunk `chunk`'s blocks, group by group, from a request's per-group block ids; None when a
    group no longer holds one of them (it left a sliding window): the chunk cannot be stored. With
    `held` (an unfull chunk), its first `held` blocks, the last of them again up to a whole chunk."""
    held = blocks_per_chunk if held is None else held
    out: list[int] = []
    for group in ids:
        blocks = list(group[chunk * blocks_per_chunk : chunk * blocks_per_chunk + held])
        if len(blocks) != held or NULL_BLOCK in blocks:
            return None
        out += blocks + blocks[-1:] * (blocks_per_chunk - held)
    return tuple(out)


def load_blocks(
    ids: Sequence[Sequence[int]], chunk: int, blocks_per_chunk: int, skip: int = 0,
    held: int | None = None,
) -> tuple[int, ...]:
    """Chunk `chunk`'s blocks to load into, group by group; `SKIP_BLOCK` where a group holds none
    (outside the window before the hit point), for the chunk's first `skip` blocks (the device
    hit already holds them) and, with `held` (an unfull chunk), for its blocks from the `held`-th."""
    held = blocks_per_chunk if held is None else held
    out: list[int] = []
    for group in ids:
        blocks = list(group[chunk * blocks_per_chunk : (chunk + 1) * blocks_per_chunk])
        blocks += [NULL_BLOCK] * (blocks_per_chunk - len(blocks))
        out.extend(SKIP_BLOCK if b == NULL_BLOCK or i < skip or i >= held else b
                   for i, b in enumerate(blocks))
    return tuple(out)
