"""Recurrent-state segments through the CUDA path's transfer (`StreamTransfer` with a `StateCopier`)
on an emulated device over CPU tensors: gated delta net and Mamba2 states (conv state kept
transposed, Mamba2's B and C whole on every rank), at TP 1 and each rank of TP 2, in several
dtypes. What holds: a state store writes the bytes the CPU path (`CpuTransfer`) writes and no
other, only once the device ran it; the two ranks of a TP=2 engine together write the rows a TP=1
engine writes; a state load writes the blocks the CPU path writes and no other; a state job that
cannot be copied fails after its event, having written nothing."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from kvtier.format.layout import host_rows
from kvtier.host.region import HostRegion
from kvtier.transfer import CpuTransfer
from kvtier.transfer.stream import StreamTransfer
from tests.format.helpers import random_kv, same
from tests.transfer.emulated_device import COMPUTE_FIRST, COPIES_FIRST, LOADS_FIRST, EmulatedDevice
from tests.transfer.helpers import NUM_SLOTS, Case, case
from tests.transfer.state_helpers import DTYPES, STATE_KINDS, StateCase, state_case

TP_RANKS = [(1, 0), (2, 0), (2, 1)]
SCHEDULES = [COPIES_FIRST, COMPUTE_FIRST, LOADS_FIRST, 5]


@pytest.fixture
def regions() -> Iterator[tuple[HostRegion, HostRegion]]:
    """The stream path's host region and the CPU path's, filled with the same random bytes."""
    a, b = HostRegion.create(NUM_SLOTS * 8192), HostRegion.create(NUM_SLOTS * 8192)
    noise = random_kv((a.size,), torch.uint8, torch.Generator().manual_seed(9))
    for r in (a, b):
        torch.frombuffer(r.buf, dtype=torch.uint8, count=r.size).copy_(noise)
    yield a, b
    a.close()
    b.close()


def region_rows(region: HostRegion, c: Case) -> torch.Tensor:
    return host_rows(region.buf, c.layout.row_bytes, region.size // c.layout.row_bytes)


def stream_path(c: Case, s: StateCase, region: HostRegion, tensors: list[list[torch.Tensor]] | None = None
                ) -> tuple[EmulatedDevice, StreamTransfer]:
    device = EmulatedDevice()
    stream = StreamTransfer(c.plan, c.tensors, device)
    stream.add_states(s.copier(tensors))
    stream.attach(region.name, "/dev/shm")
    return device, stream


def cpu_path(c: Case, s: StateCase, region: HostRegion, tensors: list[list[torch.Tensor]] | None = None
             ) -> CpuTransfer:
    cpu = CpuTransfer(c.plan, c.tensors)
    cpu.add_states(s.copier(tensors))
    cpu.attach(region.name, "/dev/shm")
    return cpu


def slots_for(s: StateCase, seed: int) -> list[int]:
    return random.Random(seed).sample(range(NUM_SLOTS), s.layout.rows)


def results(transfer: StreamTransfer | CpuTransfer) -> list[tuple[int, bool]]:
    return [(r.job_id, r.ok) for r in transfer.poll()]


@pytest.mark.parametrize("kind", STATE_KINDS)
@pytest.mark.parametrize("tp_size, rank", TP_RANKS)
@pytest.mark.parametrize("dtypes", sorted(DTYPES))
def test_a_state_store_writes_the_bytes_the_cpu_path_writes_and_no_other(
    regions: tuple[HostRegion, HostRegion], kind: str, tp_size: int, rank: int, dtypes: str
) -> None:
    c = case("flash_nhd")
    s = state_case(kind, c.layout.row_bytes, tp_size, rank, dtypes, seed=rank + 1)
    assert s.layout.rows > 1  # a segment straddles rows
    device, stream = stream_path(c, s, regions[0])
    cpu = cpu_path(c, s, regions[1])
    before = region_rows(regions[0], c).clone()
    blocks, slots = s.blocks(seed=rank), slots_for(s, seed=rank)
    stream.forward_done()
    stream.submit_state_store(1, blocks, slots)
    cpu.submit_state_store(1, blocks, slots)
    assert results(cpu) == [(1, True)]
    assert stream.poll() == [] and same(region_rows(regions[0], c), before)
    device.run(SCHEDULES[rank + tp_size])
    assert results(stream) == [(1, True)] and stream.poll() == []
    got, want = region_rows(regions[0], c), region_rows(regions[1], c)
    assert same(got, want)
    assert not same(got[slots], before[slots])
    others = [r for r in range(len(got)) if r not in slots]
    assert same(got[others], before[others])
    stream.close()
    cpu.close()


@pytest.mark.parametrize("kind", STATE_KINDS)
def test_the_two_ranks_of_a_tp2_engine_write_the_rows_a_tp1_engine_writes(
    regions: tuple[HostRegion, HostRegion], kind: str
) -> None:
    c = case("flash_nhd")
    whole = state_case(kind, c.layout.row_bytes, seed=3)
    ranks = [state_case(kind, c.layout.row_bytes, 2, r, seed=3) for r in range(2)]
    blocks, slots = whole.blocks(seed=4), slots_for(whole, seed=4)
    paths = [stream_path(c, s, regions[0]) for s in ranks]
    for _, stream in paths:
        stream.forward_done()
        stream.submit_state_store(7, blocks, slots)
    for device, _ in reversed(paths):
        device.run(COPIES_FIRST)
    cpu = cpu_path(c, whole, regions[1])
    cpu.submit_state_store(7, blocks, slots)
    assert all(results(stream) == [(7, True)] for _, stream in paths) and results(cpu) == [(7, True)]
    assert same(region_rows(regions[0], c), region_rows(regions[1], c))
    for _, stream in paths:
        stream.close()
    cpu.close()


@pytest.mark.parametrize("kind", STATE_KINDS)
@pytest.mark.parametrize("tp_size, rank", TP_RANKS)
@pytest.mark.parametrize("dtypes", sorted(DTYPES))
def test_a_state_load_writes_the_blocks_the_cpu_path_writes_and_no_other(
    regions: tuple[HostRegion, HostRegion], kind: str, tp_size: int, rank: int, dtypes: str
) -> None:
    c = case("flash_nhd")
    s = state_case(kind, c.layout.row_bytes, tp_size, rank, dtypes)
    stream_dst, cpu_dst = s.zeros(), s.zeros()
    device, stream = stream_path(c, s, regions[0], stream_dst)
    cpu = cpu_path(c, s, regions[0], cpu_dst)  # both read the same rows
    blocks, slots = s.blocks(seed=rank + 5), slots_for(s, seed=rank + 5)
    stream.submit_state_load(2, blocks, slots)
    cpu.submit_state_load(2, blocks, slots)
    assert results(cpu) == [(2, True)]
    assert stream.poll() == [] and not any(t.any() for parts in stream_dst for t in parts)
    device.run(SCHEDULES[rank + tp_size])
    assert results(stream) == [(2, True)]
    for layer, block in enumerate(blocks):
        for got, want in zip(stream_dst[layer], cpu_dst[layer], strict=True):
            assert same(got, want) and got[block].any()
            assert not got[[b for b in range(len(got)) if b != block]].any()
    stream.close()
    cpu.close()


def test_state_jobs_that_cannot_be_copied_fail_after_their_event_writing_nothing(
    regions: tuple[HostRegion, HostRegion],
) -> None:
    c = case("flash_nhd")
    s = state_case("mamba2", c.layout.row_bytes, 2, 1)
    dst = s.zeros()
    device, stream = stream_path(c, s, regions[0], dst)
    before = region_rows(regions[0], c).clone()
    slots = slots_for(s, seed=1)
    stream.forward_done()
    stream.submit_state_store(1, s.blocks(seed=1), [slots[0]] * len(slots))  # one slot twice
    stream.submit_state_load(2, (0, 99, 1), slots)  # block 99 does not exist
    stream.submit_state_load(3, s.blocks(seed=2), slots[:1])  # a segment is more rows than one
    assert stream.poll() == []
    device.run()
    assert sorted(results(stream)) == [(1, False), (2, False), (3, False)]
    assert same(region_rows(regions[0], c), before) and not any(t.any() for parts in dst for t in parts)
    stream.close()

    plain = StreamTransfer(c.plan, c.tensors, EmulatedDevice())  # no state tensors handed over
    plain.attach(regions[0].name, "/dev/shm")
    plain.submit_state_store(4, s.blocks(seed=1), slots)
    cpu = CpuTransfer(c.plan, c.tensors)
    cpu.attach(regions[1].name, "/dev/shm")
    cpu.submit_state_load(5, s.blocks(seed=1), slots)
    assert results(plain) == [(4, False)] and results(cpu) == [(5, False)]
    plain.close()
    cpu.close()


def test_state_tensors_on_another_device_than_the_kv_tensors_are_refused() -> None:
    c = case("flash_nhd")
    s = state_case("gdn", c.layout.row_bytes)
    transfer = StreamTransfer(c.plan, c.tensors, EmulatedDevice())
    meta = [[torch.empty_like(t, device="meta") for t in parts] for parts in s.tensors]
    with pytest.raises(ValueError, match="state tensors on"):
        transfer.add_states(s.copier(meta))
    assert transfer.states is None
