"""vLLM's own tiering (its OffloadingConnector with `TieringOffloadingSpec`) on vLLM's CPU backend.

vLLM 0.32 refuses to offload on its CPU backend: `CPUOffloadingSpec.get_worker` raises "CPU
Offloading is currently only supported on CUDA-alike and XPU GPUs", and its worker copies with
CUDA streams. `HostTieringSpec` is `TieringOffloadingSpec` with only that worker replaced: the
scheduler side is vLLM's unchanged (`TieringOffloadingManager`: the CPU primary tier and its
eviction policy, the secondary tiers such as vLLM's fs tier, promotions, cascades, back-pressure),
and `get_worker` skips the platform check and returns a `HostCopyWorker`, which copies between the
engine's KV tensors and the same shared offload region on the calling thread.

Loaded by vLLM's spec factory from `spec_name` + `spec_module_path` (this module must be importable
by the engine process: the repository root on `sys.path` / `PYTHONPATH`)::

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {
         "spec_name": "HostTieringSpec", "spec_module_path": "benchmarks.baselines.vllm_native",
         "cpu_bytes_to_use": 1073741824,
         "secondary_tiers": [{"type": "fs", "root_dir": "/var/tmp/kv"}]}}
"""

from __future__ import annotations

from typing_extensions import override
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from benchmarks.baselines.host_copy import HostCopyWorker


class HostTieringSpec(TieringOffloadingSpec):
    """vLLM's tiering spec whose worker copies host to host (see the module docstring).

    One worker per engine rank, created on the first `get_worker` call: it maps this rank's slot of
    every row of the shared offload region, as vLLM's CUDA worker would, and owns that mapping.
    """

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self._host_worker: HostCopyWorker | None = None

    @override
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._host_worker is None:
            if self.config.canonical_layout:
                raise ValueError(f"{type(self).__name__} copies the engine's pages as they are: "
                                 "remove canonical_layout from kv_connector_extra_config")
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(
                engine_id=self._engine_id, num_chunks=self.num_chunks, rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk, cpu_page_size=self.cpu_page_size_per_worker)
            try:
                self._host_worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, region)
            except BaseException:
                region.cleanup()
                raise
        return self._host_worker
