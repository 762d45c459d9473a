"""The vLLM flags `kvtier serve` adds so that the server starts on any machine, and why.

On vLLM's CPU backend two defaults stop or slow a first start:

- `--gpu-memory-utilization` (default 0.92) is, on CPU, the fraction of the node's memory vLLM
  reserves for its own KV cache; on a machine where other processes hold memory the worker refuses
  to start ("Available memory on node 0 ... is less than desired CPU memory utilization"). When the
  user gave no size (`SIZE_FLAGS`, or `VLLM_CPU_KVCACHE_SPACE`), `device_cache_bytes` picks one:
  `MemAvailable` (/proc/meminfo) minus the host tier (`cpu_bytes_to_use`, which lives in /dev/shm
  and is not allocated yet) minus a margin for the two server processes and the model's weights,
  at most `DEVICE_CACHE_CAP`, rounded down to a MiB. `--num-gpu-blocks-override` alone sets the
  block count but not the reservation, so the byte size is still added then.
- without `--enforce-eager` vLLM compiles the model with torch.compile before it serves (about
  2.5 minutes for SmolLM2 on 2 cores); kvtier adds it unless the user chose (`COMPILE_FLAGS`).

On other backends (CUDA) nothing is added: vLLM's defaults fit an accelerator. The user's own flags
always win: `startup_args` only adds flags the user did not give. Nothing here imports vLLM.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import KVTierError

GIB = 1 << 30
MIB = 1 << 20
SIZE_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization", "--device-memory-utilization")
"""vLLM flags that size the device KV cache in bytes (or as a memory fraction)."""
BLOCKS_FLAG = "--num-gpu-blocks-override"
COMPILE_FLAGS = ("--enforce-eager", "--no-enforce-eager", "--compilation-config", "-cc", "-O")
"""vLLM flags that say whether to compile; any of them leaves the choice to the user."""
DEVICE_CACHE_CAP = 4 * GIB
"""The largest device KV cache kvtier picks on CPU (more rarely helps on a few cores)."""
MIN_DEVICE_CACHE = 256 * MIB
"""Below this, kvtier does not pick a size: it asks the user to free memory or give one."""
PROCESS_MARGIN = 2 * GIB
"""Memory kept for vLLM's API server and engine processes (Python, torch), besides the weights."""
CPU_BLOCK_SIZE = 128
"""vLLM's default engine block size on CPU (16 on CUDA)."""
CUDA_BLOCK_SIZE = 16
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


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


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int:
    """`MemAvailable` of `meminfo`, in bytes."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError) as e:
        raise KVTierError(f"cannot read MemAvailable from {meminfo} ({e}); "
                          "give --kv-cache-memory-bytes after --") from e
    raise KVTierError(f"no MemAvailable in {meminfo}; give --kv-cache-memory-bytes after --")


def weight_bytes(model: str) -> int:
    """Bytes of weight files in the model directory `model` (0 for a hub name)."""
    path = Path(model)
    if not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.iterdir() if f.suffix in WEIGHT_SUFFIXES and f.is_file())


@dataclass(frozen=True)
class DeviceCacheChoice:
    """The device KV cache kvtier picked, and the figures it came from (bytes)."""

    size: int
    available: int
    host: int
    margin: int
    weights: int

    def line(self) -> str:
        """One line saying what was chosen and why, and how to choose otherwise."""
        room = self.available - self.host - self.margin
        capped = f", capped at {DEVICE_CACHE_CAP / GIB:g} GiB" if room > self.size else ""
        return (f"kvtier: device KV cache {self.size / GIB:.2f} GiB (--kv-cache-memory-bytes "
                f"{self.size}): vLLM's CPU backend would reserve 92% of memory; MemAvailable "
                f"{self.available / GIB:.2f} GiB - host tier {self.host / GIB:.2f} GiB - margin "
                f"{self.margin / GIB:.2f} GiB (server processes + 2 x {self.weights / GIB:.2f} GiB "
                f"of weights) = {room / GIB:.2f} GiB{capped}; give --kv-cache-memory-bytes "
                "after -- to choose")


def device_cache_bytes(available: int, host_bytes: int, weights: int) -> DeviceCacheChoice:
    """The device KV cache for a CPU server given `available` memory, the host tier's
    `host_bytes` and the model's `weights` (counted twice: a float32 copy of bf16 files).

    Raises `KVTierError` naming the figures when less than `MIN_DEVICE_CACHE` is left."""
    margin = PROCESS_MARGIN + 2 * weights
    room = available - host_bytes - margin
    size = min(DEVICE_CACHE_CAP, room) // MIB * MIB
    if size < MIN_DEVICE_CACHE:
        raise KVTierError(
            f"no room for vLLM's CPU KV cache: MemAvailable {available / GIB:.2f} GiB - host tier "
            f"(--cpu-gb) {host_bytes / GIB:.2f} GiB - margin {margin / GIB:.2f} GiB = "
            f"{room / GIB:.2f} GiB, under {MIN_DEVICE_CACHE // MIB} MiB; give a smaller --cpu-gb, "
            "or --kv-cache-memory-bytes BYTES after --")
    return DeviceCacheChoice(size, available, host_bytes, margin, weights)


def startup_args(vllm_args: Sequence[str], *, host_bytes: int, model: str, cpu: bool,
                 env: Mapping[str, str], meminfo: Path = Path("/proc/meminfo"),
                 ) -> tuple[list[str], list[str]]:
    """(flags to append to `vllm_args`, lines to print), following the module doc."""
    if not cpu:
        return [], []
    added: list[str] = []
    lines: list[str] = []
    if not has_flag(vllm_args, *SIZE_FLAGS) and not env.get("VLLM_CPU_KVCACHE_SPACE"):
        choice = device_cache_bytes(mem_available(meminfo), host_bytes, weight_bytes(model))
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
