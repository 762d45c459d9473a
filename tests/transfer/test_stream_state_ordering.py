"""The ordering of state copies on the CUDA path against the forward pass, on an emulated device whose
streams run the queued work later, in an order the test picks (`emulated_device`): the copies as
early as their waits allow, the forward passes as early as theirs allow, loads first, or seeded
random orders. What holds under every schedule, for gated delta net and Mamba2 states:

- a state store copies what the forward pass before it wrote, not what the next pass writes into
  the block vLLM freed (hazards 1 and 2 of `kvtier.transfer.stream`);
- a state load lands after the forward pass before it and after the running store that reads its
  block (hazard 4);
- a load (state or attention) lands after the block zeroing vLLM queued on the compute stream in
  the step that loads, on a model with recurrent layers (hazard 4);
- a failed state load is reported before the chunk loads queued after it, even when the device
  completed both between two queries (hazard 3: the request fails whole).
"""

from __future__ import annotations

import pytest
import torch

from kvtier.host.region import HostRegion
from kvtier.transfer.stream import StreamTransfer
from tests.format.helpers import random_kv, same
from tests.transfer.emulated_device import COMPUTE_FIRST, COPIES_FIRST, LOADS_FIRST, EmulatedDevice
from tests.transfer.helpers import Case, case
from tests.transfer.state_helpers import STATE_KINDS, StateCase, state_case

SCHEDULES = [COPIES_FIRST, COMPUTE_FIRST, LOADS_FIRST, 1, 2, 3]


def setup(
    region: HostRegion, kind: str, tp_rank: int = 0
) -> tuple[Case, StateCase, EmulatedDevice, StreamTransfer]:
    c = case("flash_nhd", seed=2)
    s = state_case(kind, c.layout.row_bytes, 2 if tp_rank else 1, tp_rank, seed=3)
    device = EmulatedDevice()
    transfer = StreamTransfer(c.plan, c.tensors, device, staging_bytes=1)
    transfer.add_states(s.copier())
    transfer.attach(region.name, "/dev/shm")
    return c, s, device, transfer


def forward_pass(tensors: list[list[torch.Tensor]], blocks: tuple[int, ...], seed: int) -> None:
    """Write new random states into `blocks` (one per recurrent layer): a forward pass."""
    gen = torch.Generator().manual_seed(seed)
    for parts, block in zip(tensors, blocks, strict=True):
        for t in parts:
            t[block] = random_kv(tuple(t[block].shape), t.dtype, gen)


def zero_blocks(c: Case, s: StateCase, blocks: list[int]) -> None:
    """vLLM's zeroing of new blocks: the whole page of each block, every layer's bytes."""
    for kv in c.tensors:
        kv[blocks] = 0
    for parts in s.tensors:
        for t in parts:
            t[blocks] = 0


def stored_rows(s: StateCase, tensors: list[list[torch.Tensor]], blocks: tuple[int, ...], slots: list[int],
                rows: torch.Tensor) -> torch.Tensor:
    """The rows the CPU path writes from `tensors` over a copy of `rows`."""
    expected = rows.clone()
    s.copier(tensors).engine_to_host(blocks, expected, slots)
    return expected


@pytest.mark.parametrize("kind", STATE_KINDS)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("hook", [True, False])
def test_a_state_store_copies_what_its_pass_wrote_not_what_the_next_one_writes(
    region: HostRegion, kind: str, schedule: tuple[str, ...] | int, hook: bool
) -> None:
    """`hook`: the connector forwards vLLM's pre-forward hook, or not."""
    _, s, device, transfer = setup(region, kind, tp_rank=1)
    assert transfer.rows is not None
    blocks, slots = s.blocks(seed=4), list(range(s.layout.rows))
    filled = s.clone()
    forward_pass(filled, blocks, seed=1)
    expected = stored_rows(s, filled, blocks, slots, transfer.rows)
    if hook:
        transfer.before_forward()
    device.compute(lambda: forward_pass(s.tensors, blocks, seed=1))  # the pass writing the states
    transfer.forward_done()
    transfer.submit_state_store(1, blocks, slots)
    if hook:
        transfer.before_forward()
    device.compute(lambda: forward_pass(s.tensors, blocks, seed=2))  # the next pass reuses the blocks
    assert transfer.poll() == []
    device.run(schedule)
    assert device.idle and [(r.job_id, r.ok) for r in transfer.poll()] == [(1, True)]
    assert same(transfer.rows, expected) and device.syncs == 0
    transfer.close()


