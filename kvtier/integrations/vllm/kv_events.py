"""KV events for KV-aware routers: where each chunk lives, in vLLM's KV-events format.

`TieringManager.take_events()` yields (tier name or "host", TierEvent) batches; `KVEventTranslator`
turns each into one vLLM `BlockStored` or `BlockRemoved` event: `block_hashes` are the 32-byte chunk
keys, `medium` ("CPU" or "STORAGE", vLLM's own medium names) and `locality` ("LOCAL" or "REMOTE") are
what the tier's class declares (`SecondaryTier.medium`, `.locality`; the host tier is CPU and LOCAL),
and `ownership` the kvtier tier name ("host" or the configured secondary tier's name), so
a router tells a copy on this host's disk from one in a shared object store. A `BlockStored` also
carries the chunk's parent key, token ids and `block_size` (tokens per chunk) when the translator
still remembers the key (`remember`, bounded), else empty token ids as vLLM's own offloading does
for chunks it did not see computed.

The vLLM connector publishes them through vLLM's publisher (its scheduler calls the connector's
`take_events` every step) only when the user enables KV events. Called on the scheduler thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError
from kvtier.format.chunks import HOST, ChunkKey, TierEvent, TierEventKind
from kvtier.tiers.base import Locality, Medium, SecondaryTier
from kvtier.tiers.registry import resolve_tier

Placement = tuple[Medium, Locality | None]
HOST_PLACEMENT: Placement = ("CPU", "LOCAL")
REMEMBERED_KEYS = 16384


def tier_placement(name: str, type_name: str, module_path: str | None = None) -> Placement:
    """(medium, locality) a tier's class declares; a tier whose class cannot be resolved here (a
    plugin named without its module) gets the contract's defaults."""
    try:
        cls = resolve_tier(name, type_name, module_path)
    except ConfigError:
        cls = SecondaryTier
    return cls.medium, cls.locality


@dataclass(frozen=True)
class _Chunk:
    parent: ChunkKey | None
    token_ids: tuple[int, ...]


class KVEventTranslator:
    """Turns kvtier tier events into vLLM KV events.

    `tier_types` maps each secondary tier's name to its type, `module_paths` a plugin tier's name to
    its module; `chunk_tokens` is the tokens per chunk (`blocks_per_chunk * block_size`);
    `lora_name` is not known per event and left None.
    """

    def __init__(
        self, tier_types: Mapping[str, str], chunk_tokens: int,
        module_paths: Mapping[str, str | None] | None = None,
    ) -> None:
        paths = module_paths or {}
        self._placements = {HOST: HOST_PLACEMENT} | {
            name: tier_placement(name, type_name, paths.get(name))
            for name, type_name in tier_types.items()
        }
        self.chunk_tokens = chunk_tokens
        self._chunks: OrderedDict[ChunkKey, _Chunk] = OrderedDict()

    def remember(self, keys: Sequence[ChunkKey], token_ids: Sequence[int], first: int = 0) -> None:
        """Remember the parent and tokens of `keys[first:]`: key i covers `token_ids` chunk i."""
        ct = self.chunk_tokens
        chunks = self._chunks
        for i in range(first, len(keys)):
            if keys[i] in chunks:
                chunks.move_to_end(keys[i])
                continue
            tokens = tuple(token_ids[i * ct : (i + 1) * ct])
            if len(tokens) != ct:
                break
            chunks[keys[i]] = _Chunk(keys[i - 1] if i else None, tokens)
        while len(chunks) > REMEMBERED_KEYS:
            chunks.popitem(last=False)

    def placement(self, tier: str) -> Placement:
        """(medium, locality) of a tier by name; an unknown name gets the contract's defaults."""
        return self._placements.get(tier, (SecondaryTier.medium, SecondaryTier.locality))

    def translate(self, tier: str, event: TierEvent) -> list[Any]:
        """vLLM events for one kvtier event batch: one BlockRemoved, or one BlockStored per run of
        keys that chain parent → child (a router needs each block's parent)."""
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        medium, locality = self.placement(tier)
        if event.kind is TierEventKind.REMOVED:
            return [BlockRemoved(
                block_hashes=list(event.keys), medium=medium, locality=locality, ownership=tier
            )]
        out: list[Any] = []
        for parent, keys, tokens in self._runs(event.keys):
            hashes: list[bytes | int] = list(keys)
            out.append(BlockStored(
                block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                block_size=self.chunk_tokens, lora_id=None, medium=medium, lora_name=None,
                locality=locality, ownership=tier,
            ))
        return out

    def _runs(
        self, keys: Sequence[ChunkKey]
    ) -> list[tuple[ChunkKey | None, list[ChunkKey], list[int]]]:
        """Split `keys` into runs where each key's parent is the previous key; a key not remembered
        is a run of its own, without tokens."""
        runs: list[tuple[ChunkKey | None, list[ChunkKey], list[int]]] = []
        for key in keys:
            chunk = self._chunks.get(key)
            last = runs[-1] if runs else None
            if chunk is None:
                runs.append((None, [key], []))
            elif last is not None and last[2] and chunk.parent == last[1][-1]:
                last[1].append(key)
                last[2].extend(chunk.token_ids)
            else:
                runs.append((chunk.parent, [key], list(chunk.token_ids)))
        return runs
