"""`KVTierConnector`: the class vLLM loads (`kv_connector_module_path="kvtier.integrations.vllm"`).

vLLM builds one instance per role: the SCHEDULER role in the engine core (it owns the host region,
the host tier and the secondary tier processes: `kvtier.engine.planner.Planner`), the WORKER role
in each worker (it copies KV between the engine's tensors and the host region:
`kvtier.engine.copier.CopyDriver`). This class reads the config, translates each vLLM hook's
objects into the plain values the request path takes, and hands it on; the two sides talk through
`KVTierMetadata` / `KVTierWorkerMetadata` only (the engine's `StepPlan` and `CopyReport` with vLLM's
base classes).

The config is kvtier's `kv_connector_extra_config`, or one written for vLLM's OffloadingConnector
(`spec_name`, `block_size`, vLLM's fs keys), mapped by the same `native_config.to_kvtier` as
`kvtier serve --config`: the scheduler role logs one line per key mapped or ignored. Before it
builds its half, the scheduler role checks the host tier against the machine's memory
(`host_memory.engine_plan`) and logs the plan.

Observability: metrics reach vLLM's `/metrics` through `get_kv_connector_stats` /
`build_kv_connector_stats` / `build_prom_metrics` (`connector_stats.py`), and are readable
in-process from `connector.planner.accounting.metrics.snapshot()`; each finished request's
prompt tokens split by source come back in its output's `kv_transfer_params["kvtier"]["tokens"]`
(`kvtier.engine.accounting`); KV events go out through `take_events` when vLLM's KV events are
enabled (`kv_events.py`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.config import KVTierConfig
from kvtier.engine.copier import CopyDriver
from kvtier.engine.planner import Planner
from kvtier.engine.step import CopyReport, StepPlan
from kvtier.integrations.vllm.connector_stats import KVTierPromMetrics, KVTierStats
from kvtier.integrations.vllm.host_memory import engine_plan
from kvtier.integrations.vllm.kv_events import make_translator
from kvtier.integrations.vllm.model.backend_layouts import engine_layout, engine_layout_name
from kvtier.integrations.vllm.model.kv_dtype import holds
from kvtier.integrations.vllm.model.read_geometry import engine_geometry
from kvtier.integrations.vllm.model.state_groups import StateWorker
from kvtier.integrations.vllm.serving.native_config import is_native, to_kvtier
from kvtier.transfer.copy_plan import EngineLayout

if TYPE_CHECKING:
    from collections.abc import Mapping

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


log = logging.getLogger("kvtier.vllm.connector")
settings_log = logging.getLogger("vllm.kvtier")
"""The config's mapping and the memory plan, a child of vLLM's logger: shown at INFO among vLLM's
own start-up lines (vLLM's logger does not propagate, and kvtier's INFO lines would not show)."""

HIT_SOURCE = {
    "host": CacheHitSource.HOST,
    "fs": CacheHitSource.DISK,
    "obj": CacheHitSource.DISK,
    "p2p": CacheHitSource.P2P,
}
EXTRA = "kv_connector_extra_config"


@dataclass
class KVTierMetadata(StepPlan, KVConnectorMetadata):
    """A `StepPlan` as the metadata vLLM hands each worker every step."""

    @classmethod
    def of(cls, plan: StepPlan) -> KVTierMetadata:
        return cls(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(StepPlan)})


@dataclass
class KVTierWorkerMetadata(CopyReport, KVConnectorWorkerMetadata):
    """A worker's `CopyReport`, as vLLM aggregates them over workers."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVTierWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into KVTierWorkerMetadata")
        merged = self.merged(other)
        return KVTierWorkerMetadata(merged.stores, merged.loads, merged.seconds)


def read_config(extra: Mapping[str, Any], engine_block_size: int, *, announce: bool) -> KVTierConfig:
    """kvtier's config from `extra`: kvtier's own, or vLLM's OffloadingConnector's mapped for an
    engine of `engine_block_size` tokens per block; with `announce`, one log line per key mapped or
    ignored and a warning for each size adjusted. Raises ConfigError naming the key."""
    if is_native(extra):
        mapping = to_kvtier(extra, engine_block_size)
        if announce:
            for line in mapping.lines(EXTRA):
                settings_log.info("%s", line)
            for line in mapping.warnings:
                settings_log.warning("%s", line)
        extra = mapping.extra
    return KVTierConfig.from_dict(extra)


