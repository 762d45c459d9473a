"""The connector's worker half on the CUDA path's transfer, over an emulated device: a model with two
KV cache groups (a full-attention layer and a sliding-window layer) stores and reloads through
`StreamTransfer`, a load leaving a sliding-window block out; its request is finished only once the
device ran the copy; a load that fails on the device fails its request (vLLM takes no block-level
errors with several groups), reported when its event completed."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import pytest
import torch

from kvtier.engine.copies import ChunkCopy
from kvtier.format.layout import SKIP_BLOCK
from kvtier.host.region import HostRegion
from kvtier.integrations.vllm.metadata import KVTierMetadata
from kvtier.integrations.vllm.worker_half import KVTierWorker
from kvtier.transfer import Transfer
from kvtier.transfer.copy_plan import CopyPlan
from kvtier.transfer.stream import StreamTransfer
from tests.integrations.halves import ROW_BYTES, geometry, kv_caches
from tests.transfer.emulated_device import COMPUTE_FIRST, EmulatedDevice

KEYS = (b"a" * 32, b"b" * 32)


@pytest.fixture
def region() -> Iterator[HostRegion]:
    r = HostRegion.create(8 * ROW_BYTES)
    yield r
    r.close()


def two_group_worker(device: EmulatedDevice, caches: dict[str, torch.Tensor]) -> KVTierWorker:
    def factory(plan: CopyPlan, tensors: Sequence[torch.Tensor]) -> Transfer:
        return StreamTransfer(plan, tensors, device)

    worker = KVTierWorker(dataclasses.replace(geometry(), layer_groups=(0, 1)), 0, factory)
    worker.register_kv_caches(caches)
    return worker


def test_a_two_group_model_stores_and_reloads_through_the_stream_path(region: HostRegion) -> None:
    device, caches = EmulatedDevice(), kv_caches(16)
    full, sliding = caches.values()
    before = [kv.clone() for kv in caches.values()]
    worker = two_group_worker(device, caches)
    stores = (ChunkCopy(1, "r1", KEYS, ((2, 3), (5, 6)), (0, 3)),)
    worker.save(KVTierMetadata(region.name, "/dev/shm", stores=stores))
    assert worker.take_worker_meta() is None
    device.run(COMPUTE_FIRST)
    out = worker.take_worker_meta()
    assert out is not None and out.stores == {1: (1, True)}

    loads = (ChunkCopy(2, "r2", KEYS, ((9, SKIP_BLOCK), (10, 11)), (0, 3)),)
    worker.start_load(KVTierMetadata(region.name, "/dev/shm", loads=loads))
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
    worker.start_load(KVTierMetadata(region.name, "/dev/shm", loads=loads))
    assert worker.take_finished_loads() == set() and worker.copies_running == 1
    device.run()
    assert worker.take_finished_loads() == {"r3"} and worker.take_failed_loads() == {"r3"}
    assert worker.take_load_errors() == set()
    worker.shutdown()
