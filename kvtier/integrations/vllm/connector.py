"""`KVTierConnector`: the class vLLM loads (`kv_connector_module_path="kvtier.integrations.vllm"`).

vLLM builds one instance per role: the SCHEDULER role in the engine core (it owns the host region,
the host tier and the secondary tier processes, see `scheduler.py`), the WORKER role in each worker
(it copies KV between the engine's tensors and the host region, see `worker.py`). This class only
parses the config and dispatches each vLLM hook to the half its role has; the halves talk through
`KVTierMetadata` / `KVTierWorkerMetadata` only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.config import KVTierConfig
from kvtier.integrations.vllm.geometry import engine_geometry
from kvtier.integrations.vllm.metadata import KVTierMetadata
from kvtier.integrations.vllm.scheduler import KVTierScheduler
from kvtier.integrations.vllm.worker import KVTierWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KVTierConnector(KVConnectorBase_V1):
    """Tiered KV-cache offloading for vLLM: host memory first, then secondary tiers."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        """Called by vLLM once per role, at engine start. Raises ConfigError (kvtier's message)
        for a bad `kv_connector_extra_config`; nothing is left running when it raises."""
        super().__init__(vllm_config, role, kv_cache_config)
        config = KVTierConfig.from_dict(self._kv_transfer_config.kv_connector_extra_config or {})
        geometry = engine_geometry(vllm_config, kv_cache_config, config.blocks_per_chunk)
        self.scheduler: KVTierScheduler | None = None
        self.worker: KVTierWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            world = vllm_config.parallel_config.world_size
            self.scheduler = KVTierScheduler(config, geometry, world)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.worker = KVTierWorker(geometry, get_tensor_model_parallel_rank())

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped store is a later miss, never a lost hand-off."""
        return False

    def _sched(self) -> KVTierScheduler:
        if self.scheduler is None:
            raise RuntimeError("kvtier: scheduler hook called on a worker-role connector")
        return self.scheduler

    def _work(self) -> KVTierWorker:
        if self.worker is None:
            raise RuntimeError("kvtier: worker hook called on a scheduler-role connector")
        return self.worker

    def _meta(self) -> KVTierMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVTierMetadata):
            raise TypeError(f"kvtier: unexpected connector metadata {type(meta).__name__}")
        return meta

    # -- worker role ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

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

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self._work().take_finished_loads() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return None if self.worker is None else self.worker.take_worker_meta()

    # -- scheduler role ------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._sched().bind_block_ids(lambda req_id: kv_cache_manager.get_block_ids(req_id)[0])

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._sched().request_finished(request)
        return False, None

    def shutdown(self) -> None:
        """Called by vLLM when the engine or worker shuts down. Idempotent."""
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if self.worker is not None:
            self.worker.shutdown()
