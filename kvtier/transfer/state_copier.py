"""Copies of recurrent-layer state segments between one rank's engine state tensors and host rows.

The canonical format of a state segment is `kvtier.format.state_rows`; which bytes of it a TP rank
holds and writes is `kvtier.format.state_shards`. The copier is written over torch tensors and runs
on any device, as `kvtier.transfer.copy_plan` does for attention pages: the segment is staged on the
state tensors' device (gathered and scattered there), and crosses to or from the host rows as one
copy per contiguous byte span, `non_blocking` (DMA queued on the current stream when the rows are
pinned). `store` and `load` only queue the copies on the current stream: `StreamTransfer` runs them
on its copy streams, ordered against the forward pass by events like the attention pages;
`engine_to_host` and `host_to_engine` return once the copy is done (the CPU path).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.format.state_rows import StateLayout
from kvtier.format.state_shards import StateShard, merge_spans


class StateCopier:
    """Copies state segments between one rank's recurrent-layer state tensors and host rows.

    `tensors[l]` are layer l's state tensors (in `layout.parts` order), each `[num_blocks,
    *engine_shape]` holding the rank's shard (`shard`; default: the whole state, TP=1): block b's
    state is `tensor[b]`. A copy stages the segment in one contiguous buffer, so a part may straddle
    two rows; a store writes only the byte spans of the shard's written pieces (and the padding on
    the first rank). Concurrent calls are safe when their slots and blocks are disjoint, or when
    they come from distinct ranks of one shard map.
    """

    def __init__(
        self,
        layout: StateLayout,
        tensors: Sequence[Sequence[torch.Tensor]],
        shard: StateShard | None = None,
    ) -> None:
        shard = shard or StateShard.whole([part.shape[0] for part in layout.parts])
        if len(shard.sections) != len(layout.parts) or any(
            shard.canonical_rows(p) != part.shape[0] for p, part in enumerate(layout.parts)
        ):
            raise ValueError(f"shard sections {shard.sections} do not cover the parts {layout.parts}")
        if len(tensors) != len(layout.layers):
            layers = len(layout.layers)
            raise ValueError(f"{len(tensors)} recurrent layers of state tensors, the layout has {layers}")
        for layer, parts in zip(layout.layers, tensors, strict=True):
            if len(parts) != len(layout.parts):
                raise ValueError(f"layer {layer}: {len(parts)} state tensors, expected {len(layout.parts)}")
            for p, (part, tensor) in enumerate(zip(layout.parts, parts, strict=True)):
                expected = part.engine_shape(shard.local_rows(p))
                if tuple(tensor.shape[1:]) != expected:
                    raise ValueError(
                        f"layer {layer}: state tensor {tuple(tensor.shape)} is not "
                        f"[num_blocks, {', '.join(map(str, expected))}]"
                    )
        self.layout = layout
        self.shard = shard
        self.tensors = [list(parts) for parts in tensors]
        self._offsets = layout.offsets()

    def _pieces(
        self, staging: torch.Tensor, block_ids: Sequence[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor, bool, tuple[int, int]]]:
        """Per layer, part and piece of the shard: (engine view in canonical orientation, canonical
        view in `staging`, whether this rank writes it, its byte span in the segment)."""
        out = []
        for parts, offsets, block in zip(self.tensors, self._offsets, block_ids, strict=True):
            for p, (part, tensor, offset) in enumerate(zip(self.layout.parts, parts, offsets, strict=True)):
                engine = tensor[block]
                if part.transposed:
                    engine = engine.transpose(0, 1)
                canon = staging[offset : offset + part.nbytes].view(part.dtype).view(part.shape)
                for piece in self.shard.pieces(p):
                    rows = piece.end - piece.start
                    span = (offset + piece.start * part.row_nbytes, offset + piece.end * part.row_nbytes)
                    out.append(
                        (
                            engine[piece.local : piece.local + rows],
                            canon[piece.start : piece.end],
                            piece.writes,
                            span,
                        )
                    )
        return out

    def check(self, block_ids: Sequence[int], rows: torch.Tensor, slots: Sequence[int], store: bool) -> None:
        """Raise ValueError, before anything is copied, when the blocks (one per recurrent layer) or
        slots (one per row of the segment, distinct on a store) do not fit the tensors or rows."""
        if len(block_ids) != len(self.layout.layers):
            raise ValueError(f"one block per recurrent layer expected, got {list(block_ids)}")
        num_blocks = min(int(t.shape[0]) for parts in self.tensors for t in parts)
        if any(not 0 <= b < num_blocks for b in block_ids):
            raise ValueError(f"state block ids must lie in [0, {num_blocks}), got {list(block_ids)}")
        if len(slots) != self.layout.rows or rows.dim() != 2 or rows.shape[1] != self.layout.row_bytes:
            raise ValueError(
                f"a state segment is {self.layout.rows} rows of {self.layout.row_bytes} bytes, got "
                f"{len(slots)} slots of {tuple(rows.shape)}"
            )
        if any(not 0 <= s < len(rows) for s in slots):
            raise ValueError(f"slots must lie in [0, {len(rows)}), got {list(slots)}")
        if store and len(set(slots)) != len(slots):
            raise ValueError(f"slots must be distinct, got {list(slots)}")

    def store(self, rows: torch.Tensor, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        """Queue, on the current stream, the copy of this rank's shard of the states of blocks
        `block_ids` (one per recurrent layer) to rows `slots`: gathered into a zeroed staging segment
        on the device, then one `non_blocking` copy per byte span this rank writes and row."""
        self.check(block_ids, rows, slots, store=True)
        staging = self._staging()
        spans = []
        for engine, canon, writes, span in self._pieces(staging, block_ids):
            if writes:
                canon.copy_(engine)
                spans.append(span)
        if self.shard.writes_padding:
            spans.append((self.layout.segment_bytes, len(staging)))
        row_bytes = self.layout.row_bytes
        for a, b in merge_spans(spans):
            for j in range(a // row_bytes, -(-b // row_bytes)):
                lo, hi = max(a, j * row_bytes), min(b, (j + 1) * row_bytes)
                host = rows[slots[j], lo - j * row_bytes : hi - j * row_bytes]
                host.copy_(staging[lo:hi], non_blocking=True)

    def load(self, rows: torch.Tensor, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        """Queue, on the current stream, the copy of this rank's shard of the segment in rows `slots`
        into blocks `block_ids`: one `non_blocking` copy per row into a staging segment on the
        device, then scattered into the blocks there."""
        self.check(block_ids, rows, slots, store=False)
        staging = self._staging()
        row_bytes = self.layout.row_bytes
        for j, slot in enumerate(slots):
            staging[j * row_bytes : (j + 1) * row_bytes].copy_(rows[slot], non_blocking=True)
        for engine, canon, _, _ in self._pieces(staging, block_ids):
            engine.copy_(canon)

    def engine_to_host(self, block_ids: Sequence[int], rows: torch.Tensor, slots: Sequence[int]) -> None:
        """`store`, returning once the rows hold the segment (on CUDA: the current stream waited)."""
        self.store(rows, block_ids, slots)
        self._wait()

    def host_to_engine(self, block_ids: Sequence[int], rows: torch.Tensor, slots: Sequence[int]) -> None:
        """`load`, returning once the blocks hold the segment (on CUDA: the current stream waited)."""
        self.load(rows, block_ids, slots)
        self._wait()

    @property
    def device(self) -> torch.device:
        return self.tensors[0][0].device

    def _staging(self) -> torch.Tensor:
        """A zeroed segment of `rows * row_bytes` bytes on the state tensors' device (from the
        current stream's pool, under CUDA)."""
        return torch.zeros(self.layout.rows * self.layout.row_bytes, dtype=torch.uint8, device=self.device)

    def _wait(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
