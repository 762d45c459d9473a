"""KV events for KV-aware routers: where each chunk lives, in the format of vLLM's own KV events.

`TieringManager.take_events()` yields (tier name or "host", TierEvent) batches of chunk keys;
`KVEventTranslator` turns them into the events vLLM's device cache publishes, in the same hash space,
so a router (NVIDIA Dynamo's KV indexer, llm-d) reads them as they are:

- `BlockStored` when chunks become loadable in a tier, `BlockRemoved` when they no longer are;
- `block_hashes`: one per engine block (a chunk of `blocks_per_chunk` blocks gives that many), the
  block's vLLM prefix-cache hash converted as vLLM converts its own (`maybe_convert_block_hash`:
  a 64-bit int unless `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`); `block_size` the engine's;
- `parent_block_hash`: the hash of the block before the run, so a host-tier run continues the
  device prefix vLLM announced; `token_ids`: the run's tokens (routers hash them themselves);
- `medium` and `locality`: what the tier's class declares (`SecondaryTier.medium`, `.locality`):
  host `CPU`/`LOCAL`, fs `STORAGE`/`LOCAL`, obj `STORAGE`/`REMOTE`, redis and p2p `CPU`/`REMOTE`
  (another host's memory); a shared tier is REMOTE because every instance reaches it alike, and a
  router that prefers the instance holding a prefix may skip it (Dynamo 1.6.1 does);
- `lora_name`/`lora_id`: the request's LoRA adapter, as vLLM's own events (routers hash the name
  with the tokens); `ownership` unset (a router may ignore events that set it), `extra_keys` unset.

The chunk → blocks mapping (`ChunkBlocks`) comes from the request, on the scheduler thread, when the
request is keyed (`remember`); it is kept while any tier holds the chunk, and in a bounded LRU of
recent chunks otherwise. A key the translator does not know (a chunk another instance wrote, or one
from before a restart) is looked up in the tier's `BlockSidecar` when it has one (fs), on the
sidecar's thread, and its event follows in a later batch (`take_resolved`); a key no one can name
gives no event: an event vLLM's format cannot carry would break the whole batch, vLLM's own device
events with it. Called on the scheduler thread; never blocks.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.engine.events.block_sidecar import BlockSidecar
from kvtier.engine.events.chunk_blocks import ChunkBlocks
from kvtier.engine.request import Request
from kvtier.errors import ConfigError
from kvtier.format.chunks import HOST, ChunkKey, TierEvent, TierEventKind
from kvtier.tiers.base import Locality, Medium, SecondaryTier
from kvtier.tiers.registry import resolve_tier

log = logging.getLogger("kvtier.vllm.events")

Placement = tuple[Medium, Locality | None]
HOST_PLACEMENT: Placement = ("CPU", "LOCAL")
REMEMBERED_CHUNKS = 16384
"""Chunks no tier holds (computed, not stored yet) whose blocks are kept, most recent first."""
HELD_CHUNKS = 1 << 17
"""Chunks some tier holds whose blocks are kept (about 0.1 GB at 128-token chunks); past it the
longest held are forgotten (a tier that never reports its removals, as a shared store whose other
users evict, cannot grow it without bound). An fs tier's are read back from its sidecar."""


def tier_placement(name: str, type_name: str, module_path: str | None = None) -> Placement:
    """(medium, locality) a tier's class declares; a tier whose class cannot be resolved here (a
    plugin named without its module) gets the contract's defaults."""
    try:
        cls = resolve_tier(name, type_name, module_path)
    except ConfigError:
        cls = SecondaryTier
    return cls.medium, cls.locality


def make_translator(config: KVTierConfig, block_size: int, layout_fingerprint: str,
                    hash_block_size: int | None = None) -> KVEventTranslator:
    """The translator of an engine with `config`, a sidecar for each fs tier (see the module
    docstring); called once on the scheduler thread when the user enabled KV events."""
    from vllm.v1.core import kv_cache_utils

    def space() -> bytes:
        return bytes(kv_cache_utils.NONE_HASH)

    tiers = config.secondary_tiers
    sidecars = {t.name: BlockSidecar(str(t.options["root_dir"]), layout_fingerprint, block_size,
                                     space)
                for t in tiers if t.type == "fs" and t.module_path is None}
    return KVEventTranslator({t.name: t.type for t in tiers}, block_size, config.blocks_per_chunk,
                             {t.name: t.module_path for t in tiers}, hash_block_size, sidecars)


