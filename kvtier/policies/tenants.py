"""Tenant shares of the host tier: who holds each row, and eviction that takes from tenants over
their share first.

A tenant is a request's `cache_salt`. `TenantShares` maps a salt to a small tenant id: 0 for
requests without a salt (label `none`), 1 for every salt the config does not name (label `other`),
2 and up for the named salts, in config order. Each id has a share of the host tier's rows (a
fraction 0-1, each a cap: the shares may sum over 1); `none` and `other` each have the `default`
share. Shares that sum to at most 1 guarantee every tenant its share: when the tier is full and a
tenant is under its share, another one is over its own, and eviction takes from that one first.
A secondary tier may have shares too (`TenantShares.tiers`, parsed by `parse_tenants`), enforced at
its admission gate (`tier_shares.py`).

`TenantClasses` is the host tier's eviction index (`PriorityClasses`) with one more index per
tenant, and the tenant of every slot (`tenant_of`, one byte per row). A tenant holds the rows it
reserved, WRITING and READY, until they are freed (`held`). Eviction (`evict` with the requesting
tenant) first takes the rows tenants hold over their cap, the most over first, each tenant's in
its own (retention, priority, policy) order; then, for what remains, the usual order over every
tenant, unless the requester itself would be over its cap: then nothing is taken (None), its new
chunks are refused rather than pushing out another tenant's rows held within its share.

Holds after every call: every resident key is in exactly one tenant index, the one of its slot's
tenant, with the same class; the tenant indexes together hold the resident keys. Costs: one
eviction takes time proportional to its victims, the pinned keys and the number of tenants, never
to the capacity. Called on the host tier's owning thread only; not thread-safe.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvtier.errors import ConfigError, unknown_name_message
from kvtier.format.chunks import HOST
from kvtier.policies.base import EvictionPolicy, Retention
from kvtier.policies.classes import PriorityClasses

NO_SALT, OTHER_SALT = 0, 1
"""The tenant ids of requests without a salt and of salts the config does not name."""
NONE_LABEL, OTHER_LABEL = "none", "other"
"""Their `tenant` metric labels; the named tenants' are `t1`, `t2`, ... in config order: a salt
keeps another tenant from probing a prefix cache, so it never appears in `/metrics`."""
MAX_TENANTS = 250
"""The most named tenants (a tenant id is one byte per row)."""


@dataclass(frozen=True)
class TenantShares:
    """Each tenant's share of the host tier, by tenant id (see the module docstring)."""

    named: Mapping[str, float]
    """The named salts' shares of the host tier, in config order."""
    default: float
    tiers: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    """The secondary tiers given shares: each one's share per tenant id (as `shares` for the host)."""

    @property
    def labels(self) -> tuple[str, ...]:
        """The `tenant` label of each tenant id: `none`, `other`, then `t1`, `t2`, ... for the
        named salts in config order."""
        return (NONE_LABEL, OTHER_LABEL, *(f"t{i}" for i in range(1, len(self.named) + 1)))

    @property
    def shares(self) -> tuple[float, ...]:
        """The share of each tenant id."""
        return (self.default, self.default, *self.named.values())

    def tenant_of(self, salt: str | None) -> int:
        """The tenant id of a request's `cache_salt`."""
        if salt is None:
            return NO_SALT
        names = list(self.named)
        return names.index(salt) + 2 if salt in self.named else OTHER_SALT

    def label_of(self, salt: str | None) -> str:
        """The `tenant` metric label of a request's `cache_salt`: bounded by the config."""
        return self.labels[self.tenant_of(salt)]

    def caps(self, slots: int) -> list[int]:
        """The most rows each tenant id holds within its share of `slots` rows."""
        return [math.floor(share * slots) for share in self.shares]


