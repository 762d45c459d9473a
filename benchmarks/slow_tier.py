"""A plug-in tier for `bench_guard`, loaded by `module_path`: the memory tier, whose loads each
complete `delay_s` seconds after they were submitted while the file `flag_path` exists (the
benchmark creates it at the moment of the slowdown). Stores complete at once; the tier's process
is never blocked."""

from __future__ import annotations

import os
import threading
import time

from kvtier.tiers.base import Job, JobResult, TierContext
from kvtier.tiers.memory import MemoryTier


class FlaggedSlowTier(MemoryTier):
    """Loads are `delay_s` late while `flag_path` exists; everything else is the memory tier."""

    def __init__(self, ctx: TierContext, *, flag_path: str, delay_s: float = 10.0) -> None:
        super().__init__(ctx)
        self.flag_path = flag_path
        self.delay_s = delay_s
        self._held: list[tuple[float, JobResult]] = []
        self._lock = threading.Lock()

    def submit_store(self, job: Job) -> None:
        super().submit_store(job)
        self._hold(0.0)

    def submit_load(self, job: Job) -> None:
        super().submit_load(job)
        self._hold(self.delay_s if os.path.exists(self.flag_path) else 0.0)

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