ROLES = {
    "kv_both": "loads and stores through every tier",
    "kv_producer": "a prefill instance: stores every computed prefix through its tiers, loads nothing",
    "kv_consumer": "a decode instance: loads from every tier, stores nothing beyond its host tier",
}
"""vLLM's `kv_role`s, as kvtier carries them out."""


def apply_role(planner: Planner, kv_role: str | None) -> None:
    """Set the planner's loads and cascades for vLLM's `kv_role` (None: kv_both; vLLM's config
    refuses any other name before an engine starts)."""
    role = kv_role or "kv_both"
    planner.loads = role != "kv_producer"
    planner.manager.cascades = role != "kv_consumer"
    settings_log.info("kvtier: kv_role %s: %s", role, ROLES[role])


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """Tiered KV-cache offloading for vLLM: host memory first, then secondary tiers.

    It supports vLLM's hybrid KV cache manager (`SupportsHMA`), so vLLM keeps it on and the device
    cache keeps its full capacity; the KV cache groups kvtier cannot hold are refused at
    construction (`read_geometry.engine_geometry`), before the engine serves.
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        """Called by vLLM once per role, at engine start. Raises ConfigError (kvtier's message)
        for a bad `kv_connector_extra_config`, and (scheduler role) for a host tier the machine's
        memory cannot hold beside the engine; nothing is left running when it raises."""
        super().__init__(vllm_config, role, kv_cache_config)
        scheduler = role == KVConnectorRole.SCHEDULER
        config = read_config(self._kv_transfer_config.kv_connector_extra_config or {},
                             vllm_config.cache_config.block_size, announce=scheduler)
        geometry = engine_geometry(vllm_config, kv_cache_config, config.blocks_per_chunk,
                                   config.chunk_tokens)
        config = dataclasses.replace(config, blocks_per_chunk=geometry.blocks_per_chunk)
        self.planner: Planner | None = None
        self.copier: CopyDriver | None = None
        if scheduler:
            memory = engine_plan(vllm_config, kv_cache_config, config.cpu_bytes_to_use,
                                 config.os_reserve_bytes)
            memory.check("cpu_bytes_to_use", config.cpu_bytes_to_use)
            settings_log.info("%s", memory.line())
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                log.warning("kvtier: kv_load_failure_policy is %r: a request whose KV load fails "
                            "(a tier went down, a chunk failed its checksum) fails instead of "
                            "recomputing; set it to \"recompute\"",
                            self._kv_transfer_config.kv_load_failure_policy)
            world = vllm_config.parallel_config.world_size
            events = vllm_config.kv_events_config
            enabled = events is not None and bool(events.enable_kv_cache_events)
            hashed = getattr(kv_cache_config, "hash_block_size", None)  # vLLM hashes requests at
            translator = make_translator(config, geometry.block_size, geometry.layout.fingerprint,
                                         hashed) if enabled else None
            sync = (config.sync_host_loads and geometry.one_group
                    and vllm_config.device_config.device_type == "cpu")
            self.planner = Planner(config, geometry, world, events=translator, sync_loads=sync)
            apply_role(self.planner, self._kv_transfer_config.kv_role)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.copier = CopyDriver(geometry, get_tensor_model_parallel_rank())

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped store is a later miss, never a lost hand-off."""
        return False

    def _sched(self) -> Planner:
        if self.planner is None:
            raise RuntimeError("kvtier: scheduler hook called on a worker-role connector")
        return self.planner

    def _work(self) -> CopyDriver:
        if self.copier is None:
            raise RuntimeError("kvtier: worker hook called on a scheduler-role connector")
        return self.copier

    def _meta(self) -> KVTierMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVTierMetadata):
            raise TypeError(f"kvtier: unexpected connector metadata {type(meta).__name__}")
        return meta

    # -- worker role ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Hand the copier the layers' tensors, the layout vLLM's backend gave them, and the
        recurrent layers' state copier. Raises ValueError for an attention layer without a tensor,
        or one of another dtype than the model's KV."""
        copier = self._work()
        geometry = copier.geometry
        for name, kv in kv_caches.items():
            if name in geometry.layer_names and not holds(kv.dtype, geometry.layout.dtype):
                raise ValueError(f"kvtier: layer {name} KV is {kv.dtype}, not {geometry.layout.dtype}")
        states = None
        if geometry.states is not None:
            states = StateWorker(geometry.states, kv_caches, copier.shard.rank).copier
        latent = geometry.layout.latent

        def layout_of(kv: torch.Tensor) -> EngineLayout:
            return engine_layout(engine_layout_name(kv.device.type, kv.shape, latent))

        copier.register(kv_caches, layout_of, states)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before every forward pass (also on steps without one): on CUDA, order it after the
        stores still reading its blocks; nothing to do on CPU, where stores end in their step."""
        self._work().before_forward()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._work().start_load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete in `start_load_kv`, for requests outside the forward pass: no wait."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Stores run all layers at once in `wait_for_save`."""

    def wait_for_save(self) -> None:
        self._work().save(self._meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The requests whose loads ended; a failed one is named again in `failed_recving` when
        the engine has several KV cache groups (else its blocks are in the load errors). Released
        tails whose stores ended are `finished_sending`."""
        worker = self._work()
        done = worker.take_finished_loads()
        return KVConnectorTransferResults(finished_sending=worker.take_finished_sends(),
                                          finished_recving=done, failed_recving=worker.take_failed_loads())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report = None if self.copier is None else self.copier.take_report()
        return None if report is None else KVTierWorkerMetadata(report.stores, report.loads, report.seconds)

    # -- scheduler role ------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._sched().bind_block_ids(kv_cache_manager.get_block_ids)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().lookup(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().allocated(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        block_state = scheduler_output.kv_connector_block_state
        plan = self._sched().step(
            scheduler_output.num_scheduled_tokens, scheduler_output.scheduled_spec_decode_tokens,
            block_state.boundary_state_offloads if block_state is not None else None,
        )
        return KVTierMetadata.of(plan)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        self._sched().copies_done(meta if isinstance(meta, CopyReport) else None,
                                  connector_output.finished_recving or ())

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Without the hybrid manager (the user disabled it): one group's blocks. True: vLLM keeps
        them until the worker reports the request finished sending (`kvtier.engine.tails`)."""
        params = self._sched().finished(request)
        return self._sched().tails.held(request.request_id), params

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """With the hybrid manager: called once per request, before the blocks of every group are
        freed. True: vLLM keeps them until the worker reports the request finished sending
        (stores that found no host room yet, `tails.py`)."""
        params = self._sched().finished(request)
        return self._sched().tails.held(request.request_id), params

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """vLLM's per-source hit counters: host tier → HOST, fs and obj → DISK, p2p → P2P, other
        tiers → EXTERNAL_UNSPECIFIED. Called after `update_state_after_alloc`."""
        sched = self._sched()
        out: dict[CacheHitSource, int] = {}
        for tier, tokens in sched.hit_sources(request).items():
            source = HIT_SOURCE.get(sched.tier_types.get(tier, tier), CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[source] = out.get(source, 0) + tokens
        rest = num_external_tokens - sum(out.values())
        if rest > 0:
            out[CacheHitSource.EXTERNAL_UNSPECIFIED] = out.get(CacheHitSource.EXTERNAL_UNSPECIFIED, 0) + rest
        return out

    def take_events(self) -> list[KVCacheEvent]:
        return self._sched().take_events() if self.planner is not None else []

    def reset_cache(self) -> bool | None:
        return self.planner.reset_cache() if self.planner is not None else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This step's metric updates (scheduler role; the worker's timings travel in its worker
        metadata instead). Called by vLLM's scheduler every step."""
        if self.planner is None:
            return None
        delta = self.planner.manager.metrics.take_delta()
        return None if delta is None else KVTierStats(delta)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVTierStats(data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVTierPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Called by vLLM when the engine or worker shuts down. Idempotent."""
        if self.planner is not None:
            self.planner.shutdown()
        if self.copier is not None:
            self.copier.shutdown()
