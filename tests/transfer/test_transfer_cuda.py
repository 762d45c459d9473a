"""The CUDA path on a real GPU (skipped without one): pinned host region, copies on the copy
streams, round trips through vLLM's CUDA layouts byte-identical, and the stream ordering that keeps
the forward pass and the copies apart. `scripts/cuda_check.py` measures the bandwidth."""

from __future__ import annotations

import time

import pytest
import torch

from kvtier.engine.copies import ChunkCopy
from kvtier.engine.step import StepPlan
from kvtier.format.layout import CanonicalLayout, TPShard
from kvtier.host.region import HostRegion
from kvtier.integrations.vllm.model.backend_layouts import engine_layout
from kvtier.transfer import CopyResult
from kvtier.transfer.copy_plan import CopyPlan
from kvtier.transfer.cuda import CudaStreams, cuda_transfer
from kvtier.transfer.stream import CopyEvent, Direction, StreamTransfer
from tests.engine import fakes as halves
from tests.format.helpers import make_rows, same
from tests.optional import CUDA
from tests.transfer.helpers import (
    BLOCK,
    GROUP_KINDS,
    HEAD_DIM,
    HEADS,
    LAYERS,
    NUM_BLOCKS,
    NUM_SLOTS,
    case,
    job,
    layer_tensors,
)

pytestmark = CUDA.skipif(not torch.cuda.is_available())

SLEEP_CYCLES = 1_000_000_000  # about half a second of a GPU's clock


def busy() -> None:
    """Queue about half a second of work on the current stream."""
    torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]


def wait_for(transfer: StreamTransfer, count: int, timeout: float = 30.0) -> list[CopyResult]:
    results: list[CopyResult] = []
    deadline = time.monotonic() + timeout
    while len(results) < count:
        results += transfer.poll()
        assert time.monotonic() < deadline, f"{len(results)} of {count} copies ended in {timeout} s"
        time.sleep(0.001)
    return results


def setup(
    region: HostRegion, kind: str = "flash_nhd", bpc: int = 1, shard: TPShard | None = None, seed: int = 0
) -> tuple[StreamTransfer, list[torch.Tensor]]:
    shard = shard or TPShard(HEADS)
    name, src = layer_tensors(kind, shard.num_heads, torch.Generator().manual_seed(seed), "cuda")
    layout = CanonicalLayout(LAYERS, HEADS, HEAD_DIM, BLOCK * bpc, torch.bfloat16)
    plan = CopyPlan(layout, engine_layout(name), shard, BLOCK)
    transfer = cuda_transfer(plan, src, staging_bytes=2 * 2 * LAYERS * HEADS * BLOCK * bpc * HEAD_DIM * 2)
    transfer.attach(region.name, "/dev/shm")
    return transfer, src


def reference_rows(
    transfer: StreamTransfer, src: list[torch.Tensor], blocks: list[list[int]], slots: list[int]
) -> torch.Tensor:
    """The rows `CopyPlan` writes from CPU copies of `src`."""
    _, rows = make_rows(transfer.plan.layout, NUM_SLOTS)
    transfer.plan.engine_to_host([t.cpu() for t in src], blocks, rows, slots)
    return rows


@pytest.mark.parametrize("kind", ["flash_hnd", "flash_nhd", "flash_cross_layer", "stacked_kv"])
@pytest.mark.parametrize("bpc", [1, 2])
@pytest.mark.parametrize("tp_size, rank", [(1, 0), (2, 1)])
def test_round_trip_device_host_device_is_byte_identical(
    region: HostRegion, kind: str, bpc: int, tp_size: int, rank: int
) -> None:
    shard = TPShard(HEADS, tp_size, rank)
    transfer, src = setup(region, kind, bpc, shard)
    assert transfer.rows is not None and transfer.rows.is_pinned()
    blocks, slots = job(bpc, 5, seed=bpc + rank)
    transfer.forward_done()
    transfer.submit_store(1, blocks, slots)
    [stored] = wait_for(transfer, 1)
    assert stored.ok and stored.seconds > 0
    assert same(transfer.rows[:NUM_SLOTS], reference_rows(transfer, src, blocks, slots))

    loader, dst = setup(region, kind, bpc, shard, seed=1)
    for t in dst:
        t.zero_()
    loader.submit_load(2, blocks, slots)
    [loaded] = wait_for(loader, 1)
    assert loaded.ok
    picked = [b for ids in blocks for b in ids]
    rest = [b for b in range(NUM_BLOCKS) if b not in picked]
    for got, want in zip(dst, src, strict=True):
        (gk, gv), (wk, wv) = transfer.plan.engine_views(got), transfer.plan.engine_views(want)
        assert same(gk[picked], wk[picked]) and same(gv[picked], wv[picked])
        assert not gk[rest].any() and not gv[rest].any()
    loader.close()
    transfer.close()


