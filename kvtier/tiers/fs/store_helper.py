"""Our C helper for the fs tier's store path, compiled on first use with the system C compiler.

From Python, each system call of a store (open, pwritev, close, rename) releases and retakes the
GIL; on 2 cores that measured about 20% slower than the same calls made from C with the GIL released
once (BENCHMARKS.md, fs tier). `NativeWriter.write_chunk` makes these calls in one ctypes call,
and ctypes releases the GIL for its duration. The shared object is built once per source version
(`kvtier.clib.build`). Without a working C compiler, or with `KVTIER_NATIVE=0`, `load()` returns
None and the fs tier keeps its pure-Python path: behaviour is the same either way.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

from kvtier.clib.build import compiled

SOURCE = Path(__file__).with_name("native") / "fs_write.c"
log = logging.getLogger("kvtier.tier.fs")


def _address(buf: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class NativeWriter:
    """The loaded helper. Thread-safe: it keeps no state between calls."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.kvtier_write_chunk
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p,
                             ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                             ctypes.c_int]

    def write_chunk(self, dir_fd: int, tmp: str, final: str, header: memoryview, row: memoryview,
                    direct: bool, mode: int) -> None:
        """Write header + row to the new file `tmp` (mode `mode`), then rename it over `final`,
        both names in the directory `dir_fd`; raises OSError (FileNotFoundError when the directory
        is gone). `tmp` is gone after a failure."""
        rc = self._fn(dir_fd, os.fsencode(tmp), os.fsencode(final), _address(header), len(header),
                      _address(row), len(row), int(direct), mode)
        if rc < 0:
            raise OSError(-rc, os.strerror(-rc), tmp)


@functools.cache
def load() -> NativeWriter | None:
    """The helper, built if needed; None when it cannot be built or loaded (logged once)."""
    try:
        return NativeWriter(compiled(SOURCE))
    except OSError as e:
        log.info("fs tier: no native store helper (%s); using the Python path", e)
        return None
