"""The planner of a recurrent hybrid (a `Planner` with its `StatePlanner`) without an engine:
vLLM group 0 holds a gated-delta-net layer's state, group 1 the attention layers (4-token blocks
and chunks). The boundary states vLLM offers are stored as state segments; a later request's hit
ends at the last chunk whose end has a state held, loads that state into the block vLLM allocated for it, and
releases its rows when the load is reported; a prefix without any state comes back not at all."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from kvtier.config import KVTierConfig
from kvtier.engine.geometry import NULL_BLOCK as N
from kvtier.engine.geometry import StateGroups
from kvtier.engine.planner import Planner
from kvtier.engine.step import CopyReport
from kvtier.format.state_rows import StateLayout, StatePart, state_keys
from tests.engine.fakes import ROW_BYTES, FakeRequest, geometry

PROMPT = list(range(100, 114))  # 14 tokens: 3 full chunks of 4
PARTS = (StatePart((6, 3), torch.bfloat16, True), StatePart((2, 4, 4), torch.float32))
STATES = StateGroups(StateLayout("gdn", (0,), PARTS, ROW_BYTES), ("model.layers.0.linear_attn",), (0,), 4)


@pytest.fixture
def sched() -> Iterator[Planner]:
    hybrid = dataclasses.replace(geometry(), group_ids=(1,), states=STATES)
    s = Planner(KVTierConfig.from_dict({"cpu_bytes_to_use": 16 * ROW_BYTES}), hybrid, 1)
    blocks: dict[str, tuple[list[int], ...]] = {}
    s.bind_block_ids(blocks.__getitem__)
    s.test_blocks = blocks  # type: ignore[attr-defined]
    yield s
    s.shutdown()


def ack(
    sched: Planner, stores: tuple[int, ...] = (), loads: tuple[int, ...] = (),
    finished: set[str] | None = None,
) -> None:
    meta = CopyReport({j: (1, True) for j in stores}, {j: (1, True) for j in loads})
    sched.copies_done(meta, finished or set())


def test_a_hit_ends_where_a_state_is_held_and_loads_it_there(sched: Planner) -> None:
    first = FakeRequest("a", PROMPT)
    sched.test_blocks["a"] = ([N, 30, N, 31], [1, 2, 3, 4])  # type: ignore[attr-defined]
    assert sched.lookup(first, 0) == (0, False)  # type: ignore[arg-type]
    offloads = {"a": [(0, 30, 8), (0, 31, 6)]}  # 6 ends no chunk: not stored
    meta = sched.step({"a": 14}, state_offloads=offloads)
    (store,), (state_store,) = meta.stores, meta.state_stores
    keys = sched.hasher.keys(PROMPT)
    assert store.block_ids == ((1,), (2,), (3,))  # the attention group's alone
    assert state_store.block_ids == (30,) and state_store.keys == tuple(state_keys(STATES.layout, keys[1]))
    ack(sched, stores=(store.job_id, state_store.job_id))
    sched.finished(first)  # type: ignore[arg-type]
    host = sched.manager.host
    assert all(host.contains(k) for k in [*keys, *state_store.keys])

    again = FakeRequest("b", PROMPT)
    assert sched.lookup(again, 0) == (8, True)  # type: ignore[arg-type]
    sched.allocated(again, ([N, 40], [5, 6]), 8)  # type: ignore[arg-type]
    meta = sched.step({})
    (load,), (state_load,) = meta.loads, meta.state_loads
    assert load.block_ids == ((5,), (6,))
    assert state_load.block_ids == (40,) and state_load.keys == state_store.keys
    assert list(state_load.slots) == host.pin(list(state_load.keys))  # pinned (and once more)
    host.unpin(list(state_load.keys))
    ack(sched, loads=(load.job_id, state_load.job_id), finished={"b"})
    host.check()
    assert sched.manager.metrics.value("kvtier_transfer_chunks_total", tier="host", op="load") == 2 + 1


def test_a_prefix_without_a_state_is_not_a_hit(sched: Planner) -> None:
    first = FakeRequest("a", PROMPT)
    sched.test_blocks["a"] = ([N, N, N, 31], [1, 2, 3, 4])  # type: ignore[attr-defined]
    sched.lookup(first, 0)  # type: ignore[arg-type]
    (store,) = sched.step({"a": 14}).stores
    ack(sched, stores=(store.job_id,))
    sched.finished(first)  # type: ignore[arg-type]
    assert all(sched.manager.host.contains(k) for k in sched.hasher.keys(PROMPT))
    assert sched.lookup(FakeRequest("b", PROMPT), 0) == (0, False)  # type: ignore[arg-type]
