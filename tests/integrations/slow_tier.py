"""A plug-in tier for the SLO guard test, loaded by `module_path`: the memory tier, whose stores
complete at once and whose loads each complete `delay_s` seconds after they were submitted."""

from __future__ import annotations

from kvtier.tiers.base import Job
from kvtier.tiers.memory import MemoryTier
from tests.tiers.plugin_tier import DelayedMemoryTier


class SlowLoadTier(DelayedMemoryTier):
    """Stores at memory speed; every load sleeps `delay_s` (the tier's process is not blocked)."""

    def submit_store(self, job: Job) -> None:
        MemoryTier.submit_store(self, job)
        with self._lock:
            self._held.extend((0.0, r) for r in MemoryTier.get_finished_jobs(self))
        self.ctx.wakeup()
