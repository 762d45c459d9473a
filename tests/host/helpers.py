"""Host tiers over anonymous memory, and what the host tests store and read back."""

from __future__ import annotations

from kvtier.format.chunks import TierEventKind
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
    slots = tier.prepare_store([k(i) for i in keys])
    assert slots is not None
    tier.complete_store(list(slots), True, priority=priority)


def evicted(tier: HostTier) -> list[bytes]:
    return [key for e in tier.take_events() if e.kind is TierEventKind.REMOVED for key in e.keys]
