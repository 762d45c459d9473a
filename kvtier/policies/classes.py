"""Retention classes: the host tier's resident chunks split by (retention, priority).

`retention` (`Retention`: COLD and WARM probation, then SETTLED) ranks above priority (0-100):
eviction empties every probation class before any settled one, and within one retention the lower
priorities first. Each class is ordered by its own instance of the configured eviction policy (LRU,
ARC, ...), which picks within the class (LRU's least recent, ARC's REPLACE). A key moves up only:
`raise_priority` within its retention, `settle` out of probation.

Holds after every call: each resident key is in exactly one class, the one `class_of(key)` names;
the classes together hold at most the capacity of the first policy (the owner never inserts more);
`evict` is all-or-nothing and never takes a protected key. The classes other than the first one
are made on first use with `type(first)(first.capacity)` (the `EvictionPolicy` constructor
contract). Called on the owning thread only; not thread-safe.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Iterable, Mapping
from typing import Generic, TypeVar

from kvtier.policies.base import EvictionPolicy, Retention

V = TypeVar("V")
Class = tuple[Retention, int]
"""A retention class: (retention, priority); eviction takes the lowest class first."""


class PriorityClasses(Generic[V]):
    """An eviction index over resident keys, ordered by (retention, priority, the class's policy)."""

    def __init__(self, first: EvictionPolicy[V], priority: int) -> None:
        """`first` (empty) orders the settled chunks of `priority`."""
        if len(first) != 0:
            raise ValueError("the eviction policy must start empty")
        self.capacity = first.capacity
        self._kind = type(first)
        self._classes: dict[Class, EvictionPolicy[V]] = {(Retention.SETTLED, priority): first}
        self._class_of: dict[bytes, Class] = {}

    def _class(self, cls: Class) -> EvictionPolicy[V]:
        policy = self._classes.get(cls)
        if policy is None:
            policy = self._classes[cls] = self._kind(self.capacity)
        return policy

    def get(self, key: bytes) -> V | None:
        """The value of a resident key, or None. Not an access."""
        cls = self._class_of.get(key)
        return None if cls is None else self._classes[cls].get(key)

    def class_of(self, key: bytes) -> Class | None:
        """The class of a resident key, or None."""
        return self._class_of.get(key)

    def priority(self, key: bytes) -> int | None:
        """The priority of a resident key, or None."""
        cls = self._class_of.get(key)
        return None if cls is None else cls[1]

    def insert_many(
        self, entries: Mapping[bytes, V], priority: int, retention: Retention = Retention.SETTLED
    ) -> None:
        """Make `entries` resident in class (`retention`, `priority`). Precondition: none is."""
        cls = (retention, priority)
        self._class(cls).insert_many(entries)
        self._class_of.update(dict.fromkeys(entries, cls))

    def remove(self, key: bytes) -> V | None:
        """Drop a resident key (not an eviction). Returns its value."""
        cls = self._class_of.pop(key, None)
        return None if cls is None else self._classes[cls].remove(key)

    def touch(self, key: bytes) -> None:
        """An access to a resident key, recorded by its class's policy."""
        cls = self._class_of.get(key)
        if cls is not None:
            self._classes[cls].touch(key)

    def refresh(self, key: bytes) -> None:
        """A use of a resident key that is no reuse, recorded by its class's policy."""
        cls = self._class_of.get(key)
        if cls is not None:
            self._classes[cls].refresh(key)

    def _move(self, key: bytes, cls: Class) -> bool:
        """Move a resident key up to class `cls`, as its most recent entry, when that is above its
        own class; True when it moved."""
        current = self._class_of.get(key)
        if current is None or current >= cls:
            return False
        value = self._classes[current].remove(key)
        if value is None:
            raise RuntimeError(f"key {key.hex()} is missing from its class {current}")
        self._class(cls).insert(key, value)
        self._class_of[key] = cls
        return True

    def raise_priority(self, key: bytes, priority: int) -> bool:
        """Move a resident key up to `priority` within its retention when that is above its own;
        True when it moved."""
        current = self._class_of.get(key)
        return current is not None and self._move(key, (current[0], max(current[1], priority)))

    def settle(self, key: bytes) -> bool:
        """Take a resident key off probation (same priority); True when it was on probation."""
        current = self._class_of.get(key)
        return current is not None and self._move(key, (Retention.SETTLED, current[1]))

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
            del self._class_of[key]
        return victims

    def _evict_by_class(
        self, n: int, protected: Container[bytes], held: Iterable[bytes]
    ) -> list[tuple[bytes, V]] | None:
        classes = self._classes
        class_of = self._class_of
        pinned = Counter(class_of[k] for k in set(held) if k in class_of)
        give = {c: len(policy) - pinned[c] for c, policy in classes.items()}
        if sum(give.values()) < n:
            return None
        victims: list[tuple[bytes, V]] = []
        for cls in sorted(classes):
            take = min(give[cls], n - len(victims))
            if take <= 0:
                continue
            got = classes[cls].evict(take, protected)
            if got is None:
                raise RuntimeError(f"class {cls} could not give {take} victims")
            victims += got
            if len(victims) == n:
                break
        return victims

    def check(self) -> None:
        """Raise RuntimeError when a key's class and its recorded class disagree, or a class
        policy's own `check()` fails."""
        sizes = 0
        for policy in self._classes.values():
            sizes += len(policy)
            checker = getattr(policy, "check", None)
            if checker is not None:
                checker()
        if sizes != len(self._class_of):
            raise RuntimeError(f"classes hold {sizes} keys, recorded {len(self._class_of)}")
        for key, cls in self._class_of.items():
            if key not in self._classes[cls]:
                raise RuntimeError(f"key {key.hex()} is not in its class {cls}")

    def __len__(self) -> int:
        return len(self._class_of)
