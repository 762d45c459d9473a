"""Engine tensors of every layout kind and copy jobs, shared by the staged and CUDA copy tests."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kvtier.format.layout import SKIP_BLOCK, CanonicalLayout, TPShard
from kvtier.integrations.vllm.model.backend_layouts import engine_layout
from kvtier.transfer.copy_plan import CopyPlan
from tests.format.helpers import random_kv

BLOCK, HEAD_DIM, LAYERS, HEADS = 4, 8, 3, 4
NUM_BLOCKS, NUM_SLOTS = 20, 10


def layer_tensors(
    kind: str, heads: int, gen: torch.Generator, device: str = "cpu"
) -> tuple[str, list[torch.Tensor]]:
    """(engine layout name, per-layer tensors on `device`) of vLLM's shapes, in several physical
    orders: the memory is allocated in that order, the tensors are vLLM's logical views of it."""

    def phys(shape: tuple[int, ...]) -> torch.Tensor:
        return random_kv(shape, torch.bfloat16, gen).to(device)

    logical = (NUM_BLOCKS, heads, BLOCK, 2 * HEAD_DIM)
    if kind == "vllm_cpu":
        return kind, [phys(logical) for _ in range(LAYERS)]
    if kind == "flash_hnd":  # vLLM KVCacheLayout LBHNC: the logical order is the memory order
        return "vllm_flash_attn", [phys(logical) for _ in range(LAYERS)]
    if kind == "flash_nhd":  # LBNHC (vLLM's default on CUDA): memory [B, N, H, C]
        nhd = (NUM_BLOCKS, BLOCK, heads, 2 * HEAD_DIM)
        return "vllm_flash_attn", [phys(nhd).transpose(1, 2) for _ in range(LAYERS)]
    if kind == "flash_cross_layer":  # BLNHC: one buffer [B, L, N, H, C], layers interleaved per block
        buf = phys((NUM_BLOCKS, LAYERS, BLOCK, heads, 2 * HEAD_DIM))
        return "vllm_flash_attn", [buf[:, i].transpose(1, 2) for i in range(LAYERS)]
    assert kind == "stacked_kv"
    return kind, [phys((2, NUM_BLOCKS, BLOCK, heads, HEAD_DIM)) for _ in range(LAYERS)]


def job(bpc: int, n_chunks: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    picked = rng.sample(range(NUM_BLOCKS), n_chunks * bpc)
    return [picked[i * bpc : (i + 1) * bpc] for i in range(n_chunks)], rng.sample(range(NUM_SLOTS), n_chunks)


GROUP_KINDS = [
    "vllm_cpu",
    "flash_hnd",
    "flash_nhd",
    "flash_cross_layer",
    "stacked_kv",
    "sliding_groups",
    "mla",
    "fp8",
]
"""Every kind of attention cache a copy path carries: each engine layout and memory order, several
KV cache groups (full attention beside sliding-window layers), MLA latents, fp8 held as uint8."""


@dataclass(frozen=True)
class Case:
    """One kind's canonical layout, copy plan and engine tensors, for one TP rank."""

    layout: CanonicalLayout
    plan: CopyPlan
    tensors: list[torch.Tensor]

    def blocks(self, n_chunks: int, seed: int, skip: bool = False) -> tuple[list[list[int]], list[int]]:
        """A job's block ids (group by group, distinct within each group) and distinct slots;
        `skip`: some sliding-window blocks are `SKIP_BLOCK` (a load's blocks outside the window)."""
        rng = random.Random(seed)
        bpc, groups = self.plan.blocks_per_chunk, self.plan.num_groups
        per_group = [rng.sample(range(NUM_BLOCKS), n_chunks * bpc) for _ in range(groups)]
        chunks = []
        for c in range(n_chunks):
            ids = [b for g in range(groups) for b in per_group[g][c * bpc : (c + 1) * bpc]]
            if skip and groups > 1 and c % 2 == 0:
                ids[bpc] = SKIP_BLOCK  # the group-1 page of the chunk's first block
            chunks.append(ids)
        return chunks, rng.sample(range(NUM_SLOTS), n_chunks)

    def zeros(self) -> list[torch.Tensor]:
        """Zeroed engine tensors of the same layout and memory order."""
        return [torch.zeros_like(t) for t in self.tensors]


def case(
    kind: str, tp_size: int = 1, rank: int = 0, bpc: int = 1, seed: int = 0, device: str = "cpu"
) -> Case:
    """Engine tensors of `kind` (see `GROUP_KINDS`) on TP rank `rank` of `tp_size`, on `device`,
    with their layout and plan; block size `BLOCK`, `bpc` blocks per chunk."""
    gen = torch.Generator().manual_seed(seed)
    groups: tuple[int, ...] = ()
    if kind == "mla":
        layout = CanonicalLayout(LAYERS, 1, HEAD_DIM, BLOCK * bpc, torch.bfloat16, latent=True)
        shard = TPShard(1, tp_size, rank)
        tensors = [random_kv((NUM_BLOCKS, 1, BLOCK, HEAD_DIM), torch.bfloat16, gen) for _ in range(LAYERS)]
        plan = CopyPlan(layout, engine_layout("vllm_mla"), shard, BLOCK)
        return Case(layout, plan, [t.to(device) for t in tensors])
    shard = TPShard(HEADS, tp_size, rank)
    dtype, name, tensors = torch.bfloat16, "", []
    if kind == "fp8":  # vLLM hands an fp8 cache over as uint8 tensors
        dtype, name = torch.float8_e4m3fn, "vllm_flash_attn"
        nhd = (NUM_BLOCKS, BLOCK, shard.num_heads, 2 * HEAD_DIM)
        tensors = [random_kv(nhd, torch.uint8, gen).transpose(1, 2) for _ in range(LAYERS)]
    elif kind == "sliding_groups":
        groups = (0, 1, 1)
        name, tensors = layer_tensors("flash_nhd", shard.num_heads, gen)
    else:
        name, tensors = layer_tensors(kind, shard.num_heads, gen)
    kinds = ("attention", "sliding_window:8", "sliding_window:8") if groups else ()
    layout = CanonicalLayout(LAYERS, HEADS, HEAD_DIM, BLOCK * bpc, dtype, layer_kinds=kinds)
    plan = CopyPlan(layout, engine_layout(name), shard, BLOCK, groups)
    return Case(layout, plan, [t.to(device) for t in tensors])
