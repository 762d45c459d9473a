"""A plug-in tier for the SLO guard test, loaded by `module_path`: the memory tier, whose stores
complete at once and whose loads each complete `delay_s` seconds after they were submitted."""

from __future__ import annotations

from kvtier.tiers.base import Job, JobKind
from tests.tiers.plugin_tier import DelayedMemoryTier


class SlowLoadTier(DelayedMemoryTier):
    """Stores at memory speed; every load takes `delay_s` (the tier's process is not blocked)."""

    def delay_of(self, job: Job) -> float:
        return self.delay_s if job.kind is JobKind.LOAD else 0.0
