"""A bounded-memory frequency sketch with aging (count-min, TinyLFU style).

`depth` rows of `width` saturating 4-bit counters (stored one per byte, capped at 15). A key's
estimate is the minimum of its `depth` counters: never below the true count since the last aging
(it may be above it, when other keys share all its counters). After `sample_size` increments every
counter is halved, so a key seen often long ago fades and the sketch follows the recent window.

Holds: memory is `depth * width` bytes whatever the number of keys; every counter is <= 15;
`add` and `estimate` cost O(depth), aging O(depth * width) once per `sample_size` increments.
Called on one thread only; not thread-safe.
"""

from __future__ import annotations

import hashlib

import numpy as np

COUNTER_MAX = 15


class FrequencySketch:
    """Count-min sketch over byte-string keys, with periodic halving (aging)."""

    def __init__(self, width: int = 1 << 16, depth: int = 4, sample_size: int | None = None) -> None:
        if width < 1 or width & (width - 1):
            raise ValueError(f"width must be a power of two >= 1, got {width}")
        if not 1 <= depth <= 8:
            raise ValueError(f"depth must be in 1..8, got {depth}")
        self.width = width
        self.depth = depth
        self.sample_size = sample_size if sample_size is not None else 10 * width
        if self.sample_size < 1:
            raise ValueError(f"sample_size must be >= 1, got {self.sample_size}")
        self._table = bytearray(depth * width)
        self._halve = np.frombuffer(self._table, dtype=np.uint8)
        """A numpy view of the table, for aging in place."""
        self._added = 0
        self.agings = 0
        """How many times the counters were halved."""

    def _cells(self, key: bytes) -> list[int]:
        """One counter index per row (row `i` at offset `i * width`), from 4 bytes each of the
        key's digest (chunk keys are already cryptographic hashes, but any key is re-hashed so
        short keys spread too)."""
        digest = hashlib.blake2b(key, digest_size=4 * self.depth).digest()
        mask, width = self.width - 1, self.width
        return [
            row * width + (int.from_bytes(digest[4 * row : 4 * row + 4], "little") & mask)
            for row in range(self.depth)
        ]

    def add(self, key: bytes) -> None:
        """Count one sighting of `key`; ages the sketch every `sample_size` sightings."""
        table = self._table
        cells = self._cells(key)
        # Conservative update: raise only the counters at the current minimum.
        low = min(table[c] for c in cells)
        if low < COUNTER_MAX:
            for c in cells:
                if table[c] == low:
                    table[c] = low + 1
        self._added += 1
        if self._added >= self.sample_size:
            self._halve >>= 1
            self._added = 0
            self.agings += 1

    def estimate(self, key: bytes) -> int:
        """How many times `key` was seen recently (an upper bound, saturating at 15)."""
        table = self._table
        return min(table[c] for c in self._cells(key))

    @property
    def nbytes(self) -> int:
        return len(self._table)
