"""The host tier: two-phase store and load, pins, atomic eviction, events; over every policy."""

from __future__ import annotations

import random
from collections.abc import Container

import numpy as np
import pytest

from kvtier.format.chunks import TierEvent, TierEventKind
from kvtier.host.tier import HostTier, HostTierError
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.lru import LRUPolicy
from tests.host.helpers import ROW, make_tier

STORED, REMOVED = TierEventKind.STORED, TierEventKind.REMOVED


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def ks(*ids: int) -> list[bytes]:
    return [k(i) for i in ids]


def store(tier: HostTier, keys: list[bytes]) -> dict[bytes, int]:
    slots = tier.reserve(keys)
    assert slots is not None
    tier.commit(list(slots), True)
    return slots


def test_constructor_validates(buf: memoryview) -> None:
    with pytest.raises(ValueError):
        HostTier(buf, 0, LRUPolicy(64))
    with pytest.raises(ValueError):
        HostTier(buf[: ROW - 1], ROW, LRUPolicy(64))
    with pytest.raises(ValueError):
        HostTier(buf, ROW, LRUPolicy(63))
    used: LRUPolicy[int] = LRUPolicy(64)
    used.insert(k(0), 0)
    with pytest.raises(ValueError):
        HostTier(buf, ROW, used)
    tier = HostTier(buf[: ROW * 8 + 100], ROW, LRUPolicy(8))
    assert tier.num_slots == 8 and tier.stats().capacity_bytes == 8 * ROW


def test_writing_is_invisible_then_published(buf: memoryview, policy_name: str) -> None:
    tier = make_tier(buf, policy_name)
    slots = tier.reserve(ks(1, 2))
    assert slots is not None and sorted(slots) == ks(1, 2)
    assert len(set(slots.values())) == 2
    assert tier.lookup(ks(1, 2)) == 0
    assert not tier.contains(k(1)) and tier.is_pending(k(1))
    assert tier.pin(ks(1)) is None
    assert tier.take_events() == []
    stats = tier.stats()
    assert (stats.used, stats.writing, stats.ready) == (2, 2, 0)
    tier.commit(ks(1, 2), True)
    assert tier.lookup(ks(1, 2, 3)) == 2
    assert tier.contains(k(2)) and not tier.is_pending(k(2))
    assert tier.take_events() == [TierEvent(STORED, (k(1), k(2)))]
    assert tier.take_events() == []
    tier.check()


def test_rollback_frees_the_slot(buf: memoryview, policy_name: str) -> None:
    tier = make_tier(buf, policy_name, slots=2)
    assert tier.reserve(ks(1, 2)) is not None
    tier.commit(ks(1), False)
    assert not tier.is_pending(k(1)) and tier.lookup(ks(1)) == 0
    assert tier.stats().used == 1
    slots = tier.reserve(ks(3))  # the freed slot, no eviction needed
    assert slots is not None and tier.take_events() == []
    tier.check()


def test_present_keys_omitted_and_duplicates_allocated_once(
    buf: memoryview, policy_name: str
) -> None:
    tier = make_tier(buf, policy_name)
    store(tier, ks(1))
    assert tier.reserve(ks(2)) is not None
    slots = tier.reserve(ks(1, 2, 3, 3, 4))
    assert slots is not None and list(slots) == ks(3, 4)
    assert tier.stats().used == 4
    tier.check()


def test_complete_store_ignores_unknown_keys(buf: memoryview, policy_name: str) -> None:
    tier = make_tier(buf, policy_name)
    store(tier, ks(1))
    tier.take_events()
    tier.commit(ks(1, 9), True)
    tier.commit(ks(1, 9), False)
    assert tier.take_events() == [] and tier.contains(k(1))
    tier.check()


def test_lookup_counts_the_leading_run(buf: memoryview, policy_name: str) -> None:
    tier = make_tier(buf, policy_name)
    store(tier, ks(1, 2, 4))
    assert tier.lookup(ks(1, 2, 3, 4)) == 2
    assert tier.lookup(ks(3, 1)) == 0
    assert tier.lookup([]) == 0


def test_eviction_takes_least_recently_used(buf: memoryview, policy_name: str) -> None:
    tier = make_tier(buf, policy_name, slots=4)
    store(tier, ks(0, 1, 2, 3))
    assert tier.pin(ks(0)) is not None  # an access: 0 is no longer the oldest
    tier.unpin(ks(0))
    tier.take_events()
    slots = tier.reserve(ks(4, 5))
    assert slots is not None
    assert tier.take_events() == [TierEvent(REMOVED, (k(1), k(2)))]
    assert tier.lookup(ks(0)) == 1 and tier.lookup(ks(1)) == 0 and tier.lookup(ks(3)) == 1
    tier.check()


