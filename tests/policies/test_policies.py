"""One contract suite for every eviction policy, then LRU and ARC specifics."""

from __future__ import annotations

import random

import pytest

from kvtier.policies.arc import ARCPolicy
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.registry import BUILTIN_EVICTION, resolve_eviction


def k(i: int) -> bytes:
    return i.to_bytes(8, "big")


def make(name: str, capacity: int) -> EvictionPolicy[int]:
    policy: EvictionPolicy[int] = resolve_eviction(name)(capacity)  # type: ignore[assignment]
    return policy


def check(policy: EvictionPolicy[int]) -> None:
    checker = getattr(policy, "check", None)
    if checker is not None:
        checker()


@pytest.fixture(params=sorted(BUILTIN_EVICTION))
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_capacity_must_be_positive(name: str) -> None:
    with pytest.raises(ValueError):
        make(name, 0)


def test_get_insert_remove(name: str) -> None:
    p = make(name, 4)
    assert p.get(k(1)) is None and len(p) == 0
    p.insert(k(1), 10)
    p.insert(k(2), 0)
    assert p.get(k(1)) == 10 and p.get(k(2)) == 0
    assert k(2) in p and k(3) not in p and "x" not in p
    assert len(p) == 2
    with pytest.raises(KeyError):
        p.insert(k(1), 11)
    assert p.remove(k(1)) == 10
    assert p.remove(k(1)) is None
    assert p.get(k(1)) is None and len(p) == 1
    p.touch(k(99))  # not resident: ignored
    assert len(p) == 1
    check(p)


def test_insert_beyond_capacity_raises(name: str) -> None:
    p = make(name, 2)
    p.insert(k(1), 1)
    p.insert(k(2), 2)
    with pytest.raises(OverflowError):
        p.insert(k(3), 3)
    assert len(p) == 2


def test_evict_oldest_untouched_first(name: str) -> None:
    p = make(name, 8)
    for i in range(5):
        p.insert(k(i), i)
    assert p.evict(2, set()) == [(k(0), 0), (k(1), 1)]
    assert len(p) == 3 and p.get(k(0)) is None
    check(p)


def test_touched_key_outlives_untouched(name: str) -> None:
    p = make(name, 8)
    for i in range(4):
        p.insert(k(i), i)
    p.touch(k(0))
    victims = p.evict(3, set())
    assert victims is not None
    assert k(0) not in [key for key, _ in victims]
    assert p.get(k(0)) == 0


def test_evict_zero_and_negative(name: str) -> None:
    p = make(name, 4)
    p.insert(k(1), 1)
    assert p.evict(0, set()) == []
    with pytest.raises(ValueError):
        p.evict(-1, set())
    assert len(p) == 1


def test_protected_never_evicted(name: str) -> None:
    p = make(name, 8)
    for i in range(6):
        p.insert(k(i), i)
    protected = {k(0), k(2), k(4)}
    victims = p.evict(3, protected)
    assert victims is not None
    assert sorted(key for key, _ in victims) == [k(1), k(3), k(5)]
    assert all(p.get(key) is not None for key in protected)
    check(p)


def test_evict_is_all_or_nothing(name: str) -> None:
    p = make(name, 8)
    for i in range(6):
        p.insert(k(i), i)
    p.touch(k(1))
    before = {i: p.get(k(i)) for i in range(6)}
    assert p.evict(3, {k(0), k(1), k(2), k(3)}) is None
    assert p.evict(7, set()) is None
    assert {i: p.get(k(i)) for i in range(6)} == before
    # Nothing moved: the same unprotected keys leave first.
    victims = p.evict(2, {k(0), k(1), k(2), k(3)})
    assert victims is not None and sorted(v for _, v in victims) == [4, 5]
    check(p)


def test_protected_accepts_any_container(name: str) -> None:
    p = make(name, 4)
    for i in range(3):
        p.insert(k(i), i)
    pins = {k(0): 2}
    victims = p.evict(2, pins)
    assert victims is not None and k(0) not in [key for key, _ in victims]


def test_reinsert_after_eviction(name: str) -> None:
    p = make(name, 3)
    for i in range(3):
        p.insert(k(i), i)
    assert p.evict(1, set()) is not None
    p.insert(k(0), 100)
    assert p.get(k(0)) == 100 and len(p) == 3
    check(p)


