"""The scheduler half of the connector: which chunks to load and store, and host-tier bookkeeping.

Runs in vLLM's scheduler (engine core) process, on its scheduler thread; every method is called
there and none blocks: host-tier calls are in-memory, and secondary tiers are reached only through
the tiering manager's non-blocking calls.

Loads are asynchronous (vLLM's `load_kv_async`): `get_num_new_matched_tokens` reports the chunks
ready in the host tier past vLLM's own device prefix hit (None, "ask again", while a promotion from
a secondary tier is in flight); `update_state_after_alloc` pins their host rows; the next
`build_connector_meta` sends the copies; the worker reports the request in `finished_recving` and
`update_connector_output` releases the pins.

Stores: `build_connector_meta` allocates host rows (WRITING) for every full chunk that this step
completes, prompt chunks and the chunks filled during decode alike (in multi-turn chat the reply is
part of the next turn's prefix); a chunk the request only partly fills is never stored. When
pinned rows leave too little room, the leading chunks get rows and the rest wait for the
request's next step. The worker copies device → host from `wait_for_save`: on CPU before the step
ends; on CUDA on a copy stream, with the next forward pass ordered after it on the device
(`handle_preemptions`), so no device block is held past its step either way, nor after the request
finishes. `update_connector_output` publishes the rows (`complete_store`) once every worker
reported its copy, then cascades them to the secondary tiers.

Per-request options (`options.py`, from `kv_transfer_params`) may skip the load or the store,
restrict the secondary tiers a load may come from, and set the cascade's retention priority.

Metrics and the per-request split of prompt tokens by source are kept by `accounting.py`; KV events
(`kv_events.py`) are drained every step by `take_events` and translated when vLLM's KV events are
on.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.chunks import HOST
from kvtier.config import KVTierConfig
from kvtier.integrations.vllm.accounting import Accounting, RequestHits
from kvtier.integrations.vllm.geometry import EngineGeometry
from kvtier.integrations.vllm.groups import load_blocks, store_blocks
from kvtier.integrations.vllm.kv_events import KVEventTranslator
from kvtier.integrations.vllm.metadata import ChunkCopy, KVTierMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.options import RequestOptions
from kvtier.keys import ChunkHasher
from kvtier.manager import TieringManager

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.vllm.scheduler")

BlockIdsFn = Callable[[str], Sequence[Sequence[int]]]


@dataclass
class _Request:
    """A live request: the keys of its full chunks known so far (the prompt's, then those its
    decode fills), and how far loads and stores have got."""

    request: Request
    keys: list[bytes]
    lora: str | None
    options: RequestOptions
    hits: RequestHits
    load_from: int = 0
    stored: int = 0
    looked_up: int = 0
    promoted_from: dict[int, str] = field(default_factory=dict)
    released: bool = False


@dataclass
class _Copy:
    """A device <-> host copy every worker (TP rank) reports on; done once all of them have."""

    acks: int = 0
    ok: bool = True
    seconds: float = 0.0

    def ack(self, acks: int, ok: bool, seconds: float, world_size: int) -> bool:
        """Record workers' reports; True when this completes the copy."""
        self.acks += acks
        self.ok = self.ok and ok
        self.seconds = max(self.seconds, seconds)
        return self.acks >= world_size


@dataclass
class _Store(_Copy):
    keys: list[bytes] = field(default_factory=list)
    priority: int = 0


@dataclass
class _Load(_Copy):
    req_id: str = ""
    sources: list[str] = field(default_factory=list)


