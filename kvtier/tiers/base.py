"""The secondary-tier contract.

A secondary tier keeps chunk rows that live in the host region somewhere slower and larger. It runs
in its own process (`kvtier.tiers.process`), maps the host region, and moves bytes directly between
region slots and its storage. It never touches the accelerator.

Threading: every method is called from the tier process's single dispatch thread. `lookup`,
`submit_store` and `submit_load` must return quickly (they may only enqueue work); the I/O happens on
the tier's own threads. Completions are reported through `get_finished_jobs`, and a tier calls
`TierContext.wakeup()` whenever a job finishes so the runner polls without delay.

Failures are values: a job that could not store or load some keys finishes with
`JobResult(success=False, successful_keys=[...])`. No exception crosses this boundary for I/O errors.
"""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from kvtier.format.chunks import ChunkKey, TierEvent
from kvtier.ops.metrics import TierCounts
from kvtier.tiers.common.fleetkey import FleetKey
from kvtier.tiers.common.options import Option

Medium = Literal["CPU", "STORAGE"]
"""What holds a tier's chunks, in vLLM's KV-event words: memory ("CPU") or storage ("STORAGE")."""
Locality = Literal["LOCAL", "REMOTE"]
"""Whether a tier's chunks are on this host ("LOCAL") or reached over the network ("REMOTE")."""


class LookupResult(enum.IntEnum):
    """Whether a tier holds a chunk.

    HIT: present and readable now. MISS: absent. RETRY: not known yet (an asynchronous lookup is in
    flight, or the chunk is being written): ask again on a later scheduler step.
    """

    MISS = 0
    HIT = 1
    RETRY = 2


class JobKind(enum.Enum):
    STORE = "store"
    LOAD = "load"


@dataclass(frozen=True)
class Job:
    """A batch of chunks to move between host-region slots and a tier.

    STORE: `slots[i]` holds the row of `keys[i]`, pinned for reading until the job finishes.
    LOAD: `slots[i]` is allocated for `keys[i]` and pinned for writing until the job finishes.
    """

    job_id: int
    kind: JobKind
    keys: tuple[ChunkKey, ...]
    slots: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.slots):
            raise ValueError(f"job {self.job_id}: {len(self.keys)} keys but {len(self.slots)} slots")


@dataclass(frozen=True)
class JobResult:
    """How a job ended. `success` holds iff every key of the job was moved."""

    job_id: int
    success: bool
    successful_keys: tuple[ChunkKey, ...] = ()
    bytes_moved: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class TierUsage:
    """How full a tier is, as far as this instance knows: `bytes_used` bytes in `chunks` chunks, out
    of `capacity_bytes` (0: unbounded, or bounded by something this instance cannot see)."""

    bytes_used: int = 0
    chunks: int = 0
    capacity_bytes: int = 0


@dataclass
class TierContext:
    """What a tier gets from kvtier when it is built.

    `region` is the whole host region; slot `s` is `region[s*row_bytes:(s+1)*row_bytes]`. A tier
    reads a slot only while a STORE job naming it is in flight, and writes a slot only while a LOAD
    job naming it is in flight.
    """

    region: memoryview
    row_bytes: int
    num_slots: int
    layout_fingerprint: str
    tier_name: str
    generations: memoryview | None = None
    """The slots' generations (`host.generations`: uint64 per slot, bumped whenever the host tier
    hands the slot out for writing), when the region has them."""
    fleet_key: FleetKey | None = None
    """The fleet key every chunk this tier stores is MACed with and every chunk it loads must
    verify under (`chunkfmt`); None: unkeyed checksums."""
    wakeup: Callable[[], None] = field(default=lambda: None)
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("kvtier.tier"))

    def slot_view(self, slot: int) -> memoryview:
        """The writable bytes of one host-region row."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside the region's {self.num_slots} slots")
        start = slot * self.row_bytes
        return self.region[start : start + self.row_bytes]


class SecondaryTier(ABC):
    """A secondary tier. Subclasses take `ctx` plus their own keyword options.

    Construction validates the options and raises `kvtier.errors.ConfigError` (naming the option)
    for bad ones; it happens once at startup, before any job.
    """

    OPTIONS: ClassVar[tuple[Option, ...]] = ()
    """The keyword options the constructor takes, checked with `common.options.check_options` by
    the config parser and by the constructor. A tier class that defines `__init__` without its own
    `OPTIONS` (a plugin) is checked against its constructor's signature instead."""

    medium: ClassVar[Medium] = "STORAGE"
    """What holds the chunks (vLLM's KV-event `medium`); each tier class sets its own."""
    locality: ClassVar[Locality | None] = None
    """Where the chunks are from this host (vLLM's KV-event `locality`); None: not declared."""
    loads_own_stores: ClassVar[bool] = True
    """Whether a chunk this instance stored can be loaded back by this instance. False for a tier
    that only offers the chunks to others (p2p): a store then proves nothing to this instance's
    lookups."""

    def __init__(self, ctx: TierContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def lookup(self, keys: Sequence[ChunkKey]) -> list[LookupResult]:
        """One result per key, in order. Must not block on slow I/O for long: return RETRY instead."""

    @abstractmethod
    def submit_store(self, job: Job) -> None:
        """Start copying `job.slots` rows out to the tier; finish later via `get_finished_jobs`."""

    @abstractmethod
    def submit_load(self, job: Job) -> None:
        """Start copying stored chunks into `job.slots`; a key not found or not valid is a failure."""

    @abstractmethod
    def get_finished_jobs(self) -> list[JobResult]:
        """Results of the jobs finished since the last call (each job reported exactly once)."""

    def take_events(self) -> list[TierEvent]:
        """Chunks stored or removed by this tier since the last call. Optional hook."""
        return []

    def usage(self) -> TierUsage | None:
        """How full the tier is now (the fill metrics); None: not reported. Optional hook, called
        on the dispatch thread about twice a second and on request; must not block on I/O."""
        return None

    def counts(self) -> TierCounts:
        """What the tier counts itself (bad chunks by reason, failures, ...) and its gauges, keyed by
        the declared `TierCounter`, `ChunkError` and `TierGauge`; counts since the tier was built.
        The tier process ships them to kvtier's metrics; what fills the tier is `usage`. Optional
        hook, called like `usage` (and after every job), so it must be cheap."""
        return TierCounts()

    def endpoints(self) -> dict[str, str]:
        """Addresses where other processes reach this tier, by role (p2p: "control", "data"); empty
        for a tier nobody connects to. Optional hook, called once, right after construction."""
        return {}

    def shutdown(self) -> None:
        """Finish or abandon in-flight work and release resources. Called once. Optional hook."""