def parse_tenants(value: object, tiers: Sequence[str] = ()) -> TenantShares:
    """`tenants`: a JSON object of salt → share, and an optional `default` share. A share is a
    number 0-1 (of the host tier), or an object of shares by tier, `{"host": 0.5, "<tier name>":
    0.25}`. Per tier, as for the host tier: a tenant that gives no share there has the default; an
    absent default is half what the named shares leave (at least 0); a secondary tier that no
    entry names has no shares. `tiers`: the secondary tiers' names."""
    if not isinstance(value, Mapping) or not value:
        raise ConfigError("tenants", value, 'a non-empty object {"<cache_salt>": share, "default": share}')
    given: dict[str, dict[str, float]] = {}
    for salt, share in value.items():
        key = f"tenants.{salt}"
        if not isinstance(salt, str) or not salt:
            raise ConfigError(key, salt, "a tenant is named by its non-empty cache_salt")
        if salt in (NONE_LABEL, OTHER_LABEL):
            raise ConfigError(key, share, f"{salt!r} labels unnamed tenants: not a salt to name")
        if isinstance(share, Mapping) and share:
            for tier in share:
                if tier != HOST and tier not in tiers:
                    raise ConfigError(f"{key}.{tier}", tier, unknown_name_message(str(tier), [HOST, *tiers]))
            given[salt] = {tier: _share(f"{key}.{tier}", s) for tier, s in share.items()}
        elif isinstance(share, Mapping):
            raise ConfigError(key, share, 'an object of shares by tier: {"host": 0.5, "<tier name>": 0.25}')
        else:
            given[salt] = {HOST: _share(key, share)}
    default = given.pop("default", {})
    if len(given) > MAX_TENANTS:
        raise ConfigError("tenants", f"{len(given)} tenants", f"at most {MAX_TENANTS} named tenants")
    per_tier: dict[str, tuple[float, ...]] = {}
    for tier in (HOST, *tiers):
        if tier != HOST and tier not in default and not any(tier in s for s in given.values()):
            continue
        rest = default.get(tier, max(0.0, 1.0 - sum(s[tier] for s in given.values() if tier in s)) / 2)
        per_tier[tier] = (rest, rest, *(s.get(tier, rest) for s in given.values()))
    host = per_tier.pop(HOST)
    return TenantShares(dict(zip(given, host[2:], strict=True)), host[0], per_tier)


def _share(key: str, share: object) -> float:
    number = not isinstance(share, bool) and isinstance(share, int | float)
    if not number or not math.isfinite(share) or not 0 <= share <= 1:  # type: ignore[arg-type,operator]
        raise ConfigError(key, share, "a share is a number from 0 to 1 (of the tier's bytes)")
    return float(share)  # type: ignore[arg-type]


