"""The synthetic caches `cuda_check.py` copies: every kind kvtier carries, in vLLM 0.32's shapes.

Attention kinds (`kv_case`): vLLM 0.32's CUDA layer view `[B, H, N, 2D]` in HND, NHD (vLLM's default)
and cross-layer memory orders, older vLLM's stacked `[2, B, N, H, D]`, a TP=2 rank's heads, a
full-attention group beside a sliding-window group, MLA latents `[B, N, 576]` (FlashMLA's), fp8
held as uint8; each also split into kernel blocks (`kv_case(ratio=...)`), as vLLM 0.32's
`create_kv_cache_views(kernel_block_size=...)` splits a group's blocks for FlashInfer on hybrids,
FlashMLA or CUTLASS MLA. State kinds (`state_case`): gated delta net and Mamba2 conv and SSM states
in vLLM's per-block shapes, whole or a TP=2 rank's shard. Random bit patterns: compare bytes, not
values. Needs torch and kvtier only.
"""

from __future__ import annotations

import argparse

import torch

from kvtier.format.layout import SKIP_BLOCK, CanonicalLayout, TPShard
from kvtier.format.state_rows import StateLayout, StatePart
from kvtier.format.state_shards import Section, StateShard
from kvtier.integrations.vllm.model.backend_layouts import engine_layout, engine_layout_name
from kvtier.transfer.copy_plan import CopyPlan

KINDS = [
    "flash_hnd",
    "flash_nhd",
    "flash_cross_layer",
    "stacked_kv",
    "tp2_rank1",
    "sliding_groups",
    "mla",
    "fp8",
]
KERNEL_KINDS = ["flash_hnd", "flash_nhd", "tp2_rank1", "sliding_groups", "mla", "fp8"]
"""The kinds vLLM may split into kernel blocks (a cross-layer order is refused there)."""
STATE_KINDS = ["gdn", "gdn_tp2_rank1", "mamba2", "mamba2_tp2_rank1"]


