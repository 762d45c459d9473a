"""The scheduler side of the request path: which chunks to load and store, per request and step.

Runs on the engine's scheduler thread; it waits there only where the manager does (a lookup's
`tier_lookup_wait_s`; `await_promotions` up to `promotion_wait_s` when a promotion it started is
nearly done). An engine integration calls it at the points named below (vLLM's hooks in
parentheses) with plain values: requests (`kvtier.engine.request.Request`), block ids per KV cache
group, token counts; it answers with `StepPlan`s for the workers.

Loads: `lookup` (`get_num_new_matched_tokens`) offers the chunks the host tier holds past the
device hit (from the chunk the hit ends in; None, "ask again", while a promotion is in flight),
and the unfull chunk where they end (`kvtier.engine.unfull`); `allocated`
(`update_state_after_alloc`) pins their rows; the next `step` sends the copies. With `sync_loads`
(CPU backend, one KV cache group) a load the host tier alone serves is copied before its own
step's forward pass, its pins released once every worker reported it; other loads are asynchronous
(released when the engine reports the request's load finished). Chunks the secondary tiers hold
beyond the host tier's room are streamed in parts (`kvtier.engine.streamed_loads`). A request whose
load failed is recomputed and offered no load again (it could wait forever in admission).

Stores: `step` (`build_connector_meta`) reserves host rows for every full chunk the step completes,
prompt and decode chunks alike (a reply is part of the next turn's prefix). Chunks without room
wait for the request's next step, or become a tail once it finished (`kvtier.engine.tails`), as
does its unfull chunk. The workers copy device → host after the forward pass; `copies_done`
(`update_connector_output`) publishes the rows once every worker reported and cascades the settled.

Recurrent layers (gated delta net, Mamba2): a `StatePlanner` (`kvtier.engine.states`) is composed
in; it trims lookups to chunk ends whose state is held and plans the state copies. Per-request
options (`kvtier.engine.request_options`) may skip the load or the store, restrict the load's
tiers and set the retention priority; `kvtier.engine.accounting` keeps metrics and each request's
token split; `take_events` drains tier events through the integration's translator;
`kvtier.engine.tracing` records finished requests (`trace_path`); `kvtier.engine.load_choice`
measures loads and prefill, and under `load_policy: auto` cuts a promotion short where
recomputing comes back sooner, and its `GiveUps` bounds a request's wait for one.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from functools import partial
from typing import Any

from kvtier.config import AUTO, KVTierConfig
from kvtier.engine.accounting import Accounting
from kvtier.engine.copies import ChunkCopy, LoadCopy
from kvtier.engine.events import EventTranslator
from kvtier.engine.geometry import EngineGeometry, load_blocks
from kvtier.engine.load_choice import GiveUps, LoadChoice
from kvtier.engine.operations import Operations
from kvtier.engine.request import Request
from kvtier.engine.request_state import RequestState, mark_load_failed
from kvtier.engine.states import StatePlanner
from kvtier.engine.step import CopyReport, StepPlan
from kvtier.engine.stores import BlockIdsFn, StorePlanner
from kvtier.engine.streamed_loads import LoadStreams, Part
from kvtier.engine.tails import Tails
from kvtier.engine.tiering_start import start_manager
from kvtier.engine.tracing import RequestTracer
from kvtier.engine.unfull import UnfullChunks
from kvtier.format.chunks import HOST
from kvtier.format.keys import ChunkHasher


class Planner:
    """Scheduler-side state of one engine: the tiering manager and per-request progress."""

    def __init__(self, config: KVTierConfig, geometry: EngineGeometry, world_size: int,
                 events: EventTranslator | None = None, sync_loads: bool = False) -> None:
        """Called once by the integration at engine start; starts the tier processes. `events`:
        the user enabled the engine's KV events, so `take_events` translates kvtier's through it.
        `sync_loads`: the workers copy synchronously and take failed loads by block (see the
        module docstring)."""
        layout = geometry.layout
        self.geometry = geometry
        self.manager = start_manager(config, layout.row_bytes, layout.fingerprint)
        self.accounting = Accounting(self.manager, geometry.chunk_tokens, config.load_policy == AUTO,
                                     config.tenants)
        self.choice = LoadChoice(config.load_policy, self.manager, geometry.chunk_tokens)
        self.tier_types = {t.name: t.type for t in config.secondary_tiers}
        self.events = events
        self.hasher = ChunkHasher(config.hash_algorithm, geometry.fingerprint, layout.chunk_tokens)
        self.shm_dir = config.shm_dir
        self.tracer = RequestTracer.make(config, geometry)
        self.world_size = world_size
        self._requests: dict[str, RequestState] = {}
        self._loads_to_send: list[ChunkCopy] = []
        self._loading: dict[str, list[bytes]] = {}
        self._loads: dict[int, LoadCopy] = {}
        self._job_ids = self.manager.job_ids
        self.promotion_wait_s = config.promotion_wait_s
        self.max_client_priority = config.max_client_priority
        self.sync_loads = sync_loads
        self.states = None if geometry.states is None else StatePlanner(
            geometry.states, geometry.chunk_tokens, self.manager, self.accounting, world_size)
        self.stream_promotions = config.stream_promotions and self.states is None
        self.give_ups = GiveUps(self.manager, self.choice, geometry.chunk_tokens)
        self.streams = LoadStreams(self.manager, self._job_ids, self.give_ups.part_patience)
        self.unfull = UnfullChunks(geometry, self.hasher, self.manager, events)
        self.stores = StorePlanner(self.manager, self.accounting, geometry, world_size, self._job_ids,
                                   self.unfull)
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
        """Called once, when the engine's KV cache manager exists (vLLM's `bind_kv_cache_manager`):
        `block_ids_of(req_id)` gives a running request's block ids, one list per KV cache group."""
        self.stores.block_ids_of = block_ids_of

    # -- loads ---------------------------------------------------------------------------------

    def lookup(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """How many tokens past the device hit `num_computed_tokens` the host tier can load.

        Called for a waiting request, possibly on several steps (vLLM's
        `get_num_new_matched_tokens`). Returns
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
        keys = self.give_ups.cap(state, start, state.keys[start : (request.num_tokens - 1) // ct])
        if not keys and not self.unfull.enabled:
            return 0, False
        # One promotion per request (or its device hit shrank): it takes what that brought.
        found = self.manager.lookup_prefix(
            keys, state.options.load_tiers, promote=state.may_promote(start),
            stream=self.stream_promotions, priority=state.priority, tenant=state.tenant,
            choose=partial(self.choice.choose, state.hits.by_choice),
        )
        state.record_promotion(start, found.ready, (*found.promoting, *found.beyond))
        if found.beyond:
            at = start + found.ready + len(found.promoting)
            state.streamed = range(at, at + len(found.beyond))
        elif found.pending and found.promoting and self.promotion_wait_s:
            self.manager.await_promotions(keys, self.promotion_wait_s)
            found = self.manager.lookup_prefix(keys, state.options.load_tiers, promote=False)
        found = self.give_ups.check(state, start, keys, found) if found.pending else found
        if not found.pending:
            state.waiting_since = None
            if state.streamed.start != start + found.ready or (offset and not found.ready):
                state.streamed = range(0)  # nothing ready right before it to stream onto
            end = None if state.streamed else start + found.ready
            self.unfull.lookup(state, end, num_computed_tokens, request.num_tokens - 1,
                               state.options.load_tiers)
        pending = found.pending or state.unfull_pending
        self.tracer.looked_up(request.request_id, pending)
        self.ops.lookup_answered(request.request_id, pending, state.promoted_from.values())
        if pending:
            return None, False
        state.load_from = start
        state.load_offset = offset
        state.looked_up = len(keys)
        chunks = found.ready + len(state.streamed)
        state.load_sync = self.sync_loads and not state.streamed
        if chunks and self.states is not None:
            return self.states.trim(state, chunks * ct - offset)
        tokens = chunks * ct + (state.unfull.blocks * self.geometry.block_size if state.unfull else 0)
        return (tokens - offset if tokens else 0), tokens > 0 and not state.load_sync

    def allocated(self, request: Request, block_ids: Sequence[Sequence[int]], num_external_tokens: int
                  ) -> None:
        """Pin the host rows of the chunks the engine just allocated `block_ids` (per KV cache
        group) for, and queue their load.

        Called right after `lookup` returned `num_external_tokens` for this request in the same
        scheduler step (0: nothing to load), for every request the engine allocates (vLLM's
        `update_state_after_alloc`).
        """
        state = self._requests.get(request.request_id)
        if state is None:
            return
        self._allocated(state, self.geometry.attention_ids(block_ids), num_external_tokens)
        if self.states is not None:
            self.states.allocated(state, block_ids, num_external_tokens, self._job_ids)

    def _allocated(self, state: RequestState, ids: Sequence[Sequence[int]], num_external_tokens: int) -> None:
        first, ct = state.load_from, self.geometry.chunk_tokens
        count = state.loaded_chunks(num_external_tokens, ct)
        unfull = state.unfull if state.unfull and num_external_tokens + state.load_offset \
            == count * ct + state.unfull.blocks * self.geometry.block_size else None
        skipped = state.load_offset if count or unfull else 0
        streamed = len(state.streamed) if count >= len(state.streamed) else 0
        head = state.keys[first : first + count - streamed] + ([unfull.key] if unfull else [])
        slots = self.manager.pin_rows(head) if head else None  # ready in the host tier
        sources = [state.promoted_from.get(c, HOST) for c in range(first, first + count)]
        sources += [unfull.source] if unfull else []
        self.manager.release(state.take_promoted(keep=range(first + count - streamed, first + count)))
        ok = slots is not None or not head
        unfilled = ct - unfull.blocks * self.geometry.block_size if unfull else 0
        if not state.hits.recorded:
            self.accounting.record_alloc(state.hits, state.looked_up, sources if ok else [], skipped,
                                         unfilled)
        if num_external_tokens == 0:
            return
        bpc, skip = self.geometry.blocks_per_chunk, skipped // self.geometry.block_size
        chunks = [load_blocks(ids, c, bpc, skip if c == first else 0)
                  for c in range(first, first + count)]
        chunks += [load_blocks(ids, unfull.chunk, bpc, 0 if count else skip, unfull.blocks)] if unfull else []
        req_id = state.request.request_id
        if not ok:
            # The rows left the host tier since the lookup: these chunks are recomputed.
            self.manager.metrics.inc("failures", len(chunks), HOST, "load")
            keys = state.keys[first : first + count] + ([unfull.key] if unfull else [])
            self._send(ChunkCopy(next(self._job_ids), req_id, tuple(keys), tuple(chunks), (),
                                 sync=state.load_sync))
            return
        if streamed:
            self.streams.start(req_id, state.keys[first + len(head) : first + count],
                               sources[len(head):], chunks[len(head):], state.priority,
                               head_in_flight=bool(head), tenant=state.tenant)
        if head and slots is not None:
            copy = ChunkCopy(next(self._job_ids), req_id, tuple(head), tuple(chunks[: len(head)]),
                             tuple(slots), last=not streamed, sync=state.load_sync)
            self._send(copy, sources[: len(head)], head, skipped, unfilled)

    def _send(self, copy: ChunkCopy, sources: list[str] | None = None,
              keys: list[bytes] | None = None, skipped: int = 0, unfilled: int = 0) -> None:
        """Queue a load (or a part of one) for the next step; `keys` pinned for it are released
        when it ends, and its `sources` are counted then (none: a failed load; `skipped`: tokens
        of its first chunk the device held; `unfilled`: tokens its last, unfull chunk lacks)."""
        state = self._requests.get(copy.req_id)
        mark_load_failed(state if not copy.slots else None)
        if keys:
            self._loading[copy.req_id] = keys
            if state is not None:
                self.manager.raise_priority(keys, state.priority)
        if copy.slots and sources is not None:
            self._loads[copy.job_id] = LoadCopy(req_id=copy.req_id, sources=sources, last=copy.last,
                                                sync=copy.sync, skipped=skipped, unfilled=unfilled)
        self._loads_to_send.append(copy)

    def _send_parts(self, parts: list[Part]) -> None:
        """Queue the streamed parts due this step (a part without rows failed: counted now)."""
        for part in parts:
            if part.copy.slots:
                self._send(part.copy, part.sources, list(part.copy.keys))
                continue
            state = self._requests.get(part.copy.req_id)
            if part.given_up:
                self.give_ups.stream_gave_up(state, part.sources)
            else:
                self.accounting.load_failed(state.hits if state else None, part.sources)
            self._send(part.copy)

    # -- each step -----------------------------------------------------------------------------

    def step(self, scheduled: Mapping[str, int], speculative: Mapping[str, Sequence[int]] | None = None,
             state_offloads: Mapping[str, Sequence[tuple[int, int, int]]] | None = None) -> StepPlan:
        """The loads queued since the last step and the stores of chunks this step completes.

        Called once per scheduler step, after every request was scheduled and before the requests'
        `num_computed_tokens` advance (vLLM's `build_connector_meta`): `scheduled` maps each
        scheduled request to its new tokens, `speculative` to its draft tokens among them, and
        `state_offloads` to the (group, block, boundary) states the engine offers to store.
        """
        speculative = speculative or {}
        self.manager.poll()
        self.accounting.step()
        self._send_parts(self.streams.parts())
        self.tracer.step()
        self.ops.step(s.request for s in self._requests.values())
        stores: list[ChunkCopy] = []
        prompt_tokens = 0
        for req_id, num_new in scheduled.items():
            state = self._requests.get(req_id)
            if state is None:
                continue
            # Draft tokens may be rejected: their KV is not final, so it is not stored.
            computed = state.request.num_computed_tokens + num_new - len(speculative.get(req_id, ()))
            prompt_tokens += max(min(computed, state.request.num_prompt_tokens)
                                 - state.request.num_computed_tokens, 0)
            self.tracer.scheduled(req_id, computed, state.request.num_prompt_tokens)
            first = state.extend_keys(computed, self.hasher)
            if first is not None and self.events is not None:
                self.events.remember(state.request, state.keys, first)
            store = self.stores.plan(state, computed)
            if store is not None:
                stores.append(store)
        self.choice.step_planned(prompt_tokens)
        tail_stores, released = self.tails.step(self.stores.plan)
        loads, self._loads_to_send = tuple(self._loads_to_send), []
        plan = StepPlan(self.region_name, self.shm_dir, loads, (*stores, *tail_stores),
                        releases=tuple(released))
        if self.states is not None:
            plan.state_loads = self.states.take_loads()
            plan.state_stores = self.states.stores(self._requests, state_offloads or {}, self.stores)
        return plan

    def copies_done(self, meta: CopyReport | None, finished_loading: Collection[str] = ()) -> None:
        """Publish finished stores (then cascade them), release the pins of finished loads.

        Called once per step with the workers' merged report of an earlier step and the requests
        whose asynchronous loads the engine saw end (vLLM's `update_connector_output`).
        """
        self.choice.step_ended()
        if self.states is not None:
            self.states.copies_done(meta, finished_loading)
        if meta is not None:
            self._finish_loads(meta)
            self.stores.done(meta)
        for req_id in finished_loading:
            self.manager.unpin_rows(self._loading.pop(req_id, []))
        self.manager.poll()

    def _finish_loads(self, meta: CopyReport) -> None:
        """Count the host → device copies every worker finished (metrics and hit records)."""
        for job_id, (acks, ok) in meta.loads.items():
            load = self._loads.get(job_id)
            seconds = meta.seconds.get(job_id, 0.0)
            if load is None or not load.ack(acks, ok, seconds, self.world_size):
                continue
            del self._loads[job_id]
            if not load.last or load.sync:
                self.manager.unpin_rows(self._loading.pop(load.req_id, []))
            if not load.last:
                self.streams.part_done(load.req_id, load.ok)
            if load.ok:
                self.accounting.copied("load", len(load.sources), load.seconds, ok=True)
                self.choice.host_loaded(len(load.sources), load.seconds)
            else:
                state = self._requests.get(load.req_id)
                mark_load_failed(state)
                self.accounting.load_failed(state.hits if state else None, load.sources,
                                            load.skipped, load.unfilled)

    def finished(self, request: Request) -> dict[str, Any] | None:
        """Forget the request; return its prompt-token split for `kv_transfer_params` (None when
        kvtier could not key it). Called once when it finishes or is aborted. Chunks that found no
        host room yet, and its unfull chunk, become a tail (`kvtier.engine.tails`)."""
        if self.states is not None:
            self.states.finished(request.request_id)
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return None
        state.unfull_due = self.unfull.due(state, request.num_computed_tokens)
        self.tails.hold(state, request.num_computed_tokens)
        self.manager.used(state.keys)
        self.ops.finished(request)
        self.manager.release(state.take_promoted())
        self.streams.drop(request.request_id)
        params = self.accounting.finish(request.request_id, state.hits)
        self.tracer.finished(request, state.keys, params["kvtier"]["tokens"], state.priority)
        return params

    def hit_sources(self, request: Request) -> dict[str, int]:
        """Tokens loaded for `request` by source ("host" or a tier), for the engine's hit counters."""
        state = self._requests.get(request.request_id)
        return {} if state is None else {k: v for k, v in state.hits.loaded.items() if v > 0}

    def take_events(self) -> list[Any]:
        """The engine's KV events for what the tiers stored and removed (or sidecars named) since
        the last call; none when KV events are off (kvtier's are still drained). Called every
        step."""
        events = self.manager.take_events()
        return [] if self.events is None else self.events.translate_all(events)

    def reset_cache(self) -> bool:
        """Drop every unpinned host-tier chunk (vLLM's `reset_prefix_cache(reset_connector=True)`)."""
        self.manager.clear_host()
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
        cap, tenants = self.max_client_priority, self.accounting.tenants
        if state is None and (state := RequestState.of(request, self.hasher, cap, tenants)) is not None:
            self.manager.record_request(state.keys)
            if self.events is not None:
                self.events.remember(request, state.keys)
            self._requests[request.request_id] = state
        return state