class TenantClasses(PriorityClasses[int]):
    """The host tier's eviction index with tenants (see the module docstring); values are slots."""

    def __init__(self, first: EvictionPolicy[int], priority: int, shares: TenantShares,
                 slots: int) -> None:
        """`first` (empty) orders the settled chunks of `priority`; `slots`: the host tier's rows."""
        super().__init__(first, priority)
        self.caps = shares.caps(slots)
        self.tenant_of = bytearray(slots)
        """The tenant of each slot's latest reservation."""
        self.held = [0] * len(self.caps)
        """Rows each tenant holds, WRITING and READY."""
        self._by_tenant = [PriorityClasses(type(first)(first.capacity), priority) for _ in self.caps]

    def claim(self, slots: Sequence[int], tenant: int) -> None:
        """`tenant` reserved `slots` (WRITING): it holds them until they are freed."""
        tenant_of = self.tenant_of
        for slot in slots:
            tenant_of[slot] = tenant
        self.held[tenant] += len(slots)

    def release(self, slots: Iterable[int]) -> None:
        """WRITING `slots` were rolled back: their tenants no longer hold them."""
        for slot in slots:
            self.held[self.tenant_of[slot]] -= 1

    def _index(self, key: bytes) -> PriorityClasses[int] | None:
        slot = self.get(key)
        return None if slot is None else self._by_tenant[self.tenant_of[slot]]

    def insert_many(
        self, entries: Mapping[bytes, int], priority: int, retention: Retention = Retention.SETTLED
    ) -> None:
        super().insert_many(entries, priority, retention)
        parts: dict[int, dict[bytes, int]] = {}
        for key, slot in entries.items():
            parts.setdefault(self.tenant_of[slot], {})[key] = slot
        for tenant, part in parts.items():
            self._by_tenant[tenant].insert_many(part, priority, retention)

    def remove(self, key: bytes) -> int | None:
        index = self._index(key)
        slot = super().remove(key)
        if index is not None and slot is not None:
            index.remove(key)
            self.held[self.tenant_of[slot]] -= 1
        return slot

    def touch(self, key: bytes) -> None:
        index = self._index(key)
        if index is not None:
            super().touch(key)
            index.touch(key)

    def refresh(self, key: bytes) -> None:
        index = self._index(key)
        if index is not None:
            super().refresh(key)
            index.refresh(key)

    def raise_priority(self, key: bytes, priority: int) -> bool:
        index = self._index(key)
        return index is not None and super().raise_priority(key, priority) and index.raise_priority(
            key, priority)

    def settle(self, key: bytes) -> bool:
        index = self._index(key)
        return index is not None and super().settle(key) and index.settle(key)

    def evict(
        self, n: int, protected: Container[bytes], held: Iterable[bytes], tenant: int | None = None,
        adding: int = 0,
    ) -> list[tuple[bytes, int]] | None:
        """`n` unprotected victims, all-or-nothing, for `adding` new rows of `tenant` (None: no
        requester): first the rows tenants hold over their cap, then the usual order unless the
        requester would be over its own cap (then None: its new chunks are refused)."""
        if n < 0:
            raise ValueError(f"cannot evict a negative number of entries: {n}")
        keep = set(held)
        pinned = Counter(self.tenant_of[s] for k in keep if (s := self.get(k)) is not None)
        need = [self.held[t] + (adding if t == tenant else 0) - cap for t, cap in enumerate(self.caps)]
        give = {t: min(over, len(self._by_tenant[t]) - pinned[t]) for t, over in enumerate(need) if over > 0}
        plan: list[tuple[int, int]] = []
        left = n
        for t in sorted(give, key=lambda t: need[t], reverse=True):
            take = min(give[t], left)
            if take > 0:
                plan.append((t, take))
                left -= take
        if left and tenant is not None and need[tenant] > 0:
            return None
        if left > len(self) - sum(pinned.values()) - (n - left):
            return None
        victims: list[tuple[bytes, int]] = []
        for t, take in plan:
            got = self._by_tenant[t].evict(take, protected, keep)
            if got is None:
                raise RuntimeError(f"tenant {t} could not give {take} victims")
            for key, _ in got:
                super().remove(key)
            self.held[t] -= take
            victims += got
        if left:
            rest = super().evict(left, protected, keep)
            if rest is None:
                raise RuntimeError(f"the usual order could not give {left} victims")
            for key, slot in rest:
                self._by_tenant[self.tenant_of[slot]].remove(key)
                self.held[self.tenant_of[slot]] -= 1
            victims += rest
        return victims

    def check(self) -> None:
        """`PriorityClasses.check`, and each resident key in its slot tenant's index, same class."""
        super().check()
        for index in self._by_tenant:
            index.check()
        if sum(map(len, self._by_tenant)) != len(self):
            raise RuntimeError(f"tenant indexes hold {sum(map(len, self._by_tenant))} keys, not {len(self)}")
        for tenant, index in enumerate(self._by_tenant):
            if len(index) > self.held[tenant]:
                raise RuntimeError(f"tenant {tenant} has {len(index)} resident keys, holds fewer rows")
        for key in list(self._class_of):
            found = self._index(key)
            if found is None or found.class_of(key) != self.class_of(key):
                raise RuntimeError(f"key {key.hex()} is not in its tenant's index with its class")
