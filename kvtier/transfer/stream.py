"""The asynchronous transfer: copies queued on copy streams, ordered and tracked with events.

`StreamTransfer` queues each job's copies on a copy stream and returns at once: attention chunks
through `StagedCopy`, recurrent-state segments (gated delta net, Mamba2) through `StateCopier`, the
same way; `poll` reports a job once the event recorded after its copies has completed (`query()`,
which never blocks), each stream's jobs in the order they were queued. The stream and event
operations sit behind `CopyStreams`, implemented for CUDA by `kvtier.transfer.cuda.CudaStreams`,
and in the tests by an emulated device over CPU tensors that runs each stream's work later, in
stream order, as a GPU would.

Hazards, and what orders them (the compute stream is the one vLLM runs the forward pass on; a
"block" is an attention block or a state block alike):

1. A store must read its blocks after the forward pass that wrote them: `forward_done`, called by
   `wait_for_save` once the pass was launched, records an event on the compute stream, and the
   store stream waits on it before the store's copies.
2. A stored block must not be overwritten before its copy has read it (only that: once a store
   has gathered its blocks into staging on the device, its copy to the host goes on beside the
   next pass; the store's fence is that point). kvtier's scheduler half
   acknowledges a store a step or more after it was planned, and vLLM frees a request's blocks as
   soon as it finishes or is preempted (a state block holds its boundary state only until the end
   of the step), so a later forward pass may write a block whose store is still running. kvtier
   does not rely on the scheduler holding blocks: the compute stream waits (on the device, the CPU
   goes on) for the last store still running, in `before_forward` (vLLM's `handle_preemptions`,
   called before every forward pass) when the connector forwards that hook, else right after the
   store is queued (which also delays the step's sampling by the copy).
3. A loaded block must not be read before its copy ended: a load is reported finished only once
   its event completed; vLLM schedules the request only after that report, and holds the blocks
   of a request aborted while loading until then (`Scheduler.finish_requests`). A request's state
   load is queued before its chunk loads, on the same stream, and `poll` keeps stream order, so a
   failed state load is reported before the request's last chunk load.
4. A load must not write a block that an earlier step still uses, nor one a running store still
   reads. With asynchronous scheduling vLLM frees a block on the CPU while a forward pass that
   writes it may still be queued on the device (a step with no stores as much as one with), and
   gives it to the loading request; with recurrent layers it also zeroes, on the compute stream
   (`new_block_ids_to_zero`), the pages of blocks it allocated in the step, which a load of the
   same step may target. So every load waits for an event recorded on the compute stream when
   it is submitted (after every pass and zeroing queued so far: vLLM 0.32 submits asynchronous
   loads after launching the step's pass, synchronous ones before it) and for the last store
   still running. A synchronous load feeds the step's own pass: `forward_reads_loads` makes the
   compute stream wait for it.
5. A job that failed part way may have queued some copies: it is reported (failed) only after its
   event, so nothing writes into its rows or blocks once kvtier or vLLM reuse them.
6. The host rows must stay mapped and pinned while copies use them: `close` waits for every job
   still running and for the region's pinning (`RegionPin`, on a thread of its own from attach)
   to end (the only blocking call, at shutdown or when the region changes) before unpinning and
   unmapping; those jobs are reported by the next `poll`. A tensor over the rows keeps the
   mapping alive after that (`host_rows`).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch

from kvtier.format.layout import host_rows
from kvtier.host.region import HostPinner, HostRegion
from kvtier.transfer.base import CopyResult, Transfer
from kvtier.transfer.copy_plan import CopyPlan
from kvtier.transfer.pinning import RegionPin
from kvtier.transfer.staged import DEFAULT_STAGING_BYTES, StagedCopy, StridedCopy, torch_strided_copy

log = logging.getLogger("kvtier.transfer")

Copy = Callable[[torch.Tensor], "Callable[[], None] | None"]
"""A job's copies, given the host rows: queued on the current stream when called. A store may
return the copies it left for after its fence (`StagedCopy.store`): the engine blocks are read
once what it queued has run."""


class Direction(Enum):
    STORE = "store"
    LOAD = "load"


class CopyEvent(Protocol):
    """A marker in a stream's work; complete once everything queued before it has run."""

    def query(self) -> bool:
        """Whether the event completed; never blocks."""

    def synchronize(self) -> None:
        """Block until the event completed (shutdown only)."""


