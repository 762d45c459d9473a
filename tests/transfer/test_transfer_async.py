"""The asynchronous transfer's ordering and completion logic, without a GPU: `StreamTransfer` and
the worker half over CPU tensors, with copy streams whose events complete when the test says so.

What must hold: a job is reported only once its end event completed; stores wait for the forward
pass, the compute stream waits for running stores, loads wait for the last forward pass and running
stores; a copy that raises fails its job as a value (a load's blocks in the load errors), still
after its event; the caller never blocks (no `synchronize` outside `close`); the host region is
pinned once at attach and unpinned at close, and never on the CPU path.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import pytest
import torch

from kvtier.engine.copier import CopyDriver
from kvtier.engine.copies import ChunkCopy
from kvtier.engine.step import StepPlan
from kvtier.format.layout import TPShard, host_rows
from kvtier.host.region import HostRegion
from kvtier.integrations.vllm.model.backend_layouts import engine_layout, engine_layout_name
from kvtier.transfer import CpuTransfer, Transfer, make_transfer
from kvtier.transfer.copy_plan import CopyPlan
from kvtier.transfer.stream import CopyEvent, CopyStreams, Direction, StreamTransfer
from tests.engine.fakes import BLOCK, HEAD_DIM, HEADS, ROW_BYTES, copier, geometry, kv_caches

KEYS = (b"a" * 32, b"b" * 32)
MARK = b"kvtier-pin-check"


class FakeEvent:
    """An event that completes when the test (or `synchronize`, counted) says so."""

    def __init__(self, name: str, before: FakeEvent | None = None) -> None:
        self.name = name
        self.before = before  # completes with this one (queued just before it on the same stream)
        self.done = False
        self.syncs = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.syncs += 1
        event: FakeEvent | None = self
        while event is not None:  # and everything queued before it on its stream
            event.done = True
            event = event.before

    def __repr__(self) -> str:
        return f"FakeEvent({self.name}, done={self.done})"


@dataclass
class Launch:
    direction: Direction
    after: list[CopyEvent]
    start: FakeEvent
    end: FakeEvent


class ScriptedStreams(CopyStreams):
    """Copy streams over CPU tensors: `launch` runs the copies at once, but its events complete
    only when `complete` is called; everything the transfer asks of the streams is recorded."""

    def __init__(self) -> None:
        self.events: list[FakeEvent] = []
        self.launches: list[Launch] = []
        self.compute_marks: list[FakeEvent] = []
        self.compute_waited: list[CopyEvent] = []
        self.refuse_launch = False

    def _event(self, name: str, before: FakeEvent | None = None) -> FakeEvent:
        event = FakeEvent(f"{name}{len(self.events)}", before)
        self.events.append(event)
        return event

    def mark_compute(self) -> CopyEvent:
        event = self._event("compute")
        self.compute_marks.append(event)
        return event

    def launch(
        self, direction: Direction, after: Sequence[CopyEvent], enqueue: Callable[[], None]
    ) -> tuple[CopyEvent, CopyEvent]:
        if self.refuse_launch:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        last = next((la.end for la in reversed(self.launches) if la.direction is direction), None)
        start = self._event(f"{direction.value}-start", before=last)
        end = self._event(f"{direction.value}-end", before=start)
        enqueue()
        self.launches.append(Launch(direction, list(after), start, end))
        return start, end

    def compute_waits(self, event: CopyEvent) -> None:
        self.compute_waited.append(event)

    def seconds(self, start: CopyEvent, end: CopyEvent) -> float:
        assert start.query() and end.query(), "elapsed time asked of an event not completed"
        return 0.25

    def complete(self, *launches: Launch) -> None:
        for launch in launches:
            launch.start.done = launch.end.done = True

    def complete_all(self) -> None:
        for event in self.events:
            event.done = True

    @property
    def syncs(self) -> int:
        return sum(e.syncs for e in self.events)


class FakePinner:
    """Records registrations, with the first bytes read at the registered address."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.registered: list[tuple[int, int, bytes]] = []
        self.unregistered: list[int] = []

    def register(self, address: int, size: int) -> None:
        if self.fail:
            raise RuntimeError("cudaHostRegister: cudaError 2")
        self.registered.append((address, size, ctypes.string_at(address, len(MARK))))

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


@pytest.fixture
def region() -> Iterator[HostRegion]:
    r = HostRegion.create(8 * ROW_BYTES)
    r.buf[: len(MARK)] = MARK
    yield r
    r.close()


