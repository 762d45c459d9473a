"""The scheduler half of a recurrent hybrid (`StateScheduler`) without an engine: vLLM group 0 holds
a gated-delta-net layer's state, group 1 the attention layers (4-token blocks and chunks). The
boundary states vLLM offers are stored as state segments; a later request's hit ends at the last
chunk whose end has a state held, loads that state into the block vLLM allocated for it, and
releases its rows when the load is reported; a prefix without any state comes back not at all."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from vllm.v1.outputs import KVConnectorOutput

from kvtier.config import KVTierConfig
from kvtier.format.state_rows import StateLayout, StatePart, state_keys
from kvtier.integrations.vllm.metadata import KVTierWorkerMetadata
from kvtier.integrations.vllm.model.groups import NULL_BLOCK as N
from kvtier.integrations.vllm.model.state_groups import StateGroups
from kvtier.integrations.vllm.state_scheduler import StateScheduler
from tests.integrations.halves import ROW_BYTES, FakeRequest, FakeSchedulerOutput, geometry

PROMPT = list(range(100, 114))  # 14 tokens: 3 full chunks of 4
PARTS = (StatePart((6, 3), torch.bfloat16, True), StatePart((2, 4, 4), torch.float32))
STATES = StateGroups(StateLayout("gdn", (0,), PARTS, ROW_BYTES), ("model.layers.0.linear_attn",), (0,), 4)


@dataclass
class BlockState:
    boundary_state_offloads: dict[str, list[tuple[int, int, int]]]


@dataclass
class Output(FakeSchedulerOutput):
    kv_connector_block_state: BlockState | None = field(default=None)


class Blocks:
    def __init__(self, *ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.ids


@pytest.fixture
def sched() -> Iterator[StateScheduler]:
    hybrid = dataclasses.replace(geometry(), group_ids=(1,), states=STATES)
    s = StateScheduler(KVTierConfig.from_dict({"cpu_bytes_to_use": 16 * ROW_BYTES}), hybrid, 1)
    blocks: dict[str, tuple[list[int], ...]] = {}
    s.bind_block_ids(blocks.__getitem__)
    s.test_blocks = blocks  # type: ignore[attr-defined]
    yield s
    s.shutdown()


def ack(
    sched: StateScheduler, stores: tuple[int, ...] = (), loads: tuple[int, ...] = (), **kwargs: Any
) -> None:
    meta = KVTierWorkerMetadata({j: (1, True) for j in stores}, {j: (1, True) for j in loads})
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta, **kwargs))


def test_a_hit_ends_where_a_state_is_held_and_loads_it_there(sched: StateScheduler) -> None:
    first = FakeRequest("a", PROMPT)
    sched.test_blocks["a"] = ([N, 30, N, 31], [1, 2, 3, 4])  # type: ignore[attr-defined]
    assert sched.get_num_new_matched_tokens(first, 0) == (0, False)  # type: ignore[arg-type]
    offloads = BlockState({"a": [(0, 30, 8), (0, 31, 6)]})  # 6 ends no chunk: not stored
    meta = sched.build_connector_meta(Output({"a": 14}, kv_connector_block_state=offloads))  # type: ignore[arg-type]
    (store,), (state_store,) = meta.stores, meta.state_stores
    keys = sched.hasher.keys(PROMPT)
    assert store.block_ids == ((1,), (2,), (3,))  # the attention group's alone
    assert state_store.block_ids == (30,) and state_store.keys == tuple(state_keys(STATES.layout, keys[1]))
    ack(sched, stores=(store.job_id, state_store.job_id))
    sched.request_finished(first)  # type: ignore[arg-type]
    host = sched.manager.host
    assert all(host.contains(k) for k in [*keys, *state_store.keys])

    again = FakeRequest("b", PROMPT)
    assert sched.get_num_new_matched_tokens(again, 0) == (8, True)  # type: ignore[arg-type]
    sched.update_state_after_alloc(again, Blocks([N, 40], [5, 6]), 8)  # type: ignore[arg-type]
    meta = sched.build_connector_meta(Output({}))  # type: ignore[arg-type]
    (load,), (state_load,) = meta.loads, meta.state_loads
    assert load.block_ids == ((5,), (6,))
    assert state_load.block_ids == (40,) and state_load.keys == state_store.keys
    assert list(state_load.slots) == host.pin(list(state_load.keys))  # pinned (and once more)
    host.unpin(list(state_load.keys))
    ack(sched, loads=(load.job_id, state_load.job_id), finished_recving={"b"})
    host.check()
    assert sched.manager.metrics.value("kvtier_transfer_chunks_total", tier="host", op="load") == 2 + 1


def test_a_prefix_without_a_state_is_not_a_hit(sched: StateScheduler) -> None:
    first = FakeRequest("a", PROMPT)
    sched.test_blocks["a"] = ([N, N, N, 31], [1, 2, 3, 4])  # type: ignore[attr-defined]
    sched.get_num_new_matched_tokens(first, 0)  # type: ignore[arg-type]
    (store,) = sched.build_connector_meta(Output({"a": 14})).stores  # type: ignore[arg-type]
    ack(sched, stores=(store.job_id,))
    sched.request_finished(first)  # type: ignore[arg-type]
    assert all(sched.manager.host.contains(k) for k in sched.hasher.keys(PROMPT))
    assert sched.get_num_new_matched_tokens(FakeRequest("b", PROMPT), 0) == (0, False)  # type: ignore[arg-type]
