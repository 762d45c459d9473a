"""The vLLM flags `kvtier serve` adds so that the server starts on any machine, and why.

On vLLM's CPU backend two defaults stop or slow a first start:

- `--gpu-memory-utilization` (default 0.92) is, on CPU, the fraction of the node's memory vLLM
  reserves for its own KV cache; on a machine where other processes hold memory the worker refuses
  to start ("Available memory on node 0 ... is less than desired CPU memory utilization"). When the
  user gave no size (`SIZE_FLAGS`, or `VLLM_CPU_KVCACHE_SPACE`), `device_cache_bytes` picks one
  from the machine's memory, never from a snapshot of free memory: `MemTotal` (/proc/meminfo)
  minus the host tier (`cpu_bytes_to_use`, which lives in /dev/shm) minus a margin for the two
  server processes and the model's weights minus the reserve for the OS and its page cache
  (`os_reserve_bytes`, `kvtier.host.budget`), at most `DEVICE_CACHE_CAP`, rounded down to a MiB:
  the memory plan `kvtier serve` then checks holds by construction, unless less than
  `MIN_DEVICE_CACHE` was left, and then the plan refuses the host tier. `--num-gpu-blocks-override`
  alone sets the block count but not the reservation, so the byte size is still added then.
- without `--enforce-eager` vLLM compiles the model with torch.compile before it serves (about
  2.5 minutes for SmolLM2 on 2 cores); kvtier adds it unless the user chose (`COMPILE_FLAGS`).

On other backends (CUDA) nothing is added: vLLM's defaults fit an accelerator. The user's own flags
always win: `startup_args` only adds flags the user did not give. Nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvtier.errors import KVTierError
from kvtier.host.budget import GIB, default_reserve, gib
from kvtier.integrations.vllm.host_memory import PROCESS_MARGIN, weight_bytes

MIB = 1 << 20
SIZE_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization", "--device-memory-utilization")
"""vLLM flags that size the device KV cache in bytes (or as a memory fraction)."""
BLOCKS_FLAG = "--num-gpu-blocks-override"
COMPILE_FLAGS = ("--enforce-eager", "--no-enforce-eager", "--compilation-config", "-cc", "-O")
"""vLLM flags that say whether to compile; any of them leaves the choice to the user."""
DEVICE_CACHE_CAP = 4 * GIB
"""The largest device KV cache kvtier picks on CPU (more rarely helps on a few cores)."""
MIN_DEVICE_CACHE = 256 * MIB
"""The smallest device KV cache kvtier picks."""
CPU_BLOCK_SIZE = 128
"""vLLM's default engine block size on CPU (16 on CUDA)."""
CUDA_BLOCK_SIZE = 16


def has_flag(args: Sequence[str], *flags: str) -> bool:
    """Whether `args` hold one of `flags`, as `--flag`, `--flag=VALUE` or (for `-O`) `-O3`."""
    for arg in args:
        for flag in flags:
            if arg == flag or arg.startswith(flag + "=") or (flag == "-O" and arg.startswith("-O")):
                return True
    return False


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value given to `flag` in `args` (`--flag V` or `--flag=V`; the last one wins)."""
    value: str | None = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def is_cpu_backend(env: Mapping[str, str]) -> bool:
    """Whether vLLM will run on its CPU backend: as vLLM decides it (`VLLM_TARGET_DEVICE=cpu`, or
    an installed vLLM whose version or distribution name says cpu), read from package metadata."""
    if env.get("VLLM_TARGET_DEVICE") == "cpu":
        return True
    try:
        return "cpu" in importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def engine_block_size(vllm_args: Sequence[str], cpu: bool) -> int:
    """Tokens per engine block: `--block-size` when given, else vLLM's default for the backend."""
    text = flag_value(vllm_args, "--block-size")
    if text is None:
        return CPU_BLOCK_SIZE if cpu else CUDA_BLOCK_SIZE
    try:
        size = int(text)
    except ValueError:
        size = 0
    if size <= 0:
        raise KVTierError(f"--block-size {text}: must be a positive number of tokens")
    return size


@dataclass(frozen=True)
class DeviceCacheChoice:
    """The device KV cache kvtier picked, and the figures it came from (bytes)."""

    size: int
    total: int
    host: int
    margin: int
    weights: int
    reserve: int

    @property
    def room(self) -> int:
        """What the memory plan leaves for the device cache (may be negative)."""
        return self.total - self.host - self.margin - self.reserve

    def line(self) -> str:
        """One line saying what was chosen and why, and how to choose otherwise."""
        capped = f", capped at {DEVICE_CACHE_CAP / GIB:g} GiB" if self.room > self.size else ""
        return (f"kvtier: device KV cache {gib(self.size)} (--kv-cache-memory-bytes {self.size}): "
                f"vLLM's CPU backend would reserve 92% of memory; MemTotal {gib(self.total)} - host "
                f"tier {gib(self.host)} - margin {gib(self.margin)} (server processes + 2 x "
                f"{gib(self.weights)} of weights) - reserve {gib(self.reserve)} (os_reserve_bytes) "
                f"= {gib(self.room)}{capped}; give --kv-cache-memory-bytes after -- to choose")


def device_cache_bytes(total: int, host_bytes: int, weights: int,
                       reserve: int | None = None) -> DeviceCacheChoice:
    """The device KV cache for a CPU server on a machine of `total` bytes (MemTotal) given the host
    tier's `host_bytes`, the model's `weights` (counted twice: a float32 copy of bf16 files) and
    the OS `reserve` (None: `default_reserve`): what is left, between `MIN_DEVICE_CACHE` and
    `DEVICE_CACHE_CAP`. Where less than the minimum is left, the memory plan `kvtier serve` checks
    next refuses the host tier with its arithmetic."""
    reserve = default_reserve(total) if reserve is None else reserve
    choice = DeviceCacheChoice(0, total, host_bytes, PROCESS_MARGIN + 2 * weights, weights, reserve)
    size = max(MIN_DEVICE_CACHE, min(DEVICE_CACHE_CAP, choice.room) // MIB * MIB)
    return dataclasses.replace(choice, size=size)


def startup_args(vllm_args: Sequence[str], *, host_bytes: int, model: str, cpu: bool,
                 env: Mapping[str, str], total: int, reserve: int | None = None,
                 ) -> tuple[list[str], list[str]]:
    """(flags to append to `vllm_args`, lines to print), following the module doc, on a machine
    of `total` bytes keeping `reserve` (None: the default) for the OS."""
    if not cpu:
        return [], []
    added: list[str] = []
    lines: list[str] = []
    if not has_flag(vllm_args, *SIZE_FLAGS) and not env.get("VLLM_CPU_KVCACHE_SPACE"):
        choice = device_cache_bytes(total, host_bytes, weight_bytes(model), reserve)
        added += ["--kv-cache-memory-bytes", str(choice.size)]
        lines.append(choice.line())
        if has_flag(vllm_args, BLOCKS_FLAG):
            lines.append(f"kvtier: {BLOCKS_FLAG} sets the block count; the byte size above only "
                         "stops vLLM reserving 92% of memory")
    if not has_flag(vllm_args, *COMPILE_FLAGS):
        added.append("--enforce-eager")
        lines.append("kvtier: --enforce-eager (no torch.compile: the server starts in tens of "
                     "seconds, not ~2.5 minutes); give --no-enforce-eager after -- to compile")
    return added, lines
