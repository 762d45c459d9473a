"""The reference secondary tier: chunk rows kept in the tier process's own memory.

It is the model the contract suite checks every other tier against, and a template for writing a
tier. Jobs complete synchronously inside `submit_*`; `max_bytes` bounds it with least-recently-used
eviction.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvtier.format.chunks import ChunkKey, TierEvent, TierEventKind
from kvtier.tiers.base import Job, JobResult, LookupResult, SecondaryTier, TierContext, TierUsage
from kvtier.tiers.common.options import at_least, check_options, max_bytes_option


class MemoryTier(SecondaryTier):
    """Rows kept as `bytes` in an LRU-ordered dict (most recently used last)."""

    medium = "CPU"
    locality = "LOCAL"
    OPTIONS = (max_bytes_option(),)
    """`max_bytes`: the bound (null: unbounded), at least one row."""

    def __init__(self, ctx: TierContext, **options: Any) -> None:
        super().__init__(ctx)
        max_bytes = check_options(self.OPTIONS, options)["max_bytes"]
        at_least("max_bytes", max_bytes, ctx.row_bytes, "one row")
        self._max_rows = None if max_bytes is None else int(max_bytes) // ctx.row_bytes
        self._rows: OrderedDict[ChunkKey, bytes] = OrderedDict()
        self._finished: list[JobResult] = []
        self._events: list[TierEvent] = []

    def lookup(self, keys: Sequence[ChunkKey]) -> list[LookupResult]:
        return [LookupResult.HIT if k in self._rows else LookupResult.MISS for k in keys]

    def submit_store(self, job: Job) -> None:
        start = time.perf_counter()
        stored: list[ChunkKey] = []
        for key, slot in zip(job.keys, job.slots, strict=True):
            self._rows[key] = bytes(self.ctx.slot_view(slot))
            self._rows.move_to_end(key)
            stored.append(key)
        evicted: list[ChunkKey] = []
        while self._max_rows is not None and len(self._rows) > self._max_rows:
            evicted.append(self._rows.popitem(last=False)[0])
        self._events.append(TierEvent(TierEventKind.STORED, tuple(stored)))
        if evicted:
            self._events.append(TierEvent(TierEventKind.REMOVED, tuple(evicted)))
        self._finish(job, stored, start)

    def submit_load(self, job: Job) -> None:
        start = time.perf_counter()
        loaded: list[ChunkKey] = []
        for key, slot in zip(job.keys, job.slots, strict=True):
            data = self._rows.get(key)
            if data is None:
                continue
            self.ctx.slot_view(slot)[:] = data
            self._rows.move_to_end(key)
            loaded.append(key)
        self._finish(job, loaded, start)

    def _finish(self, job: Job, done: list[ChunkKey], start: float) -> None:
        self._finished.append(
            JobResult(
                job.job_id,
                success=len(done) == len(job.keys),
                successful_keys=tuple(done),
                bytes_moved=len(done) * self.ctx.row_bytes,
                seconds=time.perf_counter() - start,
            )
        )
        self.ctx.wakeup()

    def get_finished_jobs(self) -> list[JobResult]:
        finished, self._finished = self._finished, []
        return finished

    def take_events(self) -> list[TierEvent]:
        events, self._events = self._events, []
        return events

    def usage(self) -> TierUsage:
        row_bytes = self.ctx.row_bytes
        return TierUsage(len(self._rows) * row_bytes, len(self._rows), (self._max_rows or 0) * row_bytes)