def async_worker(
    streams: ScriptedStreams, pinner: FakePinner | None = None, caches: dict[str, torch.Tensor] | None = None
) -> CopyDriver:
    def factory(plan: CopyPlan, tensors: Sequence[torch.Tensor]) -> Transfer:
        return StreamTransfer(plan, tensors, streams, pinner)

    return copier(geometry(), 0, kv_caches(16) if caches is None else caches, factory)


def meta(
    region: HostRegion, loads: tuple[ChunkCopy, ...] = (), stores: tuple[ChunkCopy, ...] = ()
) -> StepPlan:
    return StepPlan(region.name, "/dev/shm", loads, stores)


def expected_rows(caches: dict[str, torch.Tensor], blocks: list[list[int]], slots: list[int]) -> torch.Tensor:
    plan = CopyPlan(geometry().layout, engine_layout("vllm_cpu"), TPShard(HEADS), BLOCK)
    buf = bytearray(8 * ROW_BYTES)
    rows = host_rows(memoryview(buf), ROW_BYTES, 8)
    plan.engine_to_host(list(caches.values()), blocks, rows, slots)
    return rows


def region_rows(region: HostRegion) -> torch.Tensor:
    return host_rows(region.buf, ROW_BYTES, 8)


def test_a_store_is_reported_only_once_its_copy_ended(region: HostRegion) -> None:
    streams = ScriptedStreams()
    caches = kv_caches(16)
    worker = async_worker(streams, caches=caches)
    worker.save(meta(region, stores=(ChunkCopy(1, "r1", KEYS, ((2,), (5,)), (0, 3)),)))
    fence, rest = streams.launches  # up to the blocks read, then the last host copies
    assert fence.direction is rest.direction is Direction.STORE
    assert fence.after == streams.compute_marks and len(streams.compute_marks) == 1
    assert rest.after == []
    for _ in range(2):
        assert worker.take_finished_loads() == set()
        assert worker.take_report() is None
        streams.complete(fence)
    assert worker.copies_running == 1
    streams.complete(rest)
    meta_out = worker.take_report()
    assert meta_out is not None and meta_out.stores == {1: (1, True)} and meta_out.seconds == {1: 0.25}
    assert worker.take_report() is None and worker.copies_running == 0
    assert torch.equal(region_rows(region)[[0, 3]], expected_rows(caches, [[2], [5]], [0, 3])[[0, 3]])
    assert streams.syncs == 0
    worker.shutdown()


def test_a_load_is_finished_only_once_its_copy_ended(region: HostRegion) -> None:
    streams = ScriptedStreams()
    caches = kv_caches(16)
    worker = async_worker(streams, caches=caches)
    worker.save(meta(region, stores=(ChunkCopy(1, "r1", KEYS, ((2,), (5,)), (0, 3)),)))
    streams.complete_all()
    assert worker.take_report() is not None
    worker.start_load(meta(region, loads=(ChunkCopy(2, "r2", KEYS, ((9,), (10,)), (0, 3)),)))
    load = streams.launches[-1]
    assert load.direction is Direction.LOAD
    assert worker.take_finished_loads() == set() and worker.take_report() is None
    streams.complete(load)
    assert worker.take_finished_loads() == {"r2"}
    assert worker.take_load_errors() == set()
    out = worker.take_report()
    assert out is not None and out.loads == {2: (1, True)} and out.stores == {}
    for kv in caches.values():
        assert torch.equal(kv[9].view(torch.int16), kv[2].view(torch.int16))
        assert torch.equal(kv[10].view(torch.int16), kv[5].view(torch.int16))
    assert streams.syncs == 0
    worker.shutdown()


def test_a_copy_that_raises_fails_its_job_after_its_event(region: HostRegion) -> None:
    streams = ScriptedStreams()
    worker = async_worker(streams)
    bad_load = ChunkCopy(1, "r1", KEYS, ((4,), (99,)), (0, 1))  # block 99 does not exist
    bad_store = ChunkCopy(2, "r2", KEYS, ((3,), (4,)), (1, 1))  # one slot twice
    worker.start_load(meta(region, loads=(bad_load,)))
    worker.save(meta(region, stores=(bad_store,)))
    assert len(streams.launches) == 3  # a load, a store's two launches
    assert worker.take_finished_loads() == set() and worker.take_load_errors() == set()
    streams.complete_all()
    assert worker.take_finished_loads() == {"r1"}
    assert worker.take_load_errors() == {4, 99}
    out = worker.take_report()
    assert out is not None and out.loads == {1: (1, False)} and out.stores == {2: (1, False)}
    assert not region_rows(region)[1].any()

    streams.refuse_launch = True  # nothing could be queued: reported at the next poll
    worker.start_load(meta(region, loads=(ChunkCopy(3, "r3", KEYS, ((5,), (6,)), (2, 3)),)))
    assert worker.take_finished_loads() == {"r3"} and worker.take_load_errors() == {5, 6}
    worker.shutdown()


