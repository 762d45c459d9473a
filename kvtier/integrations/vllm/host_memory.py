"""What one vLLM engine needs from host memory, for the memory plan (`kvtier.host.budget`).

On vLLM's CPU backend the device KV cache is host memory, and so are the weights: counted twice
(a float32 copy of bf16 files, as vLLM runs on CPUs without bf16 support), plus `PROCESS_MARGIN`
for vLLM's API server and engine processes (Python, torch). On an accelerator the device cache
and the weights live on the device; host memory holds the processes and what `--cpu-offload-gb`
moves there (per device, so times the TP degree). The host tier comes on top of all of it.

`engine_needs` names the parts for figures a caller already has (`kvtier serve` reads them from
vLLM's flags before vLLM starts); `engine_plan` reads them from a running engine's config, for the
connector's check at construction (the device cache as vLLM allocated it).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.host.budget import GIB, MemoryPlan, plan

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

PROCESS_MARGIN = 2 * GIB
"""Memory kept for vLLM's API server and engine processes (Python, torch), besides the weights."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
DEVICE_CACHE = "vLLM's device KV cache"


def weight_bytes(model: str) -> int:
    """Bytes of weight files in the model directory `model` (0 for a hub name)."""
    path = Path(model)
    if not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.iterdir() if f.suffix in WEIGHT_SUFFIXES and f.is_file())


def engine_needs(*, cpu: bool, device_cache: int, weights: int, cpu_offload: int
                 ) -> tuple[tuple[str, int], ...]:
    """The parts of host memory an engine needs besides the host tier, labelled for the plan's
    arithmetic: on the CPU backend its `device_cache` (all ranks) and twice the `weights` plus the
    processes; elsewhere the processes and `cpu_offload` (weights moved to host memory, all ranks)."""
    if cpu:
        return ((DEVICE_CACHE, device_cache), ("weights and processes", PROCESS_MARGIN + 2 * weights))
    needs: tuple[tuple[str, int], ...] = (("vLLM's processes", PROCESS_MARGIN),)
    if cpu_offload:
        needs += (("weights offloaded by --cpu-offload-gb", cpu_offload),)
    return needs


def engine_plan(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, host_tier: int,
                reserve: int | None) -> MemoryPlan:
    """The memory plan of the engine vLLM is building, with a host tier of `host_tier` bytes:
    the device cache is the KV cache tensors vLLM sized for one worker, times the TP degree."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    cpu = vllm_config.device_config.device_type == "cpu"
    device_cache = sum(t.size for t in kv_cache_config.kv_cache_tensors) * tp
    offload = int(vllm_config.offload_config.uva.cpu_offload_gb * GIB) * tp
    needs = engine_needs(cpu=cpu, device_cache=device_cache,
                         weights=weight_bytes(vllm_config.model_config.model), cpu_offload=offload)
    return plan(needs, host_tier, reserve)
