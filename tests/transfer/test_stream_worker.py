"""The connector's worker half on the CUDA path's transfer, over an emulated device: a model with two
KV cache groups (a full-attention layer and a sliding-window layer) stores and reloads through
`StreamTransfer`, a load leaving a sliding-window block out; its request is finished only once the
device ran the copy; a load that fails on the device fails its request (vLLM takes no block-level
errors with several groups), reported when its event completed. A model with a recurrent layer
stores and loads its state segments through the same transfer: a state store in a step without
chunk stores still waits for the step's forward pass, a state load is reported only once the device
ran it, and one that fails there fails its request's load."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kvtier.engine.copier import CopyDriver
from kvtier.engine.copies import ChunkCopy, StateCopy
from kvtier.engine.geometry import StateGroups
from kvtier.engine.step import StepPlan
from kvtier.format.layout import SKIP_BLOCK, host_rows
from kvtier.format.state_rows import StateLayout, StatePart
from kvtier.host.region import HostRegion
from kvtier.transfer import Transfer
from kvtier.transfer.copy_plan import CopyPlan
from kvtier.transfer.stream import StreamTransfer
from tests.engine.fakes import KEYS, ROW_BYTES, copier, geometry, kv_caches
from tests.format.helpers import random_kv, same
from tests.transfer.emulated_device import COMPUTE_FIRST, COPIES_FIRST, LOADS_FIRST, EmulatedDevice


def two_group_worker(device: EmulatedDevice, caches: dict[str, torch.Tensor]) -> CopyDriver:
    def factory(plan: CopyPlan, tensors: Sequence[torch.Tensor]) -> Transfer:
        return StreamTransfer(plan, tensors, device)

    return copier(dataclasses.replace(geometry(), layer_groups=(0, 1)), 0, caches, factory)


def test_a_two_group_model_stores_and_reloads_through_the_stream_path(region: HostRegion) -> None:
    device, caches = EmulatedDevice(), kv_caches(16)
    full, sliding = caches.values()
    before = [kv.clone() for kv in caches.values()]
    worker = two_group_worker(device, caches)
    stores = (ChunkCopy(1, "r1", KEYS, ((2, 3), (5, 6)), (0, 3)),)
    worker.save(StepPlan(region.name, "/dev/shm", stores=stores))
    assert worker.take_report() is None
    device.run(COMPUTE_FIRST)
    out = worker.take_report()
    assert out is not None and out.stores == {1: (1, True)}

    loads = (ChunkCopy(2, "r2", KEYS, ((9, SKIP_BLOCK), (10, 11)), (0, 3)),)
    worker.start_load(StepPlan(region.name, "/dev/shm", loads=loads))
    assert worker.take_finished_loads() == set()
    device.run()
    assert worker.take_finished_loads() == {"r2"} and worker.take_failed_loads() == set()
    assert worker.take_load_errors() == set()
    bits = [kv.view(torch.int16) for kv in (full, sliding, *before)]
    assert torch.equal(bits[0][[9, 10]], bits[2][[2, 5]])  # the full-attention group: both chunks
    assert torch.equal(bits[1][11], bits[3][6])  # the sliding-window group: the second chunk only
    assert torch.equal(bits[1][9], bits[3][9]) and torch.equal(bits[1][10], bits[3][10])
    worker.shutdown()


def test_a_load_failing_on_the_device_fails_its_request_after_its_event(region: HostRegion) -> None:
    device = EmulatedDevice()
    worker = two_group_worker(device, kv_caches(16))
    loads = (ChunkCopy(3, "r3", KEYS[:1], ((4, 99),), (1,)),)  # block 99 does not exist
    worker.start_load(StepPlan(region.name, "/dev/shm", loads=loads))
    assert worker.take_finished_loads() == set() and worker.copies_running == 1
    device.run()
    assert worker.take_finished_loads() == {"r3"} and worker.take_failed_loads() == {"r3"}
    assert worker.take_load_errors() == set()
    worker.shutdown()


STATE_LAYER = "model.layers.2.linear_attn"
STATES = StateLayout(
    "gdn", (2,), (StatePart((64, 3), torch.bfloat16, transposed=True), StatePart((4, 16, 16), torch.float32)),
    ROW_BYTES,
)


def hybrid_worker(device: EmulatedDevice, caches: dict[str, torch.Tensor]) -> CopyDriver:
    """Two attention layers and one gated-delta-net layer (its KV cache group is vLLM's group 1)."""

    def factory(plan: CopyPlan, tensors: Sequence[torch.Tensor]) -> Transfer:
        return StreamTransfer(plan, tensors, device)

    states = StateGroups(STATES, (STATE_LAYER,), (1,), 4)
    return copier(dataclasses.replace(geometry(), states=states), 0, caches, factory)


def hybrid_caches(seed: int) -> dict[str, torch.Tensor]:
    """Attention tensors, and the state layer's raw pages as vLLM hands them (`[blocks, 1, 1, bytes]`
    int8, the parts end to end)."""
    pages = random_kv((16, 1, 1, STATES.layer_bytes), torch.int8, torch.Generator().manual_seed(seed))
    return {**kv_caches(16, seed), STATE_LAYER: pages}


def test_a_hybrid_model_stores_and_loads_its_states_through_the_stream_path(region: HostRegion) -> None:
    device, caches = EmulatedDevice(), hybrid_caches(1)
    assert STATES.rows == 2
    worker = hybrid_worker(device, caches)
    assert worker.transfer is not None and worker.transfer.states is not None
    state = worker.transfer.states.tensors[0]
    gen = torch.Generator().manual_seed(7)
    stored = [random_kv(tuple(t[5].shape), t.dtype, gen) for t in state]

    def forward_pass() -> None:  # the step's pass, launched before `wait_for_save`: it writes block 5
        for t, new in zip(state, stored, strict=True):
            t[5] = new

    device.compute(forward_pass)
    stores = (StateCopy(1, "r1", KEYS, (5,), (2, 6)),)
    worker.save(StepPlan(region.name, "/dev/shm", state_stores=stores))
    assert worker.take_report() is None and worker.copies_running == 1
    device.run(COPIES_FIRST)
    out = worker.take_report()
    assert out is not None and out.stores == {1: (1, True)} and out.loads == {}

    loaded = hybrid_worker(device, hybrid_caches(2))
    assert loaded.transfer is not None and loaded.transfer.states is not None
    loads = (ChunkCopy(3, "r2", KEYS[:1], ((9,),), (0,)),)
    state_loads = (StateCopy(2, "r2", KEYS, (11,), (2, 6)),)
    loaded.start_load(StepPlan(region.name, "/dev/shm", loads=loads, state_loads=state_loads))
    assert loaded.take_finished_loads() == set() and loaded.copies_running == 2
    device.run()
    assert loaded.take_finished_loads() == {"r2"} and loaded.take_failed_loads() == set()
    out = loaded.take_report()
    assert out is not None and out.loads == {2: (1, True), 3: (1, True)}
    assert all(same(t[11], s) for t, s in zip(loaded.transfer.states.tensors[0], stored, strict=True))
    rows = host_rows(region.buf, ROW_BYTES, 8)
    assert rows[[2, 6]].any()
    worker.shutdown()
    loaded.shutdown()


def test_a_state_load_failing_on_the_device_fails_its_request(region: HostRegion) -> None:
    device = EmulatedDevice()
    worker = hybrid_worker(device, hybrid_caches(3))
    loads = (ChunkCopy(5, "r3", KEYS[:1], ((4,),), (1,)),)
    state_loads = (
        StateCopy(4, "r3", KEYS, (99,), (2, 6)),  # block 99 does not exist
        StateCopy(6, "r4", KEYS, (3,), ()),  # its rows could not be pinned
    )
    worker.start_load(StepPlan(region.name, "/dev/shm", loads=loads, state_loads=state_loads))
    assert worker.take_finished_loads() == set()
    device.run()
    assert worker.take_finished_loads() == {"r3"} and worker.take_failed_loads() == {"r3"}
    out = worker.take_report()
    assert out is not None and out.loads == {4: (1, False), 5: (1, True), 6: (1, False)}
    worker.shutdown()


def test_a_load_waits_for_a_pass_of_a_step_without_stores(region: HostRegion) -> None:
    """Step 1 stores block 2; step 2 has no stores and its forward pass writes block 7; step 3
    loads the stored row into block 7. The load must run after step 2's pass, however late the
    device runs that pass: else the pass overwrites the loaded block."""
    device, caches = EmulatedDevice(), kv_caches(16)
    first = next(iter(caches.values()))
    stored = first[2].clone()
    worker = copier(geometry(), 0, caches, lambda plan, tensors: StreamTransfer(plan, tensors, device))
    worker.save(StepPlan(region.name, "/dev/shm", stores=(ChunkCopy(1, "r1", KEYS[:1], ((2,),), (0,)),)))
    device.run(COMPUTE_FIRST)
    assert worker.take_report() is not None

    def step_two_pass() -> None:  # a request that is gone by step 3 still writes block 7
        for kv in caches.values():
            kv[7].fill_(0)

    worker.before_forward()
    device.compute(step_two_pass)
    worker.start_load(StepPlan(region.name, "/dev/shm"))
    worker.save(StepPlan(region.name, "/dev/shm"))

    worker.before_forward()
    worker.start_load(StepPlan(region.name, "/dev/shm", loads=(ChunkCopy(2, "r2", KEYS[:1], ((7,),), (0,)),)))
    device.run(LOADS_FIRST)
    assert worker.take_finished_loads() == {"r2"}
    assert torch.equal(first[7].view(torch.int16), stored.view(torch.int16))
    worker.shutdown()
