"""The scheduler half of the connector: which chunks to load and store, and host-tier bookkeeping.

Runs on vLLM's scheduler thread (engine core process); nothing here blocks: host-tier calls are
in-memory, secondary tiers are reached through the tiering manager's non-blocking calls.

Loads: `get_num_new_matched_tokens` offers the chunks the host tier holds past vLLM's device hit
(from the chunk the hit ends in; None, "ask again", while a promotion is in flight);
`update_state_after_alloc` pins their rows; the next `build_connector_meta` sends the copies. With
`sync_loads` (CPU backend, one KV cache group) a load the host tier alone serves is copied before
its own step's forward pass, its pins released once every worker reported it; other loads are
asynchronous (`load_kv_async`, released on `finished_recving`). Chunks the secondary tiers hold
beyond the host tier's room are streamed in parts (`kvtier.engine.streamed_loads`). A request whose
load failed is recomputed and offered no load again (it could wait forever in vLLM's admission).

Stores: `build_connector_meta` allocates host rows (WRITING) for every full chunk the step
completes, prompt and decode chunks alike (a reply is part of the next turn's prefix); a partly
filled chunk is never stored. Chunks without room wait for the request's next step, or become a
tail once it finished (`kvtier.engine.tails`). The worker copies device → host in `wait_for_save`
(on CUDA on a copy stream, the next forward pass ordered after it); `update_connector_output`
publishes the rows once every worker reported (settled or on probation) and cascades the settled.

Per-request options (`kvtier.engine.request_options`) may skip the load or the store, restrict the
load's tiers and set the retention priority; `kvtier.engine.accounting` keeps metrics and each
request's token split; `take_events` drains KV events (`kv_events.py`); `tracing.py` records each
finished request when `trace_path` is set.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.config import KVTierConfig
from kvtier.engine.accounting import Accounting
from kvtier.engine.copies import ChunkCopy, LoadCopy, StoreCopy
from kvtier.engine.operations import Operations
from kvtier.engine.request_state import RequestState, mark_load_failed
from kvtier.engine.streamed_loads import LoadStreams, Part
from kvtier.engine.tails import Tails
from kvtier.engine.tiering_start import start_manager
from kvtier.format.chunks import HOST
from kvtier.format.keys import ChunkHasher
from kvtier.integrations.vllm.kv_events import make_translator
from kvtier.integrations.vllm.metadata import KVTierMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.model.geometry import EngineGeometry
from kvtier.integrations.vllm.model.groups import load_blocks, store_blocks
from kvtier.integrations.vllm.tracing import RequestTracer

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.vllm.scheduler")

BlockIdsFn = Callable[[str], Sequence[Sequence[int]]]


class KVTierScheduler:
    """Scheduler-side state of one engine: the tiering manager and per-request progress."""

    def __init__(
        self, config: KVTierConfig, geometry: EngineGeometry, world_size: int, events: bool = False,
        sync_loads: bool = False, hash_block_size: int | None = None,
    ) -> None:
        """Called once by the connector at engine start; starts the tier processes. `events`: the
        user enabled vLLM's KV events, so `take_events` translates kvtier's. `sync_loads`: the
        workers copy synchronously and take failed loads by block (see the module docstring)."""
        layout = geometry.layout
        self.geometry = geometry
        self.manager = start_manager(config, layout.row_bytes, layout.fingerprint)
        self.accounting = Accounting(self.manager, geometry.chunk_tokens)
        self.tier_types = {t.name: t.type for t in config.secondary_tiers}
        self.events = make_translator(config, geometry.block_size, layout.fingerprint,
                                      hash_block_size) if events else None
        self.hasher = ChunkHasher(config.hash_algorithm, geometry.fingerprint, layout.chunk_tokens)
        self.shm_dir = config.shm_dir
        self.tracer = RequestTracer.make(config, geometry)
        self.world_size = world_size
        self._block_ids_of: BlockIdsFn | None = None
        self._requests: dict[str, RequestState] = {}
        self._loads_to_send: list[ChunkCopy] = []
        self._loading: dict[str, list[bytes]] = {}
        self._stores: dict[int, StoreCopy] = {}
        self._loads: dict[int, LoadCopy] = {}
        self._job_ids = itertools.count(1)
        self.stream_promotions = config.stream_promotions
        self.promotion_wait_s = config.promotion_wait_s
        self.sync_loads = sync_loads
        self.streams = LoadStreams(self.manager, self._job_ids)
        self.tails = Tails(geometry.chunk_tokens)
        self.loads = True  # False on an instance that only stores what it computes (`kv_producer`)
        try:
            self.ops = Operations(config, self.manager)
        except BaseException:
            self.manager.shutdown()
            raise

    @property
    def region_name(self) -> str:
        region = self.manager.region
        if region is None:
            raise RuntimeError("kvtier: the host region is closed")
        return region.name

    def bind_block_ids(self, block_ids_of: BlockIdsFn) -> None:
        """Called once by the connector when vLLM binds its KV cache manager: `block_ids_of(req_id)`
        gives a running request's block ids, one list per KV cache group."""
        self._block_ids_of = block_ids_of

    # -- loads ---------------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """How many tokens past the device hit `num_computed_tokens` the host tier can load.

        Called by vLLM's scheduler for a waiting request, possibly on several steps. Returns
        (tokens, load asynchronously: a streamed one always), or (None, False) while a promotion
        is in flight. Never offers the last prompt token (as vLLM's prefix cache: hits agree). A
        hit ending inside a chunk goes on from it: the load skips the blocks the device holds.
        """
        state = self._state(request)
        ct = self.geometry.chunk_tokens
        if state is not None and not state.hits.recorded:
            state.hits.device = num_computed_tokens
            state.looked_up = 0
        offset = num_computed_tokens % ct
        if state is None or not self.loads or state.options.skip_load or state.load_failed \
                or offset % self.geometry.block_size:
            return 0, False
        start = num_computed_tokens // ct
        keys = state.keys[start : (request.num_tokens - 1) // ct]
        if not keys:
            return 0, False
        # One promotion per request (or its device hit shrank): it takes what that brought.
        found = self.manager.lookup_prefix(
            keys, state.options.load_tiers, promote=state.may_promote(start),
            stream=self.stream_promotions, priority=state.priority,
        )
        state.record_promotion(start, found.ready, (*found.promoting, *found.beyond))
        if found.beyond:
            at = start + found.ready + len(found.promoting)
            state.streamed = range(at, at + len(found.beyond))
        elif found.pending and found.promoting and self.promotion_wait_s:
            self.manager.await_promotions(keys, self.promotion_wait_s)
            found = self.manager.lookup_prefix(keys, state.options.load_tiers, promote=False)
        self.tracer.looked_up(request.request_id, found.pending)
        self.ops.lookup_answered(request.request_id, found.pending, state.promoted_from.values())
        if found.pending:
            return None, False
        if state.streamed.start != start + found.ready or (offset and not found.ready):
            state.streamed = range(0)  # nothing ready right before it to stream onto
        state.load_from = start
        state.load_offset = offset
        state.looked_up = len(keys)
        chunks = found.ready + len(state.streamed)
        state.load_sync = self.sync_loads and not state.streamed
        return (chunks * ct - offset if chunks else 0), chunks > 0 and not state.load_sync

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Pin the host rows of the chunks vLLM just allocated blocks for, and queue their load.

        Called right after `get_num_new_matched_tokens` returned `num_external_tokens` for this
        request in the same scheduler step (0: nothing to load), for every request vLLM allocates.
        """
        state = self._requests.get(request.request_id)
        if state is None:
            return
        first = state.load_from
        count = state.loaded_chunks(num_external_tokens, self.geometry.chunk_tokens)
        skipped = state.load_offset if count else 0
        streamed = len(state.streamed) if count >= len(state.streamed) else 0
        head = state.keys[first : first + count - streamed]  # ready in the host tier
        slots = self.manager.host.pin(head, access=False) if head else None
        sources = [state.promoted_from.get(c, HOST) for c in range(first, first + count)]
        self.manager.release(state.take_promoted(keep=range(first + count - streamed, first + count)))
        ok = slots is not None or not head
        if not state.hits.recorded:
            self.accounting.record_alloc(state.hits, state.looked_up, sources if ok else [], skipped)
        if num_external_tokens == 0:
            return
        bpc, skip = self.geometry.blocks_per_chunk, skipped // self.geometry.block_size
        chunks = [load_blocks(blocks.get_block_ids(), c, bpc, skip if c == first else 0)
                  for c in range(first, first + count)]
        req_id = request.request_id
        if not ok:
            # The rows left the host tier since the lookup: these chunks are recomputed.
            self.manager.metrics.inc("failures", count, HOST, "load")
            keys = state.keys[first : first + count]
            self._send(ChunkCopy(next(self._job_ids), req_id, tuple(keys), tuple(chunks), (),
                                 sync=state.load_sync))
            return
        if streamed:
            self.streams.start(req_id, state.keys[first + len(head) : first + count],
                               sources[len(head):], chunks[len(head):], state.priority,
                               head_in_flight=bool(head))
        if head and slots is not None:
            copy = ChunkCopy(next(self._job_ids), req_id, tuple(head), tuple(chunks[: len(head)]),
                             tuple(slots), last=not streamed, sync=state.load_sync)
            self._send(copy, sources[: len(head)], head, skipped)

    def _send(self, copy: ChunkCopy, sources: list[str] | None = None,
              keys: list[bytes] | None = None, skipped: int = 0) -> None:
        """Queue a load (or a part of one) for the next step; `keys` pinned for it are released
        when it ends, and its `sources` are counted then (none: a failed load; `skipped`: tokens
        of its first chunk the device held)."""
        state = self._requests.get(copy.req_id)
        mark_load_failed(state if not copy.slots else None)
        if keys:
            self._loading[copy.req_id] = keys
            if state is not None:
                self.manager.host.raise_priority(keys, state.priority)
        if copy.slots and sources is not None:
            self._loads[copy.job_id] = LoadCopy(req_id=copy.req_id, sources=sources, last=copy.last,
                                                sync=copy.sync, skipped=skipped)
        self._loads_to_send.append(copy)

    def _send_parts(self, parts: list[Part]) -> None:
        """Queue the streamed parts due this step (a part without rows failed: counted now)."""
        for part in parts:
            if part.copy.slots:
                self._send(part.copy, part.sources, list(part.copy.keys))
                continue
            state = self._requests.get(part.copy.req_id)
            self.accounting.load_failed(state.hits if state else None, part.sources)
            self._send(part.copy)

    # -- each step -----------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMetadata:
        """The loads queued since the last step and the stores of chunks this step completes.

        Called once per scheduler step, after every request was scheduled and before the requests'
        `num_computed_tokens` advance.
        """
        self.manager.poll()
        self.accounting.step()
        self._send_parts(self.streams.parts())
        self.tracer.step()
        self.ops.step(s.request for s in self._requests.values())
        stores: list[ChunkCopy] = []
        speculative = scheduler_output.scheduled_spec_decode_tokens
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None:
                continue
            # Draft tokens may be rejected: their KV is not final, so it is not stored.
            computed = state.request.num_computed_tokens + num_new - len(speculative.get(req_id, ()))
            self.tracer.scheduled(req_id, computed, state.request.num_prompt_tokens)
            first = state.extend_keys(computed, self.hasher)
            if first is not None and self.events is not None:
                self.events.remember(state.request, state.keys, first)
            store = self._plan_store(state, computed)
            if store is not None:
                stores.append(store)
        tail_stores, released = self.tails.step(self._plan_store)
        loads, self._loads_to_send = tuple(self._loads_to_send), []
        return KVTierMetadata(self.region_name, self.shm_dir, loads, (*stores, *tail_stores),
                              releases=tuple(released))

    def _plan_store(self, state: RequestState, computed: int) -> ChunkCopy | None:
        done = min(computed // self.geometry.chunk_tokens, len(state.keys))
        if done <= state.stored or state.options.skip_store or self._block_ids_of is None:
            return None
        if done > state.asked:
            asked = state.keys[state.asked : done]
            admitted = set(self.manager.admit(asked, HOST, state.priority))
            state.refused.update(c for c, k in enumerate(asked, state.asked) if k not in admitted)
            state.asked = done
        ids = self._block_ids_of(state.request.request_id)
        bpc = self.geometry.blocks_per_chunk
        # A chunk whose blocks a sliding-window group already freed can never be stored.
        held = [(c, b) for c in range(state.stored, done)
                if c not in state.refused and (b := store_blocks(ids, c, bpc)) is not None]
        keys = [state.keys[c] for c, _ in held]
        slots, fitted = self.manager.host.reserve_prefix(keys)
        # Chunks that found no room (rows pinned by copies in flight) are tried again at the
        # request's next step; a later chunk is never stored before them.
        state.stored = held[fitted][0] if fitted < len(held) else done
        if fitted < len(keys):
            self.accounting.store_rejected(len(keys) - fitted)
        new = [(c, state.keys[c], b) for c, b in held[:fitted] if state.keys[c] in slots]
        if not new:
            return None
        chunks = tuple(b for _, _, b in new)
        job_id = next(self._job_ids)
        self._stores[job_id] = StoreCopy(keys=[key for _, key, _ in new], priority=state.priority,
                                         lead=state.keys[0])
        req_id = state.request.request_id
        new_keys = tuple(key for _, key, _ in new)
        return ChunkCopy(job_id, req_id, new_keys, chunks, tuple(slots[k] for k in new_keys))

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Publish finished stores (then cascade them), release the pins of finished loads.

        Called once per step with the workers' aggregated output of an earlier step.
        """
        host = self.manager.host
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVTierWorkerMetadata):
            self._finish_loads(meta)
            for job_id, (acks, ok) in meta.stores.items():
                store = self._stores.get(job_id)
                seconds = meta.seconds.get(job_id, 0.0)
                if store is None or not store.ack(acks, ok, seconds, self.world_size):
                    continue
                del self._stores[job_id]
                self.accounting.copied("store", len(store.keys), store.seconds, store.ok)
                self.manager.publish(store.keys, store.ok, store.priority, store.lead)
        for req_id in output.finished_recving or ():
            keys = self._loading.pop(req_id, None)
            if keys is not None:
                host.unpin(keys)
        self.manager.poll()

    def _finish_loads(self, meta: KVTierWorkerMetadata) -> None:
        """Count the host → device copies every worker finished (metrics and hit records)."""
        for job_id, (acks, ok) in meta.loads.items():
            load = self._loads.get(job_id)
            seconds = meta.seconds.get(job_id, 0.0)
            if load is None or not load.ack(acks, ok, seconds, self.world_size):
                continue
            del self._loads[job_id]
            if not load.last or load.sync:
                keys = self._loading.pop(load.req_id, None)
                if keys is not None:
                    self.manager.host.unpin(keys)
            if not load.last:
                self.streams.part_done(load.req_id, load.ok)
            if load.ok:
                self.accounting.copied("load", len(load.sources), load.seconds, ok=True)
            else:
                state = self._requests.get(load.req_id)
                mark_load_failed(state)
                self.accounting.load_failed(state.hits if state else None, load.sources,
                                            load.skipped)

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        """Forget the request; return its prompt-token split for `kv_transfer_params` (None when
        kvtier could not key it). Called once when it finishes or is aborted. Chunks that found no
        host room yet become a tail (`kvtier.engine.tails`: vLLM keeps the blocks until they are stored)."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return None
        self.tails.hold(state, request.num_computed_tokens)
        self.manager.host.used_prefix(state.keys)
        self.ops.finished(request)
        self.manager.release(state.take_promoted())
        self.streams.drop(request.request_id)
        params = self.accounting.finish(request.request_id, state.hits)
        self.tracer.finished(request, state.keys, params["kvtier"]["tokens"], state.priority)
        return params

    def hit_sources(self, request: Request) -> dict[str, int]:
        """Tokens loaded for `request` by kvtier source ("host" or a tier name), for vLLM's
        per-source hit counters; called after `update_state_after_alloc`."""
        state = self._requests.get(request.request_id)
        return {} if state is None else {k: v for k, v in state.hits.loaded.items() if v > 0}

    def take_events(self) -> list[Any]:
        """vLLM KV events for what the tiers stored and removed (or sidecars named) since the last
        call; none when KV events are off (kvtier's are still drained). Called every step."""
        events = self.manager.take_events()
        return [] if self.events is None else self.events.translate_all(events)

    def reset_cache(self) -> bool:
        """Drop every unpinned chunk of the host tier (vLLM's `reset_prefix_cache(reset_connector=
        True)`); secondary tiers keep theirs (they are shared and persistent)."""
        self.manager.host.clear()
        return True

    def shutdown(self) -> None:
        """Close the control socket, stop the secondary tiers and remove the host region, then the
        trace writer and the event sidecars. Idempotent."""
        self.ops.shutdown()
        self.manager.shutdown()
        self.tracer.close()
        if self.events is not None:
            self.events.close()

    def _state(self, request: Request) -> RequestState | None:
        """The request's state, keyed on first sight (None: it cannot be cached)."""
        state = self._requests.get(request.request_id)
        if state is None and (state := RequestState.of(request, self.hasher)) is not None:
            self.manager.record_request(state.keys)
            if self.events is not None:
                self.events.remember(request, state.keys)
            self._requests[request.request_id] = state
        return state
