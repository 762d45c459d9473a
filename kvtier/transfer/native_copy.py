"""`CopyPlan`'s copies between CPU tensors through our C kernel (`native/kv_copy.c`).

A copy job is many small matrices: for every layer, part (K, V or latent), block and head, one
`[block_size, head_dim]` page between an engine block and a host row. torch copies each through a
strided view; vLLM's CPU layout keeps K transposed (`[head_dim, block_size]`), where torch's
element loop runs at a fraction of memory speed. The kernel takes every matrix of one stride
pattern in one call (a table of source and destination addresses) and transposes in register
tiles (BENCHMARKS.md, "copies on the engine thread").

The address tables come from the same zero-copy views `CopyPlan` copies through (their
`data_ptr` and strides), so the kernel writes exactly the elements torch would; the views' bases
are kept between calls while the layer tensors and host rows stay the same. Built for this
machine's instruction set on first use (`kvtier.clib.build`); without a C compiler, or with
`KVTIER_NATIVE=0`, `kernel()` is None and `CopyPlan` copies with torch.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvtier.clib.build import compiled

SOURCE = Path(__file__).with_name("native") / "kv_copy.c"
log = logging.getLogger("kvtier.transfer")

ViewPairs = Sequence[tuple[torch.Tensor, torch.Tensor]]


class MatrixKernel:
    """The loaded kernel; thread-safe (no state). ctypes releases the GIL for each call."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.kvtier_copy_matrices
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                             *[ctypes.c_int64] * 6]

    def copy(self, src: np.ndarray, dst: np.ndarray, itemsize: int, shape: tuple[int, int],
             src_strides: tuple[int, int], dst_strides: tuple[int, int]) -> None:
        """Copy matrix i of `shape` (elements of `itemsize` bytes, strides in elements) from
        address `src[i]` to `dst[i]` (int64 arrays of equal length)."""
        rc = self._fn(len(src), src.ctypes.data, dst.ctypes.data, itemsize, *shape,
                      *src_strides, *dst_strides)
        if rc:
            raise ValueError(f"the copy kernel takes elements of 1, 2, 4 or 8 bytes, not {itemsize}")


@functools.cache
def kernel() -> MatrixKernel | None:
    """The kernel, built if needed; None when it cannot be built or loaded (logged once)."""
    try:
        return MatrixKernel(compiled(SOURCE, native_isa=True))
    except OSError as e:
        log.info("kvtier: no native copy kernel (%s); copies run through torch", e)
        return None


@dataclass(frozen=True)
class _Unit:
    """The matrices of the layers of one group that share every stride: one kernel call."""

    group: int
    itemsize: int
    heads: int
    shape: tuple[int, int]
    engine_bases: np.ndarray  # per layer: the engine view's address
    host_offsets: np.ndarray  # per layer: the host view's address minus the rows' address
    engine_strides: tuple[int, ...]  # block, head, token, element
    host_strides: tuple[int, ...]  # slot, block in chunk, head, token, element


_Key = tuple[int, int, int, int, int, tuple[int, ...], tuple[int, ...]]


def _units(views: Sequence[tuple[int, ViewPairs]], rows: torch.Tensor) -> list[_Unit]:
    """`views`: (group, the layer's (engine, host) view pairs) for every layer, in order."""
    found: dict[_Key, tuple[list[int], list[int]]] = {}
    base = rows.data_ptr()
    for group, pairs in views:
        for engine, host in pairs:
            key: _Key = (group, engine.element_size(), engine.shape[1], engine.shape[2],
                         engine.shape[3], engine.stride(), host.stride())
            bases, offsets = found.setdefault(key, ([], []))
            bases.append(engine.data_ptr())
            offsets.append(host.data_ptr() - base)
    return [
        _Unit(group, itemsize, heads, (tokens, width), np.array(bases, dtype=np.int64),
              np.array(offsets, dtype=np.int64), engine_strides, host_strides)
        for (group, itemsize, heads, tokens, width, engine_strides, host_strides), (bases, offsets)
        in found.items()
    ]


class NativeCopies:
    """One plan's copies through the kernel, given each layer's view pairs."""

    def __init__(self, kernel: MatrixKernel) -> None:
        self.kernel = kernel
        self._key: tuple[object, ...] = ()
        self._units: list[_Unit] = []

    def copy(
        self,
        views: Callable[[], Sequence[tuple[int, ViewPairs]]],
        key: tuple[object, ...],
        pairs: Sequence[Sequence[tuple[int, int, int]]],
        rows: torch.Tensor,
        slots: Sequence[int],
        to_host: bool,
    ) -> None:
        """Copy every (chunk, block in chunk, engine block) of `pairs[group]` for each layer of
        that group; `views()` gives the layers' view pairs, asked again only when `key` (the
        tensors' identity) changed."""
        if key != self._key:
            self._units, self._key = _units(views(), rows), key
        base = rows.data_ptr()
        slot_of = np.asarray(slots, dtype=np.int64)
        tables = {g: np.asarray(p, dtype=np.int64).reshape(-1, 3) for g, p in enumerate(pairs)}
        for unit in self._units:
            table = tables[unit.group]
            if not len(table):
                continue
            heads = np.arange(unit.heads, dtype=np.int64)
            sb, sh, st, se = unit.engine_strides
            hs, hj, hh, ht, he = unit.host_strides
            chunk, j, block = table[:, 0], table[:, 1], table[:, 2]
            engine = (block[:, None] * sb + heads * sh) * unit.itemsize
            host = (slot_of[chunk][:, None] * hs + j[:, None] * hj + heads * hh) * unit.itemsize
            e = (unit.engine_bases[:, None, None] + engine).ravel()
            h = (base + unit.host_offsets[:, None, None] + host).ravel()
            if to_host:
                self.kernel.copy(e, h, unit.itemsize, unit.shape, (st, se), (ht, he))
            else:
                self.kernel.copy(h, e, unit.itemsize, unit.shape, (ht, he), (st, se))
