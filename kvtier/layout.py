"""The canonical host layout of KV chunks, the engine-layout contract, and copy plans between them.

Canonical page (one chunk of one full-attention layer): K then V, each
`[num_kv_heads, chunk_tokens, head_dim]` C-contiguous in the KV dtype, all KV heads of the model
together. A host row holds the pages of every layer for one chunk, in layer order, starting at
`layer * page_bytes`, the row padded with zeros up to a multiple of 4096 bytes. Nothing in the
row depends on the tensor-parallel degree or the attention backend, so the layout fingerprint
does not either: TP=1, TP=2 and TP=4 engines, on CPU or GPU, write byte-identical rows.

An engine's layout is a small `EngineLayout` subclass (the engine's own, under
`kvtier.integrations`) that gives zero-copy strided views `[num_blocks, H_local, block_size,
head_dim]` of K and of V in one layer tensor; the copy plans need nothing else, so a new backend is
one more subclass. Nothing in this module names an engine.

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

Copy plans hold no state: concurrent calls are safe when their slots and blocks are disjoint.
"""

from __future__ import annotations

import hashlib
import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import torch

from kvtier.errors import ConfigError

ROW_ALIGN = 4096
SKIP_BLOCK = -1
FULL_ATTENTION = "attention"
_LAYOUT_TAG = b"kvtier.canonical-layout.v1"


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
    """Other segments the model's rows hold besides these pages (`kvtier.state_rows.StateLayout.
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

    def page_offset(self, layer: int) -> int:
        """Byte offset of `layer`'s page inside a row."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        return layer * self.page_bytes

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
        `rows` (uint8 `[num_slots, row_bytes]`), sharing its memory."""
        check_rows(self, rows)
        off = self.page_offset(layer)
        page = rows[:, off : off + self.page_bytes].view(dtype or self.dtype)
        return page.view(len(rows), self.parts, self.num_kv_heads, self.chunk_tokens, self.head_dim)


def check_rows(layout: CanonicalLayout, rows: torch.Tensor) -> None:
    """Raise ValueError unless `rows` is a uint8 `[num_slots, row_bytes]` row-major tensor."""
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != layout.row_bytes:
        raise ValueError(
            f"host rows must be uint8 [num_slots, {layout.row_bytes}], got {rows.dtype} {tuple(rows.shape)}"
        )
    if rows.stride(1) != 1 or rows.stride(0) % ROW_ALIGN:
        raise ValueError(f"host rows must be row-major with aligned rows, strides {rows.stride()}")


def host_rows(buf: memoryview, row_bytes: int, num_slots: int, offset: int = 0) -> torch.Tensor:
    """uint8 `[num_slots, row_bytes]` tensor over `buf[offset:]`, sharing its memory (no copy)."""
    if offset < 0 or offset + num_slots * row_bytes > buf.nbytes:
        raise ValueError(
            f"{num_slots} rows of {row_bytes} bytes at offset {offset} "
            f"do not fit in a buffer of {buf.nbytes} bytes"
        )
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=num_slots * row_bytes, offset=offset)
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


class EngineLayout(ABC):
    """How one engine backend lays out one layer's KV cache tensor."""

    name: ClassVar[str]
    latent: ClassVar[bool] = False  # True: a layer holds one latent per token (MLA), not K and V

    @abstractmethod
    def kv_views(self, kv: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, ...]:
        """K and V of `kv` (or its latent alone, for an MLA layout) as views `[num_blocks,
        H_local, block_size, head_dim]` sharing its memory; ValueError when `kv` does not have
        this layout."""


