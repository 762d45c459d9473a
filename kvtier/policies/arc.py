"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), with eviction decoupled from insertion.

ARC keeps four LRU lists over a capacity `c`: T1 (resident, seen once recently), T2 (resident, seen
at least twice), and the ghost lists B1 and B2 (keys recently evicted from T1 and T2, without their
values). `p` is the adaptive target size of T1: a miss that hits B1 grows it, one that hits B2
shrinks it.

The owner decides when to evict, so ARC's request handling is split in two:

- `insert` is ARC's miss path without the replacement: a key found in B1 (B2) raises (lowers) `p`
  as ARC does and enters T2; a new key enters T1 after the directory is trimmed the way ARC trims
  it (LRU of B1 when |T1|+|B1| reaches c, else LRU of B2 when the directory reaches 2c).
- `insert_many` is `insert` of each key in order; when none is a ghost, the trimming is computed
  in bulk.
- `touch` is ARC's hit (Case I): the key moves to the MRU end of T2; `refresh` (a use that is no
  reuse) moves it to the MRU end of its own list.
- `evict(n)` runs ARC's REPLACE `n` times: take from T1 while |T1| > p, else from T2, moving each
  victim to its ghost list. The incoming key is not known at eviction time, so REPLACE's tie-break
  for a B2 hit at |T1| == p is left out. Protected keys are skipped (when one list has no
  unprotected key left, the other is used). All victims are chosen before anything changes, so a
  failed eviction changes nothing.

Holds after every call: T1, T2, B1, B2 are disjoint; |T1|+|T2| <= c; |T1|+|B1| <= c;
|T1|+|T2|+|B1|+|B2| <= 2c (so |B1| <= c and |B2| <= 2c); 0 <= p <= c. Called on the
owning thread only; not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Mapping
from itertools import filterfalse, islice
from math import ceil
from typing import TypeVar

from kvtier.policies.base import EvictionPolicy

V = TypeVar("V")