def test_a_load_that_is_no_access_leaves_the_eviction_order(buf: memoryview, policy_name: str) -> None:
    tier = make_tier(buf, policy_name, slots=4)
    store(tier, ks(0, 1, 2, 3))
    assert tier.pin(ks(0), access=False) is not None  # a copy to a secondary tier
    tier.unpin(ks(0))
    tier.take_events()
    assert tier.reserve(ks(4)) is not None
    assert tier.take_events() == [TierEvent(REMOVED, (k(0),))]  # still the oldest
    tier.check()


def test_a_used_prefix_keeps_its_head_longest(buf: memoryview) -> None:
    tier = make_tier(buf, "lru", slots=5)
    store(tier, ks(0, 1, 2, 3))
    tier.used_prefix(ks(0, 1, 2, 9))  # 9 is not resident: left alone
    tier.check()  # with no store in flight, the use took effect at once (nothing waits)
    tier.take_events()
    order = []
    for new in (5, 6, 7, 8):
        assert tier.reserve(ks(new)) is not None
        order += [key for event in tier.take_events() for key in event.keys]
    assert order == ks(3, 2, 1)  # 3 was not used; then the prefix's tail first, its head last
    tier.check()


def test_a_use_ranks_after_the_chunks_allocated_before_it(buf: memoryview) -> None:
    """vLLM finishes a request before it reports the step's stores: a chunk allocated before the
    use but published after it still ranks before it, as its allocation does in vLLM's CPU tier."""
    tier = make_tier(buf, "lru", slots=4)
    store(tier, ks(0, 1))
    in_flight = tier.reserve(ks(2))
    assert in_flight is not None
    tier.used_prefix(ks(0, 1))  # the request finished while chunk 2's store was in flight
    tier.commit(ks(2), True)
    tier.take_events()
    assert tier.reserve(ks(3, 4)) is not None
    (removed,) = tier.take_events()
    assert list(removed.keys) == ks(2)  # not chunk 1 (the use's tail), as an immediate touch has it
    tier.check()


def test_under_arc_only_a_later_request_makes_a_stored_chunk_frequent(buf: memoryview) -> None:
    """The request that stored chunks uses them once more at its end: no reuse, so they stay in
    ARC's T1 (seen once); a later request's use is one, and moves its chunk to T2."""
    tier = make_tier(buf, "arc", slots=3)
    store(tier, ks(0, 1, 2))
    tier.used_prefix(ks(0, 1, 2))  # the storing request finishes: T1 is 2, 1, 0 (0 most recent)
    tier.used_prefix(ks(0))  # a later request reused chunk 0: T2
    tier.take_events()
    victims = []
    for new in (3, 4):
        assert tier.reserve(ks(new)) is not None
        tier.commit(ks(new), True)
        victims += [key for event in tier.take_events() for key in event.keys if key not in ks(new)]
    # T1 (seen once) gives way first: 2, then 1, while 0 stays. Had the first use counted, all
    # three would be in T2 and the second store would take chunk 3, just stored, from T1.
    assert victims == ks(2, 1)
    tier.check()


def test_pinned_slots_never_evicted(buf: memoryview, policy_name: str) -> None:
    tier = make_tier(buf, policy_name, slots=4)
    store(tier, ks(0, 1, 2, 3))
    pinned = tier.pin(ks(0, 1))
    assert pinned is not None
    assert tier.pin_count(k(0)) == 1
    store(tier, ks(4, 5))
    assert tier.lookup(ks(0, 1)) == 2
    assert tier.pin(ks(0, 1)) == pinned
    tier.unpin(ks(0, 1))
    store(tier, ks(6, 7))  # 4 and 5 are unpinned now
    assert tier.lookup(ks(0, 1)) == 2 and tier.stats().pinned == 2
    tier.unpin(ks(0, 1))
    assert tier.stats().pinned == 0
    tier.check()


def test_eviction_all_or_nothing_when_pinned(buf: memoryview, policy_name: str) -> None:
    tier = make_tier(buf, policy_name, slots=4)
    store(tier, ks(0, 1, 2, 3))
    assert tier.pin(ks(0, 1, 2)) is not None
    tier.take_events()
    before = tier.stats()
    assert tier.reserve(ks(10, 11)) is None  # only key 3 could go
    assert tier.stats() == before and tier.take_events() == []
    assert tier.lookup(ks(0, 1, 2, 3)) == 4
    assert not tier.is_pending(k(10))
    assert tier.reserve(ks(10)) is not None
    assert tier.take_events() == [TierEvent(REMOVED, (k(3),))]
    tier.check()


