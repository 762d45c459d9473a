"""The canonical format of recurrent-layer states (gated delta net, Mamba2) in host rows.

A recurrent layer keeps no per-token KV: it keeps one state per sequence, and a prefix hit needs
only the state at the hit point. kvtier stores the state of every recurrent layer at a chunk
boundary (the end of chunk i) as a "state segment", in rows of its own next to the attention rows
of the chunks (`kvtier.format.layout`):

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
  first axis, `kvtier.format.state_shards`); its copier writes only the bytes of its shard into the
  segment's rows, and reads its shard from them, so the rows are the same whatever the TP degree.

A prefix of n chunks can be served only when the attention rows of chunks 0..n-1 and every part of
the state at the end of chunk n-1 are held: a hybrid prefix comes back whole or not at all.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError

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
