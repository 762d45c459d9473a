"""The worker half of the connector: runs the chunk copies the scheduler half planned.

Runs in each vLLM worker (one per TP rank), on the worker's model-runner thread. It needs nothing
from the scheduler process but the connector metadata of each step: the host region's name, and
(block ids, slot ids) pairs; it maps the region by name on first use.

Per step, in vLLM's order: `start_load` (bound metadata's loads, host → device), the forward pass,
`save` (its stores, device → host, done before it returns), then `take_finished_loads`,
`take_load_errors` and `take_worker_meta` report back.
"""

from __future__ import annotations

import logging
import time

import torch

from kvtier.integrations.vllm.geometry import EngineGeometry
from kvtier.integrations.vllm.metadata import KVTierMetadata, KVTierWorkerMetadata
from kvtier.layout import CopyPlan, EngineLayout, TPShard, engine_layout
from kvtier.transfer import HostTransfer

log = logging.getLogger("kvtier.vllm.worker")

ENGINE_LAYOUT_BY_DEVICE = {"cpu": "vllm_cpu"}


class KVTierWorker:
    """One rank's copies between its KV tensors and the shared host region."""

    def __init__(self, geometry: EngineGeometry, tp_rank: int) -> None:
        self.geometry = geometry
        self.shard = TPShard(geometry.layout.num_kv_heads, geometry.tp_size, tp_rank)
        self.transfer: HostTransfer | None = None
        self._finished_loads: set[str] = set()
        self._load_errors: set[int] = set()
        self._stores: dict[int, tuple[int, bool]] = {}
        self._loads: dict[int, tuple[int, bool]] = {}
        self._seconds: dict[int, float] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build the copy plan from the real tensors. Called once, after vLLM allocated its KV
        cache and before the first step; raises ValueError when a tensor's layout is unexpected."""
        missing = [name for name in self.geometry.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"kvtier: no KV cache tensor for layers {missing}")
        tensors = [kv_caches[name] for name in self.geometry.layer_names]
        layout = self._engine_layout(tensors[0])
        plan = CopyPlan(self.geometry.layout, layout, self.shard, self.geometry.block_size)
        for name, kv in zip(self.geometry.layer_names, tensors, strict=True):
            self._check(name, plan, kv)
        self.transfer = HostTransfer(plan, tensors)

    def _check(self, name: str, plan: CopyPlan, kv: torch.Tensor) -> None:
        if kv.dtype != self.geometry.layout.dtype:
            raise ValueError(f"kvtier: layer {name} KV is {kv.dtype}, not {self.geometry.layout.dtype}")
        try:
            plan.engine_views(kv)
        except ValueError as exc:
            raise ValueError(f"kvtier: layer {name}: {exc}") from exc

    def _engine_layout(self, kv: torch.Tensor) -> EngineLayout:
        name = ENGINE_LAYOUT_BY_DEVICE.get(kv.device.type)
        if name is None:
            raise NotImplementedError(f"kvtier: no engine layout for KV on {kv.device.type} yet")
        return engine_layout(name)

    def start_load(self, meta: KVTierMetadata) -> None:
        """Copy every load of `meta` host → device. Called once per step, by vLLM's
        `start_load_kv`; the loading requests are not in this step's forward pass."""
        for job in meta.loads:
            start = time.perf_counter()
            ok = bool(job.slots) and self._transfer(meta).load(job.block_ids, job.slots)
            self._seconds[job.job_id] = time.perf_counter() - start
            if not ok:
                self._load_errors.update(job.all_block_ids)
            self._loads[job.job_id] = (1, ok)
            self._finished_loads.add(job.req_id)

    def save(self, meta: KVTierMetadata) -> None:
        """Copy every store of `meta` device → host. Called once per step by vLLM's
        `wait_for_save`, after the forward pass wrote the blocks; returns once copied."""
        for job in meta.stores:
            start = time.perf_counter()
            ok = self._transfer(meta).store(job.block_ids, job.slots)
            self._seconds[job.job_id] = time.perf_counter() - start
            self._stores[job.job_id] = (1, ok)

    def _transfer(self, meta: KVTierMetadata) -> HostTransfer:
        if self.transfer is None:
            raise RuntimeError("kvtier: a transfer was planned before register_kv_caches")
        self.transfer.attach(meta.region_name, meta.shm_dir)
        return self.transfer

    def take_finished_loads(self) -> set[str]:
        """Request ids whose loads ended (successfully or not) since the last call."""
        done, self._finished_loads = self._finished_loads, set()
        return done

    def take_load_errors(self) -> set[int]:
        """Block ids whose loads failed since the last call; vLLM recomputes them."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_worker_meta(self) -> KVTierWorkerMetadata | None:
        """This rank's finished copies since the last call, or None when there are none."""
        if not self._stores and not self._loads:
            return None
        meta = KVTierWorkerMetadata(self._stores, self._loads, self._seconds)
        self._stores, self._loads, self._seconds = {}, {}, {}
        return meta

    def shutdown(self) -> None:
        """Unmap the host region. Idempotent."""
        if self.transfer is not None:
            self.transfer.close()