class CopyPlan:
    """Copies chunks between one TP rank's engine tensors and canonical host rows.

    A chunk is `blocks_per_chunk` engine blocks (chunk_tokens = blocks_per_chunk * block_size),
    given in token order. Stores from a rank that does not write (a non-first replica) copy
    nothing. K and V of each engine block of each layer are one strided `copy_` each between
    zero-copy views: a single pass over the bytes. (Batched `index_select`/`index_copy_` over these permuted
    multi-dimensional views takes torch's per-element path on CPU and measured several times
    slower, besides needing a staging copy.)
    """

    def __init__(
        self,
        layout: CanonicalLayout,
        engine: EngineLayout,
        shard: TPShard,
        block_size: int,
        layer_groups: Sequence[int] = (),
    ) -> None:
        """`layer_groups[l]`: the block-id group of layer l (default: one group for all layers)."""
        if block_size <= 0 or layout.chunk_tokens % block_size:
            raise ConfigError("block_size", block_size, f"must divide chunk_tokens={layout.chunk_tokens}")
        if shard.num_kv_heads != layout.num_kv_heads:
            raise ConfigError("tp", shard.num_kv_heads, f"shard of {layout.num_kv_heads} KV heads expected")
        if engine.latent != layout.latent:
            raise ConfigError("engine_layout", engine.name, f"a layout with latent={layout.latent}")
        groups = tuple(layer_groups) or (0,) * layout.num_layers
        if len(groups) != layout.num_layers or sorted(set(groups)) != list(range(max(groups) + 1)):
            raise ConfigError("layer_groups", groups, f"{layout.num_layers} group indices 0..n-1, each used")
        self.layout = layout
        self.engine = engine
        self.shard = shard
        self.block_size = block_size
        self.blocks_per_chunk = layout.chunk_tokens // block_size
        self.layer_groups = groups
        self.num_groups = max(groups) + 1

    def engine_to_host(
        self,
        layer_tensors: Sequence[torch.Tensor],
        block_ids_per_chunk: Sequence[Sequence[int]],
        host_rows: torch.Tensor,
        slots: Sequence[int],
    ) -> None:
        """Write this rank's heads of chunk i (blocks `block_ids_per_chunk[i]`: `blocks_per_chunk`
        per group, group by group) to `slots[i]`."""
        self._copy(layer_tensors, block_ids_per_chunk, host_rows, slots, to_host=True)

    def host_to_engine(
        self,
        layer_tensors: Sequence[torch.Tensor],
        block_ids_per_chunk: Sequence[Sequence[int]],
        host_rows: torch.Tensor,
        slots: Sequence[int],
    ) -> None:
        """Write this rank's heads of row `slots[i]` into blocks `block_ids_per_chunk[i]` (group
        by group; a `SKIP_BLOCK` leaves that group's page of that block unread)."""
        self._copy(layer_tensors, block_ids_per_chunk, host_rows, slots, to_host=False)

    def _copy(
        self,
        layer_tensors: Sequence[torch.Tensor],
        block_ids_per_chunk: Sequence[Sequence[int]],
        host_rows: torch.Tensor,
        slots: Sequence[int],
        to_host: bool,
    ) -> None:
        """One pass over the bytes in either direction; the destinations must be distinct (host
        slots on a store, engine blocks on a load), and a non-writing replica stores nothing."""
        pairs = self._pairs(layer_tensors, block_ids_per_chunk, host_rows, slots)
        if to_host and len(set(slots)) != len(slots):
            raise ValueError(f"slots must be distinct, got {list(slots)}")
        if to_host and any(len(group) != len(slots) * self.blocks_per_chunk for group in pairs):
            raise ValueError(f"a store needs every block of every chunk, got {list(block_ids_per_chunk)}")
        if not to_host and any(len({b for _, _, b in group}) != len(group) for group in pairs):
            raise ValueError("destination block ids must be distinct")
        if to_host and not self.shard.writes:
            return
        for layer, kv in enumerate(layer_tensors):
            for engine, host in self._views(kv, host_rows, layer):
                for slot, j, block in pairs[self.layer_groups[layer]]:
                    if to_host:
                        host[slot, j].copy_(engine[block])
                    else:
                        engine[block].copy_(host[slot, j])

    def engine_views(self, kv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """K and V (or latent) block views `[num_blocks, H_local, block_size, D]` of one layer
        tensor; ValueError when its shape, head count, block size or dtype width do not fit."""
        views = self.engine.kv_views(kv, self.layout.head_dim)
        if len(views) != self.layout.parts:
            parts = self.layout.parts
            raise ValueError(f"{self.engine.name}: {len(views)} views per layer, the layout has {parts}")
        k = views[0]
        expected = (self.shard.num_heads, self.block_size, self.layout.head_dim)
        if tuple(k.shape[1:]) != expected or any(v.shape != k.shape for v in views):
            raise ValueError(
                f"{self.engine.name}: layer tensor {tuple(kv.shape)} holds K/V blocks "
                f"[H, block_size, D] = {tuple(k.shape[1:])}, expected {expected}"
            )
        if kv.dtype.itemsize != self.layout.itemsize:
            raise ValueError(f"layer dtype {kv.dtype} does not match layout {self.layout.dtype}")
        return views

    def _views(
        self, kv: torch.Tensor, rows: torch.Tensor, layer: int
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """(engine, host) view pairs for K and V (or the latent): engine `[num_blocks, H_local,
        block_size, D]`, host `[num_slots, blocks_per_chunk, H_local, block_size, D]` (this rank's
        heads)."""
        page = self.layout.page_view(rows, layer, kv.dtype)
        heads = page[:, :, self.shard.head_start : self.shard.head_end]
        s, parts, h, _, d = heads.shape
        split = heads.view(s, parts, h, self.blocks_per_chunk, self.block_size, d)
        host = split.permute(1, 0, 3, 2, 4, 5)
        return tuple(zip(self.engine_views(kv), host, strict=True))

    def _pairs(
        self,
        layer_tensors: Sequence[torch.Tensor],
        block_ids_per_chunk: Sequence[Sequence[int]],
        host_rows: torch.Tensor,
        slots: Sequence[int],
    ) -> list[list[tuple[int, int, int]]]:
        """Per group, (slot, block index within the chunk, engine block) for every block the group
        holds (`SKIP_BLOCK`s left out), all validated."""
        if len(layer_tensors) != self.layout.num_layers:
            raise ValueError(
                f"{len(layer_tensors)} layer tensors, layout has {self.layout.num_layers} layers"
            )
        if len(block_ids_per_chunk) != len(slots):
            raise ValueError(f"{len(block_ids_per_chunk)} chunks of blocks for {len(slots)} slots")
        bpc = self.blocks_per_chunk
        if any(len(ids) != bpc * self.num_groups for ids in block_ids_per_chunk):
            raise ValueError(f"every chunk needs exactly {bpc * self.num_groups} block ids")
        check_rows(self.layout, host_rows)
        num_blocks = min(self.engine_views(kv)[0].shape[0] for kv in layer_tensors)
        if any(not 0 <= s < len(host_rows) for s in slots):
            raise ValueError(f"slots must lie in [0, {len(host_rows)}), got {list(slots)}")
        pairs = [
            [
                (slot, j, block)
                for slot, ids in zip(slots, block_ids_per_chunk, strict=True)
                for j, block in enumerate(ids[g * bpc : (g + 1) * bpc])
                if block != SKIP_BLOCK
            ]
            for g in range(self.num_groups)
        ]
        if any(not 0 <= block < num_blocks for group in pairs for _, _, block in group):
            raise ValueError(f"block ids must lie in [0, {num_blocks})")
        return pairs
