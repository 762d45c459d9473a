"""The copier (`CopyDriver`) and `kvtier.transfer` without an engine: copies through the host
region, attached by name (also from another process), and failures reported as values."""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import Iterator

import pytest
import torch

from kvtier.engine.copier import CopyDriver
from kvtier.engine.copies import ChunkCopy
from kvtier.engine.step import StepPlan
from kvtier.format.layout import TPShard
from kvtier.host.region import HostRegion
from kvtier.integrations.vllm.model.backend_layouts import engine_layout
from kvtier.transfer import CpuTransfer
from kvtier.transfer.copy_plan import CopyPlan
from tests.engine.fakes import (
    BLOCK,
    HEAD_DIM,
    HEADS,
    KEYS,
    ROW_BYTES,
    copier,
    geometry,
    kv_caches,
    rank_load,
    rank_store,
    store_in_child,
)


@pytest.fixture
def region() -> Iterator[HostRegion]:
    r = HostRegion.create(8 * ROW_BYTES)
    yield r
    r.close()


def worker_with(caches: dict[str, torch.Tensor]) -> CopyDriver:
    return copier(geometry(), 0, caches)


def same_blocks(a: dict[str, torch.Tensor], ia: int, b: dict[str, torch.Tensor], ib: int) -> bool:
    return all(torch.equal(a[n][ia].view(torch.int16), b[n][ib].view(torch.int16)) for n in a)


def test_store_then_load_restores_the_exact_bytes(region: HostRegion) -> None:
    caches = kv_caches(16)
    worker = worker_with(caches)
    store = ChunkCopy(1, "r1", KEYS, ((2,), (5,)), (0, 3))
    worker.save(StepPlan(region.name, "/dev/shm", stores=(store,)))
    meta = worker.take_report()
    assert meta is not None and meta.stores == {1: (1, True)}
    assert worker.take_report() is None

    load = ChunkCopy(2, "r2", KEYS, ((9,), (10,)), (0, 3))
    worker.start_load(StepPlan(region.name, "/dev/shm", loads=(load,)))
    assert worker.take_finished_loads() == {"r2"}
    assert worker.take_load_errors() == set()
    assert same_blocks(caches, 9, caches, 2) and same_blocks(caches, 10, caches, 5)
    assert not same_blocks(caches, 9, caches, 5)
    worker.shutdown()


def test_load_without_pinned_rows_fails_its_blocks(region: HostRegion) -> None:
    worker = worker_with(kv_caches(16))
    load = ChunkCopy(1, "r1", KEYS, ((4,), (6,)), ())
    worker.start_load(StepPlan(region.name, "/dev/shm", loads=(load,)))
    assert worker.take_finished_loads() == {"r1"}
    assert worker.take_load_errors() == {4, 6}
    worker.shutdown()


def test_a_synchronous_load_is_reported_in_the_worker_meta_only(region: HostRegion) -> None:
    """vLLM takes no finished request for a synchronous load (its request is running); the
    planner releases its pins from the worker meta, and a failed one's blocks are load
    errors."""
    caches = kv_caches(16)
    worker = worker_with(caches)
    store = ChunkCopy(1, "r1", KEYS, ((2,), (5,)), (0, 3))
    worker.save(StepPlan(region.name, "/dev/shm", stores=(store,)))
    worker.take_report()
    good = ChunkCopy(2, "r2", KEYS, ((9,), (10,)), (0, 3), sync=True)
    bad = ChunkCopy(3, "r3", KEYS, ((11,), (12,)), (), sync=True)
    worker.start_load(StepPlan(region.name, "/dev/shm", loads=(good, bad)))
    assert worker.take_finished_loads() == set()
    assert worker.take_load_errors() == {11, 12}
    meta = worker.take_report()
    assert meta is not None and meta.loads == {2: (1, True), 3: (1, False)}
    assert same_blocks(caches, 9, caches, 2) and same_blocks(caches, 10, caches, 5)
    worker.shutdown()


def test_register_rejects_an_unexpected_layout() -> None:
    caches = {n: t[:, :1] for n, t in kv_caches(4).items()}  # one head where two are expected
    with pytest.raises(ValueError, match=r"layer model\.layers\.0"):
        worker_with(caches)
    with pytest.raises(ValueError, match="no KV cache tensor"):
        worker_with({})