class KVEventTranslator:
    """Turns kvtier tier events into vLLM KV events (see the module docstring).

    `tier_types` maps each secondary tier's name to its type, `module_paths` a plugin tier's name to
    its module; `block_size` is the engine's block size and `hash_block_size` the size vLLM hashes
    requests at; `sidecars` maps a tier's name to the sidecar that persists its mappings.
    """

    def __init__(
        self, tier_types: Mapping[str, str], block_size: int, blocks_per_chunk: int,
        module_paths: Mapping[str, str | None] | None = None, hash_block_size: int | None = None,
        sidecars: Mapping[str, BlockSidecar] | None = None,
    ) -> None:
        paths = module_paths or {}
        self._placements = {HOST: HOST_PLACEMENT} | {
            name: tier_placement(name, type_name, paths.get(name))
            for name, type_name in tier_types.items()
        }
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.hash_block_size = hash_block_size or block_size
        self.sidecars = dict(sidecars or {})
        self._held: OrderedDict[ChunkKey, tuple[ChunkBlocks, set[str]]] = OrderedDict()
        self._recent: OrderedDict[ChunkKey, ChunkBlocks] = OrderedDict()
        self.unnamed = 0
        """Keys dropped from events because no one could name their blocks."""

    def remember(self, request: Request, keys: Sequence[ChunkKey], first: int = 0) -> None:
        """Learn the blocks of `keys[first:]`, `request`'s chunk keys, as far as vLLM hashed them."""
        self._learn(request_chunks(request, keys, first, self.block_size, self.blocks_per_chunk,
                                   self.hash_block_size))

    def remember_unfull(self, request: Request, key: ChunkKey, chunk: int, blocks: int) -> None:
        """Learn the blocks of `request`'s unfull chunk `key`: the first `blocks` of chunk `chunk`."""
        self._learn(request_chunks(request, [key], 0, self.block_size, self.blocks_per_chunk,
                                   self.hash_block_size, at=(chunk, blocks)))

    def _learn(self, chunks: list[tuple[ChunkKey, ChunkBlocks]]) -> None:
        for key, blocks in chunks:
            if key in self._held:
                continue
            self._recent[key] = blocks
            self._recent.move_to_end(key)
        while len(self._recent) > REMEMBERED_CHUNKS:
            self._recent.popitem(last=False)

    def blocks(self, key: ChunkKey) -> ChunkBlocks | None:
        held = self._held.get(key)
        return held[0] if held is not None else self._recent.get(key)

    def placement(self, tier: str) -> Placement:
        """(medium, locality) of a tier by name; an unknown name gets the contract's defaults."""
        return self._placements.get(tier, (SecondaryTier.medium, SecondaryTier.locality))

    def translate_all(self, events: Sequence[tuple[str, TierEvent]]) -> list[Any]:
        """vLLM events for the sidecars' answers since the last call, then for `events`, the
        manager's (tier name, event) batches. Called every step."""
        return [*self.take_resolved(), *(e for tier, ev in events for e in self.translate(tier, ev))]

    def translate(self, tier: str, event: TierEvent) -> list[Any]:
        """vLLM events for one kvtier event batch; keys not known here are asked of the tier's
        sidecar (their events come from `take_resolved`) or dropped."""
        known: list[tuple[ChunkKey, ChunkBlocks]] = []
        sidecar = self.sidecars.get(tier)
        for key in event.keys:
            blocks = self.blocks(key)
            if blocks is not None:
                known.append((key, blocks))
            elif sidecar is not None:
                sidecar.ask(event.kind, key)
            else:
                self.unnamed += 1
        return self._events(tier, event.kind, known)

    def take_resolved(self) -> list[Any]:
        """Events for the keys the sidecars named since the last call. Called every step."""
        out: list[Any] = []
        for tier, sidecar in self.sidecars.items():
            for kind, key, blocks in sidecar.take_answers():
                if blocks is None:
                    self.unnamed += 1
                    continue
                held = self._held.get(key)
                if kind is TierEventKind.REMOVED and held is not None and tier in held[1]:
                    continue  # stored again since (named by a request): it is still there
                out += self._events(tier, kind, [(key, blocks)])
        return out

    def close(self) -> None:
        """Finish the sidecars' queued writes and stop their threads. Idempotent."""
        for sidecar in self.sidecars.values():
            sidecar.close()

    def _events(
        self, tier: str, kind: TierEventKind, chunks: list[tuple[ChunkKey, ChunkBlocks]]
    ) -> list[Any]:
        """Residency bookkeeping for `chunks`, then their events."""
        if not chunks:
            return []
        sidecar = self.sidecars.get(tier)
        for key, blocks in chunks:
            if kind is TierEventKind.STORED:
                self._hold(key, blocks, tier)
                if sidecar is not None:
                    sidecar.save(key, blocks)
            else:
                self._release(key, tier)
                if sidecar is not None:
                    sidecar.drop(key)
        return self._vllm_events(tier, kind, [blocks for _, blocks in chunks])

    def _hold(self, key: ChunkKey, blocks: ChunkBlocks, tier: str) -> None:
        held = self._held.get(key)
        if held is None:
            self._recent.pop(key, None)
            self._held[key] = (blocks, {tier})
            while len(self._held) > HELD_CHUNKS:
                self._held.popitem(last=False)
        else:
            held[1].add(tier)

    def _release(self, key: ChunkKey, tier: str) -> None:
        held = self._held.get(key)
        if held is None:
            return
        held[1].discard(tier)
        if not held[1]:
            del self._held[key]
            self._recent[key] = held[0]
            while len(self._recent) > REMEMBERED_CHUNKS:
                self._recent.popitem(last=False)

    def _vllm_events(self, tier: str, kind: TierEventKind, chunks: list[ChunkBlocks]) -> list[Any]:
        """One BlockRemoved for all of `chunks`, or one BlockStored per run of chunks that chain
        (each chunk's parent is the previous chunk's last block)."""
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

        def convert(h: bytes) -> int | bytes:
            return maybe_convert_block_hash(BlockHash(h))

        medium, locality = self.placement(tier)
        if kind is TierEventKind.REMOVED:
            hashes = [convert(h) for c in chunks for h in c.hashes]
            return [BlockRemoved(block_hashes=hashes, medium=medium, locality=locality)]
        runs: list[list[ChunkBlocks]] = []
        for chunk in chunks:
            if runs and chunk.parent == runs[-1][-1].hashes[-1] and chunk.lora == runs[-1][-1].lora:
                runs[-1].append(chunk)
            else:
                runs.append([chunk])
        out: list[Any] = []
        for run in runs:
            lora_name, lora_id = run[0].lora if run[0].lora is not None else (None, None)
            out.append(BlockStored(
                block_hashes=[convert(h) for c in run for h in c.hashes],
                parent_block_hash=None if run[0].parent is None else convert(run[0].parent),
                token_ids=[t for c in run for t in c.tokens], block_size=self.block_size,
                lora_id=lora_id, medium=medium, lora_name=lora_name, locality=locality,
            ))
        return out


