"""Contracts of the host tier's policies: eviction (which chunk leaves) and admission (which enters).

Both are called on the host tier's owning thread only and are not thread-safe. Every operation costs
time proportional to the keys it touches, never to the capacity.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import ClassVar, Generic, TypeVar

from kvtier.format.chunks import TierEvent

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

    def refresh(self, key: bytes) -> None:
        """Make a resident key as recent as an access would, without counting one: the first use
        by the request that stored it is no reuse. Ignores keys that are not resident. This
        default is `touch`, right for policies whose only history is recency."""
        self.touch(key)

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


DEFAULT_PRIORITY = 50
"""The retention priority of a request that names none (priorities run from 0 to 100)."""


class Retention(IntEnum):
    """How a chunk the admission policies let into the host tier is kept there; the host tier
    evicts a lower value before any higher one, whatever their priorities (W-TinyLFU's window).

    COLD and WARM are probation: the chunk was not reused yet, it is not cascaded to secondary
    tiers, and it leaves probation (SETTLED, then cascaded) when a later request names it.
    """

    COLD = 0
    """Probation: nothing of the request that computed it was reused (a one-off prompt)."""
    WARM = 1
    """Probation: it extends a prefix that earlier requests reused (a conversation's new turn)."""
    SETTLED = 2
    """Seen often enough, reused, or promoted: kept by priority and the eviction policy alone."""


@dataclass(frozen=True)
class AdmissionSettings:
    """What the built-in admission policies are configured with.

    `min_seen`: sightings before `frequency` admits a chunk. `min_retention_priority`: per tier
    ("host" or a secondary tier's name), the lowest priority `priority` admits (absent: 0).
    """

    min_seen: int = 2
    min_retention_priority: Mapping[str, int] = field(default_factory=dict)


class AdmissionPolicy(ABC):
    """Decides whether a chunk deserves a slot in a tier.

    Asked at both gates: device → host store (`tier` is "host") and host → each secondary tier
    (cascade). `name` labels the chunks it rejects in `kvtier_rejected_chunks{reason}`. Built with
    the config's `AdmissionSettings`; called on the scheduler thread only.
    """

    name: ClassVar[str] = "custom"

    def __init__(self, settings: AdmissionSettings | None = None) -> None:
        self.settings = settings or AdmissionSettings()

    @abstractmethod
    def admit(self, key: bytes, tier: str, priority: int = DEFAULT_PRIORITY) -> bool:
        """Whether `key` may be stored in `tier` ("host" or a secondary tier's name), for a request
        of retention `priority` (0-100)."""

    def record_access(self, key: bytes) -> None:
        """A request with `key` in its prompt arrived (once per request). Optional hook for
        frequency-based policies."""

    def retention(self, key: bytes, lead: bytes) -> Retention:
        """How the host tier keeps `key`, a chunk this policy admitted there and a request whose
        first chunk is `lead` just computed. Optional hook: SETTLED unless a policy keeps chunks
        on probation."""
        return Retention.SETTLED

    def admitted(self, tier: str, keys: Sequence[bytes]) -> None:
        """After `admit` was asked about a batch of chunks for `tier`: the `keys` of it that every
        policy admitted (maybe none); in a secondary tier those that are host-resident are stored
        there. Optional hook, for policies that follow what each tier holds (`tier_shares`), as are
        the two below."""

    def stores_ended(self, tier: str, keys: Sequence[bytes]) -> None:
        """A store job to secondary `tier` ended, stored or failed. Its STORED events, if any, may
        reach `tier_events` before or after this call (the manager finishes a poll's jobs first)."""

    def tier_events(self, tier: str, events: Sequence[TierEvent]) -> None:
        """Secondary `tier` reported these STORED and REMOVED events (maybe none), oldest first."""


class AdmitAll(AdmissionPolicy):
    """The default: every chunk is admitted everywhere."""

    name = "all"

    def admit(self, key: bytes, tier: str, priority: int = DEFAULT_PRIORITY) -> bool:
        return True
