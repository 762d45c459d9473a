"""Engine blocks split into kernel blocks (vLLM's `create_kv_cache_views(kernel_block_size=...)`:
FlashInfer on hybrids, FlashMLA, CUTLASS MLA), through the worker's `CopyDriver` on the CPU path
(`CpuTransfer`) and on the CUDA path (`StreamTransfer` over an emulated device), for every kind of
cache: vLLM's CPU layout, the CUDA layouts in HND and NHD order, older vLLM's stacked K/V, two KV
cache groups split differently with sliding-window blocks left out, MLA latents, fp8 held as uint8,
and a hybrid with gated delta net or Mamba2 states. What holds: the copier registers the split
tensors; a chunk stored from them is byte for byte the chunk stored from unsplit tensors of the
same tokens; rows load into split tensors as into unsplit ones, both ways; state segments (per
block, not per token) are untouched by the split; a tensor whose blocks do not split the engine's
is refused at registration, naming the layer and the sizes."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import pytest
import torch

from kvtier.engine.copier import CopyDriver, TransferFactory
from kvtier.engine.copies import ChunkCopy, StateCopy
from kvtier.engine.geometry import EngineGeometry
from kvtier.engine.step import StepPlan
from kvtier.format.keys import ModelFingerprint
from kvtier.format.layout import host_rows
from kvtier.host.region import HostRegion
from kvtier.transfer import make_transfer
from kvtier.transfer.copy_plan import CopyPlan
from kvtier.transfer.state_copier import StateCopier
from kvtier.transfer.stream import StreamTransfer
from tests.format.helpers import random_kv, same
from tests.transfer.emulated_device import COMPUTE_FIRST, EmulatedDevice
from tests.transfer.helpers import BLOCK, HEAD_DIM, LAYERS, NUM_SLOTS, Case, case
from tests.transfer.kernel_blocks import SPLIT_KINDS, group_ratios, split_tensors, unsplit_tensors
from tests.transfer.state_helpers import STATE_KINDS, state_case

NAMES = tuple(f"model.layers.{i}.attn" for i in range(LAYERS))
PATHS = ["cpu", "stream"]
CHUNKS = 3


@pytest.fixture
def regions() -> Iterator[tuple[HostRegion, HostRegion]]:
    """Two host regions of the same random bytes: one for unsplit tensors, one for split ones."""
    a, b = HostRegion.create(2 * NUM_SLOTS * 8192), HostRegion.create(2 * NUM_SLOTS * 8192)
    noise = random_kv((a.size,), torch.uint8, torch.Generator().manual_seed(3))
    for r in (a, b):
        torch.frombuffer(r.buf, dtype=torch.uint8, count=r.size).copy_(noise)
    yield a, b
    a.close()
    b.close()


def geometry(c: Case) -> EngineGeometry:
    lay, shard = c.layout, c.plan.shard
    dtype = str(lay.dtype)
    fingerprint = ModelFingerprint("tiny", "", dtype, dtype, LAYERS, lay.num_kv_heads, HEAD_DIM)
    groups = c.plan.layer_groups if c.plan.num_groups > 1 else ()
    return EngineGeometry(fingerprint, lay, BLOCK, c.plan.blocks_per_chunk, NAMES, shard.tp_size, groups)


def run_step(c: Case, tensors: Sequence[torch.Tensor], path: str, region: HostRegion,
             plan: StepPlan, states: StateCopier | None = None) -> None:
    """A `CopyDriver` of `c`'s rank registered over `tensors` on `path`, running `plan` (its loads,
    then its stores) to the end; every copy must succeed."""
    device = EmulatedDevice()

    def on_device(p: CopyPlan, t: Sequence[torch.Tensor]) -> StreamTransfer:
        return StreamTransfer(p, t, device)

    factory: TransferFactory = on_device if path == "stream" else make_transfer
    driver = CopyDriver(geometry(c), c.plan.shard.rank, factory)
    driver.register(dict(zip(NAMES, tensors, strict=True)), lambda kv: c.plan.engine, states)
    plan.region_name = region.name
    driver.start_load(plan)
    driver.save(plan)
    device.run(COMPUTE_FIRST)
    report = driver.take_report()
    jobs: list[ChunkCopy | StateCopy] = [*plan.loads, *plan.stores, *plan.state_loads, *plan.state_stores]
    assert report is not None and {**report.stores, **report.loads} == {j.job_id: (1, True) for j in jobs}
    driver.shutdown()


def chunk_copy(job_id: int, blocks: list[list[int]], slots: list[int]) -> ChunkCopy:
    keys = tuple(bytes([i]) * 32 for i in range(len(slots)))
    return ChunkCopy(job_id, f"r{job_id}", keys, tuple(map(tuple, blocks)), tuple(slots))


def stores(*copies: ChunkCopy | StateCopy) -> StepPlan:
    return StepPlan("", "/dev/shm", stores=tuple(c for c in copies if isinstance(c, ChunkCopy)),
                    state_stores=tuple(c for c in copies if isinstance(c, StateCopy)))


def loads(*copies: ChunkCopy | StateCopy) -> StepPlan:
    return StepPlan("", "/dev/shm", loads=tuple(c for c in copies if isinstance(c, ChunkCopy)),
                    state_loads=tuple(c for c in copies if isinstance(c, StateCopy)))


def rows_of(region: HostRegion, c: Case) -> torch.Tensor:
    return host_rows(region.buf, c.layout.row_bytes, region.size // c.layout.row_bytes)


@pytest.mark.parametrize("kind", SPLIT_KINDS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("tp_size, rank", [(1, 0), (2, 1)])
@pytest.mark.parametrize("bpc, ratio", [(1, 2), (2, 4)])
def test_a_chunk_stored_from_kernel_blocks_is_the_chunk_stored_from_whole_blocks(
    regions: tuple[HostRegion, HostRegion],
    kind: str,
    path: str,
    tp_size: int,
    rank: int,
    bpc: int,
    ratio: int,
) -> None:
    c = case(kind, tp_size, rank, bpc, seed=ratio + rank)
    split = split_tensors(kind, c, group_ratios(kind, ratio))
    blocks, slots = c.blocks(CHUNKS, seed=rank)
    before = rows_of(regions[0], c).clone()
    for tensors, region in zip((c.tensors, split), regions, strict=True):
        run_step(c, tensors, path, region, stores(chunk_copy(1, blocks, slots)))
    whole, parts = rows_of(regions[0], c), rows_of(regions[1], c)
    assert same(whole, parts)
    assert same(whole[slots], before[slots]) != c.plan.shard.writes  # a replica writes nothing


@pytest.mark.parametrize("kind", SPLIT_KINDS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bpc, ratio", [(1, 2), (2, 4)])
def test_rows_load_into_kernel_blocks_as_into_whole_blocks(
    regions: tuple[HostRegion, HostRegion], kind: str, path: str, bpc: int, ratio: int
) -> None:
    c = case(kind, 2, 1, bpc, seed=ratio)
    ratios = group_ratios(kind, ratio)
    whole, split = c.zeros(), [torch.zeros_like(t) for t in split_tensors(kind, c, ratios)]
    blocks, slots = c.blocks(CHUNKS, seed=ratio, skip=True)
    run_step(c, whole, path, regions[0], loads(chunk_copy(2, blocks, slots)))
    run_step(c, split, path, regions[0], loads(chunk_copy(2, blocks, slots)))
    assert any(t.any() for t in whole)
    assert all(same(a, b) for a, b in zip(unsplit_tensors(c, split, ratios), whole, strict=True))


@pytest.mark.parametrize("kind", SPLIT_KINDS)
@pytest.mark.parametrize("path", PATHS)
def test_a_chunk_round_trips_between_split_and_whole_tensors(
    regions: tuple[HostRegion, HostRegion], kind: str, path: str
) -> None:
    """Stored from split tensors, loaded into unsplit ones, and the other way round: the loaded
    blocks hold the stored blocks' tokens."""
    c = case(kind, bpc=2, seed=5)
    ratios = group_ratios(kind, 2)
    src = split_tensors(kind, c, ratios)
    rng = random.Random(5)
    src_ids = rng.sample(range(10), 2 * c.plan.num_groups)
    dst_ids = rng.sample(range(10, 20), 2 * c.plan.num_groups)
    blocks, to_blocks = [src_ids], [dst_ids]
    run_step(c, src, path, regions[0], stores(chunk_copy(1, blocks, [4])))
    whole = c.zeros()
    run_step(c, whole, path, regions[0], loads(chunk_copy(2, to_blocks, [4])))
    run_step(c, c.tensors, path, regions[1], stores(chunk_copy(3, blocks, [4])))
    parts = [torch.zeros_like(t) for t in src]
    run_step(c, parts, path, regions[1], loads(chunk_copy(4, to_blocks, [4])))
    for layer, (loaded_whole, loaded_parts) in enumerate(
        zip(whole, unsplit_tensors(c, parts, ratios), strict=True)
    ):
        g = c.plan.layer_groups[layer]
        bpc = c.plan.blocks_per_chunk
        src_g, dst_g = src_ids[g * bpc : (g + 1) * bpc], dst_ids[g * bpc : (g + 1) * bpc]
        for want, got_whole, got_parts in zip(
            c.plan.engine_views(c.tensors[layer]), c.plan.engine_views(loaded_whole),
            c.plan.engine_views(loaded_parts), strict=True,
        ):
            assert same(got_whole[dst_g], want[src_g]) and same(got_parts[dst_g], want[src_g])


