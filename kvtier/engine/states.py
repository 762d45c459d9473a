"""The request path's part for models with recurrent layers (gated delta net or Mamba2 beside
attention), composed into the `Planner`.

The planner keeps handling the attention layers' chunks, on the attention groups' block ids alone.
This part adds the state segments (`kvtier.format.state_rows`, `kvtier.engine.geometry.StateGroups`):

- Lookups (`trim`): of the chunks past the device hit that the tiers hold (attention rows, promoted
  as usual), the hit ends at the last chunk n whose end has a state segment held too (promoted from
  a secondary tier when the host tier lacks it, once per request): attention chunks up to T = n *
  chunk_tokens and the state at T, or nothing. Promotions are not streamed (a streamed run could
  end where no state was checked).
- Loads (`allocated`): the state at T is pinned with the chunks and copied into the block each
  state group allocated for it, in the same step as the chunks; its rows are released when the
  engine reports the request's load finished. A state that cannot be pinned fails the request's
  load (recomputed).
- Stores (`stores`): every boundary state the engine offers in a step (vLLM:
  `boundary_state_offloads`) that ends a chunk of a request kvtier keys, and whose rows the host
  tier does not hold yet, is copied after that step's forward pass; its rows are published and
  cascaded like chunks.

Metrics count rows: a state segment's rows are counted in `kvtier_transfer_chunks_total` (and
bytes) like chunk rows, for host copies and tier jobs alike; the per-request token split counts
tokens, which the attention chunks carry (a state adds none). Called on the scheduler thread only.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence

from kvtier.engine.accounting import Accounting
from kvtier.engine.copies import CopyAcks, StateCopy
from kvtier.engine.geometry import StateGroups
from kvtier.engine.request_state import RequestState
from kvtier.engine.step import CopyReport
from kvtier.engine.stores import StorePlanner
from kvtier.format.chunks import ChunkKey
from kvtier.format.state_rows import state_keys
from kvtier.manager import TieringManager


class StatePlanner:
    """The state segments of one engine's recurrent layers: lookups, pins, copies."""

    def __init__(self, states: StateGroups, chunk_tokens: int, manager: TieringManager,
                 accounting: Accounting, world_size: int) -> None:
        self.states = states
        self.chunk_tokens = chunk_tokens
        self.manager = manager
        self.accounting = accounting
        self.world_size = world_size
        self._loads: list[StateCopy] = []
        self._promoted: dict[str, list[ChunkKey]] = {}
        """Request → the state rows promoted for it (held until its load pinned them)."""
        self._pins: dict[str, list[ChunkKey]] = {}
        """Request → the state rows pinned for its load in flight."""
        self._load_acks: dict[int, CopyAcks] = {}

    def trim(self, state: RequestState, tokens: int) -> tuple[int | None, bool]:
        """The planner's offer of `tokens` (> 0) for `state`, cut back to the last chunk end whose
        state the host tier holds: (tokens, load asynchronously), or (None, False) while a state
        is being promoted or written."""
        start = state.load_from
        for end in range(start + state.loaded_chunks(tokens, self.chunk_tokens), start, -1):
            found = self._ready(state, end)
            if found is None:
                return None, False
            if found:
                return (end - start) * self.chunk_tokens - state.load_offset, True
        return 0, False

    def _ready(self, state: RequestState, end: int) -> bool | None:
        """Whether the host tier holds the state after chunk `end - 1` (None: it is being promoted
        or written: ask again)."""
        req_id = state.request.request_id
        keys = state_keys(self.states.layout, state.keys[end - 1])
        found = self.manager.lookup_prefix(
            keys, state.options.load_tiers, promote=req_id not in self._promoted,
            priority=state.priority, tenant=state.tenant,
        )
        if found.ready == len(keys):
            return True
        if found.promoting:
            self._promoted[req_id] = keys[found.ready : found.ready + len(found.promoting)]
        return None if found.pending else False

    def allocated(self, state: RequestState, block_ids: Sequence[Sequence[int]],
                  num_external_tokens: int, job_ids: Iterator[int]) -> None:
        """Pin the state at the end of the load the engine just allocated `block_ids` (every
        group's) for, and queue its copy; release what was promoted for it."""
        req_id = state.request.request_id
        promoted = self._promoted.pop(req_id, [])
        if num_external_tokens > 0:
            end = state.load_from + state.loaded_chunks(num_external_tokens, self.chunk_tokens)
            keys = tuple(state_keys(self.states.layout, state.keys[end - 1]))
            targets = self.states.load_blocks(block_ids, end * self.chunk_tokens)
            slots = self.manager.pin_rows(keys, access=True) if targets is not None else None
            job_id = next(job_ids)
            if slots is not None:
                self._pins[req_id] = list(keys)
                self._load_acks[job_id] = CopyAcks()
            self._loads.append(StateCopy(job_id, req_id, keys, targets or (), tuple(slots or ())))
        if promoted:
            self.manager.release(promoted)

    def take_loads(self) -> tuple[StateCopy, ...]:
        """The state loads queued since the last step."""
        loads, self._loads = tuple(self._loads), []
        return loads

    def stores(self, requests: Mapping[str, RequestState],
               offloads: Mapping[str, Sequence[tuple[int, int, int]]],
               planner: StorePlanner) -> tuple[StateCopy, ...]:
        """The copies of the (group, block, boundary) states the engine offers this step."""
        out = []
        for req_id, entries in offloads.items():
            state = requests.get(req_id)
            if state is None or state.options.skip_store:
                continue
            by_boundary: dict[int, dict[int, int]] = {}
            for group, block, boundary in entries:
                by_boundary.setdefault(boundary, {})[group] = block
            for boundary, blocks in sorted(by_boundary.items()):
                copy = self._store(state, boundary, blocks, planner)
                if copy is not None:
                    out.append(copy)
        return tuple(out)

    def _store(self, state: RequestState, boundary: int, blocks: dict[int, int],
               planner: StorePlanner) -> StateCopy | None:
        """The copy of the state at `boundary` (blocks by engine group) when it ends a keyed chunk
        the host tier admitted and does not hold yet, with its rows reserved; else None."""
        chunk = boundary // self.chunk_tokens - 1
        if boundary % self.chunk_tokens or not 0 <= chunk < len(state.keys) or chunk in state.refused:
            return None
        if any(blocks.get(g, 0) == 0 for g in self.states.group_ids):
            return None
        keys = state_keys(self.states.layout, state.keys[chunk])
        slots, fitted = self.manager.reserve_rows(keys, state.tenant)
        if fitted < len(keys) or len(slots) < len(keys):
            self.manager.abandon_rows(list(slots))  # held already, or no room
            return None
        job_id = planner.add(keys, state.priority)
        block_ids = tuple(blocks[g] for g in self.states.group_ids)
        return StateCopy(job_id, state.request.request_id, tuple(keys), block_ids,
                         tuple(slots[k] for k in keys))

    def copies_done(self, report: CopyReport | None, finished_loading: Collection[str]) -> None:
        """Count the state loads every worker reported; unpin those of finished loads."""
        if report is not None:
            for job_id, (acks, ok) in report.loads.items():
                load = self._load_acks.get(job_id)
                if load is not None and load.ack(acks, ok, report.seconds.get(job_id, 0.0), self.world_size):
                    del self._load_acks[job_id]
                    self.accounting.copied("load", self.states.layout.rows, load.seconds, load.ok)
        for req_id in finished_loading:
            keys = self._pins.pop(req_id, None)
            if keys is not None:
                self.manager.unpin_rows(keys)

    def finished(self, req_id: str) -> None:
        """The request finished: release the states promoted for it and never pinned."""
        promoted = self._promoted.pop(req_id, None)
        if promoted:
            self.manager.release(promoted)
