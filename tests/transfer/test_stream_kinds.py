"""The CUDA path's copies (`StreamTransfer` over `StagedCopy`) run on an emulated device over CPU
tensors, for every kind of cache the CPU path carries: each engine layout and memory order, several
KV cache groups with sliding-window blocks left out, MLA latents, fp8 held as uint8; at TP 1, 2 and
8 (a replica that writes nothing), one and two blocks per chunk, in batches or not, under several
schedules of the device's streams. What holds: a store writes the rows the CPU path
(`CpuTransfer`) writes, byte for byte; a load writes the blocks the CPU path writes, and no
other; each job is reported once, only after the device ran it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvtier.format.layout import SKIP_BLOCK, host_rows
from kvtier.host.region import HostRegion
from kvtier.transfer import CpuTransfer
from kvtier.transfer.stream import StreamTransfer
from tests.format.helpers import random_kv, same
from tests.transfer.emulated_device import COMPUTE_FIRST, COPIES_FIRST, EmulatedDevice
from tests.transfer.helpers import GROUP_KINDS, NUM_SLOTS, Case, case

SCHEDULES = [COPIES_FIRST, COMPUTE_FIRST, 7]


@pytest.fixture
def regions() -> Iterator[tuple[HostRegion, HostRegion]]:
    """The stream path's host region and the CPU path's, each of NUM_SLOTS rows of 4 KiB pages."""
    a, b = HostRegion.create(NUM_SLOTS * 8192), HostRegion.create(NUM_SLOTS * 8192)
    yield a, b
    a.close()
    b.close()


def paths(
    c: Case, regions: tuple[HostRegion, HostRegion], staging_bytes: int
) -> tuple[EmulatedDevice, StreamTransfer, CpuTransfer]:
    device = EmulatedDevice()
    stream = StreamTransfer(c.plan, c.tensors, device, staging_bytes=staging_bytes)
    stream.attach(regions[0].name, "/dev/shm")
    cpu = CpuTransfer(c.plan, c.tensors)
    cpu.attach(regions[1].name, "/dev/shm")
    return device, stream, cpu


def one_result(stream: StreamTransfer) -> tuple[int, bool]:
    [result] = stream.poll()
    return result.job_id, result.ok


@pytest.mark.parametrize("kind", GROUP_KINDS)
@pytest.mark.parametrize("tp_size, rank", [(1, 0), (2, 1), (8, 5)])
@pytest.mark.parametrize("bpc", [1, 2])
@pytest.mark.parametrize("staging_bytes", [1, 1 << 20])
def test_a_store_writes_the_rows_the_cpu_path_writes(
    regions: tuple[HostRegion, HostRegion], kind: str, tp_size: int, rank: int, bpc: int, staging_bytes: int
) -> None:
    c = case(kind, tp_size, rank, bpc, seed=bpc + rank)
    device, stream, cpu = paths(c, regions, staging_bytes)
    blocks, slots = c.blocks(4, seed=rank)
    stream.forward_done()
    stream.submit_store(1, blocks, slots)
    cpu.submit_store(1, blocks, slots)
    assert cpu.poll()[0].ok
    assert stream.poll() == [] and stream.rows is not None and not stream.rows.any()
    device.run(SCHEDULES[(bpc + rank) % len(SCHEDULES)])
    assert one_result(stream) == (1, True) and stream.poll() == []
    assert same(stream.rows, host_rows(regions[1].buf, c.layout.row_bytes, len(stream.rows)))
    assert bool(stream.rows.any()) == c.plan.shard.writes
    stream.close()
    cpu.close()


@pytest.mark.parametrize("kind", GROUP_KINDS)
@pytest.mark.parametrize("tp_size, rank", [(1, 0), (2, 1), (8, 5)])
@pytest.mark.parametrize("bpc", [1, 2])
@pytest.mark.parametrize("staging_bytes", [1, 1 << 20])
def test_a_load_writes_the_blocks_the_cpu_path_writes_and_no_other(
    regions: tuple[HostRegion, HostRegion], kind: str, tp_size: int, rank: int, bpc: int, staging_bytes: int
) -> None:
    c = case(kind, tp_size, rank, bpc, seed=bpc + rank)
    region = regions[0]
    rows = torch.frombuffer(region.buf, dtype=torch.uint8, count=region.size)
    rows.copy_(random_kv((region.size,), torch.uint8, torch.Generator().manual_seed(rank)))
    stream_dst, cpu_dst = c.zeros(), c.zeros()
    device = EmulatedDevice()
    stream = StreamTransfer(c.plan, stream_dst, device, staging_bytes=staging_bytes)
    cpu = CpuTransfer(c.plan, cpu_dst)
    for transfer in (stream, cpu):
        transfer.attach(region.name, "/dev/shm")  # both read the same rows
    blocks, slots = c.blocks(4, seed=rank, skip=True)
    stream.submit_load(2, blocks, slots)
    cpu.submit_load(2, blocks, slots)
    assert cpu.poll()[0].ok
    assert stream.poll() == [] and not any(t.any() for t in stream_dst)
    device.run(SCHEDULES[(bpc + rank) % len(SCHEDULES)])
    assert one_result(stream) == (2, True)
    for got, want in zip(stream_dst, cpu_dst, strict=True):
        assert same(got, want)
    skipped = c.plan.num_groups > 1 and any(SKIP_BLOCK in ids for ids in blocks)
    assert skipped == (kind == "sliding_groups")
    written = {b for ids in blocks for b in ids if b != SKIP_BLOCK}
    for got in stream_dst:
        for views in c.plan.engine_views(got):
            untouched = [b for b in range(views.shape[0]) if b not in written]
            assert not views[untouched].any()
    stream.close()
    cpu.close()


def test_the_stream_path_refuses_what_the_cpu_path_refuses_before_any_copy(
    regions: tuple[HostRegion, HostRegion],
) -> None:
    c = case("sliding_groups", bpc=2)
    device, stream, cpu = paths(c, regions, 1 << 20)
    blocks, slots = c.blocks(2, seed=1, skip=True)
    for transfer in (stream, cpu):
        transfer.forward_done()
        transfer.submit_store(3, blocks, slots)  # a store needs every block of every chunk
    device.run()
    assert one_result(stream) == (3, False) and [r.ok for r in cpu.poll()] == [False]
    assert stream.rows is not None and not stream.rows.any()
    stream.close()
    cpu.close()
