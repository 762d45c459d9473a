"""The secondary-tier jobs one manager has in flight: what each moves, for whom, since when.

A job is added when the manager submits it to a tier process and taken when its result comes
back; taking it counts the outcome in the manager's metrics (chunks, bytes, seconds and failures
by tier and direction) and reports each finished load's durations to a `load_timer` (the per-request
load choice measures tier speeds from them). Scheduler thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from kvtier.format.chunks import ChunkKey
from kvtier.ops.metrics import KVTierMetrics
from kvtier.tiers.base import Job, JobKind, JobResult

LoadTimer = Callable[[str, int, float, float], None]
"""(tier, bytes, seconds the tier process took, seconds from submission until the scheduler saw
the result) per finished load job."""


@dataclass(frozen=True)
class Transfer:
    """One job in flight: its tier, direction, chunks and the retention priority they carry."""

    tier: str
    kind: JobKind
    keys: tuple[ChunkKey, ...]
    priority: int
    started: float = field(default_factory=time.monotonic)


class Transfers:
    """The jobs in flight by job id, drawn from the one job-id space `job_ids`."""

    def __init__(self, metrics: KVTierMetrics, job_ids: Iterator[int]) -> None:
        self.metrics = metrics
        self.job_ids = job_ids
        self.load_timer: LoadTimer | None = None
        self._jobs: dict[int, Transfer] = {}

    def add(self, tier: str, kind: JobKind, keys: Sequence[ChunkKey], slots: Sequence[int],
            priority: int) -> Job:
        """A new job for `tier`, recorded as in flight."""
        job = Job(next(self.job_ids), kind, tuple(keys), tuple(slots))
        self._jobs[job.job_id] = Transfer(tier, kind, job.keys, priority)
        return job

    def take(self, result: JobResult) -> tuple[Transfer, list[ChunkKey], list[ChunkKey]] | None:
        """The finished job of `result` (None: not one of ours), its keys done and failed, counted."""
        transfer = self._jobs.pop(result.job_id, None)
        if transfer is None:
            return None
        ok = set(result.successful_keys).intersection(transfer.keys)
        done = [k for k in transfer.keys if k in ok]
        failed = [k for k in transfer.keys if k not in ok]
        m, tier, op = self.metrics, transfer.tier, transfer.kind.value
        m.inc("failures", len(failed), tier, op)
        if done:
            m.inc("transfer_chunks", len(done), tier, op)
            m.inc("transfer_bytes", result.bytes_moved, tier, op)
            m.inc("transfer_seconds", result.seconds, tier, op)
            m.observe("transfer_latency_seconds", result.seconds, tier, op)
            if transfer.kind is JobKind.LOAD and self.load_timer is not None:
                self.load_timer(tier, result.bytes_moved, result.seconds,
                                time.monotonic() - transfer.started)
        return transfer, done, failed

    def ids_touching(self, tier: str, keys: Collection[ChunkKey]) -> list[int]:
        """The jobs in flight on `tier` that move any of `keys`."""
        wanted = set(keys)
        return [j for j, t in self._jobs.items() if t.tier == tier and not wanted.isdisjoint(t.keys)]

    def load_source(self, key: ChunkKey) -> str | None:
        """The tier of a load in flight that moves `key` (None: none)."""
        return next((t.tier for t in self._jobs.values() if t.kind is JobKind.LOAD and key in t.keys), None)

    def by_tier(self, tiers: Iterable[str]) -> dict[str, int]:
        """Jobs in flight per tier, every one of `tiers` named."""
        counts = dict.fromkeys(tiers, 0)
        for transfer in self._jobs.values():
            counts[transfer.tier] += 1
        return counts

    def __len__(self) -> int:
        return len(self._jobs)
