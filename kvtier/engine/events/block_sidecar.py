"""The fs tier's chunk → vLLM blocks mappings, kept on disk beside the chunks, so the KV events of
chunks stored before a restart (or by another instance sharing the directory) still name their
blocks.

One small file per chunk: `<root_dir>/<layout fingerprint>.blocks/<hash space>/<2 hex>/<key hex>`,
holding a magic, the `ChunkBlocks` record (`chunk_blocks.py`: key, block size, vLLM's raw block
hashes, parent, token ids) and an xxh3-128 checksum of it. The hash space is the first 8 bytes of
vLLM's root hash (`NONE_HASH`): engines whose block hashes are not comparable (a non-cryptographic
hash algorithm seeds it at random per process) never read each other's files. A file is published
by write-to-temp then `os.replace`; one whose magic, checksum, key or block size do not match is
removed and names nothing; so is one that is not a regular file or is over `MAX_FILE_BYTES` (never
read). Files and directories take the modes the fs tier gave its layout directory (0600/0700, or
its `shared_group` modes) whatever the umask; a sidecar directory left more open is tightened
when the sidecar starts. Every directory below the root is opened from its parent's descriptor
without following a link, and files are reached from their directory's (`_fan_dir`): a link
planted in the root leads nowhere outside it. The chunk file itself is the fs tier's: a sidecar is
only ever a hint for events, never read on the data path.

Threads: the scheduler thread queues `save`, `drop` and `ask` (never blocking); one daemon thread
does the file I/O and queues each `ask`'s answer for `take_answers`. I/O errors are logged once per
cause; a failed `ask` answers None.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import secrets
import threading
from collections.abc import Callable, Iterator
from typing import Literal

import xxhash

from kvtier.engine.events.chunk_blocks import ChunkBlocks
from kvtier.format.chunks import ChunkKey, TierEventKind
from kvtier.tiers.fs.safe_files import (
    HostileFile,
    LayoutDir,
    create_file,
    modes_of,
    read_regular,
    tighten_like,
)

log = logging.getLogger("kvtier.vllm.events")

MAGIC = b"KVTBLKS1"
DIGEST = 16
MAX_FILE_BYTES = 1 << 20
"""A sidecar file is far smaller (4 bytes a token, a hash a block); a larger one is not read."""

Answer = tuple[TierEventKind, ChunkKey, ChunkBlocks | None]
_Op = tuple[Literal["save", "drop", "ask", "stop"], ChunkKey, ChunkBlocks | TierEventKind | None]


def encode(key: ChunkKey, blocks: ChunkBlocks, block_size: int) -> bytes:
    """A sidecar file's bytes: magic, record, checksum of the record."""
    record = blocks.pack(key, block_size)
    return MAGIC + record + xxhash.xxh3_128_digest(record)


def decode(data: bytes, key: ChunkKey, block_size: int) -> ChunkBlocks | None:
    """The blocks a sidecar file names for `key`, or None when it fails any check."""
    record = data[len(MAGIC) : -DIGEST]
    if not data.startswith(MAGIC) or xxhash.xxh3_128_digest(record) != data[-DIGEST:]:
        return None
    return ChunkBlocks.unpack(record, key, block_size)


