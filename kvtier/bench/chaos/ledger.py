"""The campaign's account of every corruption it injected, and the spy that watches the tiers'
jobs to settle each one.

A corruption of chunk K in tier T is open from the moment its bytes are in place until one of:

- `detected`: the tier removed the bad copy (a REMOVED event for K from T, or, at the end, the copy
  is gone: nothing else deletes in a campaign, whose tiers are sized never to evict); for a tier
  that cannot remove what it refuses (p2p: the copy is another instance's), a load of K submitted
  after the injection began that failed K while the tier process and its peer stayed up, after
  which the copy is repaired (`repair`) so that the next corruption of K is a new one;
- `served`: a load of K from T that was submitted after the injection reported success: the bad
  copy was accepted (must never happen);
- `overwritten`: a store of K into T that completed after the injection replaced it unread (a
  tier skips storing a key it holds, so the ledger looks at the medium to tell: when the store
  completes, or, if the medium could not be read then (its server restarting), when a load of K
  next succeeds);
- `lost`: its server was restarted without persistence (redis, a cluster node), or the peer
  holding it was killed (p2p);
- `unread`: still in place, still bad, at the end of the run.

An injection never races a job of its key: `free` offers only keys that no store or load of the
tier has in flight, and an injection begins (`Corruption.start`) before the injector asks `free`.
So every load of K that may read the bad copy was submitted after `start`, and every load
submitted after the bytes were in place (`Corruption.at`) reads it: a load in between may read
either, so it can be counted as a read when it fails, never as `served` when it succeeds.

A new tier process's first scan removes (and counts) the fs copies of a wrong size before it
serves: `TierSpy` settles those as `detected` when it sees the new process, even when a store has
since written the key again.

`TierSpy` wraps one tier handle of the engine's tiering manager and reports its loads, stores and
events to the ledger; everything else is the wrapped handle's. It runs on the scheduler thread; the
injectors run on their own thread: the ledger has one lock.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.format.chunks import TierEvent, TierEventKind
from kvtier.host.reaper import start_time
from kvtier.tiers.base import Job, JobKind, JobResult

OUTCOMES = ("detected", "served", "overwritten", "lost", "unread")


@dataclass
class Corruption:
    tier: str
    key: bytes
    kind: str
    start: float
    """When the injection began (before its key was found free)."""
    at: float
    """When the bad bytes were in place."""
    outcome: str | None = None
    unchecked_store: bool = False
    """A store of its key completed after `at` while the medium could not be read."""


class Ledger:
    """Open and settled corruptions, and the jobs in flight per tier and key (not to be raced).
    `verify(tier, key)` looks at the medium: None absent, True a valid copy, False a bad one."""

    def __init__(self, verify: Callable[[str, bytes], bool | None],
                 repair: Callable[[str, bytes], None] = lambda tier, key: None) -> None:
        self._verify = verify
        self._repair = repair
        self._lock = threading.Lock()
        self._blind: dict[str, tuple[float, float]] = {}
        """Per tier, the last span (start, end; end inf while it lasts) in which its failed loads
        say nothing of its copies (its peer being restarted)."""
        self._open: dict[tuple[str, bytes], Corruption] = {}
        self.settled: list[Corruption] = []
        self._busy: Counter[tuple[str, bytes]] = Counter()
        """Stores and loads in flight per (tier, key)."""
        self.loads_ok: dict[str, list[float]] = {}
        """Per tier, when each successful load finished (the recovery measure)."""

    def free(self, tier: str, keys: list[bytes]) -> list[bytes]:
        """`keys` of `tier` that are neither corrupted already nor being stored or loaded now."""
        with self._lock:
            return [k for k in keys if (tier, k) not in self._open and not self._busy[(tier, k)]]

    def injected(self, tier: str, key: bytes, kind: str, start: float) -> None:
        """The bad bytes of `key` are in place; the injection began at `start` (before `free`)."""
        with self._lock:
            self._open[(tier, key)] = Corruption(tier, key, kind, start, time.monotonic())

    def _settle(self, tier: str, key: bytes, outcome: str) -> None:
        c = self._open.get((tier, key))
        if c is not None:
            del self._open[(tier, key)]
            c.outcome = outcome
            self.settled.append(c)

    def job_started(self, tier: str, keys: tuple[bytes, ...]) -> None:
        """A store or load of `keys` was submitted to `tier`."""
        with self._lock:
            self._busy.update((tier, k) for k in keys)

    def job_finished(self, tier: str, keys: tuple[bytes, ...]) -> None:
        with self._lock:
            for k in keys:
                self._busy[(tier, k)] -= 1
                if self._busy[(tier, k)] <= 0:
                    del self._busy[(tier, k)]

    def store_finished(self, tier: str, keys: tuple[bytes, ...], ok: set[bytes]) -> None:
        with self._lock:
            stored = [(k, self._open[(tier, k)]) for k in keys if k in ok and (tier, k) in self._open]
        for k, c in stored:
            try:
                valid = self._verify(tier, k)
            except Exception:  # the server is down: the next successful load of `k` looks again
                c.unchecked_store = True
                continue
            with self._lock:
                if valid and self._open.get((tier, k)) is c:
                    self._settle(tier, k, "overwritten")

    def loaded(self, tier: str, keys: list[bytes], submitted: float) -> None:
        """A load of `keys` submitted at `submitted` succeeded: each corruption in place before is
        served, unless a store replaced it unchecked (`store_finished`) and the medium holds a
        valid copy now (nothing but a store writes a corrupted key)."""
        with self._lock:
            self.loads_ok.setdefault(tier, []).append(time.monotonic())
            found = [(k, c) for k in keys
                     if (c := self._open.get((tier, k))) is not None and c.at < submitted]
        for k, c in found:
            replaced = False
            if c.unchecked_store:
                with contextlib.suppress(Exception):  # unreadable still: served
                    replaced = self._verify(tier, k) is True
            with self._lock:
                if self._open.get((tier, k)) is c:
                    self._settle(tier, k, "overwritten" if replaced else "served")

    def refused(self, tier: str, keys: list[bytes], submitted: float) -> None:
        """A load of `keys` submitted at `submitted` failed them, the tier process up throughout:
        each corruption whose injection began before is detected, its copy repaired first (see the
        module docstring). Nothing when the load overlapped a blind span of the tier."""
        start, end = self._blind.get(tier, (0.0, 0.0))
        if start <= time.monotonic() and submitted <= end:
            return
        with self._lock:
            found = [(k, c) for k in keys
                     if (c := self._open.get((tier, k))) is not None and c.start < submitted]
        for k, c in found:
            self._repair(tier, k)
            with self._lock:
                if self._open.get((tier, k)) is c:
                    self._settle(tier, k, "detected")

    def blind(self, tier: str, start: float, end: float = float("inf")) -> None:
        """From `start` to `end`, failed loads of `tier` (submitted before `end`) detect nothing."""
        self._blind[tier] = (start, end)

    def blinded(self, tier: str) -> bool:
        """Whether `tier` is in a blind span now (no corruption should be injected into it)."""
        start, end = self._blind.get(tier, (0.0, 0.0))
        return start <= time.monotonic() <= end

    def removed(self, tier: str, keys: tuple[bytes, ...]) -> None:
        with self._lock:
            for k in keys:
                self._settle(tier, k, "detected")

    def recheck(self, tier: str, started: float | None = None,
                removed_at_start: frozenset[str] = frozenset()) -> None:
        """A new process of `tier` started (at `started`, monotonic): its first scan may have
        removed bad copies without a REMOVED event (they were never in its index). The kinds in
        `removed_at_start` (a wrong size, for fs) in place before it started were removed and
        counted by that scan, whatever the medium shows now (a store may have written the key
        again since); the others are settled by looking at the medium."""
        with self._lock:
            keys = [k for t, k in self._open if t == tier]
            if started is not None:
                for key in keys:
                    c = self._open[(tier, key)]
                    if c.kind in removed_at_start and c.at < started:
                        self._settle(tier, key, "detected")
                keys = [k for t, k in self._open if t == tier]
        for key in keys:
            try:
                state = self._verify(tier, key)
            except Exception:  # the server is down: the end of the run decides
                continue
            if state is None:
                with self._lock:
                    self._settle(tier, key, "detected")

    def open_count(self, tier: str) -> int:
        with self._lock:
            return sum(t == tier for t, _ in self._open)

    def lose_tier(self, tier: str, where: Callable[[bytes], bool] = lambda key: True) -> None:
        """Every open corruption of `tier` (whose key `where` holds) is gone with its server's data."""
        with self._lock:
            for t, k in [tk for tk in self._open if tk[0] == tier and where(tk[1])]:
                self._settle(t, k, "lost")

    def reconcile(self) -> None:
        """Settle what is still open by looking at the media."""
        with self._lock:
            for (tier, key) in list(self._open):
                state = self._verify(tier, key)
                self._settle(tier, key, "detected" if state is None else "overwritten" if state else "unread")

    def counts(self) -> dict[str, Any]:
        with self._lock:
            every = self.settled + list(self._open.values())
            by_outcome = Counter(c.outcome or "open" for c in every)
            return {
                "injected": len(every),
                "by_kind": dict(Counter(c.kind for c in every)),
                "by_tier": dict(Counter(c.tier for c in every)),
                "outcomes": {o: by_outcome.get(o, 0) for o in (*OUTCOMES, "open")},
                "detected_by_tier": dict(Counter(c.tier for c in every if c.outcome == "detected")),
                "outcomes_by_tier": {t: dict(Counter(c.outcome or "open" for c in every if c.tier == t))
                                     for t in sorted({c.tier for c in every})},
            }

    def detected(self, tier: str) -> int:
        with self._lock:
            return sum(c.tier == tier and c.outcome == "detected" for c in self.settled)


