"""The planner with two KV cache groups (a sliding-window group and a full-attention group,
as vLLM's hybrid manager hands them): a chunk is stored only while both groups hold its blocks, and
a load skips the blocks the sliding group does not hold (outside the window)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from kvtier.config import KVTierConfig
from kvtier.engine.geometry import NULL_BLOCK
from kvtier.engine.planner import Planner
from kvtier.engine.step import CopyReport
from kvtier.format.layout import SKIP_BLOCK
from tests.engine.fakes import ROW_BYTES, FakeRequest, geometry

PROMPT = list(range(100, 114))  # 14 tokens: 3 full chunks of 4
N = NULL_BLOCK


@pytest.fixture
def sched() -> Iterator[Planner]:
    two_groups = dataclasses.replace(geometry(), layer_groups=(0, 1))
    s = Planner(KVTierConfig.from_dict({"cpu_bytes_to_use": 8 * ROW_BYTES}), two_groups, 1)
    blocks: dict[str, tuple[list[int], ...]] = {}
    s.bind_block_ids(blocks.__getitem__)
    s.test_blocks = blocks  # type: ignore[attr-defined]
    yield s
    s.shutdown()


def test_a_chunk_whose_sliding_block_was_freed_is_not_stored(sched: Planner) -> None:
    req = FakeRequest("a", PROMPT)
    # chunk 0 left the window (its sliding block is vLLM's null block); chunks 1 and 2 are held
    sched.test_blocks["a"] = ([N, 11, 12, 13], [1, 2, 3, 4])  # type: ignore[attr-defined]
    assert sched.lookup(req, 0) == (0, False)  # type: ignore[arg-type]
    (job,) = sched.step({"a": 14}).stores
    keys = sched.hasher.keys(PROMPT)
    assert list(job.keys) == keys[1:]
    assert job.block_ids == ((11, 2), (12, 3))  # group by group: sliding, then full
    sched.copies_done(
        CopyReport({job.job_id: (1, True)})
    )
    assert not sched.manager.host.contains(keys[0])
    assert all(sched.manager.host.contains(k) for k in keys[1:])
    req.num_computed_tokens = 14
    assert not sched.step({"a": 1}).stores  # never retried


def test_a_load_skips_the_blocks_outside_the_window(sched: Planner) -> None:
    first = FakeRequest("a", PROMPT)
    sched.test_blocks["a"] = ([11, 12, 13, 14], [1, 2, 3, 4])  # type: ignore[attr-defined]
    sched.lookup(first, 0)  # type: ignore[arg-type]
    (job,) = sched.step({"a": 14}).stores
    acks = CopyReport({job.job_id: (1, True)})
    sched.copies_done(acks)
    sched.finished(first)  # type: ignore[arg-type]

    again = FakeRequest("b", PROMPT)
    assert sched.lookup(again, 0) == (12, True)  # type: ignore[arg-type]
    # vLLM allocates sliding blocks for the window before the hit point only
    sched.allocated(again, ([N, 21, 22, 23], [5, 6, 7, 8]), 12)  # type: ignore[arg-type]
    (load,) = sched.step({}).loads
    assert load.block_ids == ((SKIP_BLOCK, 5), (21, 6), (22, 7))
    assert load.all_block_ids == [5, 21, 6, 22, 7]