def random_bytes(
    shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: str
) -> torch.Tensor:
    """Random bit patterns of `dtype` on `device`, contiguous in `shape` (compare bytes, not values)."""
    raw = torch.randint(0, 256, (*shape, dtype.itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape).to(device)


def kv_case(
    kind: str, a: argparse.Namespace, seed: int, ratio: int = 1
) -> tuple[CopyPlan, list[torch.Tensor]]:
    """A kind's plan and per-layer tensors, in vLLM's logical shapes over the kind's memory order;
    with `ratio`, blocks of `ratio * --block-size` tokens split into `ratio` kernel blocks of
    `--block-size` (`--blocks` blocks: `ratio * --blocks` kernel blocks)."""
    gen = torch.Generator().manual_seed(seed)
    b, n, d, layers, heads = a.blocks * ratio, a.block_size, a.head_dim, a.layers, a.heads
    chunk, kernel = n * ratio * a.bpc, (n, n) if kind == "sliding_groups" else (n,)
    tp = TPShard(heads, 2, 1) if kind == "tp2_rank1" else TPShard(heads)
    h, dtype = tp.num_heads, torch.bfloat16
    kinds: tuple[str, ...] = ()
    groups: tuple[int, ...] = ()

    def rand(*shape: int, of: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return random_bytes(shape, of, gen, a.device)

    if kind == "mla":  # FlashMLA-style `[B, N, kv_lora_rank + rope]`, one latent row per token
        layout = CanonicalLayout(layers, 1, 576, chunk, dtype, latent=True)
        tensors = [rand(b, n, 576) for _ in range(layers)]
        name = engine_layout_name(tensors[0].device.type, tensors[0].shape, latent=True)
        return CopyPlan(layout, engine_layout(name), TPShard(1), n * ratio, kernel_block_sizes=(n,)), tensors
    if kind == "flash_hnd":
        tensors = [rand(b, h, n, 2 * d) for _ in range(layers)]
    elif kind == "flash_cross_layer":
        buf = rand(b, layers, n, h, 2 * d)
        tensors = [buf[:, i].transpose(1, 2) for i in range(layers)]
    elif kind == "stacked_kv":
        tensors = [rand(2, b, n, h, d) for _ in range(layers)]
    elif kind == "fp8":  # vLLM hands an fp8 cache over as uint8
        dtype = torch.float8_e4m3fn
        tensors = [rand(b, n, h, 2 * d, of=torch.uint8).transpose(1, 2) for _ in range(layers)]
    else:  # flash_nhd, vLLM's default order, also for the TP shard and the groups
        tensors = [rand(b, n, h, 2 * d).transpose(1, 2) for _ in range(layers)]
    if kind == "sliding_groups":  # a full-attention group and a sliding-window group
        groups = tuple(0 if i % 2 == 0 else 1 for i in range(layers))
        kinds = tuple("attention" if g == 0 else "sliding_window:512" for g in groups)
    layout = CanonicalLayout(layers, heads, d, chunk, dtype, layer_kinds=kinds)
    if a.device == "cpu":  # the CUDA layouts, as the connector would name them on a GPU
        name = "stacked_kv" if kind == "stacked_kv" else "vllm_flash_attn"
    else:
        name = engine_layout_name(tensors[0].device.type, tensors[0].shape)
    return CopyPlan(layout, engine_layout(name), tp, n * ratio, groups, kernel_block_sizes=kernel), tensors


def copy_tokens(split_plan: CopyPlan, split: list[torch.Tensor], plan: CopyPlan, whole: list[torch.Tensor],
                to_whole: bool) -> None:
    """Copy every block's tokens between kernel-block tensors `split` (of `split_plan`) and unsplit
    `whole` (of `plan`): kernel block `b * r + i` holds tokens `i * k .. i * k + k - 1` of block b."""
    for layer, (part_kv, whole_kv) in enumerate(zip(split, whole, strict=True)):
        group = split_plan.layer_groups[layer]
        r, k = split_plan.ratios[group], split_plan.kernel_block_sizes[group]
        views = zip(split_plan.engine_views(part_kv, group), plan.engine_views(whole_kv), strict=True)
        for part, full in views:
            for i in range(r):
                if to_whole:
                    full[:, :, i * k : (i + 1) * k].copy_(part[i::r])
                else:
                    part[i::r].copy_(full[:, :, i * k : (i + 1) * k])


def job(
    plan: CopyPlan, num_blocks: int, chunks: int, seed: int, skip: bool
) -> tuple[list[list[int]], list[int]]:
    """Block ids (group by group, distinct per group) and distinct slots in `[0, chunks)`; `skip`:
    every other chunk leaves its first sliding-window block out (a load outside the window)."""
    gen = torch.Generator().manual_seed(seed)
    bpc, groups = plan.blocks_per_chunk, plan.num_groups
    picks = [torch.randperm(num_blocks, generator=gen)[: chunks * bpc].tolist() for _ in range(groups)]
    ids = [[b for g in range(groups) for b in picks[g][c * bpc : (c + 1) * bpc]] for c in range(chunks)]
    if skip and groups > 1:
        for c in range(0, chunks, 2):
            ids[c][bpc] = SKIP_BLOCK
    return ids, torch.randperm(chunks, generator=gen).tolist()


def state_case(
    kind: str, device: str, gen: torch.Generator, blocks: int, row_bytes: int
) -> tuple[StateLayout, StateShard, list[list[torch.Tensor]]]:
    """State tensors in vLLM's per-layer shapes (conv state kept `[kernel - 1, conv_dim]`, the SSM
    state fp32), whole or a TP=2 rank's shard, for 3 recurrent layers; segments in rows of
    `row_bytes` (the attention rows')."""
    if kind.startswith("gdn"):  # Qwen3-Next-like: conv over q, k, v channels; [heads, v_dim, k_dim]
        conv, ssm = (2 * 16 * 128 + 32 * 128, 3), (32, 128, 128)
        sections = ((Section(16 * 128), Section(16 * 128), Section(32 * 128)), (Section(32),))
    else:  # NemotronH-like Mamba2: conv over x, B, C; [heads, head_dim, d_state]
        conv, ssm = (64 * 64 + 2 * 8 * 128, 3), (64, 64, 128)
        sections = ((Section(64 * 64), Section(8 * 128), Section(8 * 128)), (Section(64),))
    parts = (StatePart(conv, torch.bfloat16, transposed=True), StatePart(ssm, torch.float32))
    layout = StateLayout(kind.split("_")[0], (1, 2, 4), parts, row_bytes)
    whole = StateShard.whole([conv[0], ssm[0]])
    shard = StateShard(sections, 2, 1) if kind.endswith("tp2_rank1") else whole
    tensors = [
        [
            random_bytes((blocks, *p.engine_shape(shard.local_rows(i))), p.dtype, gen, device)
            for i, p in enumerate(parts)
        ]
        for _ in layout.layers
    ]
    return layout, shard, tensors