def test_transfer_refuses_non_cpu_tensors() -> None:
    layout = geometry().layout
    plan = CopyPlan(layout, engine_layout("vllm_cpu"), TPShard(HEADS), BLOCK)
    meta_kv = torch.empty((4, HEADS, BLOCK, 2 * HEAD_DIM), dtype=torch.bfloat16, device="meta")
    with pytest.raises(NotImplementedError, match="CPU tensors only"):
        CpuTransfer(plan, [meta_kv, meta_kv])


@pytest.mark.slow
def test_a_worker_in_another_process_writes_the_same_rows(region: HostRegion) -> None:
    job = ChunkCopy(7, "r", KEYS, ((1,), (2,)), (4, 5))
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        ack = pool.apply(store_in_child, (region.name, "/dev/shm", job, 1))
    assert ack == (1, True)
    caches = kv_caches(16, seed=2)
    worker = worker_with(caches)
    load = ChunkCopy(8, "r", KEYS, ((11,), (12,)), (4, 5))
    worker.start_load(StepPlan(region.name, "/dev/shm", loads=(load,)))
    assert worker.take_load_errors() == set()
    child = kv_caches(16, seed=1)
    assert same_blocks(caches, 11, child, 1) and same_blocks(caches, 12, child, 2)
    worker.shutdown()


@pytest.mark.slow
def test_tp2_ranks_write_one_row_that_tp1_reads_and_back(region: HostRegion) -> None:
    """Consolidation: two copier processes (TP ranks 0 and 1, one KV head each) write their
    shards into the same host rows; a TP=1 worker reads whole heads back, and the reverse."""
    store = ChunkCopy(1, "r", KEYS, ((3,), (7,)), (1, 6))
    full = kv_caches(16, seed=1)
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        acks = pool.starmap(rank_store, [(region.name, store, 1, 0), (region.name, store, 1, 1)])
        assert acks == [(1, True), (1, True)]
        caches = kv_caches(16, seed=3)
        worker = worker_with(caches)
        load = ChunkCopy(2, "r", KEYS, ((0,), (1,)), (1, 6))
        worker.start_load(StepPlan(region.name, "/dev/shm", loads=(load,)))
        assert same_blocks(caches, 0, full, 3) and same_blocks(caches, 1, full, 7)

        other = kv_caches(16, seed=4)
        tp1 = worker_with(other)
        store = ChunkCopy(3, "r", KEYS, ((5,), (9,)), (2, 4))
        tp1.save(StepPlan(region.name, "/dev/shm", stores=(store,)))
        load = ChunkCopy(4, "r", KEYS, ((12,), (13,)), (2, 4))
        shards = pool.starmap(rank_load, [(region.name, load, 0), (region.name, load, 1)])
    for rank, loaded in enumerate(shards):
        for name, kv in other.items():
            expected = kv[[5, 9], rank : rank + 1]
            assert torch.equal(loaded[name].view(torch.int16), expected.view(torch.int16))
    worker.shutdown()
    tp1.shutdown()


def test_with_several_kv_cache_groups_a_failed_load_fails_its_request_with_its_last_part(
    region: HostRegion,
) -> None:
    """vLLM takes no block-level load errors from an engine with several groups (block ids are
    per group): the request is reported failed, when its last part ends."""
    worker = CopyDriver(dataclasses.replace(geometry(), layer_groups=(0, 1)), tp_rank=0)
    first = ChunkCopy(1, "r1", KEYS[:1], ((4,),), (), last=False)
    worker.start_load(StepPlan(region.name, "/dev/shm", loads=(first,)))
    assert worker.take_finished_loads() == set() and worker.take_failed_loads() == set()
    rest = ChunkCopy(2, "r1", KEYS[1:], ((6,),), ())
    worker.start_load(StepPlan(region.name, "/dev/shm", loads=(rest,)))
    assert worker.take_finished_loads() == {"r1"} and worker.take_failed_loads() == {"r1"}
    assert worker.take_load_errors() == set()
    worker.shutdown()
