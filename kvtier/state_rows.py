"""The canonical format of recurrent-layer states (gated delta net, Mamba2) in host rows.

A recurrent layer keeps no per-token KV: it keeps one state per sequence, and a prefix hit needs
only the state at the hit point. kvtier stores the state of every recurrent layer at a chunk
boundary (the end of chunk i) as a "state segment", in rows of its own next to the attention rows
of the chunks (`kvtier.layout`):

- Content: for each recurrent layer in model order, each of its state tensors in the engine's
  order (conv state, then the recurrent/SSM state), C-contiguous, in the dtype recorded for it.
  The conv state is `[conv_dim, kernel - 1]` (channels first), whatever orientation the engine
  keeps; the recurrent state keeps the engine's per-layer shape (gated delta net: `[num_v_heads,
  head_v_dim, head_k_dim]`; Mamba2: `[num_heads, head_dim, d_state]`). Shapes are the whole
  model's (TP=1): nothing depends on the engine's sharding.
- Rows: the segment's bytes laid end to end over `rows` consecutive parts of `row_bytes` each
  (the attention row size, so every tier stores state rows as any other row), the last padded with
  zeros. Part j of the state at the end of chunk i has the key `state_key(key_i, j)`.
- The description (`describe`) names the layers, shapes and dtypes; it is in the model
  fingerprint and the layout fingerprint, so engines whose states differ never share rows. A
  copier whose engine tensor has another dtype than the recorded one converts (`copy_`).
- Tensor parallelism: a rank's engine tensors hold a shard of each canonical part (rows along its
  first axis, `kvtier.state_shards`); its copier writes only the bytes of its shard into the
  segment's rows, and reads its shard from them, so the rows are the same whatever the TP degree.

A prefix of n chunks can be served only when the attention rows of chunks 0..n-1 and every part of
the state at the end of chunk n-1 are held: a hybrid prefix comes back whole or not at all.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError
from kvtier.state_shards import StateShard, merge_spans

_STATE_TAG = b"kvtier.state.v1"


@dataclass(frozen=True)
class StatePart:
    """One state tensor of a recurrent layer: its canonical shape and dtype, and whether the
    engine keeps it transposed (a conv state stored `[kernel - 1, conv_dim]`)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    transposed: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row along the first canonical axis (a conv channel, a head)."""
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    def engine_shape(self, rows: int | None = None) -> tuple[int, ...]:
        """The engine tensor's shape of this part holding `rows` canonical rows (all by default)."""
        shape = self.shape if rows is None else (rows, *self.shape[1:])
        return tuple(reversed(shape)) if self.transposed else shape


@dataclass(frozen=True)
class StateLayout:
    """The recurrent layers of a model (model layer indices), the parts of each layer's state, and
    how many host rows of `row_bytes` one state segment takes."""

    kind: str
    layers: tuple[int, ...]
    parts: tuple[StatePart, ...]
    row_bytes: int

    def __post_init__(self) -> None:
        if not self.layers or not self.parts:
            raise ConfigError("states", (self.layers, self.parts), "at least one layer and one part")
        if self.row_bytes <= 0:
            raise ConfigError("states.row_bytes", self.row_bytes, "a positive number of bytes")

    @property
    def layer_bytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    @property
    def segment_bytes(self) -> int:
        """Bytes of one state segment (every recurrent layer's state at one boundary)."""
        return len(self.layers) * self.layer_bytes

    @property
    def rows(self) -> int:
        """Host rows per state segment."""
        return -(-self.segment_bytes // self.row_bytes)

    def describe(self) -> str:
        """What the segment holds, for fingerprints: kind, layers, each part's shape and dtype."""
        parts = ";".join(
            f"{'x'.join(map(str, p.shape))}:{str(p.dtype).removeprefix('torch.')}" for p in self.parts
        )
        return f"{self.kind}@{','.join(map(str, self.layers))}[{parts}]"

    def offsets(self) -> list[list[int]]:
        """Byte offset of part p of recurrent layer l in the segment, as `[l][p]`."""
        out: list[list[int]] = []
        offset = 0
        for _ in self.layers:
            row = []
            for part in self.parts:
                row.append(offset)
                offset += part.nbytes
            out.append(row)
        return out


def state_key(chunk_key: bytes, part: int) -> bytes:
    """The key of row `part` of the state at the end of the chunk keyed `chunk_key` (32 bytes,
    never equal to a chunk key: another tag is hashed)."""
    return hashlib.sha256(_STATE_TAG + chunk_key + struct.pack("<I", part)).digest()


def state_keys(layout: StateLayout, chunk_key: bytes) -> list[bytes]:
    """The keys of every row of the state at the end of the chunk keyed `chunk_key`."""
    return [state_key(chunk_key, j) for j in range(layout.rows)]


class StateCopier:
    """Copies state segments between one rank's recurrent-layer state tensors and host rows.

    `tensors[l]` are layer l's state tensors (in `layout.parts` order), each `[num_blocks,
    *engine_shape]` holding the rank's shard (`shard`; default: the whole state, TP=1): block b's
    state is `tensor[b]`. A copy stages the segment in one contiguous buffer, so a part may straddle
    two rows; a store writes only the byte spans of the shard's written pieces (and the padding on
    the first rank). Copies are synchronous; concurrent calls are safe when their slots and blocks
    are disjoint, or when they come from distinct ranks of one shard map.
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
        if len(block_ids) != len(self.layout.layers):
            raise ValueError(f"one block per recurrent layer expected, got {list(block_ids)}")
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
                    out.append((engine[piece.local : piece.local + rows], canon[piece.start : piece.end],
                                piece.writes, span))
        return out

    def engine_to_host(self, block_ids: Sequence[int], rows: torch.Tensor, slots: Sequence[int]) -> None:
        """Write this rank's shard of the states of blocks `block_ids` (one per recurrent layer) to
        rows `slots`."""
        staging = self._staging(slots, rows)
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
                rows[slots[j], lo - j * row_bytes : hi - j * row_bytes] = staging[lo:hi]

    def host_to_engine(self, block_ids: Sequence[int], rows: torch.Tensor, slots: Sequence[int]) -> None:
        """Write this rank's shard of the state segment in rows `slots` into blocks `block_ids`
        (one per layer)."""
        staging = self._staging(slots, rows)
        staging.view(len(slots), self.layout.row_bytes).copy_(rows[list(slots)])
        for engine, canon, _, _ in self._pieces(staging, block_ids):
            engine.copy_(canon)

    def _staging(self, slots: Sequence[int], rows: torch.Tensor) -> torch.Tensor:
        if len(slots) != self.layout.rows or rows.dim() != 2 or rows.shape[1] != self.layout.row_bytes:
            raise ValueError(
                f"a state segment is {self.layout.rows} rows of {self.layout.row_bytes} bytes, got "
                f"{len(slots)} slots of {tuple(rows.shape)}"
            )
        return torch.zeros(self.layout.rows * self.layout.row_bytes, dtype=torch.uint8)
