"""The fs index's eviction order: its keys by last use, oldest first, in about 16 bytes a key.

Most keys sit in a sorted run: two flat arrays (the keys, shared with the index's dict, and their
times as raw doubles), consumed from the front. A key used after the run was built is pushed on a
heap of (time, key) items. An item is current while its time equals the key's time in the index's
dict; anything else (the key was used again, or is gone) is a stale item, skipped when reached.
`rebuild` sorts every key into a fresh run and empties the heap; it runs when the heap holds more
than a quarter of the keys, or the stale items outnumber the keys, so the heap's 64 bytes an item
never dominate and a key's memory stays bounded whatever the traffic.

Not thread-safe: the index calls it under its lock, after updating its dict.
"""

from __future__ import annotations

import heapq
from array import array

import numpy as np

HEAP_SLACK = 64
"""The heap may hold this many items beyond its share before a rebuild."""


class UseOrder:
    """Keys of `times` (key -> last use, owned and kept current by the index) by last use."""

    def __init__(self, times: dict[bytes, float]) -> None:
        self._times = times
        self._run_keys: list[bytes] = []
        self._run_times = array("d")
        self._pos = 0
        self._heap: list[tuple[float, bytes]] = []

    def items(self) -> int:
        """The items held, current and stale."""
        return len(self._run_keys) - self._pos + len(self._heap)

    def push(self, key: bytes, last_use: float) -> None:
        """Record that `key` was last used at `last_use` (already its time in `times`)."""
        heapq.heappush(self._heap, (last_use, key))
        keys = len(self._times)
        if len(self._heap) > keys // 4 + HEAP_SLACK or self.items() > 2 * keys + HEAP_SLACK:
            self.rebuild()

    def rebuild(self) -> None:
        """Every key of `times` in one sorted run (ties keep the dict's order); no stale item.
        The times are sorted as one numpy array: no Python call a key."""
        times = self._times
        keys = list(times)
        run_times = np.fromiter(times.values(), dtype=np.float64, count=len(keys))
        order = np.argsort(run_times, kind="stable")
        self._run_keys = [keys[i] for i in order.tolist()]
        self._run_times = array("d", run_times[order].tobytes())
        self._pos = 0
        self._heap = []

    def _run_head(self) -> tuple[float, bytes] | None:
        keys, run_times, times = self._run_keys, self._run_times, self._times
        while self._pos < len(keys):
            key, t = keys[self._pos], run_times[self._pos]
            if times.get(key) == t:
                return t, key
            self._pos += 1
        if keys:
            self._run_keys, self._run_times, self._pos = [], array("d"), 0
        return None

    def _heap_head(self) -> tuple[float, bytes] | None:
        heap, times = self._heap, self._times
        while heap:
            t, key = heap[0]
            if times.get(key) == t:
                return t, key
            heapq.heappop(heap)
        return None

    def pop(self) -> tuple[float, bytes] | None:
        """The current item of the least recently used key, taken out of the order (push it back
        to keep the key in it); None when no key is left."""
        run, top = self._run_head(), self._heap_head()
        if run is not None and (top is None or run[0] <= top[0]):
            self._pos += 1
            return run
        if top is not None:
            heapq.heappop(self._heap)
        return top
