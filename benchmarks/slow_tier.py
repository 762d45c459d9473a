"""A plug-in tier for `bench_guard`, loaded by `module_path`: the memory tier, whose loads each
complete `delay_s` seconds after they were submitted while the file `flag_path` exists (the
benchmark creates it at the moment of the slowdown). Stores complete at once; the tier's process
is never blocked. The guard test's slow tier (`tests/integrations/slow_tier.py`), switched by a file."""

from __future__ import annotations

import os

from kvtier.tiers.base import Job, TierContext
from tests.integrations.slow_tier import SlowLoadTier


class FlaggedSlowTier(SlowLoadTier):
    """Loads are `delay_s` late while `flag_path` exists; everything else is the memory tier."""

    def __init__(self, ctx: TierContext, *, flag_path: str, delay_s: float = 10.0) -> None:
        super().__init__(ctx, delay_s=delay_s)
        self.flag_path = flag_path

    def delay_of(self, job: Job) -> float:
        return super().delay_of(job) if os.path.exists(self.flag_path) else 0.0
