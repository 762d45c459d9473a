"""Probation in the host tier (W-TinyLFU's window): chunks published on probation leave before any
settled chunk whatever their priorities, cold before warm; reuse settles them. Then, over a real
tier process, the manager cascades a probation chunk only once it settles, exactly once."""

from __future__ import annotations

from kvtier.format.chunks import HOST
from kvtier.host.tier import HostTier
from kvtier.policies.base import Retention
from tests.conftest import random_key
from tests.host.helpers import evicted, k, make_tier, put
from tests.manager_helpers import drain, start


def put_on(tier: HostTier, keys: list[int], retention: Retention, priority: int = 50) -> None:
    slots = tier.reserve([k(i) for i in keys])
    assert slots is not None
    tier.commit(list(slots), True, priority, dict.fromkeys(slots, retention))


def test_probation_leaves_before_any_settled_chunk_cold_first(buf: memoryview, policy_name: str) -> None:
    tier = make_tier(buf, policy_name, slots=6)
    put(tier, [0, 1], priority=0)  # settled, the lowest priority
    put_on(tier, [2, 3], Retention.WARM, priority=100)
    put_on(tier, [4, 5], Retention.COLD, priority=100)
    assert tier.pin([k(4), k(5)]) is not None  # recent accesses do not save them
    tier.unpin([k(4), k(5)])
    tier.take_events()
    put(tier, [6, 7, 8], priority=0)
    assert sorted(evicted(tier)) == [k(2), k(4), k(5)]
    assert [tier.on_probation(k(i)) for i in (0, 3, 6)] == [False, True, False]
    tier.check()


def test_reuse_settles_a_probation_chunk_and_priority_rises_within_probation(
    buf: memoryview, policy_name: str
) -> None:
    tier = make_tier(buf, policy_name, slots=4)
    put_on(tier, [0, 1, 2], Retention.COLD, priority=10)
    put(tier, [3], priority=5)
    assert tier.raise_priority([k(1)], 90) == 1 and tier.on_probation(k(1))  # still on probation
    assert tier.settle([k(0), k(0), k(3), k(9)]) == {10: [k(0)]}  # 3 was settled, 9 not resident
    assert tier.settle([k(0)]) == {}
    assert (tier.on_probation(k(0)), tier.priority_of(k(0))) == (False, 10)
    tier.take_events()
    put(tier, [5, 6], priority=50)
    assert sorted(evicted(tier)) == [k(1), k(2)]  # probation first, though 1 is at 90
    put(tier, [7], priority=50)
    assert evicted(tier) == [k(3)]  # then the settled ones by priority: 3 (5) before 0 (10)
    tier.check()


def test_a_probation_chunk_cascades_when_reused_exactly_once() -> None:
    m = start("lru", [{"type": "memory", "name": "mem"}], admission_policy="frequency")
    try:
        lead, fresh = random_key(), random_key()
        keys = [lead, fresh]
        value = m.metrics.value
        m.record_request(keys)  # first sighting of both
        assert m.admit(keys, HOST, 50) == keys  # the host gate refuses nothing
        assert m.host.reserve(keys) is not None
        m.publish(keys, True, 50, lead)
        drain(m)
        assert m.host.lookup(keys) == 2 and m.host.on_probation(fresh)
        assert value("kvtier_transfer_chunks_total", tier="mem", op="store") == 0
        assert value("kvtier_probation_chunks_total", tier=HOST, reason="frequency") == 2
        assert value("kvtier_rejected_chunks_total", tier="mem", reason="frequency") == 2
        m.record_request(keys)  # reused: both settle and cascade now
        drain(m)
        assert not m.host.on_probation(fresh)
        assert value("kvtier_probation_reused_chunks_total", tier=HOST) == 2
        assert value("kvtier_transfer_chunks_total", tier="mem", op="store") == 2
        m.record_request(keys)  # settled already: no second store
        m.cascade([], 50)
        drain(m)
        assert value("kvtier_transfer_chunks_total", tier="mem", op="store") == 2
        # A request that continues the now reused prefix: its new chunk is warm probation.
        child = random_key()
        m.record_request([lead, child])
        assert m.host.reserve([child]) is not None
        m.publish([child], True, 50, lead)
        assert m.host.on_probation(child)
        m.host.check()
    finally:
        m.shutdown()
