"""Contracts of the host tier's policies: eviction (which chunk leaves) and admission (which enters).

Both are called on the host tier's owning thread only and are not thread-safe. Every operation costs
time proportional to the keys it touches, never to the capacity.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Mapping
from typing import Generic, TypeVar

V = TypeVar("V")


class EvictionPolicy(ABC, Generic[V]):
    """An index of the resident chunks (key → value) that also orders them for eviction.

    `capacity` is the most entries the owner will ever hold at once; policies with history (ARC's
    ghost lists) size it from that.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def get(self, key: bytes) -> V | None:
        """The value of a resident key, or None. Does not count as an access."""

    @abstractmethod
    def insert(self, key: bytes, value: V) -> None:
        """Make `key` resident. Precondition: it is not resident and len(self) < capacity."""

    def insert_many(self, entries: Mapping[bytes, V]) -> None:
        """`insert` of each entry in order; policies override it with a faster batch path."""
        for key, value in entries.items():
            self.insert(key, value)

    @abstractmethod
    def remove(self, key: bytes) -> V | None:
        """Drop a resident key (not an eviction: history is not updated). Returns its value."""

    @abstractmethod
    def touch(self, key: bytes) -> None:
        """Record an access to a resident key; ignores keys that are not resident."""

    @abstractmethod
    def evict(self, n: int, protected: Container[bytes]) -> list[tuple[bytes, V]] | None:
        """Remove and return `n` victims, none of them in `protected`.

        All-or-nothing: when fewer than `n` unprotected entries exist, returns None and changes
        nothing.
        """

    @abstractmethod
    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.get(key) is not None


class AdmissionPolicy(ABC):
    """Decides whether a chunk deserves a slot in a tier."""

    @abstractmethod
    def admit(self, key: bytes, tier: str, priority: int = 0) -> bool:
        """Whether `key` may be stored in `tier` ("host" or a secondary tier's name)."""

    def record_access(self, key: bytes) -> None:
        """A lookup asked for `key`. Optional hook for frequency-based policies."""


class AdmitAll(AdmissionPolicy):
    """The default: every chunk is admitted everywhere."""

    def admit(self, key: bytes, tier: str, priority: int = 0) -> bool:
        return True