def process_started(pid: int | None) -> float | None:
    """When process `pid` started, on `time.monotonic`'s clock (to a clock tick), or None."""
    ticks = None if pid is None else start_time(pid)
    if ticks is None:
        return None
    since_boot = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.monotonic() - since_boot


class TierSpy:
    """One tier handle, its loads, stores and REMOVED events reported to `ledger`; with `refusals`,
    its failed loads too (`Ledger.refused`), unless its process changed while they ran."""

    def __init__(self, inner: Any, ledger: Ledger, refusals: bool = False,
                 removed_at_start: frozenset[str] = frozenset()) -> None:
        self._inner = inner
        self._ledger = ledger
        self._refusals = refusals
        self._removed_at_start = removed_at_start
        self._jobs: dict[int, tuple[Job, float, int | None]] = {}
        self._events: list[TierEvent] = []
        self._pid: int | None = inner.pid
        self.name: str = inner.name

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def submit_load(self, job: Job) -> None:
        self._jobs[job.job_id] = (job, time.monotonic(), self._inner.pid)
        self._ledger.job_started(self.name, job.keys)
        self._inner.submit_load(job)

    def submit_store(self, job: Job) -> None:
        self._jobs[job.job_id] = (job, time.monotonic(), self._inner.pid)
        self._ledger.job_started(self.name, job.keys)
        self._inner.submit_store(job)

    def get_finished_jobs(self) -> list[JobResult]:
        results: list[JobResult] = self._inner.get_finished_jobs()
        # Events first: a REMOVED that arrived before a store's completion settles a corruption
        # as detected before the store could make it look overwritten.
        self._drain_events()
        if self._inner.is_up and self._inner.pid != self._pid:
            self._pid = self._inner.pid
            self._ledger.recheck(self.name, process_started(self._pid), self._removed_at_start)
        for r in results:
            entry = self._jobs.pop(r.job_id, None)
            if entry is None:
                continue
            job, submitted, pid = entry
            self._ledger.job_finished(self.name, job.keys)
            if job.kind is JobKind.STORE:
                self._ledger.store_finished(self.name, job.keys, set(r.successful_keys))
                continue
            if r.successful_keys:
                self._ledger.loaded(self.name, list(r.successful_keys), submitted)
            failed = set(job.keys) - set(r.successful_keys)
            if self._refusals and failed and self._inner.is_up and self._inner.pid == pid:
                self._ledger.refused(self.name, [k for k in job.keys if k in failed], submitted)
        return results

    def _drain_events(self) -> None:
        events: list[TierEvent] = self._inner.take_events()
        for e in events:
            if e.kind is TierEventKind.REMOVED:
                self._ledger.removed(self.name, e.keys)
        self._events += events

    def take_events(self) -> list[TierEvent]:
        self._drain_events()
        out, self._events = self._events, []
        return out
