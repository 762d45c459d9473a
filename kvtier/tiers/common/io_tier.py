"""The contract methods every tier with its own I/O threads forwards to its bookkeeper, written once.

`BookedTier` (fs, obj, redis, p2p): the I/O threads record finished jobs, events and counts in a
`TierBook`; the dispatch thread drains them through the contract (`get_finished_jobs`,
`take_events`, `counts`). It also holds the layout fingerprint every stored chunk's header carries.

`PerKeyTier` (fs, obj): jobs run one task per key on an `IoPool`; the subclass moves one key
(`_store_key`, `_load_key`, on I/O threads) and says how a failure is logged (`_key_failed`). What
it knows it holds is a `KeyIndex`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import Counter

from kvtier.errors import ConfigError
from kvtier.format.chunks import ChunkError, ChunkKey, TierEvent, TierEventKind
from kvtier.ops.metrics import TierCounts, TierGauge
from kvtier.tiers.base import Job, JobKind, JobResult, SecondaryTier, TierContext
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.common.book import KeyWork, TierBook
from kvtier.tiers.common.iopool import IoPool

KEY_BYTES = 32


class BookedTier(SecondaryTier):
    """A tier whose completions, events and counts go through `self._book`."""

    def __init__(self, ctx: TierContext) -> None:
        super().__init__(ctx)
        try:
            self._fp = chunkfmt.fingerprint_bytes(ctx.layout_fingerprint)
        except ValueError as e:
            raise ConfigError("layout_fingerprint", ctx.layout_fingerprint, str(e)) from None
        self._book = TierBook(ctx)

    def get_finished_jobs(self) -> list[JobResult]:
        return self._book.take_finished()

    def take_events(self) -> list[TierEvent]:
        return self._book.take_events()

    def counts(self) -> TierCounts:
        """The book's counts, with the subclass's `_gauges`."""
        return self._book.counts(self._gauges())

    def _gauges(self) -> dict[TierGauge, float]:
        """The tier's gauges now (none by default). Optional hook, called like `counts`."""
        return {}


class KeyIndex(ABC):
    """What a per-key tier knows it holds, behind one lock (`_lock`, for the subclass's state too).
    Keys pinned by loads in flight (pins nest) are never chosen for eviction. Any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pins: Counter[bytes] = Counter()

    def pin(self, key: bytes) -> None:
        """Protect `key` from eviction while this instance reads it."""
        with self._lock:
            self._pins[key] += 1

    def unpin(self, key: bytes) -> None:
        with self._lock:
            self._pins[key] -= 1
            if self._pins[key] <= 0:
                del self._pins[key]

    @abstractmethod
    def remove(self, key: bytes) -> bool:
        """Forget `key`; True when it was known."""


class PerKeyTier(BookedTier):
    """A BookedTier whose jobs run one task per key on `self._pool` (set by the constructor, with
    `self._index`). A key that is not 32 bytes fails without I/O."""

    _pool: IoPool
    _index: KeyIndex
    _closed = False

    def submit_store(self, job: Job) -> None:
        self._submit(job, self._store_key)

    def submit_load(self, job: Job) -> None:
        self._submit(job, self._load_key)

    def shutdown(self) -> None:
        """Wait for the keys in progress, run the queued ones, then `_close`. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown()
        self._close()

    @abstractmethod
    def _store_key(self, key: ChunkKey, slot: int) -> bool:
        """Copy one slot's row out to the tier; True when stored. I/O threads."""

    @abstractmethod
    def _load_key(self, key: ChunkKey, slot: int) -> bool:
        """Copy one stored chunk into a slot, verified; True when the slot holds it. I/O threads."""

    @abstractmethod
    def _key_failed(self, cause: str, exc: BaseException) -> None:
        """Record why a key failed (`cause` like "store:ENOSPC"). Any thread."""

    def _error_name(self, exc: BaseException) -> str:
        """The cause a raised exception is logged under."""
        return type(exc).__name__

    def _io_ready(self) -> bool:
        """False while keys should fail at once (e.g. the server is known down). I/O threads."""
        return True

    def _close(self) -> None:
        """Release what the I/O threads used; called once, after they are gone. Optional hook."""

    def _submit(self, job: Job, work: KeyWork) -> None:
        op = job.kind.value

        def checked(key: ChunkKey, slot: int) -> bool:
            if len(key) != KEY_BYTES:
                self._key_failed(f"{op}:invalid_key", ValueError("chunk key must be 32 bytes"))
                return False
            return self._io_ready() and work(key, slot)

        self._book.submit_per_key(self._pool, job, checked, self._key_raised)

    def _key_raised(self, kind: JobKind, e: Exception) -> None:
        self._key_failed(f"{kind.value}:{self._error_name(e)}", e)

    def _forget(self, key: bytes) -> None:
        """`key` is gone from the tier (a load found it missing or bad)."""
        if self._index.remove(key):
            self._book.event(TierEventKind.REMOVED, key)

    def _bad(self, reason: ChunkError, what: str) -> None:
        """Count a bad chunk and log the cause (at most once per interval); `what` says what was
        done with it."""
        self._book.bad(reason)
        self._key_failed(f"bad:{reason.value}", ValueError(what))
