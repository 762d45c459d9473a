"""Host tiers over anonymous memory, what the host tests store and read back, and a machine of a
chosen size for the memory plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.format.chunks import TierEventKind
from kvtier.host import budget
from kvtier.host.tier import HostTier
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.registry import resolve_eviction

ROW = 4096


def make_policy(name: str, capacity: int) -> EvictionPolicy[int]:
    policy: EvictionPolicy[int] = resolve_eviction(name)(capacity)  # type: ignore[assignment]
    return policy


def make_tier(buf: memoryview, policy_name: str, slots: int = 8) -> HostTier:
    return HostTier(buf[: slots * ROW], ROW, make_policy(policy_name, slots))


def k(i: int) -> bytes:
    return i.to_bytes(8, "big")


def put(tier: HostTier, keys: list[int], priority: int) -> None:
    slots = tier.reserve([k(i) for i in keys])
    assert slots is not None
    tier.commit(list(slots), True, priority=priority)


def evicted(tier: HostTier) -> list[bytes]:
    return [key for e in tier.take_events() if e.kind is TierEventKind.REMOVED for key in e.keys]


def machine_of(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, total: int) -> None:
    """Make the memory plan (`kvtier.host.budget.mem_total`) see a machine of `total` bytes, with
    its free memory at a figure no check may read."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {total // 1024} kB\nMemFree: 1 kB\nMemAvailable: 1 kB\n")
    monkeypatch.setattr(budget, "MEMINFO", meminfo)
