"""An external tier loaded by `module_path` in the tests: a tier process that writes a malformed
frame to the engine.

It runs inside a real tier runner (`python -m kvtier.tiers.runner FD`), whose socket to the engine
is the descriptor FD named on its command line. Load jobs are held unanswered (they are in flight
when the frame goes out); a store job makes the tier write `frame_hex`'s bytes raw onto that socket,
from the dispatch thread, between two whole frames of the runner's own.
"""

from __future__ import annotations

import os
import sys

from kvtier.tiers.base import Job, TierContext
from kvtier.tiers.memory import MemoryTier


class MalformedFrameTier(MemoryTier):
    """Holds its loads; answers a store with `frame_hex` written onto the runner's socket."""

    def __init__(self, ctx: TierContext, *, frame_hex: str) -> None:
        super().__init__(ctx)
        self.frame = bytes.fromhex(frame_hex)

    def submit_load(self, job: Job) -> None:
        """Never finishes the job: it stays in flight until the engine gives up on the process."""

    def submit_store(self, job: Job) -> None:
        os.write(int(sys.argv[1]), self.frame)
