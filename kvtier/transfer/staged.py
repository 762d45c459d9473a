"""Chunk copies that cross a device boundary as a few large contiguous copies.

`CopyPlan` copies each engine block of each layer with one strided `copy_`. Between a GPU and host
memory that is slow and, worse, synchronous: torch copies a non-contiguous cross-device tensor
through a temporary in pageable host memory and waits for it. `StagedCopy` instead rearranges
the blocks on the device, into a contiguous staging tensor laid out exactly as this rank's bytes
of the host rows, and moves the bytes between staging and rows with contiguous uint8 copies
(`non_blocking=True`: DMA queued on the current stream when the rows are pinned):

- store: per layer and part (K and V, or the MLA latent), the blocks of the layer's KV cache group
  are gathered (`index_select`) into staging `[chunks, H_local, layers, parts, chunk_tokens, D]`,
  then each contiguous run is copied to the rows;
- load: the runs are copied into staging, then scattered (`index_copy_`) into the blocks; a group's
  `SKIP_BLOCK` (a sliding-window block outside the window) leaves that block's pages unwritten.

Which block goes to which page is `CopyPlan.pairs`, the block mapping the CPU path copies by, with
the same checks, all made before the first copy is queued; the engine views are the plan's. Both
are by kernel blocks where the engine splits its blocks (`copy_plan`'s module doc): a layer's
blocks are gathered and scattered at its group's kernel block size, into the same staging bytes. Rows
are head-major (`kvtier.format.layout`): this rank's bytes of one chunk are one span of the row,
at its first head's offset, whatever the TP degree and layer count, and consecutive slots hold
theirs one row apart: one copy per run of consecutive slots (`runs`), a 2-D copy (`StridedCopy`:
`cudaMemcpy2DAsync` under CUDA) unless the spans touch (TP=1, rows without padding).
The engine's element type is kept: an fp8 cache held as uint8 is staged as its bytes.

All of it is plain torch on whatever device the KV tensors are on, so it runs (and is tested) on
the CPU too, where it writes the same bytes as `CopyPlan`. The staging memory of one batch is at
most `staging_bytes` (one chunk at least); bigger jobs go in batches. Allocations come from the
current stream's pool (the copy stream under `CudaStreams`), so staging freed after queuing is
reused only by later work of that stream.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from kvtier.transfer.copy_plan import CopyPlan

DEFAULT_STAGING_BYTES = 64 << 20


def _nothing() -> None:
    """No copies left for after a store's fence."""

Run = tuple[int, int, int, int]
"""(host byte offset, staging byte offset, bytes per slot, slots): `slots` consecutive host rows
(one `row_bytes` apart) against as many consecutive chunks of staging, one copy."""
StridedCopy = Callable[[torch.Tensor, torch.Tensor], None]
"""Queue on the current stream, as one copy, `dst.copy_(src)` for 2-D `[slots, bytes]` uint8
tensors of which one is a view of host rows (rows apart) and the other contiguous staging."""