def test_prefix_store_takes_the_leading_chunks_that_fit(buf: memoryview, policy_name: str) -> None:
    tier = make_tier(buf, policy_name, slots=8)
    store(tier, ks(0, 1, 2, 3, 4))
    assert tier.pin(ks(0, 1, 2)) is not None
    slots, fitted = tier.reserve_prefix(ks(2, 10, 11, 12, 13, 14, 15))
    assert fitted == 6  # key 2 is present; 3 free rows and 2 unpinned ones fit 10..14, not 15
    assert sorted(slots) == ks(10, 11, 12, 13, 14)
    assert not tier.is_pending(k(15)) and tier.lookup(ks(15)) == 0
    assert tier.reserve_prefix(ks(20, 21)) == ({}, 0)
    tier.commit(list(slots), True)
    assert tier.lookup(ks(10, 11, 12, 13, 14)) == 5
    assert tier.reserve_prefix(ks(14, 0)) == ({}, 2)  # both present: nothing to allocate
    tier.check()


def test_writing_slots_are_never_evicted(buf: memoryview, policy_name: str) -> None:
    tier = make_tier(buf, policy_name, slots=2)
    assert tier.reserve(ks(0, 1)) is not None
    assert tier.reserve(ks(2)) is None
    assert tier.reserve(ks(0, 1, 2)) is None
    assert tier.stats().writing == 2
    tier.check()


def test_store_does_not_evict_keys_it_names(buf: memoryview, policy_name: str) -> None:
    tier = make_tier(buf, policy_name, slots=3)
    store(tier, ks(0, 1, 2))
    slots = tier.reserve(ks(0, 5))  # 0 is present, oldest, and must stay
    assert slots is not None and list(slots) == ks(5)
    assert tier.contains(k(0)) and not tier.contains(k(1))
    assert tier.reserve(ks(0, 2, 5, 6, 7)) is None  # 0, 2 named, 5 WRITING
    tier.check()


def test_prepare_load_all_or_nothing(buf: memoryview, policy_name: str) -> None:
    tier = make_tier(buf, policy_name)
    store(tier, ks(0, 1))
    assert tier.pin(ks(0, 9, 1)) is None
    assert tier.stats().pinned == 0
    slots = tier.pin(ks(1, 0, 1))
    assert slots is not None and slots[0] == slots[2] != slots[1]
    assert tier.pin_count(k(1)) == 2
    tier.unpin(ks(1, 0, 1))
    assert tier.stats().pinned == 0
    tier.check()


def test_complete_load_misuse_raises_and_changes_nothing(
    buf: memoryview, policy_name: str
) -> None:
    tier = make_tier(buf, policy_name)
    store(tier, ks(0, 1))
    assert tier.pin(ks(0, 1)) is not None
    with pytest.raises(HostTierError):
        tier.unpin(ks(0, 0))
    with pytest.raises(HostTierError):
        tier.unpin(ks(1, 7))
    assert tier.pin_count(k(0)) == 1 and tier.pin_count(k(1)) == 1
    tier.unpin(ks(0, 1))
    with pytest.raises(HostTierError):
        tier.unpin(ks(0))
    tier.check()


