"""The host memory plan: the host tier checked against the machine's memory, not against free memory.

A plan starts from `MemTotal` (/proc/meminfo), takes off what the engine needs from host memory
(named parts, such as a CPU backend's device KV cache, the weights and the server's processes) and
the host tier, and what is left must be at least the reserve kept for the OS, its page cache and
co-located services (`os_reserve_bytes`; by default a tenth of MemTotal). Free memory
(`MemAvailable`) is never read: it is a snapshot that changes from one second to the next, and a
host tier sized from it fails later, under load, when the page cache or a neighbour grows back.

`MemoryPlan.check` refuses a plan that leaves less than the reserve with a `ConfigError` that names
the key and prints the arithmetic; `MemoryPlan.line` is the same arithmetic for a plan that fits.
Nothing here knows an engine: callers name the parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ConfigError, KVTierError

GIB = 1 << 30
MEMINFO = Path("/proc/meminfo")
RESERVE_DIVISOR = 10
"""The default reserve is MemTotal / RESERVE_DIVISOR."""
RESERVE_KEY = "os_reserve_bytes"


def mem_total(meminfo: Path | None = None) -> int:
    """`MemTotal` of `meminfo` (default `MEMINFO`, read when called), in bytes."""
    path = MEMINFO if meminfo is None else meminfo
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError) as e:
        raise KVTierError(f"cannot read MemTotal from {path} ({e})") from e
    raise KVTierError(f"no MemTotal in {path}")


def default_reserve(total: int) -> int:
    """The reserve when none is configured: a tenth of `total`."""
    return total // RESERVE_DIVISOR


def gib(n: int) -> str:
    """`n` bytes as GiB with two decimals."""
    return f"{n / GIB:.2f} GiB"


@dataclass(frozen=True)
class MemoryPlan:
    """MemTotal, what else needs host memory (label, bytes), the host tier and the reserve."""

    total: int
    needs: tuple[tuple[str, int], ...]
    host_tier: int
    reserve: int

    @property
    def left(self) -> int:
        """Bytes left once the needs and the host tier are taken from MemTotal (may be negative)."""
        return self.total - sum(n for _, n in self.needs) - self.host_tier

    def arithmetic(self) -> str:
        """`MemTotal T - label N - ... - host tier H = L left` in GiB."""
        terms = "".join(f" - {label} {gib(n)}" for label, n in self.needs)
        return f"MemTotal {gib(self.total)}{terms} - host tier {gib(self.host_tier)} = {gib(self.left)} left"

    def line(self) -> str:
        """One line for the log: the arithmetic and the reserve it keeps."""
        return (f"kvtier: memory plan: {self.arithmetic()}, the reserve for the OS and page cache "
                f"({RESERVE_KEY}) {gib(self.reserve)}")

    def check(self, key: str, value: object) -> None:
        """Raise `ConfigError` naming `key` (the host tier's size as the user gave it, `value`)
        when less than the reserve is left; return when the plan fits."""
        if self.left >= self.reserve:
            return
        raise ConfigError(key, value, (
            f"the host tier over-commits this machine's memory: {self.arithmetic()}, under the "
            f"{gib(self.reserve)} kept for the OS, its page cache and other services "
            f"({RESERVE_KEY}); give a smaller host tier or device KV cache, or a smaller "
            f"{RESERVE_KEY}"))


def plan(needs: tuple[tuple[str, int], ...], host_tier: int, reserve: int | None,
         total: int | None = None) -> MemoryPlan:
    """The plan for `needs` and `host_tier` on a machine of `total` bytes (None: this one's
    `mem_total()`), with the configured `reserve` (None: `default_reserve(total)`)."""
    total = mem_total() if total is None else total
    return MemoryPlan(total, needs, host_tier, default_reserve(total) if reserve is None else reserve)
