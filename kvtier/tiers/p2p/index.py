"""What this instance's host tier held when it was cascaded: key -> (slot, checksum), bounded LRU.

The host tier evicts and reuses slots without telling secondary tiers, so an entry is only a claim:
slot `s` held the row of `key`, whose xxh3-128 checksum was `digest`, when the STORE job named it.
`claim_verified` checks the claim before a send: the row is handed out only if it still has the
remembered checksum (else the entry is dropped and the key is a miss).

A newer STORE naming a slot drops the entry of whatever key that slot held before. At most
`capacity` entries are kept (the least recently stored or served go first).

Threads: any; every method takes the index's lock, except the copy and checksum of the row.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvtier.tiers import chunkfmt


class ChunkIndex:
    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._entries: OrderedDict[bytes, tuple[int, bytes]] = OrderedDict()
        self._slot_key: dict[int, bytes] = {}
        self._lock = threading.Lock()
        self.stale_dropped = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def remember(self, key: bytes, slot: int, digest: bytes) -> None:
        """Record that `slot` now holds the row of `key` with checksum `digest`."""
        with self._lock:
            old_key = self._slot_key.pop(slot, None)
            if old_key is not None and old_key != key:
                self._entries.pop(old_key, None)
            old = self._entries.pop(key, None)
            if old is not None and old[0] != slot:
                self._slot_key.pop(old[0], None)
            self._entries[key] = (slot, digest)
            self._slot_key[slot] = key
            while len(self._entries) > self.capacity:
                _, (gone_slot, _) = self._entries.popitem(last=False)
                self._slot_key.pop(gone_slot, None)

    def holds(self, keys: list[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._entries for k in keys]

    def forget(self, key: bytes, slot: int) -> None:
        """Drop `key` if it still names `slot`."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] == slot:
                del self._entries[key]
                self._slot_key.pop(slot, None)
                self.stale_dropped += 1

    def claim_verified(
        self, key: bytes, region: memoryview, row_bytes: int
    ) -> tuple[memoryview, bytes] | None:
        """The region row of `key` and its checksum, if its slot still holds it now.

        None (and the entry dropped when it was stale) when the key is unknown or the row no longer
        has the remembered checksum. The row is not copied: it may still change while it is sent,
        which the requester's own checksum check catches.
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
        slot, digest = entry
        row = region[slot * row_bytes : (slot + 1) * row_bytes]
        if chunkfmt.checksum(row) == digest:
            return row, digest
        self.forget(key, slot)
        return None