class ARCPolicy(EvictionPolicy[V]):
    """ARC: scan resistant (one-time keys stay in T1 and leave first), self-tuning through `p`."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p: float = 0.0
        self._t1: OrderedDict[bytes, V] = OrderedDict()
        self._t2: OrderedDict[bytes, V] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()

    def get(self, key: bytes) -> V | None:
        value = self._t1.get(key)
        return self._t2.get(key) if value is None else value

    def insert(self, key: bytes, value: V) -> None:
        t1, t2, b1 = self._t1, self._t2, self._b1
        if key in t1 or key in t2:
            raise KeyError(f"key {key.hex()} is already resident")
        c = self.capacity
        n1, n2 = len(t1), len(t2)
        if n1 + n2 >= c:
            raise OverflowError(f"policy is full ({c} entries)")
        if key in b1:
            self.p = min(float(c), self.p + max(len(self._b2) / len(b1), 1.0))
            del b1[key]
            t2[key] = value
            return
        b2 = self._b2
        if key in b2:
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            del b2[key]
            t2[key] = value
            return
        # |T1| + |T2| < c, so when L1 = T1 + B1 is full, B1 is not empty; and when the directory
        # is full, L1 is not, so B2 is not empty.
        nb1 = len(b1)
        if n1 + nb1 >= c:
            b1.popitem(False)
        elif n1 + n2 + nb1 + len(b2) >= 2 * c:
            b2.popitem(False)
        t1[key] = value

    def insert_many(self, entries: Mapping[bytes, V]) -> None:
        """`insert` of each pair in order, checked as a whole: on error nothing is inserted.

        When no key is a ghost, every insertion is ARC's Case IV and the directory trimming it
        implies is computed in bulk; otherwise the keys go in one by one.
        """
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        c, m = self.capacity, len(entries)
        if len(t1) + len(t2) + m > c:
            raise OverflowError(f"{m} more entries overflow capacity {c}")
        if not t1.keys().isdisjoint(entries) or (t2 and not t2.keys().isdisjoint(entries)):
            raise KeyError("some keys are already resident")
        if (b1 and not b1.keys().isdisjoint(entries)) or (b2 and not b2.keys().isdisjoint(entries)):
            for key, value in entries.items():
                self.insert(key, value)
            return
        # Each insertion pops B1's LRU while |T1|+|B1| >= c (that sum then stays put), else B2's
        # LRU while the directory holds 2c keys, else grows the directory by one.
        l1 = len(t1) + len(b1)
        growing = max(0, min(m, c - l1))
        pop_b2 = growing - (2 * c - l1 - len(t2) - len(b2))
        if growing < m:
            pop_b1 = b1.popitem
            for _ in range(m - growing):
                pop_b1(False)
        if pop_b2 > 0:
            for _ in range(pop_b2):
                b2.popitem(False)
        t1.update(entries)

    def remove(self, key: bytes) -> V | None:
        value = self._t1.pop(key, None)
        return self._t2.pop(key, None) if value is None else value

    def touch(self, key: bytes) -> None:
        t2 = self._t2
        if key in t2:
            t2.move_to_end(key)
            return
        value = self._t1.pop(key, None)
        if value is not None:
            t2[key] = value

    def refresh(self, key: bytes) -> None:
        """The key moves to the MRU end of its own list: a key seen once stays in T1."""
        for resident in (self._t1, self._t2):
            if key in resident:
                resident.move_to_end(key)
                return

    def evict(self, n: int, protected: Container[bytes]) -> list[tuple[bytes, V]] | None:
        if n < 0:
            raise ValueError(f"cannot evict a negative number of entries: {n}")
        t1, t2 = self._t1, self._t2
        if n > len(t1) + len(t2):
            return None
        skip = protected.__contains__
        from_t1 = filterfalse(skip, t1)
        # REPLACE takes from T1 while |T1| > p, then from T2; a list without unprotected keys
        # left hands over to the other one.
        excess = len(t1) - self.p
        want_t1 = min(n, ceil(excess)) if excess > 0 else 0
        take_t1 = list(islice(from_t1, want_t1))
        take_t2: list[bytes] = []
        if len(take_t1) < n:
            take_t2 = list(islice(filterfalse(skip, t2), n - len(take_t1)))
            if len(take_t1) == want_t1:
                take_t1 += islice(from_t1, n - len(take_t1) - len(take_t2))
            if len(take_t1) + len(take_t2) < n:
                return None
        pop1 = t1.pop
        victims = [(key, pop1(key)) for key in take_t1]
        self._b1.update(dict.fromkeys(take_t1))
        if take_t2:
            pop2 = t2.pop
            victims += [(key, pop2(key)) for key in take_t2]
            self._b2.update(dict.fromkeys(take_t2))
        return victims

    def check(self) -> None:
        """Raise RuntimeError when an invariant of the module docstring does not hold."""
        t1, t2, b1, b2, c = self._t1, self._t2, self._b1, self._b2, self.capacity
        sizes = len(t1) + len(t2) + len(b1) + len(b2)
        if len(set(t1) | set(t2) | set(b1) | set(b2)) != sizes:
            raise RuntimeError("ARC lists are not disjoint")
        if len(t1) + len(t2) > c or len(t1) + len(b1) > c or sizes > 2 * c:
            raise RuntimeError(f"ARC sizes out of bounds: {self.sizes()} for c={c}")
        if not 0.0 <= self.p <= c:
            raise RuntimeError(f"ARC target p={self.p} outside [0, {c}]")

    def sizes(self) -> tuple[int, int, int, int]:
        """(|T1|, |T2|, |B1|, |B2|)."""
        return len(self._t1), len(self._t2), len(self._b1), len(self._b2)

    def in_ghost(self, key: bytes) -> bool:
        """Whether `key` is remembered in B1 or B2 (evicted recently, not resident)."""
        return key in self._b1 or key in self._b2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

