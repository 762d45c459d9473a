"""The scheduler half streaming a load the host tier cannot hold at once (no engine): a prefix
of three chunks in a memory tier, a host tier of two rows. The load goes out in parts, one at a
time, the last one marked; a failed part sends the rest of the prefix as a failed last part."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from vllm.v1.outputs import KVConnectorOutput

from kvtier.config import KVTierConfig
from kvtier.integrations.vllm.metadata import ChunkCopy, KVTierWorkerMetadata
from kvtier.integrations.vllm.scheduler import KVTierScheduler
from tests.integrations.halves import ROW_BYTES, FakeBlocks, FakeRequest, FakeSchedulerOutput, geometry

PROMPT = list(range(100, 114))  # 14 tokens: 3 full chunks of 4


@pytest.fixture
def sched() -> Iterator[KVTierScheduler]:
    config = {"cpu_bytes_to_use": 2 * ROW_BYTES, "secondary_tiers": [{"type": "memory"}]}
    s = KVTierScheduler(KVTierConfig.from_dict(config), geometry(), 1)
    host = s.manager.host
    for key in s.hasher.keys(PROMPT):  # one at a time: the host tier has two rows
        slots = host.prepare_store([key])
        assert slots is not None
        host.complete_store([key], success=True)
        s.manager.cascade([key])
        while s.manager.in_flight:
            s.manager.poll()
            time.sleep(0.002)
    host.clear()
    yield s
    s.shutdown()


def matched(s: KVTierScheduler, req: FakeRequest) -> int:
    """Ask until the promotion ends, as vLLM does on each step."""
    deadline = time.monotonic() + 10
    while (found := s.get_num_new_matched_tokens(req, 0))[0] is None:  # type: ignore[arg-type]
        assert time.monotonic() < deadline, "promotion still in flight"
        time.sleep(0.002)
        s.manager.poll()
    assert found[1] is True
    return found[0]


def next_load(s: KVTierScheduler) -> ChunkCopy:
    """Steps until the scheduler sends a load (a streamed part waits for its promotion)."""
    deadline = time.monotonic() + 10
    while not (loads := s.build_connector_meta(FakeSchedulerOutput({})).loads):
        assert time.monotonic() < deadline, "no part sent"
        time.sleep(0.002)
    (load,) = loads
    return load


def ack(s: KVTierScheduler, load: ChunkCopy, ok: bool) -> None:
    finished = {load.req_id} if load.last else set()
    meta = KVTierWorkerMetadata(loads={load.job_id: (1, ok)} if load.slots else {})
    s.update_connector_output(KVConnectorOutput(finished_recving=finished, kv_connector_worker_meta=meta))


def test_the_prefix_comes_back_in_parts_each_after_the_last(sched: KVTierScheduler) -> None:
    keys = sched.hasher.keys(PROMPT)
    req = FakeRequest("b", PROMPT)
    assert matched(sched, req) == 12  # two chunks promoted, the third streamed
    sched.update_state_after_alloc(req, FakeBlocks([10, 11, 12, 13]), 12)  # type: ignore[arg-type]
    first = next_load(sched)
    assert (list(first.keys), first.block_ids, first.last) == (keys[:2], ((10,), (11,)), False)
    assert sched.build_connector_meta(FakeSchedulerOutput({})).loads == ()  # one part at a time
    ack(sched, first, ok=True)
    second = next_load(sched)
    assert (list(second.keys), second.block_ids, second.last) == (keys[2:], ((12,),), True)
    assert len(second.slots) == 1
    ack(sched, second, ok=True)

    assert sched.request_finished(req) == {  # type: ignore[arg-type]
        "kvtier": {"tokens": {"device": 0, "host": 0, "memory": 12, "recomputed": 2}}}
    assert [sched.manager.host.pin_count(k) for k in keys] == [0, 0, 0]
    assert not sched.streams
    sched.manager.host.check()


def test_a_failed_part_fails_the_rest_of_the_prefix(sched: KVTierScheduler) -> None:
    req = FakeRequest("b", PROMPT)
    assert matched(sched, req) == 12
    sched.update_state_after_alloc(req, FakeBlocks([10, 11, 12, 13]), 12)  # type: ignore[arg-type]
    first = next_load(sched)
    ack(sched, first, ok=False)
    rest = next_load(sched)
    assert (rest.block_ids, rest.slots, rest.last) == (((12,),), (), True)
    ack(sched, rest, ok=False)

    # vLLM recomputes the request and asks again: no new load is offered (one would wait for
    # blocks vLLM reserves for loads in flight, found as a hang of a 64-request burst)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # type: ignore[arg-type]
    assert sched.request_finished(req) == {  # type: ignore[arg-type]
        "kvtier": {"tokens": {"device": 0, "host": 0, "memory": 0, "recomputed": 14}}}
    assert sched.accounting.metrics.value("kvtier_failures_total", tier="host", op="load") == 3
    assert [sched.manager.host.pin_count(k) for k in sched.hasher.keys(PROMPT)] == [0, 0, 0]
    sched.manager.host.check()