class CopyStreams(ABC):
    """The stream and event operations of `StreamTransfer`: one copy stream per direction, and
    the compute stream (the caller's current stream)."""

    @abstractmethod
    def mark_compute(self) -> CopyEvent:
        """An event after everything queued so far on the compute stream."""

    @abstractmethod
    def launch(
        self, direction: Direction, after: Sequence[CopyEvent], enqueue: Callable[[], None]
    ) -> tuple[CopyEvent, CopyEvent]:
        """On `direction`'s copy stream: wait for `after`, record a start event, run `enqueue` (which
        queues copies on that stream, the current one while it runs) and record an end event.
        Returns (start, end); `enqueue` must not raise. `enqueue` may run later than this call (an
        emulated stream runs it when the stream reaches it), never after the end event completed."""

    @abstractmethod
    def compute_waits(self, event: CopyEvent) -> None:
        """Make later work on the compute stream wait for `event`, without blocking the caller."""

    @abstractmethod
    def seconds(self, start: CopyEvent, end: CopyEvent) -> float:
        """Device time between two completed events."""


@dataclass
class _Running:
    job_id: int
    direction: Direction
    what: str
    chunks: int
    start: CopyEvent
    end: CopyEvent
    errors: list[Exception]
    """What the job's copies raised: read only once `end` completed, when none can still run."""

    def result(self, seconds: float) -> CopyResult:
        for exc in self.errors:
            log.error("kvtier %s of %d chunk(s) failed: %r", self.what, self.chunks, exc)
        return CopyResult(self.job_id, not self.errors, seconds)