def test_a_failed_load_reports_its_blocks_no_later_than_its_request(region: HostRegion) -> None:
    """vLLM asks, each step, for finished requests, then load errors, then worker metadata, and
    handles one step's errors before its finished requests; a load ending between any two of those
    calls must not have its request reported in an earlier step than its blocks."""
    for ends_before in ("finished", "errors", "meta"):
        streams = ScriptedStreams()
        worker = async_worker(streams)
        worker.start_load(meta(region, loads=(ChunkCopy(1, "r1", KEYS, ((4,), (99,)), (0, 1)),)))
        takes: dict[str, Callable[[], object]] = {
            "finished": worker.take_finished_loads,
            "errors": worker.take_load_errors,
            "meta": worker.take_report,
        }
        step_of: dict[str, int] = {}
        for step in range(3):
            for call, take in takes.items():
                if step == 1 and call == ends_before:
                    streams.complete_all()
                result = take()
                if result:
                    assert call not in step_of, f"{call} reported twice"
                    step_of[call] = step
                    assert result == {"finished": {"r1"}, "errors": {4, 99}}.get(call, result)
        assert set(step_of) == {"finished", "errors", "meta"}, ends_before
        assert step_of["errors"] <= step_of["finished"], (ends_before, step_of)
        worker.shutdown()


def test_stores_wait_for_the_forward_pass_and_the_next_pass_waits_for_them(region: HostRegion) -> None:
    streams = ScriptedStreams()
    worker = async_worker(streams)
    # The connector does not forward vLLM's pre-forward hook: the compute stream waits at once.
    worker.save(meta(region, stores=(ChunkCopy(1, "r", KEYS, ((1,), (2,)), (0, 1)),)))
    store = streams.launches[-2]  # the pass waits for the store's fence, not its host copies
    assert store.after == [streams.compute_marks[-1]]
    assert streams.compute_waited == [store.end] and store.end is not streams.launches[-1].end

    streams.complete_all()
    streams.compute_waited.clear()
    worker.before_forward()  # from now on the wait moves before the next forward pass
    assert streams.compute_waited == []  # the last store already ended
    worker.save(meta(region, stores=(ChunkCopy(2, "r", KEYS, ((3,), (4,)), (2, 3)),)))
    store = streams.launches[-2]
    assert streams.compute_waited == []
    worker.before_forward()
    assert streams.compute_waited == [store.end]
    streams.complete(store)
    worker.before_forward()
    assert streams.compute_waited == [store.end]
    worker.shutdown()


def test_loads_wait_for_everything_on_the_compute_stream_and_running_stores(region: HostRegion) -> None:
    """Each load waits for a compute event recorded when it was submitted (every pass queued so
    far, in steps with stores or without) and for the last store still running; a synchronous
    load makes the compute stream wait for it."""
    streams = ScriptedStreams()
    worker = async_worker(streams)
    worker.before_forward()
    worker.start_load(meta(region, loads=(ChunkCopy(1, "a", KEYS, ((1,), (2,)), (0, 1)),)))
    assert streams.launches[-1].after == [streams.compute_marks[-1]]
    worker.save(meta(region, stores=(ChunkCopy(2, "b", KEYS, ((3,), (4,)), (2, 3)),)))
    store = streams.launches[-2]  # its fence: the blocks read
    worker.before_forward()
    worker.start_load(meta(region, loads=(ChunkCopy(3, "c", KEYS, ((5,), (6,)), (4, 5)),)))
    assert streams.launches[-1].after == [streams.compute_marks[-1], store.end]
    streams.complete_all()
    waited = list(streams.compute_waited)
    sync = ChunkCopy(4, "d", KEYS, ((7,), (8,)), (6, 7), sync=True)
    worker.start_load(meta(region, loads=(sync,)))
    assert streams.launches[-1].after == [streams.compute_marks[-1]]
    assert streams.compute_waited == [*waited, streams.launches[-1].end]
    worker.shutdown()