def test_slot_views_are_disjoint_aligned_rows(buf: memoryview, policy_name: str) -> None:
    tier = make_tier(buf, policy_name, slots=4)
    slots = tier.reserve(ks(0, 1, 2, 3))
    assert slots is not None
    for key, slot in slots.items():
        tier.slot_view(slot)[:] = key * (ROW // 32)
    tier.commit(list(slots), True)
    for key, slot in zip(ks(0, 1, 2, 3), tier.pin(ks(0, 1, 2, 3)) or [], strict=True):
        view = tier.slot_view(slot)
        assert len(view) == ROW and bytes(view) == key * (ROW // 32)
        assert np.frombuffer(view, dtype=np.uint8).ctypes.data % 4096 == 0
    for bad in (-1, 4):
        with pytest.raises(IndexError):
            tier.slot_view(bad)


def test_events_keep_their_order(buf: memoryview, policy_name: str) -> None:
    tier = make_tier(buf, policy_name, slots=2)
    store(tier, ks(0, 1))
    store(tier, ks(2))
    store(tier, ks(3))
    assert tier.take_events() == [
        TierEvent(STORED, (k(0), k(1))),
        TierEvent(REMOVED, (k(0),)),
        TierEvent(STORED, (k(2),)),
        TierEvent(REMOVED, (k(1),)),
        TierEvent(STORED, (k(3),)),
    ]


class ContractOnlyLRU(EvictionPolicy[int]):
    """An external-style policy: only the contract's methods (no insert_many fast path)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.inner: LRUPolicy[int] = LRUPolicy(capacity)

    def get(self, key: bytes) -> int | None:
        return self.inner.get(key)

    def insert(self, key: bytes, value: int) -> None:
        self.inner.insert(key, value)

    def remove(self, key: bytes) -> int | None:
        return self.inner.remove(key)

    def touch(self, key: bytes) -> None:
        self.inner.touch(key)

    def evict(self, n: int, protected: Container[bytes]) -> list[tuple[bytes, int]] | None:
        return self.inner.evict(n, protected)

    def __len__(self) -> int:
        return len(self.inner)


def test_policy_with_only_the_contract(buf: memoryview) -> None:
    tier = HostTier(buf[: 4 * ROW], ROW, ContractOnlyLRU(4))
    store(tier, ks(0, 1, 2, 3))
    store(tier, ks(4))
    assert tier.lookup(ks(0)) == 0 and tier.lookup(ks(1, 2, 3, 4)) == 4
    tier.check()


def test_check_detects_corruption(buf: memoryview, policy_name: str) -> None:
    tier = make_tier(buf, policy_name)
    store(tier, ks(0, 1))
    tier._policy.remove(k(0))
    with pytest.raises(HostTierError):
        tier.check()


@pytest.mark.parametrize("seed", range(6))
def test_randomized_stress(buf: memoryview, policy_name: str, seed: int) -> None:
    rng = random.Random(seed)
    slots = rng.choice([1, 4, 16, 64])
    tier = make_tier(buf, policy_name, slots=slots)
    universe = [k(i) for i in range(slots * 3)]
    writing: dict[bytes, int] = {}
    loads: list[list[bytes]] = []
    ready: set[bytes] = set()
    for _ in range(4000):
        op = rng.random()
        batch = [rng.choice(universe) for _ in range(rng.randint(0, 6))]
        if op < 0.35:
            got = tier.reserve(batch)
            if got is not None:
                assert not set(got) & (ready | set(writing))
                writing.update(got)
        elif op < 0.6 and writing:
            done = rng.sample(sorted(writing), rng.randint(1, len(writing)))
            tier.commit(done, rng.random() < 0.8)
            for key in done:
                del writing[key]
        elif op < 0.8:
            pinned = tier.pin(batch)
            assert (pinned is not None) == all(key in ready for key in batch)
            if pinned is not None:
                loads.append(batch)
        elif loads:
            tier.unpin(loads.pop(rng.randrange(len(loads))))
        for event in tier.take_events():
            if event.kind is STORED:
                ready.update(event.keys)
            else:
                ready.difference_update(event.keys)
        pinned_keys = {key for batch in loads for key in batch}
        assert pinned_keys <= ready
        assert all(tier.contains(key) == (key in ready) for key in universe)
        assert all(tier.is_pending(key) == (key in writing) for key in universe)
        stats = tier.stats()
        assert (stats.ready, stats.writing, stats.pinned) == (
            len(ready), len(writing), len(pinned_keys)
        )
        tier.check()


def test_clear_drops_unpinned_ready_entries_only(buf: memoryview, policy_name: str) -> None:
    tier = make_tier(buf, policy_name, slots=8)
    store(tier, ks(1, 2, 3))
    assert tier.pin(ks(2)) is not None
    writing = tier.reserve(ks(4))
    assert writing is not None
    tier.take_events()

    assert tier.clear() == 2

    assert [tier.contains(x) for x in ks(1, 2, 3)] == [False, True, False]
    assert tier.is_pending(k(4))
    assert tier.take_events() == [TierEvent(REMOVED, (k(1), k(3)))]
    stats = tier.stats()
    assert (stats.ready, stats.writing, stats.used) == (1, 1, 2)
    tier.check()
    tier.unpin(ks(2))
    tier.commit(ks(4), True)
    assert store(tier, ks(*range(10, 16))) and tier.stats().used == 8
    tier.check()
    assert tier.clear() == 8 and tier.clear() == 0
    tier.check()


def test_every_slot_handed_out_for_writing_gets_a_new_generation() -> None:
    gens = memoryview(bytearray(8 * 2)).cast("Q")
    host = HostTier(memoryview(bytearray(2 * ROW)), ROW, LRUPolicy(2), gens)
    assert host.reserve(ks(1, 2)) == {k(1): 0, k(2): 1} and list(gens) == [1, 1]
    host.commit(ks(1, 2), True)
    assert host.reserve(ks(1)) == {} and host.pin(ks(2)) == [1]
    assert list(gens) == [1, 1]  # present keys and loads leave the generations alone
    host.unpin(ks(2))
    assert host.reserve(ks(3)) == {k(3): 0} and list(gens) == [2, 1]  # k(1) evicted
    host.commit(ks(3), False)
    assert host.reserve(ks(4)) == {k(4): 0} and list(gens) == [3, 1]  # rolled back, reused
