"""Device <-> host copy jobs in flight, as the scheduler half tracks them.

A copy job is done once every worker (TP rank) reported it (`KVTierWorkerMetadata`): its outcome
is the conjunction of theirs and its time the slowest one's. A store remembers the chunks it
publishes and the retention priority they cascade with; a load, its request, the source of each
chunk it copies, whether it is the last part of the request's load (`streams.py`), and whether it
is synchronous (it feeds its own step's forward pass).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.policies.base import DEFAULT_PRIORITY


@dataclass
class CopyAcks:
    """A device <-> host copy every worker (TP rank) reports on; done once all of them have."""

    acks: int = 0
    ok: bool = True
    seconds: float = 0.0

    def ack(self, acks: int, ok: bool, seconds: float, world_size: int) -> bool:
        """Record workers' reports; True when this completes the copy."""
        self.acks += acks
        self.ok = self.ok and ok
        self.seconds = max(self.seconds, seconds)
        return self.acks >= world_size


@dataclass
class StoreCopy(CopyAcks):
    keys: list[bytes] = field(default_factory=list)
    priority: int = DEFAULT_PRIORITY
    lead: bytes | None = None
    """The first chunk key of the request that computed them (admission's probation verdicts);
    None: no verdict asked (published settled)."""


@dataclass
class LoadCopy(CopyAcks):
    req_id: str = ""
    sources: list[str] = field(default_factory=list)
    last: bool = True
    sync: bool = False
