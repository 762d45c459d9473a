"""The scheduler half for models with recurrent layers (gated delta net beside attention).

`KVTierScheduler` keeps handling the attention layers' chunks, on the attention groups' block ids
alone. This subclass adds the state segments (`kvtier.format.state_rows`, `model/state_groups.py`):

- Lookups: of the chunks past the device hit that the tiers hold (attention rows, promoted as
  usual), the hit ends at the last chunk n whose end has a state segment held too (promoted from a
  secondary tier when the host tier lacks it, once per request): attention chunks up to T = n *
  chunk_tokens and the state at T, or nothing. Promotions are not streamed (a streamed run could
  end where no state was checked).
- Loads: the state at T is pinned with the chunks and copied into the block each state group
  allocated for it, in the same step as the chunks; its rows are released when vLLM reports the
  request's load finished. A state that cannot be pinned fails the request's load (recomputed).
- Stores: every boundary state vLLM offers in a step (`boundary_state_offloads`) that ends a chunk
  of a request kvtier keys, and whose rows the host tier does not hold yet, is copied in that
  step's `wait_for_save`; its rows are published and cascaded like chunks.

Metrics count rows: a state segment's rows are counted in `kvtier_transfer_chunks_total` (and
bytes) like chunk rows, for host copies and tier jobs alike; the per-request token split counts
tokens, which the attention chunks carry (a state adds none).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from kvtier.config import KVTierConfig
from kvtier.engine.copies import CopyAcks, StateCopy, StoreCopy
from kvtier.engine.request_state import RequestState
from kvtier.format.state_rows import state_keys
from kvtier.integrations.vllm.metadata import KVTierMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.model.geometry import EngineGeometry
from kvtier.integrations.vllm.scheduler_half import BlockIdsFn, KVTierScheduler

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class _AttentionBlocks:
    """A request's new blocks as `update_state_after_alloc` sees them, attention groups only."""

    def __init__(self, ids: Sequence[Sequence[int]]) -> None:
        self._ids = tuple(list(group) for group in ids)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self._ids


