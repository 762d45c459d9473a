"""The retention priority each chunk was last cascaded with, remembered for the most recent keys.

Secondary tiers store bytes, not priorities; when a chunk is promoted back to the host tier, the
manager gives it the priority it was stored with (or the promoting request's, when higher or when
the key was forgotten), so that it is evicted and cascaded again as it was before.

Holds: at most `capacity` keys are remembered (the least recently remembered are forgotten first),
so memory stays bounded however many chunks the secondary tiers hold. Called on the scheduler
thread only; not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class RememberedPriorities:
    """A bounded key → priority map, least recently remembered first out."""

    def __init__(self, capacity: int = 1 << 18) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._priorities: OrderedDict[bytes, int] = OrderedDict()

    def remember(self, keys: Iterable[bytes], priority: int) -> None:
        """`keys` were stored with `priority` (a later call for a key replaces it)."""
        known = self._priorities
        for key in keys:
            known[key] = priority
            known.move_to_end(key)
        while len(known) > self.capacity:
            known.popitem(last=False)

    def get(self, key: bytes, default: int) -> int:
        """The priority `key` was stored with, or `default` when not remembered."""
        return self._priorities.get(key, default)

    def __len__(self) -> int:
        return len(self._priorities)
