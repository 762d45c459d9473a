"""Least-recently-used eviction.

Holds: the resident keys are ordered from least to most recently inserted or touched; `evict`
takes victims from the least recent end, skipping protected keys, and is all-or-nothing. Called on
the owning thread only; not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Mapping
from itertools import filterfalse, islice
from typing import TypeVar

from kvtier.policies.base import EvictionPolicy

V = TypeVar("V")


class LRUPolicy(EvictionPolicy[V]):
    """LRU over an OrderedDict: the first entry is the next victim."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._entries: OrderedDict[bytes, V] = OrderedDict()

    def get(self, key: bytes) -> V | None:
        return self._entries.get(key)

    def insert(self, key: bytes, value: V) -> None:
        entries = self._entries
        if key in entries:
            raise KeyError(f"key {key.hex()} is already resident")
        if len(entries) >= self.capacity:
            raise OverflowError(f"policy is full ({self.capacity} entries)")
        entries[key] = value

    def insert_many(self, entries: Mapping[bytes, V]) -> None:
        """`insert` of each pair in order, checked as a whole: on error nothing is inserted."""
        resident = self._entries
        if len(resident) + len(entries) > self.capacity:
            raise OverflowError(f"{len(entries)} more entries overflow capacity {self.capacity}")
        if not resident.keys().isdisjoint(entries):
            raise KeyError("some keys are already resident")
        resident.update(entries)

    def remove(self, key: bytes) -> V | None:
        return self._entries.pop(key, None)

    def touch(self, key: bytes) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)

    def evict(self, n: int, protected: Container[bytes]) -> list[tuple[bytes, V]] | None:
        if n < 0:
            raise ValueError(f"cannot evict a negative number of entries: {n}")
        entries = self._entries
        if n > len(entries):
            return None
        victims = list(islice(filterfalse(protected.__contains__, entries), n))
        if len(victims) < n:
            return None
        pop = entries.pop
        return [(k, pop(k)) for k in victims]

    def check(self) -> None:
        """Raise RuntimeError when more entries are resident than the capacity allows."""
        if len(self._entries) > self.capacity:
            raise RuntimeError(f"LRU holds {len(self._entries)} entries, capacity {self.capacity}")

    def keys_lru_first(self) -> list[bytes]:
        """The resident keys, next victim first (a copy; costs time proportional to the size)."""
        return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries
