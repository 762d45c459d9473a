"""The memory plan of a `kvtier serve` command, checked before vLLM starts (`kvtier.host.budget`).

The figures come from the flags vLLM will get (the user's and those `startup.startup_args` adds)
and from the model directory, never from free memory:

- on vLLM's CPU backend, each worker's device KV cache: `VLLM_CPU_KVCACHE_SPACE` GiB (vLLM lets it
  override the flag), else `--kv-cache-memory-bytes` (a number of bytes, or vLLM's `4G`, `512M`,
  `1.5g`); without either, `--gpu-memory-utilization` F (vLLM's default 0.92) is the fraction of
  MemTotal each CPU worker takes for its weights and KV cache together;
- `--tensor-parallel-size` (`-tp`): how many workers;
- on an accelerator, `--cpu-offload-gb` per device: weights vLLM keeps in host memory.

`cpu_offload_warning` is the line `kvtier serve` prints when `--cpu-offload-gb` is given: it is
vLLM's weight offload, not a KV cache offload.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from kvtier.errors import KVTierError
from kvtier.host.budget import GIB, MemoryPlan, plan
from kvtier.integrations.vllm.host_memory import PROCESS_MARGIN, engine_needs
from kvtier.integrations.vllm.serving.startup import flag_value

CPU_OFFLOAD_FLAG = "--cpu-offload-gb"
DEFAULT_UTILIZATION = 0.92
"""vLLM's default `--gpu-memory-utilization`."""
SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
            "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
"""The size suffixes vLLM's byte flags accept: lower case decimal, upper case binary."""


def _number(flag: str, text: str, allowed: str) -> float:
    """`text` as a finite number >= 0, or KVTierError naming `flag`, `text` and what is `allowed`."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        raise KVTierError(f"{flag} {text}: {allowed}")
    return value


def size_bytes(flag: str, text: str) -> int:
    """`text`, the value of the byte-size flag `flag`, in bytes (`4294967296`, `4G`, `1.5g`)."""
    suffix = text[-1:] if text[-1:] in SUFFIXES else ""
    number = text[: len(text) - len(suffix)]
    value = _number(flag, number, "must be a number of bytes, such as 4294967296, 4G or 4g")
    return int(value * SUFFIXES.get(suffix, 1))


def _workers(args: Sequence[str]) -> int:
    text = flag_value(args, "--tensor-parallel-size") or flag_value(args, "-tp") or "1"
    count = _number("--tensor-parallel-size", text, "must be a positive whole number")
    if count < 1 or not count.is_integer():
        raise KVTierError(f"--tensor-parallel-size {text}: must be a positive whole number")
    return int(count)


def _cpu_needs(args: Sequence[str], env: Mapping[str, str], total: int, weights: int,
               workers: int) -> tuple[tuple[str, int], ...]:
    space = env.get("VLLM_CPU_KVCACHE_SPACE")
    given = flag_value(args, "--kv-cache-memory-bytes")
    if space:
        per_worker = int(_number("VLLM_CPU_KVCACHE_SPACE", space, "must be a number of GiB") * GIB)
    elif given is not None:
        per_worker = size_bytes("--kv-cache-memory-bytes", given)
    else:
        text = (flag_value(args, "--gpu-memory-utilization")
                or flag_value(args, "--device-memory-utilization") or str(DEFAULT_UTILIZATION))
        fraction = _number("--gpu-memory-utilization", text, "must be a fraction of memory")
        return ((f"vLLM's CPU workers ({fraction:g} x MemTotal each, --gpu-memory-utilization: "
                 "weights and KV cache)", int(fraction * total) * workers),
                ("vLLM's processes", PROCESS_MARGIN))
    return engine_needs(cpu=True, device_cache=per_worker * workers, weights=weights, cpu_offload=0)


def serve_plan(vllm_args: Sequence[str], env: Mapping[str, str], *, cpu: bool, host_bytes: int,
               weights: int, reserve: int | None, total: int) -> MemoryPlan:
    """The memory plan of vLLM started with `vllm_args` (after kvtier's additions) in `env`, with
    a host tier of `host_bytes`, `weights` bytes of weight files, on a machine of `total` bytes."""
    workers = _workers(vllm_args)
    if cpu:
        needs = _cpu_needs(vllm_args, env, total, weights, workers)
    else:
        offload = flag_value(vllm_args, CPU_OFFLOAD_FLAG)
        per_device = 0.0 if offload is None else _number(CPU_OFFLOAD_FLAG, offload, "must be GiB >= 0")
        needs = engine_needs(cpu=False, device_cache=0, weights=weights,
                             cpu_offload=int(per_device * GIB) * workers)
    return plan(needs, host_bytes, reserve, total)


def cpu_offload_warning(value: str, cpu: bool) -> str:
    """What `kvtier serve` says about `--cpu-offload-gb value` (passed on to vLLM as given), on
    vLLM's CPU backend (`cpu`) or an accelerator."""
    where = ("on vLLM's CPU backend the weights are in CPU memory already" if cpu else
             "the offloaded weights cross to the device on every forward pass; counted in the "
             "memory plan")
    return (f"kvtier: warning: {CPU_OFFLOAD_FLAG} {value} offloads model weights to CPU memory "
            "(vLLM's weight offload), not the KV cache: it adds no KV capacity, and kvtier's KV "
            f"offload is --cpu-gb (--kv-offloading-size); {where}. Passed on to vLLM as given")
