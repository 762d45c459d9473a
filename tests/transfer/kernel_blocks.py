"""Engine tensors split into kernel blocks, as vLLM's `create_kv_cache_views(kernel_block_size=...)`
lays them out, holding the same tokens as a `tests.transfer.helpers.Case`'s unsplit tensors.

A split layer tensor holds `NUM_BLOCKS * ratio` kernel blocks of `BLOCK // ratio` tokens, in the
memory order of its kind (vLLM splits only dense pages: a cross-layer order is refused there, so it
has no split twin); block b is kernel blocks `b * ratio .. b * ratio + ratio - 1`, in token order.
"""

from __future__ import annotations

import torch

from tests.transfer.helpers import BLOCK, HEAD_DIM, NUM_BLOCKS, Case

SPLIT_KINDS = ["vllm_cpu", "flash_hnd", "flash_nhd", "stacked_kv", "sliding_groups", "mla", "fp8"]
"""Every kind of `tests.transfer.helpers.GROUP_KINDS` an engine may split into kernel blocks."""


def group_ratios(kind: str, ratio: int) -> tuple[int, ...]:
    """Kernel blocks per block of each KV cache group of `kind`: `ratio`; with two groups, the
    second splits differently (each group has its own kernel block size)."""
    return (ratio, 2 if ratio == 4 else 4) if kind == "sliding_groups" else (ratio,)


def views(c: Case, kv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """K and V (or the latent) of `kv` as `c`'s engine layout views them: `[blocks, H, tokens, D]`."""
    return c.plan.engine.kv_views(kv, HEAD_DIM)


def empty_split(kind: str, kv: torch.Tensor, ratio: int) -> torch.Tensor:
    """A zeroed tensor of `kind` like the unsplit `kv`, with `ratio` kernel blocks per block: vLLM's
    logical view of memory allocated in the kind's order, kernel blocks a dense page apart."""
    blocks, tokens = NUM_BLOCKS * ratio, BLOCK // ratio
    if kind == "stacked_kv":  # [2, B, N, H, D]
        return torch.zeros(2, blocks, tokens, *kv.shape[3:], dtype=kv.dtype)
    if kind in ("vllm_cpu", "flash_hnd", "mla"):  # memory [B, H, N, C]: vLLM's LBHNC
        return torch.zeros(blocks, kv.shape[1], tokens, kv.shape[3], dtype=kv.dtype)
    return torch.zeros(blocks, tokens, kv.shape[1], kv.shape[3], dtype=kv.dtype).transpose(1, 2)  # LBNHC


def split_tensors(kind: str, c: Case, ratios: tuple[int, ...]) -> list[torch.Tensor]:
    """`c.tensors`' tokens in kernel-block tensors (group g split `ratios[g]` ways): kernel block
    `b * r + i` holds tokens `i * k .. i * k + k - 1` of block b, k the kernel block size."""
    out = []
    for layer, kv in enumerate(c.tensors):
        ratio = ratios[c.plan.layer_groups[layer]]
        tokens = BLOCK // ratio
        split = empty_split(kind, kv, ratio)
        for whole, part in zip(views(c, kv), views(c, split), strict=True):
            for i in range(ratio):
                part[i::ratio].copy_(whole[:, :, i * tokens : (i + 1) * tokens])
        out.append(split)
    return out


def unsplit_tensors(c: Case, split: list[torch.Tensor], ratios: tuple[int, ...]) -> list[torch.Tensor]:
    """The tokens of kernel-block tensors `split` in tensors of `c`'s unsplit layout."""
    out = c.zeros()
    for layer, (kv, whole_kv) in enumerate(zip(split, out, strict=True)):
        ratio = ratios[c.plan.layer_groups[layer]]
        tokens = BLOCK // ratio
        for whole, part in zip(views(c, whole_kv), views(c, kv), strict=True):
            for i in range(ratio):
                whole[:, :, i * tokens : (i + 1) * tokens].copy_(part[i::ratio])
    return out
