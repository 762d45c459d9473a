"""What the obj tier knows about keys: present (LRU order), absent (for a while), being asked.

Thread-safe: one lock guards everything; every method is short. The dispatch thread calls `lookup`;
I/O threads record what requests proved.

Invariants: a key is in at most one of present / absent; a key is pending (a HEAD queued or in
flight) only while it is not present. A HEAD answer never overrides a presence proved by a store
or a load meanwhile. An absence is remembered until `absent_s` after it was first reported by
`lookup`, so an asker that got RETRY always gets the answer when it asks again. With `max_bytes`,
(present + reserved) * object_bytes <= max_bytes, and keys pinned by loads in flight are never
chosen for eviction. Without it, at most MAX_REMEMBERED present keys are remembered (the oldest
are forgotten, not deleted: a later lookup asks the server again).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvtier.format.chunks import ChunkKey
from kvtier.tiers.base import LookupResult
from kvtier.tiers.common.io_tier import KeyIndex

MAX_REMEMBERED = 1 << 20
"""Present keys remembered without `max_bytes` (about 150 MB of index at most)."""


class ObjIndex(KeyIndex):
    def __init__(self, object_bytes: int, max_bytes: int | None, absent_s: float) -> None:
        super().__init__()
        self.object_bytes = object_bytes
        self.absent_s = absent_s
        self.max_bytes = max_bytes
        self._present: OrderedDict[bytes, None] = OrderedDict()
        self._absent: dict[bytes, float] = {}
        """Key -> when its absence expires (infinity until `lookup` first reports it)."""
        self._pending: set[bytes] = set()
        self._reserved = 0
        self._dropped: set[bytes] | None = None
        """Keys removed since `start_scan` (None: no scan running): a listing must not revive them."""

    @property
    def present(self) -> int:
        return len(self._present)

    @property
    def bytes_used(self) -> int:
        return len(self._present) * self.object_bytes

    def lookup(self, keys: Sequence[ChunkKey], now: float) -> tuple[list[LookupResult], list[bytes]]:
        """Answers for `keys`, and the keys that need a HEAD (now marked pending)."""
        answers: list[LookupResult] = []
        ask: list[bytes] = []
        with self._lock:
            for key in keys:
                if key in self._present:
                    answers.append(LookupResult.HIT)
                    continue
                until = self._absent.get(key)
                if until is not None:
                    if until == math.inf:
                        self._absent[key] = until = now + self.absent_s
                    if until > now:
                        answers.append(LookupResult.MISS)
                        continue
                    del self._absent[key]
                answers.append(LookupResult.RETRY)
                if key not in self._pending:
                    self._pending.add(key)
                    ask.append(key)
        return answers, ask

    def answer(self, key: bytes, present: bool | None) -> None:
        """Record a HEAD's answer (None: the HEAD failed, a brief miss)."""
        with self._lock:
            self._pending.discard(key)
            if key in self._present:
                return
            if present:
                self._add(key)
            else:
                self._set_absent(key)

    def touch(self, key: bytes) -> bool:
        """Mark a present key most recently used; False when it is not known present."""
        with self._lock:
            if key not in self._present:
                return False
            self._present.move_to_end(key)
            return True

    def add(self, key: bytes) -> bool:
        """Record a key proved present (most recently used); True when it was not known."""
        with self._lock:
            return self._add(key)

    def _add(self, key: bytes) -> bool:
        self._absent.pop(key, None)
        new = key not in self._present
        self._present[key] = None
        self._present.move_to_end(key)
        if self.max_bytes is None:
            while len(self._present) > MAX_REMEMBERED:
                self._present.popitem(last=False)
        return new

    def _set_absent(self, key: bytes) -> None:
        self._absent[key] = math.inf
        if len(self._absent) > MAX_REMEMBERED:  # forget the oldest half: they are asked again
            self._absent = dict(list(self._absent.items())[MAX_REMEMBERED // 2 :])

    def remove(self, key: bytes) -> bool:
        """Record a key proved absent; True when it was known present."""
        with self._lock:
            self._set_absent(key)
            if key not in self._present:
                return False
            del self._present[key]
            if self._dropped is not None:
                self._dropped.add(key)
            return True

    def reserve(self, n: int = 1) -> tuple[bool, list[bytes]]:
        """Make room for `n` new objects: (granted, victims), victims already removed from the
        index (the caller deletes their objects). A grant must be given back with `release`."""
        if self.max_bytes is None:
            return True, []
        victims: list[bytes] = []
        with self._lock:
            limit = self.max_bytes // self.object_bytes
            excess = len(self._present) + self._reserved + n - limit
            if excess > 0:
                for key in self._present:
                    if len(victims) == excess:
                        break
                    if key not in self._pins:
                        victims.append(key)
                for key in victims:
                    del self._present[key]
                if self._dropped is not None:
                    self._dropped.update(victims)
            granted = len(self._present) + self._reserved + n <= limit
            if granted:
                self._reserved += n
        return granted, victims

    def release(self, n: int = 1) -> None:
        if self.max_bytes is not None:
            with self._lock:
                self._reserved -= n

    def start_scan(self) -> None:
        """Call before listing the bucket; `merge_listed` then skips keys removed meanwhile."""
        with self._lock:
            self._dropped = set()

    def merge_listed(self, keys: Iterable[bytes]) -> None:
        """Add keys found by a listing, oldest first, as less recently used than known ones."""
        with self._lock:
            dropped, self._dropped = self._dropped or set(), None
            for key in reversed(list(keys)):
                if key not in self._present and key not in dropped:
                    self._absent.pop(key, None)
                    self._present[key] = None
                    self._present.move_to_end(key, last=False)
