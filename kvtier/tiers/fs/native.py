"""Our C helper for the fs tier's store path, compiled on first use with the system C compiler.

From Python, each system call of a store (open, pwritev, close, rename) releases and retakes the
GIL; on 2 cores that measured about 20% slower than the same calls made from C with the GIL released
once (BENCHMARKS.md, fs tier). `NativeWriter.write_chunk` makes the four calls in one ctypes call,
and ctypes releases the GIL for its duration. The shared object is built once per source version
into `~/.cache/kvtier/native` (published by rename, so concurrent builders never see a partial
file). Without a working C compiler, or with `KVTIER_NATIVE=0`, `load()` returns None and the fs
tier keeps its pure-Python path: behaviour is the same either way.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("native") / "fs_write.c"
log = logging.getLogger("kvtier.tier.fs")


def _address(buf: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class NativeWriter:
    """The loaded helper. Thread-safe: it keeps no state between calls."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.kvtier_write_chunk
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t,
                             ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def write_chunk(self, tmp: str, final: str, header: memoryview, row: memoryview,
                    direct: bool) -> None:
        """Write header + row to the new file `tmp`, then rename it over `final`; raises OSError
        (FileNotFoundError when the directory is missing). `tmp` is gone after a failure."""
        rc = self._fn(os.fsencode(tmp), os.fsencode(final), _address(header), len(header),
                      _address(row), len(row), int(direct))
        if rc < 0:
            raise OSError(-rc, os.strerror(-rc), tmp)


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtier" / "native"


def _build(target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", tmp, str(SOURCE)],
                       check=True, capture_output=True, timeout=60)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@functools.cache
def load() -> NativeWriter | None:
    """The helper, built if needed; None when it cannot be built or loaded (logged once)."""
    if os.environ.get("KVTIER_NATIVE", "1") == "0":
        return None
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    target = _cache_dir() / f"fs_write-{digest}.so"
    try:
        if not target.exists():
            _build(target)
        return NativeWriter(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError) as e:
        log.info("fs tier: no native store helper (%s); using the Python path", e)
        return None
