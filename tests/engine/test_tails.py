"""Tails: a finished request's chunks that found no host room are stored after it finished, with
vLLM keeping its blocks until the worker reports the stores ended (scheduler and worker halves)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.config import KVTierConfig
from kvtier.engine.copies import ChunkCopy
from kvtier.engine.planner import Planner
from kvtier.engine.step import CopyReport, StepPlan
from kvtier.host.region import HostRegion
from tests.engine.fakes import ROW_BYTES, FakeRequest, copier, geometry, kv_caches

PROMPT = list(range(100, 114))  # 14 tokens: 3 full chunks of 4


@pytest.fixture
def sched() -> Iterator[Planner]:
    s = Planner(KVTierConfig.from_dict({"cpu_bytes_to_use": 4 * ROW_BYTES}), geometry(), 1)
    blocks: dict[str, list[int]] = {"other": [1, 2, 3, 4]}
    s.bind_block_ids(lambda req_id: (blocks[req_id],))
    s.test_blocks = blocks  # type: ignore[attr-defined]
    yield s
    s.shutdown()


def ack(s: Planner, jobs: tuple[ChunkCopy, ...]) -> None:
    acks = {job.job_id: (1, True) for job in jobs}
    s.copies_done(CopyReport(acks))


def fill_and_pin(s: Planner, pinned_rows: int) -> list[bytes]:
    """Store another prompt's chunks and pin `pinned_rows` of them, as cascades in flight do."""
    other = FakeRequest("other", list(range(500, 500 + 4 * pinned_rows + 1)))
    assert s.lookup(other, 0) == (0, False)  # type: ignore[arg-type]
    ack(s, s.step({"other": other.num_tokens}).stores)
    keys = s.hasher.keys(other.prompt_token_ids)
    assert s.manager.host.pin(keys) is not None
    return keys


def test_chunks_without_room_are_stored_after_the_request_finished(sched: Planner) -> None:
    pinned = fill_and_pin(sched, 4)  # every row pinned, as by cascades in flight
    req = FakeRequest("a", PROMPT)
    sched.test_blocks["a"] = [8, 9, 10, 11]  # type: ignore[attr-defined]
    assert sched.lookup(req, 0) == (0, False)  # type: ignore[arg-type]
    assert sched.step({"a": 14}).stores == ()
    req.num_computed_tokens = 14

    sched.finished(req)  # type: ignore[arg-type]
    assert sched.tails.held("a"), "unstored chunks keep the request's blocks"
    meta = sched.step({})
    assert meta.stores == () and meta.releases == ()  # still no room: the tail waits

    sched.manager.host.unpin(pinned)
    meta = sched.step({})
    (job,) = meta.stores
    assert job.req_id == "a" and job.block_ids == ((8,), (9,), (10,))
    assert list(job.keys) == sched.hasher.keys(PROMPT)
    assert meta.releases == ("a",) and not sched.tails.held("a")
    ack(sched, meta.stores)
    assert all(sched.manager.host.contains(k) for k in sched.hasher.keys(PROMPT))


def test_a_request_with_everything_stored_keeps_no_block(sched: Planner) -> None:
    req = FakeRequest("a", PROMPT)
    sched.test_blocks["a"] = [8, 9, 10, 11]  # type: ignore[attr-defined]
    assert sched.lookup(req, 0) == (0, False)  # type: ignore[arg-type]
    ack(sched, sched.step({"a": 14}).stores)
    req.num_computed_tokens = 14
    sched.finished(req)  # type: ignore[arg-type]
    assert not sched.tails.held("a")


def test_a_tail_is_released_when_its_time_is_up(sched: Planner) -> None:
    fill_and_pin(sched, 4)  # every row pinned
    sched.tails._wait_s = 0.0
    req = FakeRequest("a", PROMPT)
    sched.test_blocks["a"] = [8, 9, 10, 11]  # type: ignore[attr-defined]
    assert sched.lookup(req, 0) == (0, False)  # type: ignore[arg-type]
    assert sched.step({"a": 14}).stores == ()
    req.num_computed_tokens = 14
    sched.finished(req)  # type: ignore[arg-type]
    assert sched.tails.held("a")
    meta = sched.step({})
    assert meta.stores == () and meta.releases == ("a",)


@pytest.fixture
def region() -> Iterator[HostRegion]:
    r = HostRegion.create(8 * ROW_BYTES)
    yield r
    r.close()


def test_worker_reports_a_released_request_once_its_stores_ended(region: HostRegion) -> None:
    worker = copier(geometry(), 0, kv_caches(16))
    store = ChunkCopy(1, "a", (b"k" * 32,), ((2,),), (0,))
    worker.save(StepPlan(region.name, "/dev/shm", stores=(store,), releases=("a", "b")))
    assert worker.take_finished_sends() == {"a", "b"}
    worker.save(StepPlan(region.name, "/dev/shm"))
    assert worker.take_finished_sends() == set()
    worker.shutdown()
