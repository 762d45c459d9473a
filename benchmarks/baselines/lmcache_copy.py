"""LMCache's copy half for vLLM's CPU backend: `HostPagedConnector`.

LMCache moves KV between the engine and its memory objects through a "GPU connector"
(`lmcache.v1.gpu_connector.GPUConnectorInterface`); LMCache 0.5.6 ships none for vLLM's CPU backend.
`HostPagedConnector` copies the tokens of a slot mapping between vLLM's CPU layer tensors
(`[num_blocks, H, block_size, 2*D]`, K transposed per block and head: kvtier's `VllmCpuLayout`) and
LMCache's `KV_2LTD` memory objects (`[2, num_layers, tokens, H*D]`), on the calling thread.

Importing this module imports LMCache, which imports numba: vLLM's CPU worker must have started
first (its Triton-kernel override scan trips over llvmlite's module objects), so only
`benchmarks.baselines.lmcache_cpu.install` imports it, when LMCache builds its engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata

from kvtier.integrations.vllm.model.backend_layouts import VllmCpuLayout

_LAYOUT = VllmCpuLayout()


class HostPagedConnector(GPUConnectorInterface):
    """LMCache's copy half for vLLM's CPU backend (see the module docstring).

    Every call gets `kvcaches` (one tensor per layer, in layer order) and `slot_mapping` (the engine
    slot of each token of the whole sequence) as keyword arguments; `start:end` selects the tokens
    of one memory object. After `from_gpu` the object holds those tokens' K and V; after `to_gpu`
    the engine slots hold the object's. Nothing is asynchronous: the copy is done on return.
    """

    def __init__(self, metadata: LMCacheMetadata) -> None:
        num_layers, kv_size, _, num_heads, head_dim = metadata.kv_shape
        if metadata.use_mla or kv_size != 2:
            raise NotImplementedError("HostPagedConnector copies K and V pages; MLA is not supported")
        self.num_layers, self.num_heads, self.head_dim = num_layers, num_heads, head_dim
        self.kvcaches: list[torch.Tensor] | None = None
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._block_size = 0

    def initialize_kvcaches_ptr(self, **kwargs: Any) -> None:
        caches = kwargs.get("kvcaches")
        if caches is None or (self.kvcaches is not None and caches[0] is self.kvcaches[0]):
            return
        caches = list(caches)
        if len(caches) != self.num_layers:
            raise ValueError(f"{len(caches)} KV tensors for a model of {self.num_layers} layers")
        views = [_LAYOUT.kv_views(kv, self.head_dim) for kv in caches]
        self.kvcaches, self._views, self._block_size = caches, views, caches[0].shape[2]

    def _slots(self, start: int, end: int, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        self.initialize_kvcaches_ptr(**kwargs)
        if not self._views:
            raise ValueError("HostPagedConnector: no kvcaches given yet")
        slots = kwargs["slot_mapping"][start:end].to(device="cpu", dtype=torch.long)
        return torch.div(slots, self._block_size, rounding_mode="floor"), slots % self._block_size

    def _payload(self, memory_obj: MemoryObj, tokens: int) -> torch.Tensor:
        tensor = memory_obj.tensor
        if tensor is None or memory_obj.metadata.fmt != MemoryFormat.KV_2LTD:
            raise ValueError("HostPagedConnector: a KV_2LTD memory object with a tensor is needed")
        return tensor.view(2, self.num_layers, tokens, self.num_heads, self.head_dim)

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        blocks, offsets = self._slots(start, end, kwargs)
        out = self._payload(memory_obj, end - start)
        for layer, (k, v) in enumerate(self._views):
            out[0, layer] = k[blocks, :, offsets]
            out[1, layer] = v[blocks, :, offsets]

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        blocks, offsets = self._slots(start, end, kwargs)
        src = self._payload(memory_obj, end - start)
        for layer, (k, v) in enumerate(self._views):
            k[blocks, :, offsets] = src[0, layer]
            v[blocks, :, offsets] = src[1, layer]

    def batched_from_gpu(self, memory_objs: Sequence[MemoryObj], starts: Sequence[int],
                         ends: Sequence[int], **kwargs: Any) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs: Sequence[MemoryObj], starts: Sequence[int],
                       ends: Sequence[int], **kwargs: Any) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.num_heads * self.head_dim])
