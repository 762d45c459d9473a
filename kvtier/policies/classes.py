"""Retention by priority: the host tier's resident chunks split into priority classes (0-100).

Each class is ordered by its own instance of the configured eviction policy (LRU, ARC, ...);
eviction empties lower classes first, so a chunk leaves only when no unprotected chunk of a lower
priority is left, and within a class the policy picks (LRU's least recent, ARC's REPLACE).

Holds after every call: each resident key is in exactly one class, the one `priority(key)` names;
the classes together hold at most the capacity of the first policy (the owner never inserts more);
`evict` is all-or-nothing and never takes a protected key. The classes for priorities other than
the first one's are made on first use with `type(first)(first.capacity)` (the `EvictionPolicy`
constructor contract). Called on the owning thread only; not thread-safe.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Iterable, Mapping
from typing import Generic, TypeVar

from kvtier.policies.base import EvictionPolicy

V = TypeVar("V")


class PriorityClasses(Generic[V]):
    """An eviction index over resident keys, ordered by (priority, then the class's policy)."""

    def __init__(self, first: EvictionPolicy[V], priority: int) -> None:
        if len(first) != 0:
            raise ValueError("the eviction policy must start empty")
        self.capacity = first.capacity
        self._kind = type(first)
        self._classes: dict[int, EvictionPolicy[V]] = {priority: first}
        self._priority: dict[bytes, int] = {}

    def _class(self, priority: int) -> EvictionPolicy[V]:
        policy = self._classes.get(priority)
        if policy is None:
            policy = self._classes[priority] = self._kind(self.capacity)
        return policy

    def get(self, key: bytes) -> V | None:
        """The value of a resident key, or None. Not an access."""
        priority = self._priority.get(key)
        return None if priority is None else self._classes[priority].get(key)

    def priority(self, key: bytes) -> int | None:
        """The class of a resident key, or None."""
        return self._priority.get(key)

    def insert_many(self, entries: Mapping[bytes, V], priority: int) -> None:
        """Make `entries` resident in class `priority`. Precondition: none is resident."""
        self._class(priority).insert_many(entries)
        self._priority.update(dict.fromkeys(entries, priority))

    def remove(self, key: bytes) -> V | None:
        """Drop a resident key (not an eviction). Returns its value."""
        priority = self._priority.pop(key, None)
        return None if priority is None else self._classes[priority].remove(key)

    def touch(self, key: bytes) -> None:
        """An access to a resident key, recorded by its class's policy."""
        priority = self._priority.get(key)
        if priority is not None:
            self._classes[priority].touch(key)

    def raise_priority(self, key: bytes, priority: int) -> bool:
        """Move a resident key up to class `priority` (as its most recent entry) when that is above
        its own; True when it moved."""
        current = self._priority.get(key)
        if current is None or current >= priority:
            return False
        value = self._classes[current].remove(key)
        if value is None:
            raise RuntimeError(f"key {key.hex()} is missing from its class {current}")
        self._class(priority).insert(key, value)
        self._priority[key] = priority
        return True

    def evict(
        self, n: int, protected: Container[bytes], held: Iterable[bytes]
    ) -> list[tuple[bytes, V]] | None:
        """Remove and return `n` unprotected victims, lowest priorities first; None (nothing
        changed) when fewer exist. `held` lists every resident key in `protected` (the owner's pins
        and the keys its call names), so each class knows how many keys it may give."""
        if n < 0:
            raise ValueError(f"cannot evict a negative number of entries: {n}")
        classes = self._classes
        if len(classes) == 1:
            victims = next(iter(classes.values())).evict(n, protected)
        else:
            victims = self._evict_by_class(n, protected, held)
        for key, _ in victims or ():
            del self._priority[key]
        return victims

    def _evict_by_class(
        self, n: int, protected: Container[bytes], held: Iterable[bytes]
    ) -> list[tuple[bytes, V]] | None:
        classes = self._classes
        pinned = Counter(self._priority[k] for k in set(held) if k in self._priority)
        give = {p: len(policy) - pinned[p] for p, policy in classes.items()}
        if sum(give.values()) < n:
            return None
        victims: list[tuple[bytes, V]] = []
        for priority in sorted(classes):
            take = min(give[priority], n - len(victims))
            if take <= 0:
                continue
            got = classes[priority].evict(take, protected)
            if got is None:
                raise RuntimeError(f"priority class {priority} could not give {take} victims")
            victims += got
            if len(victims) == n:
                break
        return victims

    def check(self) -> None:
        """Raise RuntimeError when a key's class and its recorded priority disagree, or a class
        policy's own `check()` fails."""
        sizes = 0
        for policy in self._classes.values():
            sizes += len(policy)
            checker = getattr(policy, "check", None)
            if checker is not None:
                checker()
        if sizes != len(self._priority):
            raise RuntimeError(f"classes hold {sizes} keys, priorities {len(self._priority)}")
        for key, priority in self._priority.items():
            if key not in self._classes[priority]:
                raise RuntimeError(f"key {key.hex()} is not in its class {priority}")

    def __len__(self) -> int:
        return len(self._priority)
