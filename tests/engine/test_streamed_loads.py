"""The planner streaming a load the host tier cannot hold at once (no engine): a prefix
of three chunks in a memory tier, a host tier of two rows. The load goes out in parts, one at a
time, the last one marked; a failed part sends the rest of the prefix as a failed last part."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvtier.config import KVTierConfig
from kvtier.engine.copies import ChunkCopy
from kvtier.engine.planner import Planner
from kvtier.engine.step import CopyReport
from tests.engine.fakes import ROW_BYTES, FakeRequest, geometry

PROMPT = list(range(100, 114))  # 14 tokens: 3 full chunks of 4


@pytest.fixture
def sched() -> Iterator[Planner]:
    config = {"cpu_bytes_to_use": 2 * ROW_BYTES, "secondary_tiers": [{"type": "memory"}]}
    s = Planner(KVTierConfig.from_dict(config), geometry(), 1)
    host = s.manager.host
    for key in s.hasher.keys(PROMPT):  # one at a time: the host tier has two rows
        slots = host.reserve([key])
        assert slots is not None
        host.commit([key], success=True)
        s.manager.cascade([key])
        while s.manager.in_flight:
            s.manager.poll()
            time.sleep(0.002)
    host.clear()
    yield s
    s.shutdown()


def matched(s: Planner, req: FakeRequest) -> int:
    """Ask until the promotion ends, as vLLM does on each step."""
    deadline = time.monotonic() + 10
    while (found := s.lookup(req, 0))[0] is None:  # type: ignore[arg-type]
        assert time.monotonic() < deadline, "promotion still in flight"
        time.sleep(0.002)
        s.manager.poll()
    assert found[1] is True
    return found[0]


def next_load(s: Planner) -> ChunkCopy:
    """Steps until the scheduler sends a load (a streamed part waits for its promotion)."""
    deadline = time.monotonic() + 10
    while not (loads := s.step({}).loads):
        assert time.monotonic() < deadline, "no part sent"
        time.sleep(0.002)
    (load,) = loads
    return load


def ack(s: Planner, load: ChunkCopy, ok: bool) -> None:
    finished = {load.req_id} if load.last else set()
    meta = CopyReport(loads={load.job_id: (1, ok)} if load.slots else {})
    s.copies_done(meta, finished)


def test_the_prefix_comes_back_in_parts_each_after_the_last(sched: Planner) -> None:
    keys = sched.hasher.keys(PROMPT)
    req = FakeRequest("b", PROMPT)
    assert matched(sched, req) == 12  # two chunks promoted, the third streamed
    sched.allocated(req, ([10, 11, 12, 13],), 12)  # type: ignore[arg-type]
    first = next_load(sched)
    assert (list(first.keys), first.block_ids, first.last) == (keys[:2], ((10,), (11,)), False)
    assert sched.step({}).loads == ()  # one part at a time
    ack(sched, first, ok=True)
    second = next_load(sched)
    assert (list(second.keys), second.block_ids, second.last) == (keys[2:], ((12,),), True)
    assert len(second.slots) == 1
    ack(sched, second, ok=True)

    assert sched.finished(req) == {  # type: ignore[arg-type]
        "kvtier": {"tokens": {"device": 0, "host": 0, "memory": 12, "recomputed": 2}}}
    assert [sched.manager.host.pin_count(k) for k in keys] == [0, 0, 0]
    assert not sched.streams
    sched.manager.host.check()


def test_a_failed_part_fails_the_rest_of_the_prefix(sched: Planner) -> None:
    req = FakeRequest("b", PROMPT)
    assert matched(sched, req) == 12
    sched.allocated(req, ([10, 11, 12, 13],), 12)  # type: ignore[arg-type]
    first = next_load(sched)
    ack(sched, first, ok=False)
    rest = next_load(sched)
    assert (rest.block_ids, rest.slots, rest.last) == (((12,),), (), True)
    ack(sched, rest, ok=False)

    # vLLM recomputes the request and asks again: no new load is offered (one would wait for
    # blocks vLLM reserves for loads in flight, found as a hang of a 64-request burst)
    assert sched.lookup(req, 0) == (0, False)  # type: ignore[arg-type]
    assert sched.finished(req) == {  # type: ignore[arg-type]
        "kvtier": {"tokens": {"device": 0, "host": 0, "memory": 0, "recomputed": 14}}}
    assert sched.accounting.metrics.value("kvtier_failures_total", tier="host", op="load") == 3
    assert [sched.manager.host.pin_count(k) for k in sched.hasher.keys(PROMPT)] == [0, 0, 0]
    sched.manager.host.check()


@pytest.fixture
def sched3() -> Iterator[Planner]:
    """The same prefix in the memory tier, and a host tier of three rows."""
    config = {"cpu_bytes_to_use": 3 * ROW_BYTES, "secondary_tiers": [{"type": "memory"}]}
    s = Planner(KVTierConfig.from_dict(config), geometry(), 1)
    host = s.manager.host
    keys = s.hasher.keys(PROMPT)
    assert host.reserve(keys) is not None
    host.commit(keys, success=True)
    s.manager.cascade(keys)
    while s.manager.in_flight:
        s.manager.poll()
        time.sleep(0.002)
    host.clear()
    yield s
    s.shutdown()


def matched_from(s: Planner, req: FakeRequest, device_tokens: int) -> int:
    """Ask with a device hit of `device_tokens` until the promotion ends."""
    deadline = time.monotonic() + 10
    while (found := s.lookup(req, device_tokens))[0] is None:  # type: ignore[arg-type]
        assert time.monotonic() < deadline, "promotion still in flight"
        time.sleep(0.002)
        s.manager.poll()
    return found[0]


def test_a_device_hit_that_shrinks_while_waiting_is_promoted_again(sched3: Planner) -> None:
    keys = sched3.hasher.keys(PROMPT)
    req = FakeRequest("b", PROMPT)
    assert matched_from(sched3, req, 4) == 8  # chunk 0 on the device: chunks 1 and 2 promoted
    # vLLM evicted chunk 0's device block while the request waited: its device hit is now 0.
    # Chunk 0 is promoted too; without it the promoted chunks were useless and all recomputed.
    assert matched_from(sched3, req, 0) == 12
    sched3.allocated(req, ([10, 11, 12, 13],), 12)  # type: ignore[arg-type]
    load = next_load(sched3)
    assert (list(load.keys), len(load.slots), load.last) == (keys, 3, True)
    ack(sched3, load, ok=True)
    assert sched3.finished(req) == {  # type: ignore[arg-type]
        "kvtier": {"tokens": {"device": 0, "host": 0, "memory": 12, "recomputed": 2}}}
    assert [sched3.manager.host.pin_count(k) for k in keys] == [0, 0, 0]
    sched3.manager.host.check()


def test_promoted_chunks_a_stream_takes_over_stay_held_until_it_sends_them(
    sched3: Planner,
) -> None:
    keys = sched3.hasher.keys(PROMPT)
    host = sched3.manager.host
    other = [b"other-chunk-f", b"other-chunk-g"]
    assert host.reserve(other[:1]) is not None  # a store in flight pins the third row
    req = FakeRequest("b", PROMPT)
    assert matched_from(sched3, req, 4) == 8  # chunks 1 and 2 promoted into the two free rows
    # The device hit shrinks: chunk 0 finds no room now, so all three are streamed.
    assert matched_from(sched3, req, 0) == 12
    sched3.allocated(req, ([10, 11, 12, 13],), 12)  # type: ignore[arg-type]
    host.commit(other[:1], success=True)
    # The stream promotes chunk 0 into that row; while it is in flight, another store wants a
    # row. Chunks 1 and 2 are still held for the stream: it must not get theirs.
    assert sched3.step({}).loads == ()
    slots = host.reserve(other[1:])
    if slots is not None:
        host.commit(other[1:], success=True)
    loads = [next_load(sched3)]
    while not loads[-1].last:
        ack(sched3, loads[-1], ok=True)
        loads.append(next_load(sched3))
    ack(sched3, loads[-1], ok=True)
    assert [k for load in loads for k in load.keys] == keys
    assert all(load.slots for load in loads)
    assert sched3.finished(req) == {  # type: ignore[arg-type]
        "kvtier": {"tokens": {"device": 0, "host": 0, "memory": 12, "recomputed": 2}}}
    assert [host.pin_count(k) for k in keys] == [0, 0, 0]
    host.check()


@pytest.mark.parametrize(("in_host", "tokens"), [
    # Chunks 1 and 2 are in the host tier, 0 is not: while chunk 0 comes back from the memory
    # tier they are held for the request (a store took chunk 1's before: it then loaded 1 chunk).
    # They count as host hits.
    (slice(1, 3), {"device": 0, "host": 8, "memory": 4, "recomputed": 2}),
    # Chunk 0 is in the host tier, 1 and 2 are not: the host hit the promotion extends is held
    # (a store took chunk 0's before, and the request, finding no host hit, recomputed the whole
    # prefix behind it: cpu preset, 16 conversations).
    (slice(0, 1), {"device": 0, "host": 4, "memory": 8, "recomputed": 2}),
], ids=["run-chunks-in-host", "host-hits-before-the-run"])
def test_host_chunks_stay_held_while_a_promotion_runs(
    sched3: Planner, in_host: slice, tokens: dict[str, int],
) -> None:
    keys = sched3.hasher.keys(PROMPT)
    host = sched3.manager.host
    assert host.reserve(keys[in_host]) is not None
    host.commit(keys[in_host], success=True)
    req = FakeRequest("b", PROMPT)
    assert sched3.lookup(req, 0) == (None, False)  # type: ignore[arg-type]
    assert host.reserve([b"other-chunk"]) is None  # every row is held for the request
    assert matched_from(sched3, req, 0) == 12
    sched3.allocated(req, ([10, 11, 12, 13],), 12)  # type: ignore[arg-type]
    load = next_load(sched3)
    assert (list(load.keys), len(load.slots), load.last) == (keys, 3, True)
    ack(sched3, load, ok=True)
    assert sched3.finished(req) == {"kvtier": {"tokens": tokens}}  # type: ignore[arg-type]
    assert [host.pin_count(k) for k in keys] == [0, 0, 0]
    host.check()
