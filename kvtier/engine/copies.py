"""Device <-> host copies: the records the scheduler half sends its workers, and the jobs in flight.

`ChunkCopy` and `StateCopy` are what a worker is asked to copy in one step (plain ints, strings
and bytes, so an engine may ship them to worker processes). A copy job is done once every worker
(TP rank) reported it (the engine's worker report): its outcome
is the conjunction of theirs and its time the slowest one's. A store remembers the chunks it
publishes and the retention priority they cascade with; a load, its request, the source of each
chunk it copies, whether it is the last part of the request's load (`streamed_loads.py`), and whether it
is synchronous (it feeds its own step's forward pass).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.format.layout import SKIP_BLOCK
from kvtier.policies.base import DEFAULT_PRIORITY


@dataclass(frozen=True)
class ChunkCopy:
    """One batch of chunk copies for one request, between engine blocks and host slots.

    `block_ids[i]` are the `blocks_per_chunk` engine blocks of chunk i in token order, for each KV
    cache group in turn (a load's `SKIP_BLOCK` where a group holds none); `slots[i]` is its host
    row; `keys[i]` its chunk key (for logs, events and checks: copies need none). A load whose
    `slots` is empty could not pin its host rows: the worker fails it. A request's load may come
    in parts, one at a time (`streamed_loads.py`): the worker reports the request's load finished when
    its `last` part ends. A `sync` load feeds the forward pass of its own step (its request is in
    it): it is copied before that pass and never reported finished; a failed one's blocks are
    reported as load errors (one KV cache group only).
    """

    job_id: int
    req_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[tuple[int, ...], ...]
    slots: tuple[int, ...]
    last: bool = True
    sync: bool = False

    @property
    def all_block_ids(self) -> list[int]:
        return [b for chunk in self.block_ids for b in chunk if b != SKIP_BLOCK]


StoreRow = tuple[bytes, tuple[int, ...], int]
"""A chunk to store: its key, its engine block ids (as `ChunkCopy.block_ids[i]`), its host slot."""


@dataclass(frozen=True)
class StateCopy:
    """One state segment copy (`kvtier.format.state_rows`) for one request: `block_ids[l]` is the block of
    recurrent layer l holding the state, `slots` the segment's host rows, `keys` their keys. A load
    whose `slots` is empty could not pin its rows: the worker fails the request's load."""

    job_id: int
    req_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]


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
    skipped: int = 0
    """Tokens of the first chunk the device already held: its load wrote only the rest."""
    unfilled: int = 0
    """Tokens the last chunk lacks (an unfull chunk, `kvtier.engine.unfull`): not loaded."""
