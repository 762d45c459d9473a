"""The C copy kernel against torch's copies through the same views: every engine layout and memory
order, several groups with skipped blocks, MLA, fp8, TP shards, and vLLM's CPU layout at real
sizes in each element width (its K transposed through register tiles, partial tiles at the edges);
stores write the same host bytes and loads the same engine bytes, byte for byte."""

from __future__ import annotations

import os

import pytest
import torch

from kvtier.format.layout import CanonicalLayout, TPShard
from kvtier.integrations.vllm.model.backend_layouts import engine_layout
from kvtier.transfer.copy_plan import CopyPlan
from kvtier.transfer.native_copy import kernel
from tests.format.helpers import make_rows, random_kv, same
from tests.optional import NATIVE_OFF
from tests.transfer.helpers import GROUP_KINDS, NUM_SLOTS, case

pytestmark = NATIVE_OFF.skipif(os.environ.get("KVTIER_NATIVE") == "0")


def twin(plan: CopyPlan) -> CopyPlan:
    """The same plan copying through torch."""
    groups = plan.layer_groups if plan.num_groups > 1 else ()
    return CopyPlan(plan.layout, plan.engine, plan.shard, plan.block_size, groups, native=False)


def check_both_ways(plan: CopyPlan, tensors: list[torch.Tensor], chunks: list[list[int]],
                    slots: list[int], load_chunks: list[list[int]] | None = None) -> None:
    """A store and a load through the kernel give the bytes torch gives."""
    assert plan.native is not None, "the copy kernel did not build"
    reference = twin(plan)
    _, rows = make_rows(plan.layout, NUM_SLOTS)
    _, expected_rows = make_rows(plan.layout, NUM_SLOTS)
    plan.engine_to_host(tensors, chunks, rows, slots)
    reference.engine_to_host(tensors, chunks, expected_rows, slots)
    assert same(rows, expected_rows)
    if not plan.shard.writes:
        return
    loaded = [torch.zeros_like(t) for t in tensors]
    expected = [torch.zeros_like(t) for t in tensors]
    plan.host_to_engine(loaded, load_chunks or chunks, rows, slots)
    reference.host_to_engine(expected, load_chunks or chunks, rows, slots)
    assert all(same(a, b) for a, b in zip(loaded, expected, strict=True))
    assert any(bool(t.view(torch.uint8).any()) for t in loaded)


@pytest.mark.parametrize("kind", GROUP_KINDS)
@pytest.mark.parametrize(("tp", "rank", "bpc"), [(1, 0, 1), (2, 1, 2), (4, 2, 1)])
def test_every_kind_and_shard_copies_as_torch_does(kind: str, tp: int, rank: int, bpc: int) -> None:
    c = case(kind, tp, rank, bpc, seed=tp + rank)
    chunks, slots = c.blocks(3, seed=7)
    skipped, _ = c.blocks(3, seed=7, skip=True)
    check_both_ways(c.plan, c.tensors, chunks, slots, skipped)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize(("block", "head_dim"), [(128, 64), (32, 128), (16, 72), (48, 80)])
def test_vllms_cpu_layout_at_real_sizes(dtype: torch.dtype, block: int, head_dim: int) -> None:
    """K is stored transposed per head; tiles of 16 cover it whole or leave edges (72, 48, 80)."""
    gen = torch.Generator().manual_seed(block + head_dim)
    heads, layers, num_blocks = 3, 2, 12
    layout = CanonicalLayout(layers, heads, head_dim, 2 * block, dtype)
    plan = CopyPlan(layout, engine_layout("vllm_cpu"), TPShard(heads), block)
    tensors = [random_kv((num_blocks, heads, block, 2 * head_dim), dtype, gen) for _ in range(layers)]
    check_both_ways(plan, tensors, [[3, 9], [0, 11], [5, 4]], [2, 7, 0], [[-1, 9], [0, 11], [5, 4]])


def test_the_kernel_refuses_an_element_width_it_does_not_know() -> None:
    found = kernel()
    assert found is not None
    empty = torch.zeros(1, dtype=torch.int64).numpy()
    with pytest.raises(ValueError, match="not 3"):
        found.copy(empty, empty, 3, (1, 1), (1, 1), (1, 1))