@pytest.mark.parametrize("kind", GROUP_KINDS)
@pytest.mark.parametrize("tp_size, rank", [(1, 0), (2, 1), (8, 5)])
def test_every_kind_copies_as_the_cpu_path_does(
    region: HostRegion, kind: str, tp_size: int, rank: int
) -> None:
    """Several KV cache groups (a load skipping sliding-window blocks), MLA latents, fp8 as uint8:
    the rows a store writes and the blocks a load writes are the CPU path's, byte for byte."""
    c = case(kind, tp_size, rank, bpc=2, seed=rank, device="cuda")
    transfer = cuda_transfer(c.plan, c.tensors, staging_bytes=1)
    transfer.attach(region.name, "/dev/shm")
    assert transfer.rows is not None
    blocks, slots = c.blocks(4, seed=rank)
    transfer.forward_done()
    transfer.submit_store(1, blocks, slots)
    [stored] = wait_for(transfer, 1)
    _, expected = make_rows(c.layout, NUM_SLOTS)
    c.plan.engine_to_host([t.cpu() for t in c.tensors], blocks, expected, slots)
    assert stored.ok and same(transfer.rows[:NUM_SLOTS], expected)

    transfer.rows[:NUM_SLOTS] = torch.randint(0, 256, tuple(expected.shape), dtype=torch.uint8)
    dst = c.zeros()
    loader = cuda_transfer(c.plan, dst, staging_bytes=1)
    loader.attach(region.name, "/dev/shm")
    blocks, slots = c.blocks(4, seed=rank + 1, skip=True)
    loader.submit_load(2, blocks, slots)
    [loaded] = wait_for(loader, 1)
    want = [torch.zeros_like(t, device="cpu") for t in c.tensors]
    c.plan.host_to_engine(want, blocks, transfer.rows[:NUM_SLOTS], slots)
    assert loaded.ok and all(same(got.cpu(), w) for got, w in zip(dst, want, strict=True))
    loader.close()
    transfer.close()


def test_a_store_waits_for_the_forward_pass_without_blocking_the_caller(region: HostRegion) -> None:
    transfer, src = setup(region)
    transfer.forward_done()
    transfer.submit_store(1, [[1]], [0])  # warm-up: allocators, pinned index buffers
    wait_for(transfer, 1)
    expected = reference_rows(transfer, src, [[2], [3]], [1, 2])
    busy()  # the "forward pass" still running on the compute stream
    compute = torch.cuda.current_stream()
    transfer.forward_done()
    transfer.submit_store(2, [[2], [3]], [1, 2])
    # Both calls returned, and the store is not reported, while the forward pass still runs.
    assert transfer.poll() == []
    assert not compute.query()
    [result] = wait_for(transfer, 1)
    assert result.ok and transfer.rows is not None and same(transfer.rows[1:3], expected[1:3])
    transfer.close()


class NoComputeWait(CudaStreams):
    """The control: copy streams whose forward pass never waits for running stores."""

    def compute_waits(self, event: CopyEvent) -> None:
        return None


@pytest.mark.parametrize("ordered", [True, False])
def test_the_next_forward_pass_waits_for_a_running_store(region: HostRegion, ordered: bool) -> None:
    transfer, src = setup(region)
    if not ordered:
        transfer.streams = NoComputeWait(src[0].device)
    streams = transfer.streams
    assert isinstance(streams, CudaStreams)
    transfer.before_forward()  # vLLM forwards its pre-forward hook
    transfer.forward_done()
    transfer.submit_store(1, [[1]], [0])
    wait_for(transfer, 1)
    expected = reference_rows(transfer, src, [[4]], [5])
    with torch.cuda.stream(streams.stream(Direction.STORE)):
        busy()  # this store starts late
    transfer.forward_done()
    transfer.submit_store(2, [[4]], [5])
    transfer.before_forward()
    for t in src:
        t.zero_()  # the next forward pass overwrites the (freed and reallocated) block
    torch.cuda.synchronize()
    assert transfer.rows is not None
    assert same(transfer.rows[5], expected[5]) == ordered  # without the wait, the store reads zeros
    transfer.close()


def test_a_load_is_reported_only_after_its_copy(region: HostRegion) -> None:
    transfer, src = setup(region)
    transfer.forward_done()
    transfer.submit_store(1, [[6]], [3])
    wait_for(transfer, 1)
    dst_transfer, dst = setup(region, seed=2)
    streams = dst_transfer.streams
    assert isinstance(streams, CudaStreams)
    with torch.cuda.stream(streams.stream(Direction.LOAD)):
        busy()
    dst_transfer.submit_load(2, [[7]], [3])
    assert dst_transfer.poll() == []
    assert not streams.stream(Direction.LOAD).query()  # the poll came while the copy waited
    [result] = wait_for(dst_transfer, 1)
    assert result.ok
    for got, want in zip(dst, src, strict=True):
        (gk, gv), (wk, wv) = transfer.plan.engine_views(got), transfer.plan.engine_views(want)
        assert same(gk[7], wk[6]) and same(gv[7], wv[6])
    dst_transfer.close()
    transfer.close()


def test_the_worker_half_copies_cuda_tensors_asynchronously() -> None:
    region = HostRegion.create(8 * halves.ROW_BYTES)
    caches = {n: t.cuda() for n, t in halves.kv_caches(16).items()}
    worker = halves.copier(halves.geometry(), 0, caches)
    assert isinstance(worker.transfer, StreamTransfer)
    store = ChunkCopy(1, "r1", (b"a" * 32,), ((2,),), (0,))
    meta = StepPlan(region.name, "/dev/shm", stores=(store,))
    worker.before_forward()
    worker.save(meta)
    deadline = time.monotonic() + 30
    while (out := worker.take_report()) is None:
        assert time.monotonic() < deadline
    assert out.stores == {1: (1, True)}
    load = ChunkCopy(2, "r2", (b"a" * 32,), ((9,),), (0,))
    worker.start_load(StepPlan(region.name, "/dev/shm", loads=(load,)))
    while not (done := worker.take_finished_loads()):
        assert time.monotonic() < deadline
    assert done == {"r2"} and worker.take_load_errors() == set()
    for kv in caches.values():
        assert torch.equal(kv[9].view(torch.int16), kv[2].view(torch.int16))
    worker.shutdown()
    region.close()
