"""Copy plans between one TP rank's engine tensors and canonical host rows, and the engine-layout
contract they read engine tensors through.

An engine's layout is a small `EngineLayout` subclass (the engine's own, under
`kvtier.integrations`) that gives zero-copy strided views `[num_blocks, H_local, block_size,
head_dim]` of K and of V in one layer tensor (or of the latent alone, for MLA); a `CopyPlan` needs
nothing else, so a new backend is one more subclass.

Kernel blocks: an engine may split each of a group's blocks of `block_size` tokens into `ratio`
kernel blocks of `block_size // ratio` tokens (vLLM does when an attention backend needs smaller
blocks): the layer tensor then holds `num_blocks * ratio` blocks of the kernel size, and block b is
kernel blocks `b * ratio .. b * ratio + ratio - 1`, in token order. Block ids stay the engine's
blocks everywhere; the plan copies by kernel blocks (`pairs` expands each block into its kernel
blocks), so the host rows are the same bytes whatever the split.

The plan is written once over torch tensors and runs on any device: the CPU path (`transfer.cpu`)
copies by it, and the CUDA path (`transfer.staged`, `transfer.stream`) gathers and scatters by its
block mapping (`pairs`) and views.

Copy plans hold no state: concurrent calls are safe when their slots and blocks are disjoint.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch

from kvtier.errors import ConfigError
from kvtier.format.layout import SKIP_BLOCK, CanonicalLayout, TPShard, check_rows

if TYPE_CHECKING:
    from kvtier.transfer.native_copy import NativeCopies

log = logging.getLogger("kvtier.transfer")


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
        native: bool = True,
        kernel_block_sizes: Sequence[int] = (),
    ) -> None:
        """`layer_groups[l]`: the block-id group of layer l (default: one group for all layers);
        `native`: copies between CPU tensors go through our C kernel when it is available;
        `kernel_block_sizes[g]`: the tokens of one block of group g's layer tensors, a divisor of
        `block_size` (default: `block_size`, no split; see the module doc)."""
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
        kernel = tuple(kernel_block_sizes) or (block_size,) * self.num_groups
        if len(kernel) != self.num_groups or any(k <= 0 or block_size % k for k in kernel):
            raise ConfigError(
                "kernel_block_sizes", kernel, f"one per group, each dividing block_size={block_size}"
            )
        self.kernel_block_sizes = kernel
        self.ratios = tuple(block_size // k for k in kernel)
        """Kernel blocks per block, per group."""
        self.kernel_blocks_per_chunk = tuple(self.blocks_per_chunk * r for r in self.ratios)
        """Kernel blocks per chunk, per group."""
        self.native = _native_copies() if native else None
        self._counted: tuple[tuple[tuple[int, torch.Size], ...], list[int]] | None = None
        """The last tensors' key and `block_counts`."""

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
        pairs = self.pairs(layer_tensors, block_ids_per_chunk, host_rows, slots, to_host)
        if to_host and not self.shard.writes:
            return
        if self.native is not None and host_rows.device.type == "cpu" \
                and all(kv.device.type == "cpu" for kv in layer_tensors):

            def views() -> list[tuple[int, tuple[tuple[torch.Tensor, torch.Tensor], ...]]]:
                return [(self.layer_groups[layer], self._views(kv, host_rows, layer))
                        for layer, kv in enumerate(layer_tensors)]

            key = (host_rows.data_ptr(), len(host_rows),
                   *((kv.data_ptr(), kv.dtype, kv.shape, kv.stride()) for kv in layer_tensors))
            self.native.copy(views, key, pairs, host_rows, slots, to_host)
            return
        for layer, kv in enumerate(layer_tensors):
            for engine, host in self._views(kv, host_rows, layer):
                for chunk, j, block in pairs[self.layer_groups[layer]]:
                    if to_host:
                        host[slots[chunk], j].copy_(engine[block])
                    else:
                        engine[block].copy_(host[slots[chunk], j])

    def block_counts(self, layer_tensors: Sequence[torch.Tensor]) -> list[int]:
        """Per group, how many engine blocks every one of its layers' tensors holds. Derived from
        the views once per set of tensors (an engine's never change), not for every job."""
        key = tuple((kv.data_ptr(), kv.shape) for kv in layer_tensors)
        if self._counted is not None and self._counted[0] == key:
            return self._counted[1]
        counts: list[list[int]] = [[] for _ in range(self.num_groups)]
        for layer, kv in enumerate(layer_tensors):
            g = self.layer_groups[layer]
            counts[g].append(len(self.engine_views(kv, g)[0]) // self.ratios[g])
        found = [min(c) for c in counts]
        self._counted = (key, found)
        return found

    def engine_views(self, kv: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, ...]:
        """K and V (or latent) kernel block views `[num_kernel_blocks, H_local, kernel_block_size,
        D]` of one layer tensor of group `group`; ValueError when its shape, head count, kernel
        block size or dtype width do not fit."""
        views = self.engine.kv_views(kv, self.layout.head_dim)
        if len(views) != self.layout.parts:
            parts = self.layout.parts
            raise ValueError(f"{self.engine.name}: {len(views)} views per layer, the layout has {parts}")
        k = views[0]
        expected = (self.shard.num_heads, self.kernel_block_sizes[group], self.layout.head_dim)
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
        """(engine, host) view pairs for K and V (or the latent), by the layer's kernel blocks:
        engine `[num_kernel_blocks, H_local, kernel_block_size, D]`, host `[num_slots,
        kernel_blocks_per_chunk, H_local, kernel_block_size, D]` (this rank's heads)."""
        group = self.layer_groups[layer]
        page = self.layout.page_view(rows, layer, kv.dtype)
        heads = page[:, :, self.shard.head_start : self.shard.head_end]
        s, parts, h, _, d = heads.shape
        kbpc, kbs = self.kernel_blocks_per_chunk[group], self.kernel_block_sizes[group]
        host = heads.view(s, parts, h, kbpc, kbs, d).permute(1, 0, 3, 2, 4, 5)
        return tuple(zip(self.engine_views(kv, group), host, strict=True))

    def pairs(
        self,
        layer_tensors: Sequence[torch.Tensor],
        block_ids_per_chunk: Sequence[Sequence[int]],
        host_rows: torch.Tensor,
        slots: Sequence[int],
        to_host: bool,
    ) -> list[list[tuple[int, int, int]]]:
        """Per group, (chunk index, kernel block index within the chunk, engine kernel block) for
        every kernel block of every block the group holds, in chunk then token order (`SKIP_BLOCK`s
        left out; without a split, kernel blocks are the blocks): the one block mapping of every
        copy path, CPU or device. `block_ids_per_chunk` holds the engine's block ids. Raises
        ValueError, before anything is copied, when a slot or block is out of range, a store's
        slots repeat or miss a block, or a load's blocks repeat."""
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
        num_blocks = self.block_counts(layer_tensors)
        if any(not 0 <= s < len(host_rows) for s in slots):
            raise ValueError(f"slots must lie in [0, {len(host_rows)}), got {list(slots)}")
        blocks = [
            [
                (chunk, j, block)
                for chunk, ids in enumerate(block_ids_per_chunk)
                for j, block in enumerate(ids[g * bpc : (g + 1) * bpc])
                if block != SKIP_BLOCK
            ]
            for g in range(self.num_groups)
        ]
        for g, group in enumerate(blocks):
            if any(not 0 <= b < num_blocks[g] for _, _, b in group):
                raise ValueError(f"block ids must lie in [0, {num_blocks[g]}) in group {g}")
        if to_host and len(set(slots)) != len(slots):
            raise ValueError(f"slots must be distinct, got {list(slots)}")
        if to_host and any(len(group) != len(slots) * bpc for group in blocks):
            raise ValueError(f"a store needs every block of every chunk, got {list(block_ids_per_chunk)}")
        if not to_host and any(len({b for _, _, b in group}) != len(group) for group in blocks):
            raise ValueError("destination block ids must be distinct")
        return [
            [(chunk, j * r + i, block * r + i) for chunk, j, block in group for i in range(r)]
            for group, r in zip(blocks, self.ratios, strict=True)
        ]


def _native_copies() -> NativeCopies | None:
    """Our C kernel's copies, or None where they cannot run: without numpy (the address tables'
    arrays; a CUDA machine may lack it, and its copies never take this path) or without the kernel
    (`native_copy.kernel`)."""
    try:
        from kvtier.transfer.native_copy import NativeCopies, kernel
    except ImportError as e:
        log.info("kvtier: no native copy kernel (%s); copies run through torch", e)
        return None
    found = kernel()
    return NativeCopies(found) if found is not None else None