@pytest.mark.parametrize("seed", range(5))
def test_randomized_against_model(name: str, seed: int) -> None:
    rng = random.Random(seed)
    capacity = rng.choice([1, 3, 16, 64])
    p = make(name, capacity)
    model: dict[bytes, int] = {}
    universe = [k(i) for i in range(capacity * 4)]
    for step in range(3000):
        op = rng.random()
        key = rng.choice(universe)
        if op < 0.4:
            if key not in model and len(model) < capacity:
                p.insert(key, step)
                model[key] = step
        elif op < 0.6:
            p.touch(key)
        elif op < 0.7:
            assert p.remove(key) == model.pop(key, None)
        else:
            n = rng.randint(0, capacity)
            protected = set(rng.sample(universe, rng.randint(0, capacity)))
            candidates = [x for x in model if x not in protected]
            victims = p.evict(n, protected)
            if len(candidates) < n:
                assert victims is None
            else:
                assert victims is not None and len(victims) == n
                assert len({v for v, _ in victims}) == n
                for victim, value in victims:
                    assert victim not in protected
                    assert model.pop(victim) == value
        assert len(p) == len(model)
        assert p.get(key) == model.get(key)
        check(p)
    assert all(p.get(x) == v for x, v in model.items())


@pytest.mark.parametrize("seed", range(3))
def test_lru_order_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    p: LRUPolicy[int] = LRUPolicy(32)
    order: list[bytes] = []
    for step in range(2000):
        key = k(rng.randrange(64))
        op = rng.random()
        if op < 0.5 and key not in order and len(order) < 32:
            p.insert(key, step)
            order.append(key)
        elif op < 0.8 and key in order:
            p.touch(key)
            order.remove(key)
            order.append(key)
        elif op >= 0.8:
            n = rng.randint(0, 4)
            victims = p.evict(n, set())
            if n > len(order):
                assert victims is None
            else:
                assert victims is not None and [v for v, _ in victims] == order[:n]
                del order[:n]
        assert p.keys_lru_first() == order


def test_arc_scan_does_not_flush_frequent_keys() -> None:
    capacity = 100
    arc: ARCPolicy[int] = ARCPolicy(capacity)
    lru: LRUPolicy[int] = LRUPolicy(capacity)
    hot = [k(i) for i in range(50)]
    for policy in (arc, lru):
        for key in hot:
            policy.insert(key, 0)
            policy.touch(key)
        # A one-time scan, ten times the capacity, each key used once.
        for i in range(1000, 2000):
            if len(policy) == capacity:
                assert policy.evict(1, set()) is not None
            policy.insert(k(i), 1)
    assert all(key in arc for key in hot)
    assert not any(key in lru for key in hot)
    arc.check()


def test_arc_ghost_hit_in_b1_grows_p_and_enters_t2() -> None:
    arc: ARCPolicy[int] = ARCPolicy(4)
    for i in range(4):
        arc.insert(k(i), i)
    assert arc.evict(2, set()) == [(k(0), 0), (k(1), 1)]
    assert arc.in_ghost(k(0)) and arc.sizes() == (2, 0, 2, 0)
    assert arc.p == 0.0
    arc.insert(k(0), 10)
    assert arc.p == 1.0
    assert not arc.in_ghost(k(0)) and arc.get(k(0)) == 10
    assert arc.sizes() == (2, 1, 1, 0)
    arc.check()


def test_arc_ghost_hit_in_b2_shrinks_p() -> None:
    arc: ARCPolicy[int] = ARCPolicy(4)
    for i in range(4):
        arc.insert(k(i), i)
        arc.touch(k(i))  # all in T2
    assert arc.sizes() == (0, 4, 0, 0)
    assert arc.evict(1, set()) == [(k(0), 0)]
    arc.p = 2.0
    arc.insert(k(0), 0)
    assert arc.p == 1.0 and arc.sizes() == (0, 4, 0, 0)
    arc.check()


def test_arc_p_steers_the_victim_list() -> None:
    arc: ARCPolicy[int] = ARCPolicy(6)
    for i in range(3):
        arc.insert(k(i), i)
        arc.touch(k(i))  # T2: 0, 1, 2
    for i in range(3, 6):
        arc.insert(k(i), i)  # T1: 3, 4, 5
    arc.p = 3.0  # |T1| == p: REPLACE takes from T2
    assert arc.evict(1, set()) == [(k(0), 0)]
    arc.p = 1.0  # |T1| > p: from T1 until |T1| reaches p
    assert arc.evict(3, set()) == [(k(3), 3), (k(4), 4), (k(1), 1)]
    arc.check()


