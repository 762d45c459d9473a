"""What this instance's host tier held when it was cascaded: key -> (slot, checksum, generation), bounded LRU.

The host tier evicts and reuses slots without telling secondary tiers, so an entry is only a claim:
slot `s` held the row of `key` when the STORE job named it, with the whole-row xxh3-128 `digest`,
while the slot's generation (`host.generations`) was `generation`. The server sends the row only
while the slot's generation is still that one (read before and after the send), and calls `forget`
when it is not (a reused slot).

A newer STORE naming a slot drops the entry of whatever key that slot held before. At most
`capacity` entries are kept (the least recently stored or served go first).

Threads: any; every method takes the index's lock (briefly: no row is read under it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple


class Claim(NamedTuple):
    slot: int
    digest: bytes
    generation: int


class ChunkIndex:
    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._entries: OrderedDict[bytes, Claim] = OrderedDict()
        self._slot_key: dict[int, bytes] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def remember(self, key: bytes, claim: Claim) -> None:
        """Record that `claim.slot` now holds the row of `key`."""
        with self._lock:
            old_key = self._slot_key.pop(claim.slot, None)
            if old_key is not None and old_key != key:
                self._entries.pop(old_key, None)
            old = self._entries.pop(key, None)
            if old is not None and old.slot != claim.slot:
                self._slot_key.pop(old.slot, None)
            self._entries[key] = claim
            self._slot_key[claim.slot] = key
            while len(self._entries) > self.capacity:
                _, gone = self._entries.popitem(last=False)
                self._slot_key.pop(gone.slot, None)

    def holds(self, keys: list[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._entries for k in keys]

    def claim(self, key: bytes) -> Claim | None:
        """The claim for `key` (now the most recently used), or None when unknown."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def forget(self, key: bytes, slot: int) -> bool:
        """Drop `key` if it still names `slot` (the slot was found reused); True when dropped."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.slot != slot:
                return False
            del self._entries[key]
            self._slot_key.pop(slot, None)
            return True
