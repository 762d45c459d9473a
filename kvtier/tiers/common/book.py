"""Bookkeeping shared by the tiers whose I/O runs on their own threads (fs, obj, redis).

`TierBook` holds a tier's counts (the declared `TierCounter`s and bad chunks by `ChunkError`), its
pending events and its finished jobs; `FailureLog` turns a
stream of failures into one log line per cause. Both are thread-safe: the I/O threads record, the
tier process's dispatch thread drains.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

from kvtier.format.chunks import ChunkError, ChunkKey, TierEvent, TierEventKind
from kvtier.ops.metrics import TierCounter, TierCounts, TierGauge, TierStat
from kvtier.tiers.base import Job, JobKind, JobResult, TierContext
from kvtier.tiers.common.iopool import IoPool, JobTracker

LOG_INTERVAL_S = 600.0
"""A failure cause already logged is logged again (with the count since) at most this often."""
KeyWork = Callable[[ChunkKey, int], bool]
"""Moves one key between its host-region slot and the tier; True on success. Runs on an I/O thread."""


class FailureLog:
    """Logs a failure cause (e.g. "store:ENOSPC") at its first occurrence, then at most once per
    LOG_INTERVAL_S with the number of occurrences suppressed since, however many chunks it hits."""

    def __init__(
        self, log: logging.Logger, who: str, scrub: Callable[[str], str] = lambda s: s
    ) -> None:
        self.log = log
        self.who = who
        self._scrub = scrub
        self._logged: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def failed(self, cause: str, exc: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            last, suppressed = self._logged.get(cause, (-math.inf, 0))
            if now - last < LOG_INTERVAL_S:
                self._logged[cause] = (last, suppressed + 1)
                return
            self._logged[cause] = (now, 0)
        more = f" ({suppressed} more since the last report)" if suppressed else ""
        self.log.warning("%s: %s: %s%s", self.who, cause, self._scrub(str(exc)), more)

    def clear(self) -> None:
        """Forget what was logged, so the next occurrence of any cause is logged at once."""
        with self._lock:
            self._logged.clear()


class TierBook:
    """A tier's counts, pending events and finished jobs."""

    def __init__(self, ctx: TierContext) -> None:
        self.ctx = ctx
        self._lock = threading.Lock()
        self._counts: Counter[TierCounter | ChunkError] = Counter()
        self._events: list[tuple[TierEventKind, ChunkKey]] = []
        self._finished: list[JobResult] = []

    def count(self, counter: TierCounter, n: int = 1) -> None:
        with self._lock:
            self._counts[counter] += n

    def bad(self, reason: ChunkError, n: int = 1) -> None:
        """Count `n` stored chunks rejected for `reason`, and wake the dispatch thread: a tier
        process reports the count at once, whichever thread found the chunks (a load, or a scan
        that no job waits for), so a process killed soon after loses none of it."""
        with self._lock:
            self._counts[reason] += n
        self.ctx.wakeup()

    def counts(self, gauges: Mapping[TierGauge, float] | None = None) -> TierCounts:
        """A snapshot of every count, with the tier's `gauges` of now."""
        with self._lock:
            values: dict[TierStat, float] = {k: float(v) for k, v in self._counts.items()}
        for gauge, value in (gauges or {}).items():
            values[gauge] = value
        return TierCounts(values)

    def event(self, kind: TierEventKind, key: ChunkKey) -> None:
        with self._lock:
            self._events.append((kind, key))

    def events(self, kind: TierEventKind, keys: Iterable[ChunkKey]) -> None:
        with self._lock:
            self._events.extend((kind, k) for k in keys)

    def take_events(self) -> list[TierEvent]:
        """Pending events in order, consecutive ones of a kind grouped into one TierEvent."""
        with self._lock:
            pending, self._events = self._events, []
        out: list[TierEvent] = []
        run: list[ChunkKey] = []
        for i, (kind, key) in enumerate(pending):
            run.append(key)
            if i + 1 == len(pending) or pending[i + 1][0] is not kind:
                out.append(TierEvent(kind, tuple(run)))
                run = []
        return out

    def finish(self, tracker: JobTracker) -> None:
        """Report a job whose every key is done, and wake the dispatch thread."""
        job = tracker.job
        done = tuple(k for k, ok in zip(job.keys, tracker.ok, strict=True) if ok)
        result = JobResult(
            job.job_id,
            success=len(done) == len(job.keys),
            successful_keys=done,
            bytes_moved=len(done) * self.ctx.row_bytes,
            seconds=time.perf_counter() - tracker.start,
        )
        with self._lock:
            self._finished.append(result)
        self.ctx.wakeup()

    def track(self, job: Job) -> JobTracker | None:
        """A tracker for `job`'s keys; None for a job without keys, which is reported done now."""
        tracker = JobTracker(job)
        if job.keys:
            return tracker
        self.finish(tracker)
        return None

    def finish_key(self, tracker: JobTracker, i: int, ok: bool) -> None:
        """Record key `i`'s outcome; the call that completes the job reports it."""
        if tracker.finish_key(i, ok):
            self.finish(tracker)

    def take_finished(self) -> list[JobResult]:
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def submit_per_key(
        self, pool: IoPool, job: Job, work: KeyWork, on_error: Callable[[JobKind, Exception], None]
    ) -> None:
        """Run `work` for every key of `job` on `pool`, one task per key; the thread that finishes
        the last key reports the job. A key whose work raises fails (`on_error` records why); once
        the pool is shut down, every key of a new job fails at once."""
        tracker = self.track(job)
        if tracker is None:
            return
        failures = TierCounter.STORE_FAILURES if job.kind is JobKind.STORE else TierCounter.LOAD_FAILURES

        def run(i: int, live: bool) -> None:
            ok = False
            try:
                ok = live and work(job.keys[i], job.slots[i])
            except Exception as e:  # a failed request, or a bug: the key fails, the job goes on
                on_error(job.kind, e)
            if not ok:
                self.count(failures)
            self.finish_key(tracker, i, ok)

        if not pool.submit(job.kind is JobKind.LOAD, [functools.partial(run, i, True)
                                                       for i in range(len(job.keys))]):
            for i in range(len(job.keys)):
                run(i, False)