def torch_strided_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`StridedCopy` through torch: one call (between CPU tensors one pass; across devices torch
    would go through a temporary, so `kvtier.transfer.cuda` gives its own)."""
    dst.copy_(src, non_blocking=True)
Pairs = list[list[tuple[int, int, int]]]  # per group: (chunk index, block in chunk, engine block)
Batch = list[tuple[torch.Tensor, torch.Tensor, bool]]  # per group: (blocks, positions, all present)


class StagedCopy:
    """Copies chunks between `layer_tensors` (one per layer, model order) and host rows, for every
    layout `CopyPlan` carries: several KV cache groups, MLA latents, any KV dtype."""

    def __init__(
        self,
        plan: CopyPlan,
        layer_tensors: Sequence[torch.Tensor],
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        strided_copy: StridedCopy = torch_strided_copy,
    ) -> None:
        layers = plan.layout.num_layers
        if len(layer_tensors) != layers:
            raise ValueError(f"{len(layer_tensors)} layer tensors, layout has {layers} layers")
        self.plan = plan
        self.strided_copy = strided_copy
        self.layer_tensors = list(layer_tensors)
        self.views = [plan.engine_views(kv, plan.layer_groups[i]) for i, kv in enumerate(layer_tensors)]
        self.device = layer_tensors[0].device
        self.dtype = layer_tensors[0].dtype
        """The engine's element type: staging holds its bytes unconverted (an fp8 layout over
        vLLM's uint8 tensors included)."""
        lay, shard = plan.layout, plan.shard
        self.chunk_bytes = shard.num_heads * lay.head_bytes
        """This rank's bytes of one chunk: one run of a row."""
        self.chunks_per_batch = max(1, staging_bytes // self.chunk_bytes)

    def runs(self, slots: Sequence[int]) -> list[Run]:
        """The copies between host rows and staging for chunks in `slots`, one per run of
        consecutive slots: this rank's heads of a chunk are one span of its row (head-major
        rows), and consecutive rows hold theirs one `row_bytes` apart. A run whose spans touch
        (TP=1, rows without padding) is one contiguous span (`slots` 1)."""
        lay = self.plan.layout
        head_off = lay.part_offset(self.plan.shard.head_start, 0, 0)
        width, touching = self.chunk_bytes, self.chunk_bytes == lay.row_bytes
        runs: list[Run] = []
        for i, slot in enumerate(slots):
            host, staged = slot * lay.row_bytes + head_off, i * width
            last = runs[-1] if runs else None
            if last is not None and last[0] + last[3] * lay.row_bytes == host:
                runs[-1] = (last[0], last[1], last[2], last[3] + 1)
            else:
                runs.append((host, staged, width, 1))
        if touching:
            return [(h, s, w * n, 1) for h, s, w, n in runs]
        return runs

    def _copy_runs(self, host: torch.Tensor, staging: torch.Tensor, runs: list[Run], to_host: bool) -> None:
        """Queue one copy per run between the rows (`host`, flat) and `staging`."""
        row_bytes = self.plan.layout.row_bytes
        for h, s, width, n in runs:
            if n == 1:
                rows, staged = host[h : h + width], staging[s : s + width]
                (rows if to_host else staged).copy_(staged if to_host else rows, non_blocking=True)
                continue
            rows = host.as_strided((n, width), (row_bytes, 1), host.storage_offset() + h)
            staged = staging[s : s + n * width].view(n, width)
            if to_host:
                self.strided_copy(rows, staged)
            else:
                self.strided_copy(staged, rows)

    def store(
        self, rows: torch.Tensor, block_ids: Sequence[Sequence[int]], slots: Sequence[int]
    ) -> Callable[[], None]:
        """Queue the copy of chunk i (blocks `block_ids[i]`, group by group) into host row
        `slots[i]`, all but the last batch's host copies, which the returned callable queues.

        Once what this queued has run, every engine block of the job was read (the store's fence:
        later passes may write them); with several batches the host copies of the earlier ones
        come before the last gather, so the fence also waits for them. A rank that does not write
        (a non-first replica of its heads) copies nothing."""
        pairs = self.plan.pairs(self.layer_tensors, block_ids, rows, slots, to_host=True)
        put: Callable[[], None] = _nothing
        if not self.plan.shard.writes:
            return put
        host = rows.view(-1)
        for first, count in self._batches(len(slots)):
            put()
            staging = self._gather(self._batch(pairs, first, count), count)
            runs = self.runs(slots[first : first + count])
            put = functools.partial(self._copy_runs, host, staging, runs, True)
        return put

    def load(self, rows: torch.Tensor, block_ids: Sequence[Sequence[int]], slots: Sequence[int]) -> None:
        """Queue the copy of host row `slots[i]` into blocks `block_ids[i]` (group by group; a
        `SKIP_BLOCK` leaves that group's pages of that block unwritten)."""
        pairs = self.plan.pairs(self.layer_tensors, block_ids, rows, slots, to_host=False)
        host = rows.view(-1)
        for first, count in self._batches(len(slots)):
            staging = torch.empty(count * self.chunk_bytes, dtype=torch.uint8, device=self.device)
            self._copy_runs(host, staging, self.runs(slots[first : first + count]), False)
            self._scatter(staging, self._batch(pairs, first, count), count)

    def _batches(self, chunks: int) -> list[tuple[int, int]]:
        """(first chunk, chunk count) of each batch."""
        step = self.chunks_per_batch
        return [(first, min(step, chunks - first)) for first in range(0, chunks, step)]

    def _batch(self, pairs: Pairs, first: int, count: int) -> Batch:
        """Per group, for chunks `[first, first + count)`: (engine kernel block ids, their
        positions `chunk * kernel_blocks_per_chunk + j` in the batch, whether every position is
        present), on the device."""
        out = []
        for group, bpc in zip(pairs, self.plan.kernel_blocks_per_chunk, strict=True):
            picked = [(c - first, j, b) for c, j, b in group if first <= c < first + count]
            blocks = self._index([b for _, _, b in picked])
            positions = self._index([c * bpc + j for c, j, _ in picked])
            out.append((blocks, positions, len(picked) == count * bpc))
        return out

    def _gather(self, groups: Batch, n: int) -> torch.Tensor:
        """uint8 staging of `n` chunks' blocks, in the rows' byte order (a store: every position
        present)."""
        lay = self.plan.layout
        heads = self.plan.shard.num_heads
        shape = (n, heads, len(self.views), lay.parts, lay.chunk_tokens, lay.head_dim)
        staging = torch.empty(shape, dtype=self.dtype, device=self.device)
        for layer, views in enumerate(self.views):
            bpc, bs = self._block_shape(layer)
            blocks, _, _ = groups[self.plan.layer_groups[layer]]
            for part, engine in enumerate(views):
                picked = engine.index_select(0, blocks).view(n, bpc, heads, bs, lay.head_dim)
                pages = staging[:, :, layer, part].view(n, heads, bpc, bs, lay.head_dim)
                pages.copy_(picked.transpose(1, 2))
        return staging.view(-1).view(torch.uint8)

    def _scatter(self, staging: torch.Tensor, groups: Batch, n: int) -> None:
        lay = self.plan.layout
        heads, dim = self.plan.shard.num_heads, lay.head_dim
        chunks = staging.view(self.dtype).view(n, heads, len(self.views), lay.parts, lay.chunk_tokens, dim)
        for layer, views in enumerate(self.views):
            bpc, bs = self._block_shape(layer)
            blocks, positions, whole = groups[self.plan.layer_groups[layer]]
            for part, engine in enumerate(views):
                pages = chunks[:, :, layer, part].view(n, heads, bpc, bs, dim)
                src = pages.transpose(1, 2).reshape(n * bpc, heads, bs, dim)
                engine.index_copy_(0, blocks, src if whole else src.index_select(0, positions))

    def _block_shape(self, layer: int) -> tuple[int, int]:
        """(kernel blocks per chunk, kernel block size) of `layer`'s group."""
        group = self.plan.layer_groups[layer]
        return self.plan.kernel_blocks_per_chunk[group], self.plan.kernel_block_sizes[group]

    def _index(self, values: Sequence[int]) -> torch.Tensor:
        """`values` as a long tensor on the device; from pinned memory without waiting, under CUDA."""
        index = torch.tensor(list(values), dtype=torch.long)
        if self.device.type == "cpu":
            return index
        return index.pin_memory().to(self.device, non_blocking=True)
