"""The CUDA path's ordering against the forward pass, on an emulated device over CPU tensors whose
streams run the work queued on them later, in an order the test picks (`emulated_device`).

Each test queues "forward passes" on the compute stream that write engine blocks, drives the
transfer as the connector's worker does, then runs the device with the copies as early as their
waits allow (`COPIES_FIRST`), the forward passes as early as theirs allow (`COMPUTE_FIRST`), or
loads first (`LOADS_FIRST`). What holds under every schedule: a store copies what the forward pass
before it wrote, not what the next pass writes into its freed blocks; a load lands after the forward
pass before it and after the running store that reads its blocks; every job is reported once, only
after the device reached its end event; nothing blocks the caller but `close`.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.format.layout import host_rows
from kvtier.host.region import HostRegion
from kvtier.transfer.stream import StreamTransfer
from tests.format.helpers import make_rows, random_kv, same
from tests.transfer.emulated_device import (
    COMPUTE_FIRST,
    COPIES_FIRST,
    LOADS_FIRST,
    EmulatedDevice,
)
from tests.transfer.helpers import NUM_SLOTS, Case, case

SCHEDULES = [COPIES_FIRST, COMPUTE_FIRST, LOADS_FIRST, 1, 2, 3]
KINDS = ["flash_nhd", "sliding_groups", "mla", "fp8"]


def setup(region: HostRegion, kind: str) -> tuple[Case, EmulatedDevice, StreamTransfer]:
    c = case(kind, bpc=2, seed=3)
    device = EmulatedDevice()
    transfer = StreamTransfer(c.plan, c.tensors, device, staging_bytes=1)
    transfer.attach(region.name, "/dev/shm")
    return c, device, transfer


def ids_of(blocks: list[list[int]]) -> list[int]:
    return sorted({b for chunk in blocks for b in chunk if b >= 0})


def forward_pass(c: Case, tensors: list[torch.Tensor], blocks: list[list[int]], seed: int) -> None:
    """Write new random bytes into every page of `blocks` (a forward pass filling them)."""
    gen = torch.Generator().manual_seed(seed)
    ids = ids_of(blocks)
    for kv in tensors:
        for view in c.plan.engine_views(kv):
            view[ids] = random_kv(tuple(view[ids].shape), view.dtype, gen)


def rows_of(c: Case, tensors: list[torch.Tensor], blocks: list[list[int]], slots: list[int]) -> torch.Tensor:
    """The rows the CPU path writes from `tensors`."""
    _, rows = make_rows(c.layout, NUM_SLOTS)
    c.plan.engine_to_host(tensors, blocks, rows, slots)
    return rows


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("hook", [True, False])
def test_a_store_copies_what_its_forward_pass_wrote_not_what_the_next_one_writes(
    region: HostRegion, kind: str, schedule: tuple[str, ...] | int, hook: bool
) -> None:
    """`hook`: the connector forwards vLLM's pre-forward hook (the compute stream waits for running
    stores before the next pass), or not (it waits right after the store is queued)."""
    c, device, transfer = setup(region, kind)
    blocks, slots = c.blocks(3, seed=5)
    if hook:
        transfer.before_forward()
    filled = [t.clone() for t in c.tensors]
    forward_pass(c, filled, blocks, seed=1)
    expected = rows_of(c, filled, blocks, slots)
    device.compute(lambda: forward_pass(c, c.tensors, blocks, seed=1))  # the pass filling the blocks
    transfer.forward_done()
    transfer.submit_store(1, blocks, slots)
    if hook:
        transfer.before_forward()
    device.compute(lambda: forward_pass(c, c.tensors, blocks, seed=2))  # it reuses the freed blocks
    assert transfer.poll() == []
    device.run(schedule)
    assert device.idle
    [result] = transfer.poll()
    assert (result.job_id, result.ok) == (1, True) and result.seconds > 0
    assert transfer.rows is not None and same(transfer.rows[:NUM_SLOTS], expected)
    assert device.syncs == 0
    transfer.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pass_between", [True, False])
def test_a_load_lands_after_the_last_forward_pass_and_the_store_reading_its_blocks(
    region: HostRegion, kind: str, schedule: tuple[str, ...] | int, pass_between: bool
) -> None:
    """`pass_between`: a forward pass that still uses the blocks runs between the store and the
    load (else the load comes in the store's step, its blocks freed by a request that ended)."""
    c, device, transfer = setup(region, kind)
    assert transfer.rows is not None
    rows = transfer.rows
    blocks, store_slots = c.blocks(2, seed=11)
    expected_store = rows_of(c, c.tensors, blocks, store_slots)
    load_slots = [s for s in range(NUM_SLOTS) if s not in store_slots][:2]
    rows[load_slots] = random_kv((2, c.layout.row_bytes), torch.uint8, torch.Generator().manual_seed(4))
    want = [t.clone() for t in c.tensors]
    if pass_between:
        forward_pass(c, want, blocks, seed=6)
    c.plan.host_to_engine(want, blocks, rows, load_slots)

    transfer.forward_done()
    transfer.submit_store(1, blocks, store_slots)  # still running when the load is queued
    if pass_between:
        transfer.before_forward()
        device.compute(lambda: forward_pass(c, c.tensors, blocks, seed=6))  # it uses the old blocks
        transfer.forward_done()
    transfer.submit_load(2, blocks, load_slots)  # vLLM freed the blocks and gave them to a new request
    assert transfer.poll() == []
    device.run(schedule)
    results = sorted((r.job_id, r.ok) for r in transfer.poll())
    assert results == [(1, True), (2, True)] and transfer.poll() == []
    for got, expected in zip(c.tensors, want, strict=True):
        assert same(got, expected)
    view = host_rows(region.buf, c.layout.row_bytes, NUM_SLOTS)
    assert same(view[store_slots], expected_store[store_slots])
    transfer.close()


def test_a_job_is_reported_once_its_end_event_completed_and_close_runs_it(region: HostRegion) -> None:
    c, device, transfer = setup(region, "sliding_groups")
    blocks, slots = c.blocks(2, seed=2)
    transfer.forward_done()
    transfer.submit_store(1, blocks, slots)
    transfer.submit_load(2, [[0, 1, 2, 3]], [slots[0]])
    device.run_stream("store")  # waits for the forward pass: nothing ran
    assert transfer.poll() == [] and transfer.running == 2
    device.run_stream("compute")
    device.run_stream("store")
    assert [(r.job_id, r.ok) for r in transfer.poll()] == [(1, True)] and transfer.running == 1
    transfer.close()  # runs the device until the load ended
    assert device.syncs == 1
    assert [(r.job_id, r.ok) for r in transfer.poll()] == [(2, True)]


def test_a_copy_that_raises_on_the_device_fails_its_job_after_its_event(region: HostRegion) -> None:
    c, device, transfer = setup(region, "mla")
    blocks, slots = c.blocks(2, seed=2)
    transfer.forward_done()
    transfer.submit_store(1, blocks, [slots[0], slots[0]])  # one slot twice
    transfer.submit_load(2, [[0, 99]], [slots[1]])  # block 99 does not exist
    assert transfer.poll() == []
    device.run()
    assert sorted((r.job_id, r.ok) for r in transfer.poll()) == [(1, False), (2, False)]
    assert transfer.rows is not None and not transfer.rows.any()
    transfer.close()