class BlockSidecar:
    """Sidecar files of one fs tier under `root_dir` (see the module docstring).

    `space()` gives vLLM's root hash; it is called on the sidecar's thread at its first operation,
    once the engine has set it.
    """

    def __init__(self, root_dir: str, layout_fingerprint: str, block_size: int,
                 space: Callable[[], bytes]) -> None:
        self.base = os.path.join(os.path.abspath(root_dir), f"{layout_fingerprint}.blocks")
        self.block_size = block_size
        self._space = space
        self._dir: str | None = None
        self._ops: queue.SimpleQueue[_Op] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[Answer] = queue.SimpleQueue()
        self._logged: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="kvtier-block-sidecar", daemon=True)
        self._thread.start()

    def save(self, key: ChunkKey, blocks: ChunkBlocks) -> None:
        """Write `key`'s file (kept when it is already there)."""
        self._ops.put(("save", key, blocks))

    def drop(self, key: ChunkKey) -> None:
        """Remove `key`'s file."""
        self._ops.put(("drop", key, None))

    def ask(self, kind: TierEventKind, key: ChunkKey) -> None:
        """Read `key`'s file; the answer (`kind`, `key`, blocks or None) comes from `take_answers`."""
        self._ops.put(("ask", key, kind))

    def take_answers(self) -> list[Answer]:
        """The answers of the reads finished since the last call."""
        out: list[Answer] = []
        with contextlib.suppress(queue.Empty):
            while True:
                out.append(self._answers.get_nowait())
        return out

    def close(self, timeout: float = 5.0) -> None:
        """Finish the queued operations and stop the thread. Idempotent."""
        if self._thread.is_alive():
            self._ops.put(("stop", b"", None))
            self._thread.join(timeout)

    def path(self, key: ChunkKey) -> str:
        """Where `key`'s file is (for readers; the sidecar itself reaches it by `_fan_dir`)."""
        name = key.hex()
        return os.path.join(self.base, self._space_dir(), name[:2], name)

    def _space_dir(self) -> str:
        if self._dir is None:
            self._dir = self._space()[:8].hex()
        return self._dir

    @contextlib.contextmanager
    def _fan_dir(self, key: ChunkKey, create: bool) -> Iterator[int]:
        """An fd of the directory of `key`'s file, each directory below the tier's root opened
        from its parent's fd without following a link (`LayoutDir`): nothing done through it
        leaves the root, whatever was planted in it."""
        modes = modes_of(self.base.removesuffix(".blocks"))
        dirs = LayoutDir(os.path.dirname(self.base), os.path.basename(self.base), modes)
        with dirs.sub(f"{self._space_dir()}/{key.hex()[:2]}", create) as fd:
            yield fd

    # ---- the sidecar's thread ----------------------------------------------------------------

    def _run(self) -> None:
        tighten_like(self.base, self.base.removesuffix(".blocks"))  # left open by an older version
        while True:
            op, key, arg = self._ops.get()
            if op == "stop":
                return
            try:
                if op == "save" and isinstance(arg, ChunkBlocks):
                    self._save(key, arg)
                elif op == "drop":
                    with contextlib.suppress(FileNotFoundError, HostileFile), \
                            self._fan_dir(key, create=False) as fd:
                        os.unlink(key.hex(), dir_fd=fd)
                elif op == "ask" and isinstance(arg, TierEventKind):
                    self._answers.put((arg, key, self._read(key)))
            except Exception as e:  # a sidecar is a hint: its errors never reach the engine
                self._failed(op, e)
                if op == "ask" and isinstance(arg, TierEventKind):
                    self._answers.put((arg, key, None))

    def _save(self, key: ChunkKey, blocks: ChunkBlocks) -> None:
        name = key.hex()
        with self._fan_dir(key, create=True) as fd:
            with contextlib.suppress(FileNotFoundError):
                os.stat(name, dir_fd=fd, follow_symlinks=False)
                return
            temp = f"{name}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
            try:
                with os.fdopen(create_file(temp, modes_of(self.base.removesuffix(".blocks")).file,
                                           dir_fd=fd), "wb") as f:
                    f.write(encode(key, blocks, self.block_size))
                os.replace(temp, name, src_dir_fd=fd, dst_dir_fd=fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=fd)
                raise

    def _read(self, key: ChunkKey) -> ChunkBlocks | None:
        name = key.hex()
        try:
            with self._fan_dir(key, create=False) as fd:
                try:
                    data = read_regular(name, MAX_FILE_BYTES, dir_fd=fd)
                except HostileFile:
                    data = b""
                blocks = decode(data, key, self.block_size)
                if blocks is None:
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=fd)
                return blocks
        except (FileNotFoundError, HostileFile):  # no file, or a planted link where a directory is
            return None

    def _failed(self, op: str, e: Exception) -> None:
        cause = f"{op}:{type(e).__name__}"
        if cause not in self._logged:
            self._logged.add(cause)
            log.warning("kvtier: block sidecar under %s: %s failed: %s", self.base, op, e)