@pytest.mark.parametrize("state_kind", STATE_KINDS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("tp_size, rank", [(1, 0), (2, 1)])
def test_a_hybrids_states_copy_by_block_beside_split_attention(
    regions: tuple[HostRegion, HostRegion], state_kind: str, path: str, tp_size: int, rank: int
) -> None:
    """A hybrid (FlashInfer aligns its attention blocks up and splits them): chunk and state
    segment stored from split attention tensors are the bytes stored from unsplit ones; loaded
    back into either, the states and the tokens are the same (at TP 1: the stored ones)."""
    c = case("flash_nhd", tp_size, rank, bpc=2, seed=7)
    ratios = group_ratios("flash_nhd", 4)
    s = state_case(state_kind, c.layout.row_bytes, tp_size, rank, seed=8)
    state_slots = tuple(range(NUM_SLOTS, NUM_SLOTS + s.layout.rows))
    keys = tuple(bytes([9]) * 32 for _ in state_slots)
    blocks, slots = c.blocks(CHUNKS, seed=9)
    state_blocks = tuple(blocks[-1][-1] for _ in s.layout.layers)  # the state at the chunk's end
    copies = (chunk_copy(1, blocks, slots), StateCopy(2, "r1", keys, state_blocks, state_slots))
    split = split_tensors("flash_nhd", c, ratios)
    for tensors, region in zip((c.tensors, split), regions, strict=True):
        run_step(c, tensors, path, region, stores(*copies), s.copier())
    assert same(rows_of(regions[0], c), rows_of(regions[1], c))

    to_blocks, _ = c.blocks(CHUNKS, seed=10)
    to_states = tuple(to_blocks[-1][-1] for _ in s.layout.layers)
    back = loads(StateCopy(3, "r2", keys, to_states, state_slots), chunk_copy(4, to_blocks, slots))
    loaded: list[tuple[list[list[torch.Tensor]], list[torch.Tensor]]] = []
    for tensors, region in zip((c.tensors, split), regions, strict=True):
        dst_states, dst = s.zeros(), [torch.zeros_like(t) for t in tensors]
        run_step(c, dst, path, region, back, s.copier(dst_states))
        loaded.append((dst_states, dst))
    (whole_states, whole), (split_states, parts) = loaded
    for x, y in zip(whole_states, split_states, strict=True):
        assert all(same(a, b) for a, b in zip(x, y, strict=True))
    assert all(same(a, b) for a, b in zip(whole, unsplit_tensors(c, parts, ratios), strict=True))
    if tp_size == 1:
        src_ids, dst_ids = [b for ids in blocks for b in ids], [b for ids in to_blocks for b in ids]
        for kv, got_kv in zip(c.tensors, whole, strict=True):
            for want, got in zip(c.plan.engine_views(kv), c.plan.engine_views(got_kv), strict=True):
                assert same(got[dst_ids], want[src_ids])
        for layer, (src_parts, got_parts) in enumerate(zip(s.tensors, whole_states, strict=True)):
            for want, got in zip(src_parts, got_parts, strict=True):
                assert same(got[to_states[layer]], want[state_blocks[layer]])


def test_blocks_that_do_not_split_the_engines_blocks_are_refused_naming_the_layer() -> None:
    c = case("flash_nhd")
    odd = [t.clone() for t in c.tensors]
    odd[1] = torch.zeros(2 * len(c.tensors[1]), 3, c.plan.shard.num_heads, 2 * HEAD_DIM,
                         dtype=torch.bfloat16).transpose(1, 2)
    with pytest.raises(ValueError, match=rf"layer {NAMES[1]}: .* blocks of 3 tokens, .* {BLOCK} tokens"):
        CopyDriver(geometry(c), 0).register(dict(zip(NAMES, odd, strict=True)), lambda kv: c.plan.engine)
    mixed = [*split_tensors("flash_nhd", c, (2,))[:2], *split_tensors("flash_nhd", c, (4,))[2:]]
    with pytest.raises(ValueError, match=rf"layers {NAMES[0]} and {NAMES[2]} of one KV cache group"):
        CopyDriver(geometry(c), 0).register(dict(zip(NAMES, mixed, strict=True)), lambda kv: c.plan.engine)


@pytest.mark.parametrize("order, kind", [("LBHNC", "flash_hnd"), ("LBNHC", "flash_nhd")])
def test_split_tensors_are_laid_out_as_vllm_lays_them_out(order: str, kind: str) -> None:
    """The split tensors above have the shape and strides of vLLM's own kernel-block views."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    c = case(kind)
    heads = c.plan.shard.num_heads
    spec = FullAttentionSpec(BLOCK, num_kv_heads=heads, head_size=HEAD_DIM, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    blocks = len(c.tensors[0])
    raw = torch.zeros(page * blocks, dtype=torch.int8)
    tensor = KVCacheTensor(page * blocks, ["layer"], layer_stride=page * blocks, block_stride=page)
    layout = KVCacheLayout[order]
    [want] = create_kv_cache_views(raw, spec, blocks, layout, tensor, kernel_block_size=BLOCK // 2)
    [got] = split_tensors(kind, case(kind), (2,))[:1]
    assert (tuple(got.shape), got.stride()) == (tuple(want.shape), want.stride())
