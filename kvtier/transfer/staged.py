"""Chunk copies that cross a device boundary as a few large contiguous copies.

`CopyPlan` copies each engine block of each layer with one strided `copy_`. Between a GPU and host
memory that is slow and, worse, synchronous: torch copies a non-contiguous cross-device tensor
through a temporary in pageable host memory and waits for it. `StagedCopy` instead rearranges
the blocks on the device, into a contiguous staging tensor laid out exactly as this rank's bytes
of the host rows, and moves the bytes between staging and rows with contiguous uint8 copies
(`non_blocking=True`: DMA queued on the current stream when the rows are pinned):

- store: per layer, K and V blocks are gathered (`index_select`) into staging
  `[chunks, layers, 2, H_local, chunk_tokens, D]`, then each contiguous run is copied to the rows;
- load: the runs are copied into staging, then scattered (`index_copy_`) into the blocks.

This rank's bytes of one chunk are `2 * num_layers` runs of `H_local * chunk_tokens * D` elements
(K, then V, of each layer, at this rank's head offset in the canonical page); runs adjacent in both
staging and rows are merged, so at TP=1 a chunk is one run and consecutive slots one run together.

All of it is plain torch on whatever device the KV tensors are on, so it runs (and is tested) on
the CPU too, where it writes the same bytes as `CopyPlan`. Every check happens before the first
copy is queued. The staging memory of one batch is at most `staging_bytes` (one chunk at least);
bigger jobs go in batches. Allocations come from the current stream's pool (the copy stream
under `CudaStreams`), so staging freed after queuing is reused only by later work of that stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.format.layout import check_rows
from kvtier.transfer.copy_plan import CopyPlan

DEFAULT_STAGING_BYTES = 64 << 20

Run = tuple[int, int, int]  # (host byte offset, staging byte offset, length)


class StagedCopy:
    """Copies chunks between `layer_tensors` (one per layer, model order) and host rows."""

    def __init__(
        self,
        plan: CopyPlan,
        layer_tensors: Sequence[torch.Tensor],
        staging_bytes: int = DEFAULT_STAGING_BYTES,
    ) -> None:
        layers = plan.layout.num_layers
        if plan.layout.latent:
            raise NotImplementedError("kvtier's staged (CUDA) copies do not handle MLA latents yet")
        if plan.num_groups != 1:
            raise NotImplementedError(
                f"kvtier's staged (CUDA) copies handle one KV cache group, this model has {plan.num_groups}"
            )
        if len(layer_tensors) != layers:
            raise ValueError(f"{len(layer_tensors)} layer tensors, layout has {layers} layers")
        self.plan = plan
        self.views = [plan.engine_views(kv) for kv in layer_tensors]
        self.device = layer_tensors[0].device
        self.dtype = layer_tensors[0].dtype
        """The engine's element type: staging holds its bytes unconverted (an fp8 layout over
        vLLM's uint8 tensors included)."""
        self.num_blocks = min(k.shape[0] for k, _ in self.views)
        lay, shard = plan.layout, plan.shard
        self.run_bytes = shard.num_heads * lay.chunk_tokens * lay.head_dim * lay.itemsize
        self.chunk_bytes = 2 * lay.num_layers * self.run_bytes
        self.chunks_per_batch = max(1, staging_bytes // self.chunk_bytes)

    def runs(self, slots: Sequence[int]) -> list[Run]:
        """The merged contiguous runs between host rows and staging for chunks in `slots`."""
        lay, shard = self.plan.layout, self.plan.shard
        head_off = shard.head_start * lay.chunk_tokens * lay.head_dim * lay.itemsize
        half = lay.num_kv_heads * lay.chunk_tokens * lay.head_dim * lay.itemsize
        runs: list[Run] = []
        staged = 0
        for slot in slots:
            for layer in range(lay.num_layers):
                for kv in range(2):
                    host = slot * lay.row_bytes + lay.page_offset(layer) + kv * half + head_off
                    last = runs[-1] if runs else None
                    if last and last[0] + last[2] == host and last[1] + last[2] == staged:
                        runs[-1] = (last[0], last[1], last[2] + self.run_bytes)
                    else:
                        runs.append((host, staged, self.run_bytes))
                    staged += self.run_bytes
        return runs

    def store(self, rows: torch.Tensor, block_ids: Sequence[Sequence[int]], slots: Sequence[int]) -> None:
        """Queue the copy of chunk i (blocks `block_ids[i]`) into host row `slots[i]`; a rank that
        does not write (a non-first replica of its heads) copies nothing."""
        self._check(rows, block_ids, slots)
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots must be distinct, got {list(slots)}")
        if not self.plan.shard.writes:
            return
        host = rows.view(-1)
        for first in range(0, len(slots), self.chunks_per_batch):
            batch = slice(first, first + self.chunks_per_batch)
            staging = self._gather(block_ids[batch])
            for h, s, n in self.runs(slots[batch]):
                host[h : h + n].copy_(staging[s : s + n], non_blocking=True)

    def load(self, rows: torch.Tensor, block_ids: Sequence[Sequence[int]], slots: Sequence[int]) -> None:
        """Queue the copy of host row `slots[i]` into blocks `block_ids[i]`."""
        self._check(rows, block_ids, slots)
        flat = [b for ids in block_ids for b in ids]
        if len(set(flat)) != len(flat):
            raise ValueError("destination block ids must be distinct")
        host = rows.view(-1)
        for first in range(0, len(slots), self.chunks_per_batch):
            batch = slice(first, first + self.chunks_per_batch)
            chunks = slots[batch]
            staging = torch.empty(len(chunks) * self.chunk_bytes, dtype=torch.uint8, device=self.device)
            for h, s, n in self.runs(chunks):
                staging[s : s + n].copy_(host[h : h + n], non_blocking=True)
            self._scatter(staging, block_ids[batch])

    def _gather(self, block_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """uint8 staging of the chunks' blocks, in the rows' byte order."""
        n, (bpc, heads, bs, dim) = len(block_ids), self._block_shape()
        index = self._index(block_ids)
        staging = torch.empty(
            (n, len(self.views), 2, heads, bpc, bs, dim), dtype=self.dtype, device=self.device
        )
        for layer, kv_views in enumerate(self.views):
            for which, blocks in enumerate(kv_views):
                picked = blocks.index_select(0, index).view(n, bpc, heads, bs, dim)
                staging[:, layer, which].copy_(picked.transpose(1, 2))
        return staging.view(-1).view(torch.uint8)

    def _scatter(self, staging: torch.Tensor, block_ids: Sequence[Sequence[int]]) -> None:
        n, (bpc, heads, bs, dim) = len(block_ids), self._block_shape()
        index = self._index(block_ids)
        chunks = staging.view(self.dtype).view(n, len(self.views), 2, heads, bpc, bs, dim)
        for layer, kv_views in enumerate(self.views):
            for which, blocks in enumerate(kv_views):
                src = chunks[:, layer, which].transpose(1, 2).reshape(n * bpc, heads, bs, dim)
                blocks.index_copy_(0, index, src)

    def _block_shape(self) -> tuple[int, int, int, int]:
        """(blocks per chunk, this rank's heads, block size, head dim)."""
        plan = self.plan
        return plan.blocks_per_chunk, plan.shard.num_heads, plan.block_size, plan.layout.head_dim

    def _index(self, block_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """The flat block ids on the device; from pinned memory without waiting, under CUDA."""
        index = torch.tensor([b for ids in block_ids for b in ids], dtype=torch.long)
        if self.device.type == "cpu":
            return index
        return index.pin_memory().to(self.device, non_blocking=True)

    def _check(self, rows: torch.Tensor, block_ids: Sequence[Sequence[int]], slots: Sequence[int]) -> None:
        check_rows(self.plan.layout, rows)
        if len(block_ids) != len(slots):
            raise ValueError(f"{len(block_ids)} chunks of blocks for {len(slots)} slots")
        bpc = self.plan.blocks_per_chunk
        if any(len(ids) != bpc for ids in block_ids):
            raise ValueError(f"every chunk needs exactly {bpc} block ids")
        if any(not 0 <= s < len(rows) for s in slots):
            raise ValueError(f"slots must lie in [0, {len(rows)}), got {list(slots)}")
        if any(not 0 <= b < self.num_blocks for ids in block_ids for b in ids):
            raise ValueError(f"block ids must lie in [0, {self.num_blocks})")
