"""Device → host stores: the host rows reserved for the chunks a step completes, published once
every worker copied them.

Runs on the scheduler thread, called by the `Planner` (and by `StatePlanner` for state segments).
A chunk is stored once, in chunk order: a chunk the admission policies refused for the host tier
is never stored; one whose blocks a sliding-window group already freed can never be; one without
room (rows pinned by copies in flight) is tried again at the request's next step, and no later
chunk is stored before it. A store job's rows are published (settled or on probation) and
cascaded when every worker acknowledged it, or rolled back when one failed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from kvtier.engine.accounting import Accounting
from kvtier.engine.copies import ChunkCopy, StoreCopy, StoreRow
from kvtier.engine.geometry import EngineGeometry, store_blocks
from kvtier.engine.request_state import RequestState
from kvtier.engine.step import CopyReport
from kvtier.engine.unfull import UnfullChunks
from kvtier.format.chunks import HOST, ChunkKey
from kvtier.manager import TieringManager

BlockIdsFn = Callable[[str], Sequence[Sequence[int]]]


class StorePlanner:
    """The store jobs of one engine, from reservation to publication."""

    def __init__(self, manager: TieringManager, accounting: Accounting, geometry: EngineGeometry,
                 world_size: int, job_ids: Iterator[int], unfull: UnfullChunks) -> None:
        self.manager = manager
        self.accounting = accounting
        self.geometry = geometry
        self.world_size = world_size
        self.job_ids = job_ids
        self.unfull = unfull
        self.block_ids_of: BlockIdsFn | None = None
        """A running request's block ids per KV cache group, once the engine bound its cache."""
        self._jobs: dict[int, StoreCopy] = {}

    def plan(self, state: RequestState, computed: int) -> ChunkCopy | None:
        """The copy of the chunks of `state` that its first `computed` tokens complete and that
        are not stored yet, with their rows reserved, and of its unfull chunk once it is due and
        every full one stored; None when there is none (or no room)."""
        done = min(computed // self.geometry.chunk_tokens, len(state.keys))
        if state.options.skip_store or self.block_ids_of is None:
            return None
        if done <= state.stored:
            return self._unfull(state)
        if done > state.asked:
            asked = state.keys[state.asked : done]
            admitted = set(self.manager.admit(asked, HOST, state.priority))
            state.refused.update(c for c, k in enumerate(asked, state.asked) if k not in admitted)
            state.asked = done
        ids = self.geometry.attention_ids(self.block_ids_of(state.request.request_id))
        bpc = self.geometry.blocks_per_chunk
        held = [(c, b) for c in range(state.stored, done)
                if c not in state.refused and (b := store_blocks(ids, c, bpc)) is not None]
        keys = [state.keys[c] for c, _ in held]
        slots, fitted = self.manager.reserve_rows(keys, state.tenant)
        state.stored = held[fitted][0] if fitted < len(held) else done
        if fitted < len(keys):
            self.accounting.store_rejected(len(keys) - fitted)
        new = [(state.keys[c], b, slots[state.keys[c]]) for c, b in held[:fitted] if state.keys[c] in slots]
        return self._copy(state, new)

    def _unfull(self, state: RequestState) -> ChunkCopy | None:
        if state.unfull_due is None or self.block_ids_of is None:
            return None
        ids = self.geometry.attention_ids(self.block_ids_of(state.request.request_id))
        row = self.unfull.reserve(state, ids)
        return self._copy(state, [row] if row else [])

    def _copy(self, state: RequestState, new: list[StoreRow]) -> ChunkCopy | None:
        """The store job of rows reserved for (key, block ids, slot) each; None for none."""
        if not new:
            return None
        keys = tuple(key for key, _, _ in new)
        job_id = self.add(keys, state.priority, lead=state.keys[0] if state.keys else None)
        return ChunkCopy(job_id, state.request.request_id, keys, tuple(b for _, b, _ in new),
                         tuple(slot for _, _, slot in new))

    def add(self, keys: Sequence[ChunkKey], priority: int, lead: ChunkKey | None = None) -> int:
        """A store job for rows of `keys` already reserved; its id. `lead`: the first chunk of the
        request that computed them, for the admission policies' probation (None: settled)."""
        job_id = next(self.job_ids)
        self._jobs[job_id] = StoreCopy(keys=list(keys), priority=priority, lead=lead)
        return job_id

    def done(self, report: CopyReport) -> None:
        """Publish (then cascade) or roll back each store every worker has now reported."""
        for job_id, (acks, ok) in report.stores.items():
            store = self._jobs.get(job_id)
            if store is None or not store.ack(acks, ok, report.seconds.get(job_id, 0.0), self.world_size):
                continue
            del self._jobs[job_id]
            self.accounting.copied("store", len(store.keys), store.seconds, store.ok)
            self.manager.publish(store.keys, store.ok, store.priority, store.lead)