class StateScheduler(KVTierScheduler):
    """`KVTierScheduler` plus the state segments of a model's recurrent layers."""

    def __init__(
        self, config: KVTierConfig, geometry: EngineGeometry, world_size: int, events: bool = False,
        hash_block_size: int | None = None,
    ) -> None:
        if geometry.states is None:
            raise ValueError("StateScheduler needs a geometry with recurrent-state groups")
        super().__init__(config, geometry, world_size, events, hash_block_size=hash_block_size)
        self.states = geometry.states
        self.stream_promotions = False
        self._state_loads: list[StateCopy] = []
        self._promoted_states: dict[str, list[bytes]] = {}
        """Request → the state rows promoted for it (held until its load pinned them)."""
        self._state_pins: dict[str, list[bytes]] = {}
        """Request → the state rows pinned for its load in flight."""
        self._state_load_acks: dict[int, CopyAcks] = {}

    def _attention(self, ids: Sequence[Sequence[int]]) -> list[Sequence[int]]:
        return [ids[g] for g in self.geometry.group_ids]

    def bind_block_ids(self, block_ids_of: BlockIdsFn) -> None:
        super().bind_block_ids(lambda req_id: self._attention(block_ids_of(req_id)))

    # -- loads ---------------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tokens, load = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if not tokens:
            return tokens, load
        state = self._requests[request.request_id]
        ct = self.geometry.chunk_tokens
        start = state.load_from
        for end in range(start + state.loaded_chunks(tokens, ct), start, -1):
            found = self._state_ready(state, end)
            if found is None:
                return None, False
            if found:
                return (end - start) * ct - state.load_offset, True
        return 0, False

    def _state_ready(self, state: RequestState, end: int) -> bool | None:
        """Whether the host tier holds the state after chunk `end - 1` (None: it is being promoted
        or written: ask again)."""
        req_id = state.request.request_id
        keys = state_keys(self.states.layout, state.keys[end - 1])
        found = self.manager.lookup_prefix(
            keys, state.options.load_tiers, promote=req_id not in self._promoted_states,
            priority=state.priority,
        )
        if found.ready == len(keys):
            return True
        if found.promoting:
            self._promoted_states[req_id] = keys[found.ready : found.ready + len(found.promoting)]
        return None if found.pending else False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        ids = blocks.get_block_ids()
        attention = cast("KVCacheBlocks", _AttentionBlocks(self._attention(ids)))
        super().update_state_after_alloc(request, attention, num_external_tokens)
        req_id = request.request_id
        promoted = self._promoted_states.pop(req_id, [])
        state = self._requests.get(req_id)
        if state is not None and num_external_tokens > 0:
            end = state.load_from + state.loaded_chunks(num_external_tokens, self.geometry.chunk_tokens)
            keys = tuple(state_keys(self.states.layout, state.keys[end - 1]))
            targets = self.states.load_blocks(ids, end * self.geometry.chunk_tokens)
            slots = self.manager.host.pin(keys) if targets is not None else None
            job_id = next(self._job_ids)
            if slots is not None:
                self._state_pins[req_id] = list(keys)
                self._state_load_acks[job_id] = CopyAcks()
            self._state_loads.append(StateCopy(job_id, req_id, keys, targets or (), tuple(slots or ())))
        if promoted:
            self.manager.release(promoted)

    # -- each step -----------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMetadata:
        meta = super().build_connector_meta(scheduler_output)
        meta.state_loads, self._state_loads = tuple(self._state_loads), []
        block_state = scheduler_output.kv_connector_block_state
        offloads = block_state.boundary_state_offloads if block_state is not None else {}
        stores = []
        for req_id, entries in offloads.items():
            state = self._requests.get(req_id)
            if state is None or state.options.skip_store:
                continue
            by_boundary: dict[int, dict[int, int]] = {}
            for group, block, boundary in entries:
                by_boundary.setdefault(boundary, {})[group] = block
            for boundary, blocks in sorted(by_boundary.items()):
                copy = self._state_store(state, boundary, blocks)
                if copy is not None:
                    stores.append(copy)
        meta.state_stores = tuple(stores)
        return meta

    def _state_store(self, state: RequestState, boundary: int, blocks: dict[int, int]) -> StateCopy | None:
        """The copy of the state at `boundary` (blocks by vLLM group) when it ends a keyed chunk
        the host tier admitted and does not hold yet, with its rows allocated; else None."""
        ct = self.geometry.chunk_tokens
        chunk = boundary // ct - 1
        if boundary % ct or not 0 <= chunk < len(state.keys) or chunk in state.refused:
            return None
        if any(blocks.get(g, 0) == 0 for g in self.states.group_ids):
            return None
        keys = state_keys(self.states.layout, state.keys[chunk])
        host = self.manager.host
        slots, fitted = host.reserve_prefix(keys)
        if fitted < len(keys) or len(slots) < len(keys):
            host.commit(list(slots), success=False)  # held already, or no room
            return None
        job_id = next(self._job_ids)
        self._stores[job_id] = StoreCopy(keys=list(keys), priority=state.priority)
        block_ids = tuple(blocks[g] for g in self.states.group_ids)
        targets = tuple(slots[k] for k in keys)
        return StateCopy(job_id, state.request.request_id, tuple(keys), block_ids, targets)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVTierWorkerMetadata):
            for job_id, (acks, ok) in meta.loads.items():
                load = self._state_load_acks.get(job_id)
                if load is not None and load.ack(acks, ok, meta.seconds.get(job_id, 0.0), self.world_size):
                    del self._state_load_acks[job_id]
                    self.accounting.copied("load", self.states.layout.rows, load.seconds, load.ok)
        for req_id in output.finished_recving or ():
            keys = self._state_pins.pop(req_id, None)
            if keys is not None:
                self.manager.host.unpin(keys)
        super().update_connector_output(output)

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        promoted = self._promoted_states.pop(request.request_id, None)
        if promoted:
            self.manager.release(promoted)
        return super().request_finished(request)
