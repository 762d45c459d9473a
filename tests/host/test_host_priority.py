"""Retention follows priority in the host tier: lower priorities leave first, the configured policy
orders each priority class, pins are honoured across classes, and reuse raises a chunk's priority.
Then, over real tier processes, a promoted chunk keeps the priority it was cascaded with."""

from __future__ import annotations

import time

import pytest

from kvtier.format.chunks import TierEvent, TierEventKind
from kvtier.manager import PrefixLookup, TieringManager
from kvtier.policies.base import DEFAULT_PRIORITY
from kvtier.policies.remembered import RememberedPriorities
from tests.conftest import random_key
from tests.host.helpers import evicted, k, make_tier, put
from tests.manager_helpers import HOST_SLOTS, drain, start


def test_lower_priorities_leave_first_whatever_their_recency(buf: memoryview, policy_name: str) -> None:
    tier = make_tier(buf, policy_name, slots=6)
    put(tier, [0, 1], priority=90)
    put(tier, [2, 3], priority=10)
    put(tier, [4, 5], priority=50)
    assert tier.pin([k(2), k(3)]) is not None  # recent accesses do not save them
    tier.unpin([k(2), k(3)])
    tier.take_events()
    put(tier, [6, 7, 8], priority=50)
    assert sorted(evicted(tier)) == [k(2), k(3), k(4)]
    assert [tier.priority_of(k(i)) for i in (0, 5, 6)] == [90, 50, 50]
    assert tier.priority_of(k(2)) is None
    tier.check()


def test_within_a_priority_the_policy_orders(buf: memoryview) -> None:
    tier = make_tier(buf, "lru", slots=4)
    put(tier, [0, 1, 2], priority=20)
    put(tier, [3], priority=80)
    assert tier.pin([k(0)]) is not None
    tier.unpin([k(0)])
    tier.take_events()
    put(tier, [4, 5], priority=20)
    assert evicted(tier) == [k(1), k(2)]  # LRU within class 20; 0 was touched, 3 is above
    tier.check()


def test_pinned_low_chunks_are_skipped_and_eviction_is_all_or_nothing(
    buf: memoryview, policy_name: str
) -> None:
    tier = make_tier(buf, policy_name, slots=4)
    put(tier, [0, 1], priority=5)
    put(tier, [2, 3], priority=60)
    assert tier.pin([k(0), k(1), k(2)]) is not None
    tier.take_events()
    assert tier.reserve([k(9), k(10)]) is None  # one unpinned row only: nothing changes
    assert tier.lookup([k(0), k(1), k(2), k(3)]) == 4 and evicted(tier) == []
    put(tier, [9], priority=5)
    assert evicted(tier) == [k(3)]  # the low ones are pinned: the higher class gives
    tier.unpin([k(0), k(1), k(2)])
    tier.check()


def test_reuse_raises_a_chunks_priority_never_lowers_it(buf: memoryview, policy_name: str) -> None:
    tier = make_tier(buf, policy_name, slots=3)
    put(tier, [0, 1], priority=10)
    put(tier, [2], priority=40)
    assert tier.raise_priority([k(0), k(2), k(7)], 30) == 1  # 2 is above 30, 7 is not resident
    assert [tier.priority_of(k(i)) for i in range(3)] == [30, 10, 40]
    tier.take_events()
    put(tier, [3, 4], priority=DEFAULT_PRIORITY)
    assert evicted(tier) == [k(1), k(0)]
    tier.check()


def test_clear_and_check_cover_every_class(buf: memoryview, policy_name: str) -> None:
    tier = make_tier(buf, policy_name, slots=4)
    put(tier, [0], priority=1)
    put(tier, [1], priority=99)
    assert tier.clear() == 2
    assert tier.take_events()[-1] == TierEvent(TierEventKind.REMOVED, (k(0), k(1)))
    put(tier, [0, 1, 2, 3], priority=7)
    tier.check()
    assert tier.stats().ready == 4


@pytest.mark.parametrize("priority", [0, 100])
def test_priority_bounds_are_classes_too(buf: memoryview, priority: int) -> None:
    tier = make_tier(buf, "arc", slots=2)
    put(tier, [0], priority=priority)
    put(tier, [1], priority=50)
    put(tier, [2], priority=50)
    assert tier.contains(k(0)) is (priority == 100)
    tier.check()


def promote(m: TieringManager, keys: list[bytes], priority: int) -> PrefixLookup:
    deadline = time.monotonic() + 10
    while (found := m.lookup_prefix(keys, priority=priority)).pending:
        assert time.monotonic() < deadline, "promotion still pending"
        time.sleep(0.002)
        m.poll()
    m.release(keys)
    return found


def fill_host(m: TieringManager, priority: int) -> None:
    filler = [random_key() for _ in range(HOST_SLOTS)]
    assert m.host.reserve(filler) is not None
    m.host.commit(filler, True, priority=priority)


def test_a_promoted_chunk_keeps_its_priority_and_is_cascaded_with_it() -> None:
    m = start("lru", [{"type": "memory", "name": "a"},
                      {"type": "memory", "name": "b", "min_retention_priority": 70}],
              admission_policy="priority")
    try:
        keys = [random_key() for _ in range(2)]
        assert m.host.reserve(keys) is not None
        m.host.commit(keys, True, priority=80)
        m.cascade(keys, 80, skip="b")  # only `a` gets them now
        drain(m)
        fill_host(m, priority=90)
        assert m.host.lookup(keys) == 0
        # A low-priority request promotes them: they come back at 80, not at its 20, and are
        # cascaded at 80 to `b`, whose minimum (70) a 20 would not pass.
        assert promote(m, keys, priority=20) == PrefixLookup(2, pending=False)
        assert [m.host.priority_of(key) for key in keys] == [80, 80]
        drain(m)
        value = m.metrics.value
        assert value("kvtier_transfer_chunks_total", tier="b", op="store") == 2
        assert value("kvtier_rejected_chunks_total", tier="b", reason="priority") == 0
        # A higher-priority request raises them; a chunk not remembered takes the requester's.
        fill_host(m, priority=100)
        promote(m, keys, priority=95)
        assert [m.host.priority_of(key) for key in keys] == [95, 95]
        drain(m)
        fill_host(m, priority=100)
        m.priorities = RememberedPriorities()
        promote(m, keys, priority=60)
        assert [m.host.priority_of(key) for key in keys] == [60, 60]
        m.host.check()
    finally:
        m.shutdown()


def test_remembered_priorities_are_bounded() -> None:
    known = RememberedPriorities(capacity=2)
    known.remember([k(0), k(1)], 10)
    known.remember([k(0)], 30)
    known.remember([k(2)], 50)  # forgets k(1), the least recently remembered
    assert (known.get(k(0), 0), known.get(k(1), -1), known.get(k(2), 0), len(known)) == (30, -1, 50, 2)
    with pytest.raises(ValueError):
        RememberedPriorities(0)
