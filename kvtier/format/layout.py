"""The canonical host layout of KV chunks: page and row geometry, TP shards, layer kinds.

A host row holds one chunk of every layer, head-major: for each KV head, for each layer, K then
V (or the MLA latent), each `[chunk_tokens, head_dim]` C-contiguous in the KV dtype; the row is
`[num_kv_heads, num_layers, parts, chunk_tokens, head_dim]`, padded with zeros up to a multiple of
4096 bytes. A layer's page (`page_view`: its K and V of every head) is a strided view of the row.
Head-major because a TP rank holds a range of heads: its bytes of a chunk are one contiguous run
of the row, one copy between device and host whatever the layer count. Nothing in the row depends
on the tensor-parallel degree or the attention backend, so the layout fingerprint does not
either: TP=1, TP=2 and TP=4 engines, on CPU or GPU, write byte-identical rows.

An engine's own tensor layout, and the copies between it and these rows, are in
`kvtier.transfer.copy_plan`. Nothing in this module names an engine.

Tensor parallelism follows vLLM's `QKVParallelLinear`: with `tp <= H` rank r holds heads
`[r*H/tp, (r+1)*H/tp)`; with `tp > H` each head is replicated on `tp/H` consecutive ranks and rank
r holds head `r // (tp/H)`. Only the first replica (`r % (tp/H) == 0`) writes a replicated head to
host memory, so each canonical head is written exactly once; every rank reads.

MLA (multi-head latent attention): a layer caches one latent row per token (`kv_lora_rank + rope`
values), the same on every TP rank. A `latent` layout's page is that row for each token of the
chunk, `[1, chunk_tokens, head_dim]` (num_kv_heads 1, no V); the first rank writes it, every rank
reads it.

Hybrid models: every layer keeps its page in the row, identified by its model layer index (never by
an engine's grouping of layers). `layer_kinds` names what each layer's page holds ("attention" for
full attention, "sliding_window:W" for a layer that attends to the last W tokens); the page format
is the same for both, and the kinds are in the layout fingerprint, so two models whose layers
differ in kind never share rows. An engine that groups layers (each group with its own block ids)
gives a `CopyPlan` the group of each layer; each chunk's block ids are then group by group, and
`SKIP_BLOCK` stands for a block a group does not hold (a sliding-window block outside the window):
a load leaves that page unread, a store refuses it.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from functools import cached_property

import torch

from kvtier.errors import ConfigError

ROW_ALIGN = 4096
SKIP_BLOCK = -1
FULL_ATTENTION = "attention"
_LAYOUT_TAG = b"kvtier.canonical-layout.v2"


@dataclass(frozen=True)
class CanonicalLayout:
    """The canonical page and row geometry of one model's full-attention KV cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    chunk_tokens: int
    dtype: torch.dtype
    layer_kinds: tuple[str, ...] = ()
    latent: bool = False
    segments: str = ""
    """Other segments the model's rows hold besides these pages (`kvtier.format.state_rows.StateLayout.
    describe`); in the fingerprint when not empty."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"layout.{name}", value, "a positive integer")
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigError("layout.dtype", self.dtype, "a torch.dtype")
        if self.layer_kinds and len(self.layer_kinds) != self.num_layers:
            kinds, expected = self.layer_kinds, f"one kind per layer ({self.num_layers})"
            raise ConfigError("layout.layer_kinds", kinds, expected)
        if self.latent and self.num_kv_heads != 1:
            raise ConfigError("layout.num_kv_heads", self.num_kv_heads, "1 for a latent (MLA) layout")

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's kind; every layer is full attention when `layer_kinds` is empty."""
        return self.layer_kinds or (FULL_ATTENTION,) * self.num_layers

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def parts(self) -> int:
        """Tensors per page: K and V (2), or the latent alone (1)."""
        return 1 if self.latent else 2

    @property
    def page_bytes(self) -> int:
        """Bytes of one layer's K and V (or latent) for one chunk."""
        return self.parts * self.num_kv_heads * self.chunk_tokens * self.head_dim * self.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one host row: every layer's page, padded to a multiple of ROW_ALIGN."""
        used = self.num_layers * self.page_bytes
        return -(-used // ROW_ALIGN) * ROW_ALIGN

    @property
    def head_bytes(self) -> int:
        """Bytes of one KV head of every layer (K and V, or the latent) for one chunk: the row's
        unit, contiguous."""
        return self.num_layers * self.parts * self.chunk_tokens * self.head_dim * self.itemsize

    def part_offset(self, head: int, layer: int, part: int) -> int:
        """Byte offset inside a row of `head`'s K (part 0), V (1) or latent (0) of `layer`."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        block = self.chunk_tokens * self.head_dim * self.itemsize
        return head * self.head_bytes + (layer * self.parts + part) * block

    @cached_property
    def fingerprint(self) -> str:
        """32 hex digits naming this layout; equal layouts on any machine give equal digits."""
        desc = _LAYOUT_TAG + struct.pack(
            "<5q", self.num_layers, self.num_kv_heads, self.head_dim, self.chunk_tokens, ROW_ALIGN
        )
        name = str(self.dtype).encode()
        desc += struct.pack("<I", len(name)) + name
        if set(self.kinds) != {FULL_ATTENTION} or self.latent:  # plain models keep their fingerprint
            kinds = ",".join(self.kinds).encode()
            desc += struct.pack("<I?", len(kinds), self.latent) + kinds
        if self.segments:
            segments = b"segments:" + self.segments.encode()
            desc += struct.pack("<I", len(segments)) + segments
        return hashlib.sha256(desc).digest()[:16].hex()

    def page_view(self, rows: torch.Tensor, layer: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`[num_slots, parts, num_kv_heads, chunk_tokens, head_dim]` view of `layer`'s pages in
        `rows` (uint8 `[num_slots, row_bytes]`), sharing its memory (strided: heads are apart)."""
        check_rows(self, rows)
        dtype = dtype or self.dtype
        if dtype.itemsize != self.itemsize:
            raise ValueError(f"a view as {dtype} of a layout of {self.dtype}")
        used = rows[:, : self.num_kv_heads * self.head_bytes].view(dtype)
        whole = used.view(len(rows), self.num_kv_heads, self.num_layers, self.parts, self.chunk_tokens,
                          self.head_dim)
        return whole[:, :, layer].transpose(1, 2)


def check_rows(layout: CanonicalLayout, rows: torch.Tensor) -> None:
    """Raise ValueError unless `rows` is a uint8 `[num_slots, row_bytes]` row-major tensor."""
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != layout.row_bytes:
        raise ValueError(
            f"host rows must be uint8 [num_slots, {layout.row_bytes}], got {rows.dtype} {tuple(rows.shape)}"
        )
    if rows.stride(1) != 1 or rows.stride(0) % ROW_ALIGN:
        raise ValueError(f"host rows must be row-major with aligned rows, strides {rows.stride()}")


def host_rows(buf: memoryview, row_bytes: int, num_slots: int, offset: int = 0) -> torch.Tensor:
    """uint8 `[num_slots, row_bytes]` tensor over `buf[offset:]`, sharing its memory (no copy).

    The tensor holds an export of `buf` (through a numpy array its storage keeps alive), so a
    mapping under it cannot be unmapped while the tensor or a view of it lives: closing the
    mapping then leaves it to go with the last of them (`HostRegion.close`). Without numpy (an
    image with torch alone, never one with vLLM, which needs numpy) the tensor holds no export:
    its mapping must outlive it."""
    if offset < 0 or offset + num_slots * row_bytes > buf.nbytes:
        raise ValueError(
            f"{num_slots} rows of {row_bytes} bytes at offset {offset} "
            f"do not fit in a buffer of {buf.nbytes} bytes"
        )
    count = num_slots * row_bytes
    try:
        import numpy as np
    except ModuleNotFoundError:
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=count, offset=offset)
    else:
        flat = torch.from_numpy(np.frombuffer(buf, dtype=np.uint8, count=count, offset=offset))
    return flat.view(num_slots, row_bytes)


@dataclass(frozen=True)
class TPShard:
    """The canonical KV heads `[head_start, head_end)` that TP rank `rank` of `tp_size` holds."""

    num_kv_heads: int
    tp_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        h, tp = self.num_kv_heads, self.tp_size
        if h <= 0 or tp <= 0 or not 0 <= self.rank < tp:
            raise ConfigError("tp", (h, tp, self.rank), "heads > 0, tp_size > 0, 0 <= rank < tp")
        if (tp <= h and h % tp) or (tp > h and tp % h):
            raise ConfigError("tp_size", tp, f"must divide num_kv_heads={h} or be a multiple of it")

    @property
    def replicas(self) -> int:
        """How many ranks hold each of this rank's heads."""
        return max(1, self.tp_size // self.num_kv_heads)

    @property
    def head_start(self) -> int:
        if self.tp_size > self.num_kv_heads:
            return self.rank // self.replicas
        return self.rank * (self.num_kv_heads // self.tp_size)

    @property
    def num_heads(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def head_end(self) -> int:
        return self.head_start + self.num_heads

    @property
    def writes(self) -> bool:
        """Whether this rank writes its heads to host rows (the first replica of each head)."""
        return self.rank % self.replicas == 0
