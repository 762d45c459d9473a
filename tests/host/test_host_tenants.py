"""The host tier with tenant shares: eviction takes from tenants over their share first, admission
refuses only a tenant over its share when the tier is full, and the rows each tenant holds."""

from __future__ import annotations

import random

import pytest

from kvtier.host.tier import HostTier
from kvtier.policies.base import Retention
from kvtier.policies.tenants import NO_SALT, OTHER_SALT, TenantShares
from tests.host.helpers import ROW, evicted, k, make_policy

A = 2  # the first named tenant's id
SHARES = TenantShares({"a": 0.5}, 0.5)  # 8 slots: `a` may hold 4, `none` 4, `other` 4


def tenant_tier(buf: memoryview, policy_name: str, shares: TenantShares | None = SHARES) -> HostTier:
    return HostTier(buf[: 8 * ROW], ROW, make_policy(policy_name, 8), shares=shares)


def store(tier: HostTier, keys: list[int], tenant: int) -> bool:
    slots = tier.reserve([k(i) for i in keys], tenant)
    if slots is None:
        return False
    tier.commit(list(slots), True)
    tier.check()
    return True


def test_a_flooding_tenant_evicts_its_own_rows_not_those_within_a_share(
    buf: memoryview, policy_name: str
) -> None:
    tier = tenant_tier(buf, policy_name)
    assert store(tier, [0, 1, 2, 3], A)  # `a`'s working set: the oldest rows, within its share
    assert store(tier, [10, 11, 12, 13], OTHER_SALT)  # the tier is full
    tier.take_events()
    for i in range(20, 40):  # one-off prompts, several times the tier's size
        assert store(tier, [i], OTHER_SALT)
    assert tier.lookup([k(i) for i in range(4)]) == 4
    assert set(evicted(tier)) == {k(i) for i in [10, 11, 12, 13, *range(20, 36)]}
    assert tier.stats().tenant_bytes == (0, 4 * ROW, 4 * ROW)


def test_without_shares_the_flood_takes_the_oldest_rows(buf: memoryview, policy_name: str) -> None:
    tier = tenant_tier(buf, policy_name, shares=None)
    assert store(tier, [0, 1, 2, 3], NO_SALT)
    assert store(tier, [10, 11, 12, 13], NO_SALT)
    for i in range(20, 40):
        assert store(tier, [i], NO_SALT)
    assert tier.lookup([k(i) for i in range(4)]) == 0
    assert tier.stats().tenant_bytes == ()


def test_a_tenant_over_its_share_is_refused_when_only_rows_within_a_share_could_go(
    buf: memoryview, policy_name: str
) -> None:
    tier = tenant_tier(buf, policy_name)
    assert store(tier, [0, 1, 2, 3], A)
    assert store(tier, [10, 11, 12, 13], OTHER_SALT)
    other = [k(i) for i in [10, 11, 12, 13]]
    assert tier.pin(other) is not None  # its own rows are being read: none of them can go
    before = tier.stats()
    assert tier.reserve([k(20)], OTHER_SALT) is None  # over its share and the tier is full
    assert tier.stats() == before
    tier.check()
    assert store(tier, [4], A)  # `a`, at its share, makes room with its own oldest row
    assert evicted(tier) == [k(0)]
    tier.unpin(other)
    assert store(tier, [20], OTHER_SALT)  # and so does `other`, once its rows are free
    assert evicted(tier) == [k(10)]
    assert tier.lookup([k(i) for i in range(1, 5)]) == 4


def test_a_tenant_within_its_share_takes_rows_held_over_a_share_first(
    buf: memoryview, policy_name: str
) -> None:
    tier = tenant_tier(buf, policy_name)
    assert store(tier, list(range(10, 17)), OTHER_SALT)  # 7 rows, 3 over its share (the tier was empty)
    assert store(tier, [0], A)  # the last free row
    tier.take_events()
    assert store(tier, [1, 2, 3], A)  # full: the over-share rows go, the oldest first
    assert sorted(evicted(tier)) == [k(10), k(11), k(12)]
    assert tier.stats().tenant_bytes == (0, 4 * ROW, 4 * ROW)
    assert store(tier, [4], A)  # `a` is at its share and no one is over: its own oldest row goes
    assert evicted(tier) == [k(0)]


def test_shares_over_one_fall_back_to_the_usual_order(buf: memoryview, policy_name: str) -> None:
    tier = tenant_tier(buf, policy_name, TenantShares({"a": 0.75, "b": 0.75}, 0.0))
    assert store(tier, [0, 1, 2, 3], A)
    assert store(tier, [10, 11, 12, 13], A + 1)
    tier.take_events()
    assert store(tier, [14], A + 1)  # both within their share: the usual order picks the victim
    assert len(evicted(tier)) == 1
    assert tier.stats().used == 8


def test_rolled_back_and_cleared_rows_leave_their_tenant(buf: memoryview, policy_name: str) -> None:
    tier = tenant_tier(buf, policy_name)
    slots = tier.reserve([k(0), k(1)], A)
    assert slots is not None and tier.stats().tenant_bytes == (0, 0, 2 * ROW)
    tier.commit([k(0)], False)
    tier.commit([k(1)], True, probation={k(1): Retention.COLD})
    assert tier.stats().tenant_bytes == (0, 0, ROW)
    tier.check()
    assert tier.clear() == 1
    assert tier.stats().tenant_bytes == (0, 0, 0)
    tier.check()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_randomized_tenants_keep_every_invariant(buf: memoryview, policy_name: str, seed: int) -> None:
    rng = random.Random(seed)
    tier = tenant_tier(buf, policy_name, TenantShares({"a": 0.25, "b": 0.5}, 0.25))
    pins: list[bytes] = []
    for step in range(600):
        op = rng.random()
        key = k(rng.randrange(40))
        if op < 0.5:
            slots = tier.reserve([key, k(rng.randrange(40))], rng.randrange(4))
            if slots is not None:
                tier.commit(list(slots), rng.random() < 0.9, priority=rng.choice([20, 50, 80]))
        elif op < 0.65 and tier.pin([key]) is not None:
            pins.append(key)
        elif op < 0.8 and pins:
            tier.unpin([pins.pop(rng.randrange(len(pins)))])
        elif op < 0.9:
            tier.used_prefix([key])
            tier.settle([key])
        elif op < 0.95:
            tier.raise_priority([key], rng.choice([60, 90]))
        elif step % 7 == 0:
            tier.clear()
        tier.check()