def request_chunks(
    request: Request, keys: Sequence[ChunkKey], first: int, block_size: int, blocks_per_chunk: int,
    hash_block_size: int, at: tuple[int, int] | None = None,
) -> list[tuple[ChunkKey, ChunkBlocks]]:
    """`ChunkBlocks` of `keys[first:]`, the chunk keys of `request` (key i covers its blocks
    `[i * blocks_per_chunk, (i + 1) * blocks_per_chunk)`), as far as vLLM has hashed its blocks;
    with `at` = (chunk, blocks), `keys` is one unfull chunk: the first `blocks` of that chunk.

    vLLM hashes a request's blocks at `hash_block_size` tokens (the engine block size, or a divisor
    of it for hybrid models); a block's hash is then the hash of its last sub-block, as vLLM's own
    events name it. A request without vLLM's `block_hashes` gives nothing.
    """
    from vllm.v1.core.kv_cache_utils import resolve_block_hashes

    if block_size % hash_block_size:
        return []  # vLLM never hashes so; a view it would refuse names nothing
    hashes = resolve_block_hashes(getattr(request, "block_hashes", []), hash_block_size, block_size)
    tokens = request.all_token_ids
    adapter = getattr(request, "lora_request", None)
    lora = (str(adapter.name), int(adapter.adapter_id)) if adapter is not None else None
    bpc = blocks_per_chunk
    spans = [(i, i * bpc, bpc) for i in range(first, len(keys))] if at is None else [(0, at[0] * bpc, at[1])]
    out: list[tuple[ChunkKey, ChunkBlocks]] = []
    for i, start, count in spans:
        span = (start * block_size, (start + count) * block_size)
        if len(hashes) < start + count or len(tokens) < span[1]:
            break
        parent = hashes[start - 1] if start else None
        chunk = ChunkBlocks(tuple(hashes[start : start + count]), parent,
                            array("I", tokens[span[0] : span[1]]), lora)
        out.append((keys[i], chunk))
    return out
