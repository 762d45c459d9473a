"""A host-to-host copy handler for vLLM's offloading worker API, for vLLM's CPU backend.

vLLM's own `CPUOffloadingWorker` drives CUDA (or XPU) streams and events between device tensors
and the offload region. On the CPU backend the engine's KV cache is already in host memory, so a
copy is a plain memory copy: `HostCopyWorker` does it on the calling thread (the worker's step),
as kvtier's `CpuTransfer` does on CPU, and reports each job once from `get_finished`.

The offload region is vLLM's `SharedOffloadRegion`, laid out as vLLM's CUDA worker lays it out:
one strided int8 view per engine KV tensor (`create_next_worker_view`, in tensor order), each row a
chunk of `blocks_per_chunk` engine pages of that tensor. vLLM's scheduler side (the primary tier
and its secondary tiers) reads and writes the same rows, so nothing else of its tiering changes.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion


class HostCopyWorker(OffloadingWorker):
    """Copies engine KV pages to and from the offload region's chunk rows, synchronously.

    Holds after `submit_store` returns: the region's rows hold the engine blocks' pages; after
    `submit_load` returns: the engine blocks hold the rows' pages. Every submitted job is reported
    by exactly one later `get_finished` call. The worker owns `region` and releases it on
    `shutdown` (idempotent).
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int,
                 region: SharedOffloadRegion) -> None:
        if blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk {blocks_per_chunk}: must be >= 1")
        self.blocks_per_chunk = blocks_per_chunk
        self._region: SharedOffloadRegion | None = region
        self._pages = [t.page_size_bytes for t in kv_caches.tensors]
        self._engine = [t.tensor.view(torch.int8).view(-1, t.page_size_bytes) for t in kv_caches.tensors]
        for engine in self._engine:
            if engine.device.type != "cpu":
                raise ValueError(f"HostCopyWorker copies host memory only; a KV tensor is on {engine.device}")
        self._rows = [region.create_next_worker_view(page * blocks_per_chunk) for page in self._pages]
        self._group_tensors = [list(dict.fromkeys(ref.tensor_idx for ref in refs))
                               for refs in kv_caches.group_data_refs]
        self._finished: list[TransferResult] = []

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Engine blocks `src_spec` → region chunks `dst_spec`, done before returning."""
        return self._run(job_id, src_spec, dst_spec, to_region=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        """Region chunks `src_spec` → engine blocks `dst_spec`, done before returning."""
        return self._run(job_id, dst_spec, src_spec, to_region=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Nothing to wait for: every job ended inside its submit call."""

    def shutdown(self) -> None:
        region, self._region = self._region, None
        self._rows.clear()
        self._engine.clear()
        if region is not None:
            region.cleanup()

    def _run(self, job_id: int, engine_spec: GPULoadStoreSpec, chunk_spec: LoadStoreSpec,
             to_region: bool) -> bool:
        if not isinstance(chunk_spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"job {job_id}: chunk spec {type(chunk_spec).__name__} has no block ids")
        start = time.perf_counter()
        size = self._copy(engine_spec, chunk_spec.block_ids, to_region)
        self._finished.append(TransferResult(job_id, True, size, time.perf_counter() - start))
        return True

    def _copy(self, engine_spec: GPULoadStoreSpec, chunk_ids: np.ndarray, to_region: bool) -> int:
        """Copy each KV-cache group's run of engine blocks; the bytes copied.

        Group g's `group_sizes[g]` engine blocks are consecutive blocks of the request starting at
        block `block_indices[g]`; their chunks come next in `chunk_ids`, and the first of them is
        entered at sub-block `block_indices[g] % blocks_per_chunk` (the chunk began earlier)."""
        per_chunk = self.blocks_per_chunk
        engine_ids = engine_spec.block_ids
        used_blocks = used_chunks = copied = 0
        for group, (size, first) in enumerate(zip(engine_spec.group_sizes, engine_spec.block_indices,
                                                  strict=True)):
            if size == 0:
                continue
            position = first % per_chunk + np.arange(size)
            count = -(-(first % per_chunk + size) // per_chunk)
            blocks = engine_ids[used_blocks:used_blocks + size].tolist()
            chunks = chunk_ids[used_chunks:used_chunks + count][position // per_chunk].tolist()
            subs = (position % per_chunk).tolist()
            for tensor in self._group_tensors[group]:
                engine, rows, page = self._engine[tensor], self._rows[tensor], self._pages[tensor]
                for block, chunk, sub in zip(blocks, chunks, subs, strict=True):
                    row = rows[chunk, sub * page:(sub + 1) * page]
                    if to_region:
                        row.copy_(engine[block])
                    else:
                        engine[block].copy_(row)
                copied += page * size
            used_blocks += size
            used_chunks += count
        if used_blocks != len(engine_ids) or used_chunks != len(chunk_ids):
            raise ValueError(f"{len(engine_ids)} engine blocks and {len(chunk_ids)} chunks given, "
                             f"the groups cover {used_blocks} and {used_chunks}")
        return copied