def test_close_waits_for_running_copies_then_unpins(region: HostRegion) -> None:
    streams, pinner = ScriptedStreams(), FakePinner()
    transfer = StreamTransfer(
        CopyPlan(geometry().layout, engine_layout("vllm_cpu"), TPShard(HEADS), BLOCK),
        list(kv_caches(16).values()),
        streams,
        pinner,
    )
    transfer.attach(region.name, "/dev/shm")
    transfer.attach(region.name, "/dev/shm")
    assert transfer.pin is not None and transfer.pin.wait(30)
    [(address, size, first_bytes)] = pinner.registered
    assert size == region.size and first_bytes == MARK
    transfer.forward_done()
    transfer.submit_store(1, [[1]], [0])
    transfer.submit_load(2, [[2]], [1])
    assert transfer.poll() == [] and transfer.running == 2 and streams.syncs == 0
    transfer.close()
    assert [launch.end.syncs for launch in streams.launches] == [0, 1, 1]  # a store's two, a load
    assert pinner.unregistered == [address]
    assert sorted((r.job_id, r.ok) for r in transfer.poll()) == [(1, True), (2, True)]
    transfer.close()
    assert pinner.unregistered == [address]
    transfer.submit_store(3, [[1]], [0])  # detached: fails as a value
    assert [(r.job_id, r.ok) for r in transfer.poll()] == [(3, False)]


def test_a_region_that_cannot_be_pinned_still_copies(
    region: HostRegion, caplog: pytest.LogCaptureFixture
) -> None:
    streams = ScriptedStreams()
    worker = async_worker(streams, FakePinner(fail=True))
    with caplog.at_level(logging.WARNING, logger="kvtier.transfer"):
        worker.save(meta(region, stores=(ChunkCopy(1, "r", KEYS, ((1,), (2,)), (0, 1)),)))
        transfer = worker.transfer
        assert isinstance(transfer, StreamTransfer) and transfer.pin is not None and transfer.pin.wait(30)
    assert "could not pin host region" in caplog.text and "cudaError 2" in caplog.text
    streams.complete_all()
    out = worker.take_report()
    assert out is not None and out.stores == {1: (1, True)}
    worker.shutdown()


def test_pin_is_once_and_close_unpins_before_unmapping() -> None:
    pinner = FakePinner()
    with HostRegion.create(2 * ROW_BYTES) as r:
        r.buf[: len(MARK)] = MARK
        r.pin(pinner)
        r.pin(pinner)
        assert r.pinned and len(pinner.registered) == 1
        assert pinner.registered[0][1:] == (2 * ROW_BYTES, MARK)
    assert pinner.unregistered == [pinner.registered[0][0]] and not r.pinned
    with pytest.raises(ValueError, match="closed"):
        _ = r.address


def test_the_cpu_path_stays_synchronous_and_unpinned(region: HostRegion) -> None:
    plan = CopyPlan(geometry().layout, engine_layout("vllm_cpu"), TPShard(HEADS), BLOCK)
    caches = kv_caches(16)
    transfer = make_transfer(plan, list(caches.values()))
    assert isinstance(transfer, CpuTransfer)
    transfer.attach(region.name, "/dev/shm")
    transfer.before_forward()
    transfer.forward_done()
    transfer.submit_store(1, [[2]], [4])
    [result] = transfer.poll()
    assert (result.job_id, result.ok) == (1, True) and transfer.poll() == []
    assert torch.equal(region_rows(region)[4], expected_rows(caches, [[2]], [4])[4])
    transfer.close()


def test_engine_layouts_by_device_and_shape() -> None:
    assert engine_layout_name("cpu", (8, HEADS, BLOCK, 2 * HEAD_DIM)) == "vllm_cpu"
    assert engine_layout_name("cuda", (8, HEADS, BLOCK, 2 * HEAD_DIM)) == "vllm_flash_attn"
    assert engine_layout_name("cuda", (2, 8, BLOCK, HEADS, HEAD_DIM)) == "stacked_kv"
    unknown = (("cuda", (8, 2, BLOCK, HEADS, HEAD_DIM)), ("cuda", (8, 64)), ("xpu", (8, 2, 4, 16)))
    for device, shape in unknown:
        with pytest.raises(NotImplementedError, match="no engine layout"):
            engine_layout_name(device, shape)
    plan = CopyPlan(geometry().layout, engine_layout("vllm_flash_attn"), TPShard(HEADS), BLOCK)
    on_meta = torch.empty((4, HEADS, BLOCK, 2 * HEAD_DIM), dtype=torch.bfloat16, device="meta")
    with pytest.raises(NotImplementedError, match="CPU or CUDA"):
        make_transfer(plan, [on_meta, on_meta])
