"""`StagedCopy` (the CUDA path's copies, run here on CPU tensors) against `CopyPlan`: the same row
bytes for every engine layout and physical stride order, TP shard and chunk size; batching; the
contiguous runs; checks before any copy."""

from __future__ import annotations

import pytest
import torch

from kvtier.format.layout import CanonicalLayout, TPShard
from kvtier.integrations.vllm.model.backend_layouts import engine_layout
from kvtier.transfer.copy_plan import CopyPlan
from kvtier.transfer.staged import StagedCopy
from tests.format.helpers import make_rows, same
from tests.transfer.helpers import BLOCK, HEAD_DIM, HEADS, LAYERS, NUM_BLOCKS, NUM_SLOTS, job, layer_tensors

KINDS = ["vllm_cpu", "flash_hnd", "flash_nhd", "flash_cross_layer", "stacked_kv"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bpc", [1, 2])
@pytest.mark.parametrize("tp_size, rank", [(1, 0), (2, 1), (8, 5)])
@pytest.mark.parametrize("staging_bytes", [1, 1 << 20])
def test_staged_copies_write_and_read_what_copy_plan_does(
    kind: str, bpc: int, tp_size: int, rank: int, staging_bytes: int
) -> None:
    shard = TPShard(HEADS, tp_size, rank)
    gen = torch.Generator().manual_seed(bpc * 10 + rank)
    name, src = layer_tensors(kind, shard.num_heads, gen)
    layout = CanonicalLayout(LAYERS, HEADS, HEAD_DIM, BLOCK * bpc, torch.bfloat16)
    plan = CopyPlan(layout, engine_layout(name), shard, BLOCK)
    blocks, slots = job(bpc, 4, seed=bpc + rank)
    _, expected = make_rows(layout, NUM_SLOTS)
    plan.engine_to_host(src, blocks, expected, slots)
    _, rows = make_rows(layout, NUM_SLOTS)
    StagedCopy(plan, src, staging_bytes).store(rows, blocks, slots)()
    assert same(rows, expected)
    if not shard.writes:
        assert not rows.any()
        first_replica = CopyPlan(layout, engine_layout(name), TPShard(HEADS, tp_size, rank - 1), BLOCK)
        first_replica.engine_to_host(src, blocks, rows, slots)  # the same heads' bytes, to read back

    expected_dst = [torch.zeros_like(t) for t in src]
    plan.host_to_engine(expected_dst, blocks, rows, slots)
    dst = [torch.zeros_like(t) for t in src]
    StagedCopy(plan, dst, staging_bytes).load(rows, blocks, slots)
    for got, want, orig in zip(dst, expected_dst, src, strict=True):
        assert same(got, want)
        k, v = plan.engine_views(got)
        k0, v0 = plan.engine_views(orig)
        picked = [b for ids in blocks for b in ids]
        assert same(k[picked], k0[picked]) and same(v[picked], v0[picked])


def test_runs_merge_what_is_contiguous_on_both_sides() -> None:
    layout = CanonicalLayout(2, 2, HEAD_DIM, BLOCK, torch.bfloat16)  # 512 bytes of a 4096-byte row
    src = [torch.zeros((NUM_BLOCKS, 2, BLOCK, 2 * HEAD_DIM), dtype=torch.bfloat16) for _ in range(2)]
    tp1 = StagedCopy(CopyPlan(layout, engine_layout("vllm_cpu"), TPShard(2), BLOCK), src)
    assert tp1.runs([3]) == [(3 * 4096, 0, 512, 1)]
    assert tp1.runs([3, 4, 1]) == [(3 * 4096, 0, 512, 2), (4096, 1024, 512, 1)]  # rows apart
    half = [t[:, :1] for t in src]
    tp2 = StagedCopy(CopyPlan(layout, engine_layout("vllm_cpu"), TPShard(2, 2, 1), BLOCK), half)
    head = 2 * 2 * BLOCK * HEAD_DIM * 2  # one head's K and V of both layers: 256 bytes
    # Rank 1's head is the second of two in a head-major row: one run, whatever the layer count.
    assert tp2.runs([0]) == [(head, 0, head, 1)]
    assert tp2.runs([0, 1, 2, 5]) == [(head, 0, head, 3), (5 * 4096 + head, 3 * head, head, 1)]
    packed = CanonicalLayout(2, 2, 16, 16, torch.bfloat16)  # exactly one 4096-byte row
    flat = [torch.zeros((NUM_BLOCKS, 2, 16, 32), dtype=torch.bfloat16) for _ in range(2)]
    whole = StagedCopy(CopyPlan(packed, engine_layout("vllm_cpu"), TPShard(2), 16), flat)
    assert whole.runs([2, 3, 4, 0]) == [(2 * 4096, 0, 3 * 4096, 1), (0, 3 * 4096, 4096, 1)]


def test_batches_bound_the_staging_memory() -> None:
    layout = CanonicalLayout(LAYERS, HEADS, HEAD_DIM, BLOCK, torch.bfloat16)
    _, src = layer_tensors("vllm_cpu", HEADS, torch.Generator().manual_seed(0))
    plan = CopyPlan(layout, engine_layout("vllm_cpu"), TPShard(HEADS), BLOCK)
    chunk = 2 * LAYERS * HEADS * BLOCK * HEAD_DIM * 2
    assert StagedCopy(plan, src, 3 * chunk + 1).chunks_per_batch == 3
    assert StagedCopy(plan, src, 1).chunks_per_batch == 1


def test_bad_jobs_raise_before_any_copy() -> None:
    layout = CanonicalLayout(LAYERS, HEADS, HEAD_DIM, BLOCK, torch.bfloat16)
    _, src = layer_tensors("flash_nhd", HEADS, torch.Generator().manual_seed(0))
    staged = StagedCopy(CopyPlan(layout, engine_layout("vllm_flash_attn"), TPShard(HEADS), BLOCK), src)
    _, rows = make_rows(layout, NUM_SLOTS)
    before = [t.clone() for t in src]
    bad = [
        ([[1], [NUM_BLOCKS]], [0, 1], "block ids must lie"),
        ([[1], [2]], [0, NUM_SLOTS], "slots must lie"),
        ([[1, 2]], [0], "exactly 1 block ids"),
        ([[1]], [0, 1], "chunks of blocks"),
    ]
    for blocks, slots, message in bad:
        with pytest.raises(ValueError, match=message):
            staged.store(rows, blocks, slots)
        with pytest.raises(ValueError, match=message):
            staged.load(rows, blocks, slots)
    with pytest.raises(ValueError, match="slots must be distinct"):
        staged.store(rows, [[1], [2]], [3, 3])
    with pytest.raises(ValueError, match="block ids must be distinct"):
        staged.load(rows, [[1], [1]], [3, 4])
    assert not rows.any()
    assert all(same(a, b) for a, b in zip(src, before, strict=True))
    with pytest.raises(ValueError, match="layer tensors"):
        StagedCopy(staged.plan, src[:1])


def test_a_store_reads_every_block_before_its_fence() -> None:
    """What `store` queues reads every engine block of the job (the fence: the next pass may then
    write them); the host copies of the last batch come only from the callable it returns. A
    block overwritten after the fence still reaches the rows as it was read."""
    layout = CanonicalLayout(LAYERS, HEADS, HEAD_DIM, BLOCK, torch.bfloat16)
    _, src = layer_tensors("vllm_cpu", HEADS, torch.Generator().manual_seed(3))
    plan = CopyPlan(layout, engine_layout("vllm_cpu"), TPShard(HEADS), BLOCK)
    blocks, slots = [[1], [5], [6]], [0, 2, 3]
    _, expected = make_rows(layout, NUM_SLOTS)
    plan.engine_to_host(src, blocks, expected, slots)
    chunk = 2 * LAYERS * HEADS * BLOCK * HEAD_DIM * 2
    for staging_bytes, written_before in ((3 * chunk, []), (2 * chunk, [0, 2])):
        _, rows = make_rows(layout, NUM_SLOTS)
        engine = [t.clone() for t in src]
        rest = StagedCopy(plan, engine, staging_bytes).store(rows, blocks, slots)
        assert [s for s in slots if rows[s].any()] == written_before  # earlier batches only
        for t in engine:
            t.zero_()  # the next pass writes the blocks once the fence is passed
        rest()
        assert same(rows, expected)


def test_block_counts_are_derived_once_per_set_of_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job's checks need each group's block count; the engine views behind it are derived once
    for an engine's tensors, not for every layer of every job (the engine thread's launch cost)."""
    layout = CanonicalLayout(LAYERS, HEADS, HEAD_DIM, BLOCK, torch.bfloat16)
    _, src = layer_tensors("vllm_cpu", HEADS, torch.Generator().manual_seed(0))
    plan = CopyPlan(layout, engine_layout("vllm_cpu"), TPShard(HEADS), BLOCK)
    staged = StagedCopy(plan, src)
    _, rows = make_rows(layout, NUM_SLOTS)
    views = 0
    derive = plan.engine_views

    def counted(kv: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, ...]:
        nonlocal views
        views += 1
        return derive(kv, group)

    monkeypatch.setattr(plan, "engine_views", counted)
    staged.store(rows, [[1], [2]], [0, 1])()
    assert 0 < views <= LAYERS
    views = 0
    for _ in range(3):
        staged.store(rows, [[1], [2]], [0, 1])()
        staged.load(rows, [[3], [4]], [0, 1])
    assert views == 0
    fewer = [t[: NUM_BLOCKS // 2] for t in src]
    assert plan.block_counts(fewer) == [NUM_BLOCKS // 2] and views == LAYERS
    with pytest.raises(ValueError, match="block ids must lie"):
        plan.pairs(fewer, [[NUM_BLOCKS // 2]], rows, [0], to_host=True)


def test_consecutive_slots_at_tp2_move_in_one_strided_copy_each_way() -> None:
    """A rank's spans of consecutive rows are one row apart: one 2-D copy per run of slots, the
    bytes the CPU path writes, and back."""
    layout = CanonicalLayout(LAYERS, HEADS, HEAD_DIM, BLOCK, torch.bfloat16)
    shard = TPShard(HEADS, 2, 1)
    _, src = layer_tensors("vllm_cpu", shard.num_heads, torch.Generator().manual_seed(5))
    plan = CopyPlan(layout, engine_layout("vllm_cpu"), shard, BLOCK)
    blocks, slots = [[1], [2], [3], [6]], [2, 3, 4, 0]
    _, expected = make_rows(layout, NUM_SLOTS)
    plan.engine_to_host(src, blocks, expected, slots)
    calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def strided(dst: torch.Tensor, source: torch.Tensor) -> None:
        calls.append((tuple(dst.shape), tuple(dst.stride())))
        dst.copy_(source)

    staged = StagedCopy(plan, src, strided_copy=strided)
    assert len(staged.runs(slots)) == 2
    _, rows = make_rows(layout, NUM_SLOTS)
    staged.store(rows, blocks, slots)()
    assert same(rows, expected)
    assert calls == [((3, staged.chunk_bytes), (layout.row_bytes, 1))]
    dst = [torch.zeros_like(t) for t in src]
    StagedCopy(plan, dst, strided_copy=strided).load(rows, blocks, slots)
    assert calls[1] == ((3, staged.chunk_bytes), (staged.chunk_bytes, 1))
    want = [torch.zeros_like(t) for t in src]
    plan.host_to_engine(want, blocks, rows, slots)
    assert all(same(a, b) for a, b in zip(dst, want, strict=True))
