"""Tier processes killed and not yet gone, with the jobs they had in flight.

A process stuck in uninterruptible I/O (a hung NFS server, a dying disk) outlives SIGKILL until
that I/O returns, and may then still write the host rows of its loads. Its jobs are reported
failed only once it has exited: the engine hands a job's rows on once it is reported, and rows
handed to another load must never be written by a process that is not dead yet.
"""

from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass

log = logging.getLogger("kvtier.tiers")

WARN_AFTER_S = 10.0
"""How long a killed process may take to exit before a warning says its jobs' rows are held."""


@dataclass
class _Killed:
    proc: subprocess.Popen[bytes]
    job_ids: list[int]
    since: float
    warned: bool = False


class KilledProcesses:
    """The killed processes of one tier, by the caller's clock."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self._killed: list[_Killed] = []

    def add(self, proc: subprocess.Popen[bytes], job_ids: list[int], now: float) -> None:
        """`proc` was killed at `now` with `job_ids` in flight."""
        self._killed.append(_Killed(proc, job_ids, now))

    def ended(self, now: float, everything: bool = False) -> list[int]:
        """The jobs of the killed processes that have exited since the last call (with
        `everything`, of all of them: at shutdown, when nothing is handed on any more)."""
        ended: list[int] = []
        alive: list[_Killed] = []
        for k in self._killed:
            if everything or k.proc.poll() is not None:
                ended.extend(k.job_ids)
                continue
            if not k.warned and now - k.since > WARN_AFTER_S:
                k.warned = True
                log.warning("tier %s: process %d outlived its SIGKILL for %.0f s (uninterruptible I/O?); "
                            "the host rows of its %d jobs stay held until it exits",
                            self.tier, k.proc.pid, now - k.since, len(k.job_ids))
            alive.append(k)
        self._killed = alive
        return ended