class KVTierScheduler:
    """Scheduler-side state of one engine: the tiering manager and per-request progress."""

    def __init__(
        self, config: KVTierConfig, geometry: EngineGeometry, world_size: int, events: bool = False
    ) -> None:
        """Called once by the connector at engine start; starts the tier processes. `events`: the
        user enabled vLLM's KV events, so `take_events` translates kvtier's."""
        layout = geometry.layout
        self.geometry = geometry
        self.manager = TieringManager.from_config(config, layout.row_bytes, layout.fingerprint)
        self.accounting = Accounting(self.manager, geometry.chunk_tokens)
        self.tier_types = {t.name: t.type for t in config.secondary_tiers}
        paths = {t.name: t.module_path for t in config.secondary_tiers}
        self.events = (
            KVEventTranslator(self.tier_types, geometry.chunk_tokens, paths) if events else None
        )
        self.hasher = ChunkHasher(config.hash_algorithm, geometry.fingerprint, layout.chunk_tokens)
        self.shm_dir = config.shm_dir
        self.world_size = world_size
        self._block_ids_of: BlockIdsFn | None = None
        self._requests: dict[str, _Request] = {}
        self._loads_to_send: list[ChunkCopy] = []
        self._loading: dict[str, list[bytes]] = {}
        self._stores: dict[int, _Store] = {}
        self._loads: dict[int, _Load] = {}
        self._job_ids = itertools.count(1)

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
        (tokens, load asynchronously), or (None, False) while a promotion is in flight. Never
        offers the last prompt token (as vLLM's own prefix cache, so hit lengths agree).
        """
        state = self._state(request)
        ct = self.geometry.chunk_tokens
        if state is not None and not state.hits.recorded:
            state.hits.device = num_computed_tokens
            state.looked_up = 0
        if state is None or state.options.skip_load or num_computed_tokens % ct:
            return 0, False
        start = num_computed_tokens // ct
        keys = state.keys[start : (request.num_tokens - 1) // ct]
        if not keys:
            return 0, False
        # One promotion per request: once it ran, the request takes what it brought.
        found = self.manager.lookup_prefix(
            keys, state.options.load_tiers, promote=not state.promoted_from
        )
        for i, tier in enumerate(found.promoting, start + found.ready):
            state.promoted_from.setdefault(i, tier)
        if found.pending:
            return None, False
        state.load_from = start
        state.looked_up = len(keys)
        return found.ready * ct, found.ready > 0

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
        count = num_external_tokens // self.geometry.chunk_tokens
        keys = state.keys[first : first + count]
        slots = self.manager.host.prepare_load(keys) if keys else None
        sources = [state.promoted_from.get(c, HOST) for c in range(first, first + count)]
        self._release_promoted(state)
        if not state.hits.recorded:
            self.accounting.record_alloc(state.hits, state.looked_up, sources if slots else [])
        if num_external_tokens == 0:
            return
        bpc = self.geometry.blocks_per_chunk
        ids = blocks.get_block_ids()
        chunks = tuple(load_blocks(ids, c, bpc) for c in range(first, first + count))
        if slots is None:
            # The rows left the host tier since the lookup: these chunks are recomputed.
            self.manager.metrics.inc("failures", count, HOST, "load")
            slots = []
        else:
            self._loading[request.request_id] = keys
        job = ChunkCopy(next(self._job_ids), request.request_id, tuple(keys), chunks, tuple(slots))
        if slots:
            self._loads[job.job_id] = _Load(req_id=request.request_id, sources=sources)
        self._loads_to_send.append(job)

    # -- each step -----------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMetadata:
        """The loads queued since the last step and the stores of chunks this step completes.

        Called once per scheduler step, after every request was scheduled and before the requests'
        `num_computed_tokens` advance.
        """
        self.manager.poll()
        self.accounting.step()
        stores: list[ChunkCopy] = []
        speculative = scheduler_output.scheduled_spec_decode_tokens
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None:
                continue
            # Draft tokens may be rejected: their KV is not final, so it is not stored.
            computed = state.request.num_computed_tokens + num_new - len(speculative.get(req_id, ()))
            self._extend_keys(state, computed)
            store = self._plan_store(state, computed)
            if store is not None:
                stores.append(store)
        loads, self._loads_to_send = tuple(self._loads_to_send), []
        return KVTierMetadata(self.region_name, self.shm_dir, loads, tuple(stores))

    def _extend_keys(self, state: _Request, computed: int) -> None:
        """Key the full chunks that decode filled up to `computed` tokens."""
        if computed // self.geometry.chunk_tokens <= len(state.keys):
            return
        request = state.request
        tokens = request.all_token_ids[:computed]
        first = len(state.keys)
        state.keys += self.hasher.extend(state.keys, tokens, cache_salt=request.cache_salt, lora=state.lora)
        if self.events is not None:
            self.events.remember(state.keys, tokens, first)

    def _plan_store(self, state: _Request, computed: int) -> ChunkCopy | None:
        done = min(computed // self.geometry.chunk_tokens, len(state.keys))
        if done <= state.stored or state.options.skip_store or self._block_ids_of is None:
            return None
        ids = self._block_ids_of(state.request.request_id)
        bpc = self.geometry.blocks_per_chunk
        # A chunk whose blocks a sliding-window group already freed can never be stored.
        held = [(c, b) for c in range(state.stored, done) if (b := store_blocks(ids, c, bpc)) is not None]
        keys = [state.keys[c] for c, _ in held]
        slots, fitted = self.manager.host.prepare_store_prefix(keys)
        # Chunks that found no room (rows pinned by copies in flight) are tried again at the
        # request's next step; a later chunk is never stored before them.
        state.stored = held[fitted][0] if fitted < len(held) else done
        if fitted < len(keys):
            self.accounting.store_rejected(len(keys) - fitted)
        new = [(c, state.keys[c], b) for c, b in held if state.keys[c] in slots]
        if not new:
            return None
        chunks = tuple(b for _, _, b in new)
        job_id = next(self._job_ids)
        self._stores[job_id] = _Store(keys=[key for _, key, _ in new], priority=state.options.priority)
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
                host.complete_store(store.keys, success=store.ok)
                if store.ok:
                    self.manager.cascade(store.keys, store.priority)
        for req_id in output.finished_recving or ():
            keys = self._loading.pop(req_id, None)
            if keys is not None:
                host.complete_load(keys)
        self.manager.poll()

    def _finish_loads(self, meta: KVTierWorkerMetadata) -> None:
        """Count the host → device copies every worker finished (metrics and hit records)."""
        for job_id, (acks, ok) in meta.loads.items():
            load = self._loads.get(job_id)
            seconds = meta.seconds.get(job_id, 0.0)
            if load is None or not load.ack(acks, ok, seconds, self.world_size):
                continue
            del self._loads[job_id]
            if load.ok:
                self.accounting.copied("load", len(load.sources), load.seconds, ok=True)
            else:
                state = self._requests.get(load.req_id)
                self.accounting.load_failed(state.hits if state else None, load.sources)

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        """Forget the request; return its prompt-token split for `kv_transfer_params` (None when
        kvtier could not key it). Called once when it finishes or is aborted; no block is held:
        its stores were copied in their step (CPU) or are ordered before any forward pass that
        could reuse the blocks (CUDA)."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return None
        self._release_promoted(state)
        return self.accounting.finish(request.request_id, state.hits)

    def _release_promoted(self, state: _Request) -> None:
        """Release the holds on the chunks promoted for this request (once): its own load has
        pinned the rows it needs, or it no longer needs them."""
        if state.promoted_from and not state.released:
            state.released = True
            self.manager.release([state.keys[i] for i in state.promoted_from])

    def hit_sources(self, request: Request) -> dict[str, int]:
        """Tokens loaded for `request` by kvtier source ("host" or a tier name), for vLLM's
        per-source hit counters; called after `update_state_after_alloc`."""
        state = self._requests.get(request.request_id)
        return {} if state is None else {k: v for k, v in state.hits.loaded.items() if v > 0}

    def take_events(self) -> list[Any]:
        """vLLM KV events for what the tiers stored and removed since the last call (empty when
        KV events are off: kvtier's are still drained). Called by vLLM every step."""
        events = self.manager.take_events()
        if self.events is None:
            return []
        return [e for tier, event in events for e in self.events.translate(tier, event)]

    def reset_cache(self) -> bool:
        """Drop every unpinned chunk of the host tier (vLLM's `reset_prefix_cache(reset_connector=
        True)`); secondary tiers keep theirs (they are shared and persistent)."""
        self.manager.host.clear()
        return True

    def shutdown(self) -> None:
        """Stop the secondary tiers and remove the host region. Idempotent."""
        self.manager.shutdown()

    def _state(self, request: Request) -> _Request | None:
        """The request's state, keyed on first sight; None when it cannot be cached (multimodal
        inputs or prompt embeddings are not hashed yet)."""
        state = self._requests.get(request.request_id)
        if state is not None:
            return state
        if request.prompt_token_ids is None or request.mm_features:
            return None
        lora = request.lora_request.lora_name if request.lora_request else None
        keys = self.hasher.keys(request.prompt_token_ids, cache_salt=request.cache_salt, lora=lora)
        options = RequestOptions.from_params(request.request_id, request.kv_transfer_params)
        state = _Request(request, keys, lora, options, RequestHits(request.num_prompt_tokens))
        if self.events is not None:
            self.events.remember(keys, request.prompt_token_ids)
        self._requests[request.request_id] = state
        return state

