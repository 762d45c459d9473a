"""An external tier loaded by `module_path` in the tests: the memory tier with delayed completions.

Delaying completions keeps jobs in flight long enough to kill or stop the tier process under them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kvtier.tiers.base import Job, JobResult, LookupResult, TierContext
from kvtier.tiers.memory import MemoryTier


class DelayedMemoryTier(MemoryTier):
    """Completes each job `delay_of(job)` seconds (`delay_s` unless a subclass says otherwise)
    after it was submitted; the tier's process is never blocked meanwhile."""

    def __init__(self, ctx: TierContext, *, delay_s: float = 0.5) -> None:
        super().__init__(ctx)
        self.delay_s = delay_s
        self._held: list[tuple[float, JobResult]] = []
        self._lock = threading.Lock()

    def delay_of(self, job: Job) -> float:
        """How long `job`'s result is held before `get_finished_jobs` reports it."""
        return self.delay_s

    def submit_store(self, job: Job) -> None:
        super().submit_store(job)
        self._hold(self.delay_of(job))

    def submit_load(self, job: Job) -> None:
        super().submit_load(job)
        self._hold(self.delay_of(job))

    def _hold(self, delay_s: float) -> None:
        due = time.monotonic() + delay_s
        with self._lock:
            self._held.extend((due, r) for r in MemoryTier.get_finished_jobs(self))
        if delay_s > 0:
            threading.Timer(delay_s, self.ctx.wakeup).start()
        else:
            self.ctx.wakeup()

    def get_finished_jobs(self) -> list[JobResult]:
        now = time.monotonic()
        with self._lock:
            ready = [r for due, r in self._held if due <= now]
            self._held = [(due, r) for due, r in self._held if due > now]
        return ready


class NotATier:
    """Named by a config to check that plugins must derive from the contract."""


class RetryOnceTier(MemoryTier):
    """Answers RETRY the first time a key is looked up, HIT afterwards."""

    def __init__(self, ctx: TierContext) -> None:
        super().__init__(ctx)
        self._seen: set[bytes] = set()

    def lookup(self, keys: Sequence[bytes]) -> list[LookupResult]:
        out = [LookupResult.HIT if k in self._seen else LookupResult.RETRY for k in keys]
        self._seen.update(keys)
        return out