def test_arc_falls_back_to_other_list_when_protected() -> None:
    arc: ARCPolicy[int] = ARCPolicy(4)
    arc.insert(k(0), 0)
    arc.touch(k(0))  # T2
    arc.insert(k(1), 1)  # T1, preferred since p = 0
    assert arc.evict(1, {k(1)}) == [(k(0), 0)]
    assert arc.sizes() == (1, 0, 0, 1)


def test_arc_directory_stays_bounded() -> None:
    c = 8
    arc: ARCPolicy[int] = ARCPolicy(c)
    rng = random.Random(7)
    for step in range(5000):
        key = k(rng.randrange(64))
        if key in arc:
            arc.touch(key)
            continue
        if len(arc) == c:
            assert arc.evict(rng.randint(1, 3), set()) is not None
        arc.insert(key, step)
        t1, t2, b1, b2 = arc.sizes()
        assert t1 + b1 <= c and t1 + t2 + b1 + b2 <= 2 * c
        arc.check()


def arc_state(arc: ARCPolicy[int]) -> tuple[list[bytes], ...]:
    return list(arc._t1), list(arc._t2), list(arc._b1), list(arc._b2)


def random_arc(rng: random.Random, c: int) -> ARCPolicy[int]:
    arc: ARCPolicy[int] = ARCPolicy(c)
    for step in range(rng.randint(0, 20 * c)):
        key = k(rng.randrange(4 * c))
        if key in arc:
            arc.touch(key)
        elif len(arc) < c and rng.random() < 0.7:
            arc.insert(key, step)
        else:
            arc.evict(rng.randint(0, 2), set())
    return arc


@pytest.mark.parametrize("seed", range(40))
def test_arc_insert_many_equals_inserts_in_order(seed: int) -> None:
    rng = random.Random(seed)
    c = rng.choice([1, 2, 5, 16])
    one, many = random_arc(random.Random(seed), c), random_arc(random.Random(seed), c)
    room = c - len(one)
    pool = [k(i) for i in range(6 * c) if k(i) not in one]
    if rng.random() < 0.5:  # no ghost among the keys: the bulk path
        pool = [x for x in pool if not one.in_ghost(x)]
    keys = rng.sample(pool, min(len(pool), rng.randint(0, room)))
    entries = {key: i for i, key in enumerate(keys)}
    for key, value in entries.items():
        one.insert(key, value)
    many.insert_many(entries)
    assert arc_state(one) == arc_state(many) and one.p == many.p
    many.check()


@pytest.mark.parametrize("name", sorted(BUILTIN_EVICTION))
def test_insert_many_checks_before_inserting(name: str) -> None:
    p = make(name, 3)
    p.insert(k(0), 0)
    insert_many = getattr(p, "insert_many")  # noqa: B009 - not part of the contract
    with pytest.raises(KeyError):
        insert_many({k(1): 1, k(0): 0})
    with pytest.raises(OverflowError):
        insert_many({k(1): 1, k(2): 2, k(3): 3})
    assert len(p) == 1
    insert_many({k(1): 1, k(2): 2})
    assert [p.get(k(i)) for i in range(3)] == [0, 1, 2]


def reference_replace(arc: ARCPolicy[int], n: int, protected: set[bytes]) -> list[bytes] | None:
    """ARC's REPLACE run n times, one victim at a time, skipping protected keys."""
    t1 = [x for x in arc._t1 if x not in protected]
    t2 = [x for x in arc._t2 if x not in protected]
    t1_size = len(arc._t1)
    victims = []
    for _ in range(n):
        if t1 and (t1_size > arc.p or not t2):
            victims.append(t1.pop(0))
            t1_size -= 1
        elif t2:
            victims.append(t2.pop(0))
        else:
            return None
    return victims


@pytest.mark.parametrize("seed", range(40))
def test_arc_evict_follows_replace_step_by_step(seed: int) -> None:
    rng = random.Random(seed)
    c = rng.choice([2, 5, 16])
    arc = random_arc(rng, c)
    arc.p = rng.uniform(0, c)
    resident = list(arc._t1) + list(arc._t2)
    protected = set(rng.sample(resident, rng.randint(0, len(resident))))
    n = rng.randint(0, len(resident))
    expected = reference_replace(arc, n, protected)
    victims = arc.evict(n, protected)
    if expected is None:
        assert victims is None
    else:
        assert victims is not None and sorted(v for v, _ in victims) == sorted(expected)
        assert all(arc.in_ghost(v) for v in expected)
    arc.check()
