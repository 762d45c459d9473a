"""Unfull chunks: the whole engine blocks after a request's last full chunk, stored and found again.

With chunks of several engine blocks, the KV a request computed past its last full chunk is `b`
whole blocks (0 < b < blocks_per_chunk) and a partial block. When the request finishes, those b
blocks are stored under the unfull key of their tokens (`ChunkHasher.unfull_key`), as a tail (the
engine keeps the request's blocks until the store is planned: `kvtier.engine.tails`). An unfull
chunk fills a whole host row: the row's blocks after the b-th hold copies of the b-th block, so a
row never carries bytes of another request and every copy path sees a whole chunk.

A later request continuing the same prefix finds them where its run of full chunks ends: its
lookup tries that chunk's unfull keys from the most blocks down (the host tier, then the secondary
tiers, which promote it like any chunk) and loads the b blocks found; the chunk's blocks after them
are left to the forward pass. A multi-turn conversation's next turn so reloads the tokens its last
turn ended with, at any chunk size.

Not for models with recurrent layers (their state at an unfull chunk's end is not stored) nor with
a single block per chunk (nothing is unfull). Runs on the scheduler thread; never blocks but
where a lookup does (`lookup_wait_s`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvtier.engine.copies import StoreRow
from kvtier.engine.events import EventTranslator
from kvtier.engine.geometry import EngineGeometry, store_blocks
from kvtier.engine.request_state import RequestState, Unfull
from kvtier.format.chunks import HOST
from kvtier.format.keys import ChunkHasher
from kvtier.manager import TieringManager
from kvtier.tiers.base import LookupResult


class UnfullChunks:
    """The unfull chunks of one engine's requests: their keys, lookups, loads and stores."""

    def __init__(self, geometry: EngineGeometry, hasher: ChunkHasher, manager: TieringManager,
                 events: EventTranslator | None = None) -> None:
        self.enabled = geometry.blocks_per_chunk > 1 and geometry.states is None
        self.block_size = geometry.block_size
        self.blocks_per_chunk = geometry.blocks_per_chunk
        self.chunk_tokens = geometry.chunk_tokens
        self.hasher = hasher
        self.manager = manager
        self.events = events

    def candidates(self, state: RequestState, chunk: int | None, first: int, end: int) -> list[Unfull]:
        """Chunk `chunk`'s unfull keys whose tokens reach past token `first` and stay within the
        first `end` tokens of `state`'s sequence, the most blocks first (None: no chunk, none)."""
        if not self.enabled or chunk is None or chunk > len(state.keys):
            return []
        base, bs = chunk * self.chunk_tokens, self.block_size
        most = min(self.blocks_per_chunk - 1, (end - base) // bs)
        tokens = state.request.all_token_ids
        parent = self._parent(state, chunk)
        return [Unfull(chunk, b, self.hasher.unfull_key(parent, tokens[base : base + b * bs]))
                for b in range(most, 0, -1) if base + b * bs > first]

    def lookup(self, state: RequestState, chunk: int | None, first: int, end: int,
               tiers: Collection[str] | None) -> None:
        """Set `state.unfull` to its unfull chunk at chunk `chunk` (past token `first`, within
        `end`; None: a stream follows the run, no unfull chunk) that the host tier holds readable,
        or None. The most blocks a secondary tier holds
        are promoted first, once per request (held for it until `take_promoted`), unless the
        request chose to recompute what a tier held (`load_policy: auto`); meanwhile, and while a
        tier's answer is unknown, `state.unfull_pending` says "ask again"."""
        state.unfull, state.unfull_pending = None, False
        promoted = state.unfull_promoted
        if promoted is not None:
            ready = self.manager.ready_prefix([promoted.key]) if promoted.chunk == chunk else 0
            state.unfull_pending = ready is None
            state.unfull = promoted if ready else None
            return
        candidates = self.candidates(state, chunk, first, end)
        found = self.manager.locate([c.key for c in candidates], tiers) if candidates else []
        for candidate, where in zip(candidates, found, strict=True):
            if where == HOST:
                state.unfull = candidate
            elif where is LookupResult.RETRY:
                state.unfull_pending = True
            elif isinstance(where, str) and not state.released and not state.hits.by_choice \
                    and self.manager.promote(
                    [candidate.key], [where], state.priority, state.tenant):
                state.unfull_promoted = Unfull(candidate.chunk, candidate.blocks, candidate.key, where)
                state.unfull_pending = True
            if where is not LookupResult.MISS:
                return

    def due(self, state: RequestState, computed: int) -> Unfull | None:
        """The unfull chunk the finished `state`, whose blocks hold `computed` tokens, leaves to
        store once its full chunks are stored (None: none); the integration's events learn its
        blocks."""
        chunk, rest = divmod(computed, self.chunk_tokens)
        blocks = rest // self.block_size
        if not self.enabled or state.options.skip_store or chunk != len(state.keys) or not blocks:
            return None
        base = chunk * self.chunk_tokens
        key = self.hasher.unfull_key(self._parent(state, chunk),
                                     state.request.all_token_ids[base : base + blocks * self.block_size])
        if self.events is not None:
            self.events.remember_unfull(state.request, key, chunk, blocks)
        return Unfull(chunk, blocks, key)

    def reserve(self, state: RequestState, ids: Sequence[Sequence[int]]) -> StoreRow | None:
        """The store of `state`'s due unfull chunk, its row reserved; None when there is none to
        store (then it is no longer due) or no room now."""
        due = state.unfull_due
        if due is None:
            return None
        block_ids = store_blocks(ids, due.chunk, self.blocks_per_chunk, held=due.blocks)
        if block_ids is None or not self.manager.admit([due.key], HOST, state.priority):
            state.unfull_due = None
            return None
        slots, fitted = self.manager.reserve_rows([due.key], state.tenant)
        if not fitted:
            return None
        state.unfull_due = None
        return (due.key, block_ids, slots[due.key]) if due.key in slots else None

    def _parent(self, state: RequestState, chunk: int) -> bytes:
        if chunk:
            return state.keys[chunk - 1]
        return self.hasher.root(cache_salt=state.request.cache_salt, lora=state.lora)
