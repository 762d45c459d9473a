"""Engine tensors of every layout kind and copy jobs, shared by the staged and CUDA copy tests."""

from __future__ import annotations

import random

import torch

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