class StreamTransfer(Transfer):
    """Asynchronous copies between one rank's KV tensors and the host rows (see the module doc)."""

    def __init__(
        self,
        plan: CopyPlan,
        layer_tensors: Sequence[torch.Tensor],
        streams: CopyStreams,
        pinner: HostPinner | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        strided_copy: StridedCopy = torch_strided_copy,
    ) -> None:
        self.plan = plan
        self.staged = StagedCopy(plan, layer_tensors, staging_bytes, strided_copy)
        self.streams = streams
        self.pinner = pinner
        self.ordered_before_forward = False  # True once vLLM calls `before_forward`
        self._region: HostRegion | None = None
        self.pin: RegionPin | None = None
        """The pinning of the attached region (hazard 6), when there is a pinner."""
        self._rows: torch.Tensor | None = None
        self._running: list[_Running] = []
        self._ended: list[CopyResult] = []
        self._forward: CopyEvent | None = None
        self._last_store: CopyEvent | None = None
        self._last_load: CopyEvent | None = None

    def attach(self, region_name: str, shm_dir: str) -> None:
        if self._region is not None and self._region.name == region_name:
            return
        self.close()
        region = HostRegion.attach(region_name, shm_dir=shm_dir)
        if self.pinner is not None:
            self.pin = RegionPin(region, self.pinner)
        row_bytes = self.plan.layout.row_bytes
        self._rows = host_rows(region.buf, row_bytes, region.size // row_bytes)
        self._region = region

    def before_forward(self) -> None:
        self.ordered_before_forward = True
        if self._last_store is not None and not self._last_store.query():
            self.streams.compute_waits(self._last_store)

    def forward_done(self) -> None:
        self._forward = self.streams.mark_compute()

    def forward_reads_loads(self) -> None:
        if self._last_load is not None and not self._last_load.query():
            self.streams.compute_waits(self._last_load)

    @property
    def device(self) -> torch.device:
        return self.staged.device

    def submit_store(self, job_id: int, block_ids: Sequence[Sequence[int]], slots: Sequence[int]) -> None:
        self._store(job_id, "store", len(slots), lambda rows: self.staged.store(rows, block_ids, slots))

    def submit_state_store(self, job_id: int, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        states = self.states
        copy = None if states is None else lambda rows: states.store(rows, block_ids, slots)
        self._store(job_id, "state store", 1, copy)

    def submit_load(self, job_id: int, block_ids: Sequence[Sequence[int]], slots: Sequence[int]) -> None:
        self._load(job_id, "load", len(slots), lambda rows: self.staged.load(rows, block_ids, slots))

    def submit_state_load(self, job_id: int, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        states = self.states
        copy = None if states is None else lambda rows: states.load(rows, block_ids, slots)
        self._load(job_id, "state load", 1, copy)

    def _store(self, job_id: int, what: str, chunks: int, copy: Copy | None) -> None:
        """Hazards 1 and 2: after the forward pass that wrote the blocks; the next pass (and a
        load into its blocks) only after the store's fence, once its blocks were read."""
        after = [self._forward] if self._forward is not None else []
        fence = self._launch(job_id, Direction.STORE, what, chunks, after, copy)
        if fence is None:
            return
        self._last_store = fence
        if not self.ordered_before_forward:
            self.streams.compute_waits(fence)

    def _load(self, job_id: int, what: str, chunks: int, copy: Copy | None) -> None:
        """Hazard 4: after everything queued on the compute stream now, and the running stores."""
        after = [self.streams.mark_compute()]
        if self._last_store is not None and not self._last_store.query():
            after.append(self._last_store)
        end = self._launch(job_id, Direction.LOAD, what, chunks, after, copy)
        if end is not None:
            self._last_load = end

    def _launch(
        self,
        job_id: int,
        direction: Direction,
        what: str,
        chunks: int,
        after: Sequence[CopyEvent],
        copy: Copy | None,
    ) -> CopyEvent | None:
        """Queue the job's copies (`copy`, given the host rows); its fence, or None when nothing
        could be queued (no region attached, no state copier, or the stream refused).

        A store is two launches on its stream: what `copy` queues (up to the fence: the engine
        blocks read), then what it left for after it (the last host copies); its fence is the
        first launch's end. A load is one launch, its fence its end."""
        rows = self._rows
        if rows is None or copy is None:
            cause = "before the host region was attached" if rows is None else "without state tensors"
            log.error("kvtier %s of %d chunk(s) %s", what, chunks, cause)
            self._ended.append(CopyResult(job_id, False, 0.0))
            return None
        errors: list[Exception] = []
        rest: list[Callable[[], None]] = []

        def enqueue() -> None:
            try:
                after_fence = copy(rows)
            except Exception as exc:
                errors.append(exc)
            else:
                if after_fence is not None:
                    rest.append(after_fence)

        def enqueue_rest() -> None:
            try:
                for queue_copies in rest:
                    queue_copies()
            except Exception as exc:
                errors.append(exc)

        try:
            start, fence = self.streams.launch(direction, after, enqueue)
        except Exception:
            log.exception("kvtier could not queue the %s of %d chunk(s)", what, chunks)
            self._ended.append(CopyResult(job_id, False, 0.0))
            return None
        end = fence
        if direction is Direction.STORE:
            try:
                end = self.streams.launch(direction, (), enqueue_rest)[1]
            except Exception as exc:  # reported failed once what was queued has run
                errors.append(exc)
        self._running.append(_Running(job_id, direction, what, chunks, start, end, errors))
        return fence

    def poll(self) -> list[CopyResult]:
        """The jobs that ended, each stream's in the order they were queued: a job still running
        holds back the later ones of its stream (a failed state load is reported before the
        request's chunk loads queued after it)."""
        done, self._ended = self._ended, []
        running: list[_Running] = []
        held: set[Direction] = set()
        for job in self._running:
            if job.direction not in held and job.end.query():
                done.append(job.result(self.streams.seconds(job.start, job.end)))
            else:
                held.add(job.direction)
                running.append(job)
        self._running = running
        return done

    @property
    def rows(self) -> torch.Tensor | None:
        """The host rows (uint8 `[num_slots, row_bytes]` over the mapping), None before attach."""
        return self._rows

    @property
    def running(self) -> int:
        """Jobs queued and not yet reported by `poll`."""
        return len(self._running)

    def close(self) -> None:
        for job in self._running:
            job.end.synchronize()
            self._ended.append(job.result(self.streams.seconds(job.start, job.end)))
        self._running = []
        self._forward = self._last_store = self._last_load = None
        self._rows = None
        if self.pin is not None:
            self.pin.wait()
            self.pin = None
        if self._region is not None:
            self._region.close()
            self._region = None
