"""Tenant shares of the secondary tiers, at their admission gate (`tenant_shares`).

With `tenants` configured, this policy follows what each tenant (`tenants.py`: a request's
`cache_salt`, as a tenant id) holds in each secondary tier: the chunks the tier reported STORED and
not yet REMOVED, plus the chunks submitted for store there and not yet reported (a store in
flight: admitted by every policy, `admitted`, until `stores_ended`). The tenant of a chunk is the one
holding its host row when it is cascaded (a chunk that is not host-resident then is not stored).

A tier given shares (`TenantShares.tiers`) refuses a tenant's new chunks only when the tier is full
and the tenant holds at least its share of it; a tenant under its share is never refused here. Full
means one more chunk would not fit: the tier's bytes as it last reported them (`TierUsage`), or
what this instance counts if more (a report lags), plus the stores in flight, against the tier's
capacity. A tier that reports no capacity (unbounded, or not reported yet) is never full. Bytes are
counted as host rows (`row_bytes` each).

What it does not do: it acts at the admission gate only and does not change the order of a tier's
own evictions (a tenant under its share may still lose its oldest chunks to its own or another
tenant's newer ones once the tier is full); it sees only this instance's tenants, not those of
other engines sharing the tier, nor chunks stored before it started. A tier process that restarts
forgets what this instance counted there (an undercount: fewer refusals, never more).

Every batch of events sets `kvtier_tenant_bytes{tenant, tier}` for that tier (labels bounded by the
config: `none`, `other`, `t1`, ...). Called on the scheduler thread only; each call costs time
proportional to the keys it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.format.chunks import HOST, TierEvent, TierEventKind
from kvtier.ops.metrics import KVTierMetrics
from kvtier.policies.base import DEFAULT_PRIORITY, AdmissionPolicy, AdmissionSettings
from kvtier.policies.tenants import TenantShares


class TierFill(Protocol):
    """What a tier reports of its fill (`kvtier.tiers.base.TierUsage`)."""

    @property
    def bytes_used(self) -> int: ...
    @property
    def capacity_bytes(self) -> int: ...


class WatchedTier(Protocol):
    """What this policy reads of a secondary tier's process (`kvtier.tiers.process.TierProcess`)."""

    @property
    def last_usage(self) -> TierFill | None: ...
    @property
    def restarts(self) -> int: ...


@dataclass
class _Holdings:
    """What each tenant holds in one tier (stored) and is storing there (pending, batch)."""

    tenants: int
    restarts: int
    stored: dict[bytes, int] = field(default_factory=dict)
    pending: dict[bytes, int] = field(default_factory=dict)
    count: list[int] = field(default_factory=list)
    """Per tenant id: stored + pending + admitted in the batch being asked."""
    stored_count: list[int] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.count, self.stored_count, self.batch = ([0] * self.tenants for _ in range(3))


class TierShares(AdmissionPolicy):
    """Refuses a tenant's new chunks in a full secondary tier where it holds its share or more."""

    name = "tenant_shares"

    def __init__(self, settings: AdmissionSettings | None = None) -> None:
        super().__init__(settings)
        self.shares: TenantShares | None = None
        self._tiers: Mapping[str, WatchedTier] = {}
        self._tenant_of: Callable[[bytes], int | None] = lambda key: None
        self._row_bytes = 1
        self._metrics: KVTierMetrics | None = None
        self._held: dict[str, _Holdings] = {}

    def bind(self, shares: TenantShares, tenant_of: Callable[[bytes], int | None],
             tiers: Mapping[str, WatchedTier], row_bytes: int, metrics: KVTierMetrics) -> None:
        """Follow `tiers` (by name) for the tenants of `shares`: `tenant_of` gives the tenant id
        holding a host-resident chunk (None: unknown), `row_bytes` a chunk's bytes, `metrics` gets
        the gauge. Called once, before the first chunk is asked about; unbound, it admits all."""
        self.shares, self._tenant_of, self._tiers = shares, tenant_of, tiers
        self._row_bytes, self._metrics = row_bytes, metrics

    def admit(self, key: bytes, tier: str, priority: int = DEFAULT_PRIORITY) -> bool:
        caps = None if tier == HOST or self.shares is None else self.shares.tiers.get(tier)
        tenant = None if caps is None else self._tenant_of(key)
        held = self._holdings(tier)
        if caps is None or tenant is None or held is None:
            return True
        capacity = self._capacity(tier)
        if capacity and self._full(tier, held, capacity) and held.count[tenant] * self._row_bytes >= (
                caps[tenant] * capacity):
            return False
        held.count[tenant] += 1
        held.batch[tenant] += 1
        return True

    def admitted(self, tier: str, keys: Sequence[bytes]) -> None:
        held = self._holdings(tier)
        if held is None:
            return
        for tenant, n in enumerate(held.batch):
            held.count[tenant] -= n
            held.batch[tenant] = 0
        for key in keys:
            if key not in held.pending and key not in held.stored and (t := self._tenant_of(key)) is not None:
                held.pending[key] = t
                held.count[t] += 1

    def stores_ended(self, tier: str, keys: Sequence[bytes]) -> None:
        held = self._holdings(tier)
        if held is None:
            return
        for key in keys:
            if (t := held.pending.pop(key, None)) is not None:
                held.count[t] -= 1

    def tier_events(self, tier: str, events: Sequence[TierEvent]) -> None:
        held = self._holdings(tier)
        if held is None or not events:
            return
        for event in events:
            for key in event.keys:
                if event.kind is TierEventKind.STORED and key not in held.stored:
                    t = held.pending.pop(key, None)
                    if t is None and (t := self._tenant_of(key)) is not None:
                        held.count[t] += 1
                    if t is not None:
                        held.stored[key] = t
                        held.stored_count[t] += 1
                elif event.kind is TierEventKind.REMOVED and (t := held.stored.pop(key, None)) is not None:
                    held.count[t] -= 1
                    held.stored_count[t] -= 1
        if self._metrics is not None and self.shares is not None:
            for label, n in zip(self.shares.labels, held.stored_count, strict=True):
                self._metrics.set("tenant_bytes", n * self._row_bytes, label, tier)

    def _holdings(self, tier: str) -> _Holdings | None:
        """The tier's holdings, forgotten when its process restarted; None: a tier not followed."""
        proc = self._tiers.get(tier)
        if proc is None or self.shares is None:
            return None
        held = self._held.get(tier)
        if held is None or held.restarts != proc.restarts:
            held = self._held[tier] = _Holdings(len(self.shares.labels), proc.restarts)
        return held

    def _capacity(self, tier: str) -> int:
        usage = self._tiers[tier].last_usage
        return 0 if usage is None else usage.capacity_bytes

    def _full(self, tier: str, held: _Holdings, capacity: int) -> bool:
        """Whether one more chunk would not fit in `tier` (see the module docstring)."""
        usage = self._tiers[tier].last_usage
        reported = 0 if usage is None else usage.bytes_used
        row = self._row_bytes
        in_flight = sum(held.count) - sum(held.stored_count)
        return max(reported, sum(held.stored_count) * row) + (in_flight + 1) * row > capacity