@pytest.mark.parametrize("kind", STATE_KINDS)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pass_between", [True, False])
def test_a_state_load_lands_after_the_last_pass_and_the_store_reading_its_block(
    region: HostRegion, kind: str, schedule: tuple[str, ...] | int, pass_between: bool
) -> None:
    """`pass_between`: a forward pass that still uses the blocks runs between the store and the
    load (else the load comes in the store's step, its blocks freed by a request that ended)."""
    _, s, device, transfer = setup(region, kind)
    assert transfer.rows is not None
    rows = transfer.rows
    blocks = s.blocks(seed=5)
    store_slots = list(range(s.layout.rows))
    load_slots = [n + s.layout.rows for n in store_slots]
    noise = random_kv((len(load_slots), rows.shape[1]), torch.uint8, torch.Generator().manual_seed(6))
    rows[load_slots] = noise
    expected_store = stored_rows(s, s.tensors, blocks, store_slots, rows)
    want = s.clone()
    if pass_between:
        forward_pass(want, blocks, seed=7)
    s.copier(want).host_to_engine(blocks, rows, load_slots)

    transfer.before_forward()  # the connector forwards vLLM's pre-forward hook
    transfer.forward_done()
    transfer.submit_state_store(1, blocks, store_slots)  # still running when the load is queued
    if pass_between:
        transfer.before_forward()
        device.compute(lambda: forward_pass(s.tensors, blocks, seed=7))  # it still uses the blocks
        transfer.forward_done()
    transfer.submit_state_load(2, blocks, load_slots)  # the blocks, freed, given to a loading request
    device.run(schedule)
    assert sorted((r.job_id, r.ok) for r in transfer.poll()) == [(1, True), (2, True)]
    for got, expected in zip(s.tensors, want, strict=True):
        assert all(same(g, e) for g, e in zip(got, expected, strict=True))
    assert same(rows[store_slots], expected_store[store_slots])
    transfer.close()


@pytest.mark.parametrize("kind", STATE_KINDS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_loads_land_after_the_block_zeroing_queued_in_their_step(
    region: HostRegion, kind: str, schedule: tuple[str, ...] | int
) -> None:
    """vLLM zeroes the blocks it allocated in a step on the compute stream before that step's
    forward pass; a block freed and given again in one scheduling pass is zeroed and loaded in the
    same step: the load must land after the zeroing, or the request reads zeros."""
    c, s, device, transfer = setup(region, kind)
    assert transfer.rows is not None
    rows = transfer.rows
    rows.copy_(random_kv(tuple(rows.shape), torch.uint8, torch.Generator().manual_seed(8)))
    state_blocks = s.blocks(seed=9)
    state_slots = list(range(s.layout.rows))
    chunk_blocks, chunk_slots = c.blocks(2, seed=10)
    chunk_slots = [s.layout.rows + n for n in range(2)]
    zeroed = sorted({*state_blocks, *(b for ids in chunk_blocks for b in ids)})
    want = state_case(kind, c.layout.row_bytes, seed=3)  # the same tensors, zeroed then loaded
    want_kv = [t.clone() for t in c.tensors]
    zero_blocks(Case(c.layout, c.plan, want_kv), want, zeroed)
    want.copier().host_to_engine(state_blocks, rows, state_slots)
    c.plan.host_to_engine(want_kv, chunk_blocks, rows, chunk_slots)

    transfer.forward_done()  # the previous step
    transfer.before_forward()
    device.compute(lambda: zero_blocks(c, s, zeroed))  # this step's `new_block_ids_to_zero`
    transfer.submit_state_load(1, state_blocks, state_slots)
    transfer.submit_load(2, chunk_blocks, chunk_slots)
    device.run(schedule)
    assert [(r.job_id, r.ok) for r in transfer.poll()] == [(1, True), (2, True)]
    for got, expected in zip(s.tensors, want.tensors, strict=True):
        assert all(same(g, e) for g, e in zip(got, expected, strict=True))
    assert all(same(got, expected) for got, expected in zip(c.tensors, want_kv, strict=True))
    transfer.close()


def test_a_failed_state_load_is_reported_before_the_chunk_loads_queued_after_it(region: HostRegion) -> None:
    """On a GPU the chunk load's end event may read complete while the state load's, queried just
    before, did not: `poll` holds the chunk load back until the state load is reported."""
    c, s, device, transfer = setup(region, "gdn")
    transfer.submit_state_load(1, (0, 99, 1), list(range(s.layout.rows)))  # block 99 does not exist
    chunk_blocks, _ = c.blocks(1, seed=1)
    transfer.submit_load(2, chunk_blocks, [s.layout.rows])
    device.events[-1].done = True  # the chunk load's end event, seen complete first
    assert transfer.poll() == []
    device.run()
    assert [(r.job_id, r.ok) for r in transfer.poll()] == [(1, False), (2, True)]
    transfer.close()
