"""KV events for KV-aware routers: where each chunk lives, in vLLM's KV-events format.

`TieringManager.take_events()` yields (tier name or "host", TierEvent) batches; `KVEventTranslator`
turns each into one vLLM `BlockStored` or `BlockRemoved` event: `block_hashes` are the 32-byte chunk
keys, `medium` is "CPU" or "STORAGE" (vLLM's own medium names) by tier type, `locality` "LOCAL" or
"REMOTE", and `ownership` the kvtier tier name ("host" or the configured secondary tier's name), so
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

from kvtier.chunks import HOST, ChunkKey, TierEvent, TierEventKind

# tier type → (medium, locality); a plugin tier of unknown type is STORAGE, locality unknown.
PLACEMENT: dict[str, tuple[str, str | None]] = {
    HOST: ("CPU", "LOCAL"),
    "memory": ("CPU", "LOCAL"),
    "fs": ("STORAGE", "LOCAL"),
    "obj": ("STORAGE", "REMOTE"),
    "redis": ("CPU", "REMOTE"),
    "p2p": ("CPU", "REMOTE"),
}
REMEMBERED_KEYS = 16384


@dataclass(frozen=True)
class _Chunk:
    parent: ChunkKey | None
    token_ids: tuple[int, ...]


class KVEventTranslator:
    """Turns kvtier tier events into vLLM KV events.

    `tier_types` maps each secondary tier's name to its type; `chunk_tokens` is the tokens per
    chunk (`blocks_per_chunk * block_size`); `lora_name` is not known per event and left None.
    """

    def __init__(self, tier_types: Mapping[str, str], chunk_tokens: int) -> None:
        self.tier_types = {HOST: HOST, **tier_types}
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

    def placement(self, tier: str) -> tuple[str, str | None]:
        """(medium, locality) of a tier by name."""
        return PLACEMENT.get(self.tier_types.get(tier, ""), ("STORAGE", None))

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
