"""Reading and writing one chunk file: zero-copy vectored I/O between a host row and the file.

A chunk file is the `chunkfmt` header followed by the row. Writes go to a temp file in the target
directory (named relative to its fd, created with the tier's file mode whatever the umask, never
through a symlink), are checked for completeness, and are published by `os.replace`; the temp file
never outlives a failed write. Reads fill the caller's header buffer and row with one `preadv`, then
verify everything before the row may be used.

With O_DIRECT, every buffer must be page-aligned and a multiple of the page size: the header buffers
here are anonymous mappings (page-aligned), and the caller checks rows before choosing O_DIRECT.
Functions here are called from the I/O threads; each thread uses its own header buffer.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os

from kvtier.format.chunks import ChunkError
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.common.fleetkey import FleetKey
from kvtier.tiers.fs.index import temp_name
from kvtier.tiers.fs.safe_files import HostileFile, create_file, open_regular
from kvtier.tiers.fs.store_helper import NativeWriter

O_DIRECT: int = getattr(os, "O_DIRECT", 0)
PAGE = mmap.PAGESIZE
CHECK_PIECE_BYTES = 1 << 20
"""`check_file` reads a payload in pieces of at most this size."""


def address(buf: memoryview) -> int | None:
    """The address of a writable buffer's first byte, or None when it cannot be known."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    except (TypeError, ValueError):
        return None


def new_header_buffer() -> mmap.mmap:
    """A page-aligned buffer for one header."""
    return mmap.mmap(-1, chunkfmt.HEADER_BYTES)


def probe_direct_io(directory: str) -> bool:
    """Whether files in `directory` accept O_DIRECT writes and reads of an aligned page."""
    if not O_DIRECT:
        return False
    path = os.path.join(directory, temp_name("probe"))
    page = mmap.mmap(-1, PAGE)
    try:
        fd = create_file(path, 0o600, os.O_RDWR | O_DIRECT)
        try:
            return os.pwrite(fd, page, 0) == PAGE and os.preadv(fd, [page], 0) == PAGE
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        page.close()
        with contextlib.suppress(OSError):
            os.unlink(path)


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """What is left of `bufs` after their first `n` bytes."""
    out: list[memoryview] = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
        else:
            out.append(b[n:])
            n = 0
    return out


def write_chunk(
    dir_fd: int, name: str, header: mmap.mmap, key: bytes, layout_fp: bytes, row: memoryview,
    direct: bool, mode: int, native: NativeWriter | None = None, fleet: FleetKey | None = None,
) -> None:
    """Publish `row` as the chunk file `name` of the directory `dir_fd`, with permission bits
    `mode`, through `native` when given, MACed with `fleet` when given. Raises OSError;
    FileNotFoundError means the directory is gone."""
    chunkfmt.pack_header(memoryview(header), key, layout_fp, row, fleet)
    tmp = temp_name(name)
    if native is not None:
        native.write_chunk(dir_fd, tmp, name, memoryview(header), row, direct, mode)
        return
    fd = create_file(tmp, mode, os.O_WRONLY | (O_DIRECT * direct), dir_fd)
    try:
        try:
            bufs = [memoryview(header), row]
            offset = 0
            while bufs:
                n = os.pwritev(fd, bufs, offset)
                if n <= 0:
                    raise OSError(errno.EIO, f"short write at offset {offset} of {tmp}")
                offset += n
                bufs = _advance(bufs, n)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def read_chunk(
    fd: int, header: mmap.mmap, key: bytes, layout_fp: bytes, row: memoryview,
    fleet: FleetKey | None = None,
) -> ChunkError | None:
    """Fill `row` from the open chunk file `fd`; None when the file is a valid chunk of `key`
    (MACed with `fleet` when given), else why not (the row then holds garbage). Raises OSError
    for I/O errors."""
    hview = memoryview(header)
    bufs = [hview, row]
    got = 0
    while bufs:
        n = os.preadv(fd, bufs, got)
        if n <= 0:
            break
        got += n
        bufs = _advance(bufs, n)
    if got < chunkfmt.HEADER_BYTES:
        return ChunkError.SHORT
    err, digest = chunkfmt.check_header(hview, key, layout_fp, len(row), fleet)
    if err is not None:
        return err
    if bufs:
        return ChunkError.SHORT
    if os.fstat(fd).st_size != chunkfmt.HEADER_BYTES + len(row):
        return ChunkError.LENGTH
    return chunkfmt.check_payload(hview, row, digest, fleet)


def check_file(
    dir_fd: int, name: str, header: mmap.mmap, key: bytes, layout_fp: bytes, row_bytes: int,
    fleet: FleetKey | None,
) -> ChunkError | None:
    """Verify the chunk file `name` of `dir_fd` without a row to read it into (its payload is
    streamed through the digest in pieces); None when it is a valid chunk of `key`, else why not.
    Raises FileNotFoundError when it is gone, OSError for I/O errors."""
    try:
        fd = open_regular(name, os.O_RDONLY, dir_fd)
    except HostileFile:
        return ChunkError.MAGIC
    with open(fd, "rb", buffering=0) as f:
        hview = memoryview(header)
        if f.readinto(hview) != chunkfmt.HEADER_BYTES:
            return ChunkError.SHORT
        err, expected = chunkfmt.check_header(hview, key, layout_fp, row_bytes, fleet)
        if err is not None:
            return err
        if os.fstat(fd).st_size != chunkfmt.HEADER_BYTES + row_bytes:
            return ChunkError.LENGTH
        digest = chunkfmt.payload_digest(hview, fleet)
        piece = memoryview(bytearray(min(row_bytes, CHECK_PIECE_BYTES)))
        left = row_bytes
        while left:
            n = f.readinto(piece[: min(left, len(piece))])
            if not n:
                return ChunkError.SHORT
            digest.update(piece[:n])
            left -= n
        return chunkfmt.check_digest(digest.digest(), expected, fleet)
