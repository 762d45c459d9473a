"""The fs secondary tier: one file per chunk, named by its key, on a local or shared filesystem.

A chunk file is the `chunkfmt` header (4 KiB) followed by the host row; the directory layout is in
`kvtier.tiers.fs.index`. Several instances (processes, hosts) may share one directory without
configuration: files are published by writing a temp file in the target directory and renaming it
over the final name, so a reader sees either no file or a complete one; a file that another
instance removes between a lookup and a load is a miss. Files are not fsynced: after a crash a file
may hold garbage, which the checksum catches on the next load.

Threads: the dispatch thread calls the contract methods; an `IoPool` of `n_read_threads` load-first
and `n_write_threads` store-first threads moves one key per task (either kind takes the other's
work when its own queue is empty); a maintenance thread rescans the directory every
`rescan_interval_s`. I/O goes straight between the host-region row and the file (`preadv` /
`pwritev`), with O_DIRECT when the filesystem supports it, so the page cache holds no second copy.

Files are private to the serving user (0600, directories 0700) whatever the umask, unless
`shared_group` opens them to the root's group (0660, directories 2770). Nothing in the root is
trusted: chunk files are opened without following links or blocking and used only when regular
files, and every fan-out directory is opened without following links from the layout directory's
fd, so a planted FIFO or symlink is a counted bad chunk and a fan-out replaced by a symlink is
replaced by a directory again (`safe_files`); no file outside `root_dir` is ever written or read.

Invariants: a load never leaves a row it reports as loaded unverified (header fields and checksum
match); a bad file is counted, removed and reported as a failed key; `max_bytes` bounds the bytes of
the chunk files this instance knows of (eviction by last use; a load refreshes the file's mtime so
the order survives restarts and is seen by other instances). Failures are values: I/O errors end
the key as failed and are logged once per cause (operation and errno) per `LOG_INTERVAL_S`.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvtier.errors import ConfigError
from kvtier.format.chunks import ChunkError, ChunkKey, TierEventKind
from kvtier.ops.metrics import TierCounter, TierGauge
from kvtier.tiers.base import LookupResult, TierContext, TierUsage
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.common.book import FailureLog
from kvtier.tiers.common.io_tier import PerKeyTier
from kvtier.tiers.common.iopool import IoPool
from kvtier.tiers.common.options import (
    Kind,
    Option,
    at_least,
    check_options,
    count,
    max_bytes_option,
    seconds,
)
from kvtier.tiers.fs import store_helper
from kvtier.tiers.fs.index import (
    FsIndex,
    fanout_name,
    key_name,
    remove_scanned,
    scan_layout_dir,
    temp_name,
)
from kvtier.tiers.fs.io import (
    O_DIRECT,
    PAGE,
    address,
    check_file,
    new_header_buffer,
    probe_direct_io,
    read_chunk,
    write_chunk,
)
from kvtier.tiers.fs.safe_files import (
    HostileFile,
    LayoutDir,
    create_file,
    modes,
    open_regular,
    tighten,
)

MTIME_REFRESH_S = 1.0
"""A load refreshes a file's mtime only when it is older than this (saves metadata writes)."""


class FsTier(PerKeyTier):
    """Chunks as files under `root_dir/<layout fingerprint>/`, shared by every instance using it."""

    medium = "STORAGE"
    locality = "LOCAL"
    _index: FsIndex
    OPTIONS = (
        Option("root_dir", Kind.TEXT, required=True, test=bool, allowed="must be a directory path"),
        max_bytes_option(),
        count("n_read_threads", 4, 256),
        count("n_write_threads", 4, 256),
        Option("direct_io", Kind.BOOL, allowed="must be true, false or null (auto-detect)"),
        seconds("rescan_interval_s", 60.0, nullable=True),
        seconds("temp_grace_s", 600.0, low=0),
        Option("shared_group", Kind.BOOL, False),
    )
    """`root_dir`; `max_bytes` (null: unbounded; at least one chunk file); `n_read_threads` and
    `n_write_threads` (the I/O pool); `direct_io` (null: when the filesystem supports it);
    `rescan_interval_s` (null: never rescan) and `temp_grace_s` (a temp file older is stale);
    `shared_group` (files and directories readable and writable by the root's group too)."""

    def __init__(self, ctx: TierContext, **options: Any) -> None:
        super().__init__(ctx)
        o = check_options(self.OPTIONS, options)
        self.file_bytes = chunkfmt.HEADER_BYTES + ctx.row_bytes
        at_least("max_bytes", o["max_bytes"], self.file_bytes, "one chunk file")
        self.root_dir = os.path.abspath(o["root_dir"])
        self.layout_dir = os.path.join(self.root_dir, ctx.layout_fingerprint)
        self.modes = modes(bool(o["shared_group"]))
        self._layout = LayoutDir(self.root_dir, ctx.layout_fingerprint, self.modes)
        self.temp_grace_s = float(o["temp_grace_s"])
        self._check_writable()
        self.direct_io = self._choose_direct_io(o["direct_io"])
        self._native = store_helper.load()
        self._index = FsIndex(None if o["max_bytes"] is None else int(o["max_bytes"]),
                             self.file_bytes)
        self._faillog = FailureLog(ctx.log, f"fs tier {ctx.tier_name}")
        self._local = threading.local()
        self._stop = threading.Event()
        self._rescan(initial=True)

        self._pool = IoPool(o["n_read_threads"], o["n_write_threads"], f"kvtier-fs-{ctx.tier_name}")
        self._maintenance: threading.Thread | None = None
        if o["rescan_interval_s"] is not None:
            self._maintenance = threading.Thread(
                target=self._maintain, args=(float(o["rescan_interval_s"]),),
                name=f"kvtier-fs-{ctx.tier_name}-scan", daemon=True,
            )
            self._maintenance.start()

    # ---- setup -------------------------------------------------------------------------------

    def _check_writable(self) -> None:
        """Create `root_dir` (when missing), the layout directory and its fan-outs with the tier's
        modes, tighten those this user made under other modes, and write a probe file."""
        probe = temp_name("probe")
        try:
            if not os.path.isdir(self.root_dir):
                os.makedirs(os.path.dirname(self.root_dir), exist_ok=True)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(self.root_dir, self.modes.dir)
                    tighten(self.root_dir, self.modes.dir)
            top = self._layout.open_top(create=True)
            try:
                tighten(self.layout_dir, self.modes.dir)
                # Every fan-out directory exists up front: a store never pays a mkdir on its path.
                for i in range(256):
                    with self._layout.sub(f"{i:02x}", create=True):
                        tighten(f"{i:02x}", self.modes.dir, top)
                os.close(create_file(probe, self.modes.file, dir_fd=top))
                os.unlink(probe, dir_fd=top)
            finally:
                os.close(top)
        except OSError as e:
            why = f"cannot create and write {self.layout_dir}: {e.strerror}"
            raise ConfigError("root_dir", self.root_dir, why) from None

    def _choose_direct_io(self, wanted: bool | None) -> bool:
        if wanted is False:
            return False
        why = ""
        region_at = address(self.ctx.region)
        if not O_DIRECT:
            why = "this platform has no O_DIRECT"
        elif self.ctx.row_bytes % PAGE or region_at is None or region_at % PAGE:
            why = f"host rows are not aligned to {PAGE} bytes"
        elif not probe_direct_io(self.layout_dir):
            why = f"the filesystem at {self.layout_dir} does not support O_DIRECT"
        if why and wanted:
            raise ConfigError("direct_io", wanted, why)
        if why:
            self.ctx.log.info("fs tier %s: buffered I/O (%s)", self.ctx.tier_name, why)
        return not why

    # ---- contract ----------------------------------------------------------------------------

    def lookup(self, keys: Sequence[ChunkKey]) -> list[LookupResult]:
        """HIT for a key whose name is a regular file (a hint: the load verifies)."""
        out: list[LookupResult] = []
        for key in keys:
            name = key_name(key)
            try:
                hit = name is not None and stat.S_ISREG(os.lstat(self._path(name)).st_mode)
            except OSError:
                hit = False
            out.append(LookupResult.HIT if hit else LookupResult.MISS)
        return out

    def usage(self) -> TierUsage:
        return TierUsage(self._index.bytes_used, len(self._index), self._index.max_bytes or 0)

    def _gauges(self) -> dict[TierGauge, float]:
        return {TierGauge.DIRECT_IO: float(self.direct_io),
                TierGauge.NATIVE_IO: float(self._native is not None)}

    def _close(self) -> None:
        """Stop the scanner (the I/O threads are gone)."""
        self._stop.set()
        if self._maintenance is not None:
            self._maintenance.join()

    def _key_failed(self, cause: str, exc: BaseException) -> None:
        self._faillog.failed(cause, exc)

    # ---- per-key I/O (I/O threads) -----------------------------------------------------------

    def _path(self, name: str) -> str:
        return os.path.join(self.layout_dir, fanout_name(name), name)

    def _header_buf(self) -> mmap.mmap:
        """This thread's page-aligned header buffer (O_DIRECT needs aligned memory)."""
        buf: mmap.mmap | None = getattr(self._local, "header", None)
        if buf is None:
            buf = new_header_buffer()
            self._local.header = buf
        return buf

    def _store_key(self, key: ChunkKey, slot: int) -> bool:
        name = key.hex()
        try:
            # Our subdirectories may have been removed (made again), or replaced by something
            # other than a directory (replaced again); root_dir itself is never recreated.
            with self._layout.sub(fanout_name(name), create=True) as dir_fd:
                return self._store_in(dir_fd, name, key, slot)
        except OSError as e:
            self._faillog.failed(f"store:{errno.errorcode.get(e.errno or 0, e.errno)}", e)
            return False

    def _store_in(self, dir_fd: int, name: str, key: ChunkKey, slot: int) -> bool:
        """Store `key` as `name` in the fan-out directory `dir_fd`; a regular file already there is
        kept (its mtime refreshed), unless with a fleet key it fails verification (counted), and
        anything else at the name is replaced. Raises OSError."""
        try:
            present = stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            present = False
        if present and self.ctx.fleet_key is not None:  # with a key, a planted file is replaced
            bad = check_file(dir_fd, name, self._header_buf(), key, self._fp, self.ctx.row_bytes,
                             self.ctx.fleet_key)
            if bad is not None:
                self._bad(bad, f"replacing bad chunk file {self._path(name)}")
                present = False
        if present:
            os.utime(name, dir_fd=dir_fd, follow_symlinks=False)
            if self._index.add(key, time.time()):
                self._book.event(TierEventKind.STORED, key)
            return True
        granted, victims = self._index.reserve(self.file_bytes)
        self._evict(victims)
        if not granted:
            self._faillog.failed("store:max_bytes", OSError(errno.ENOSPC, "every file is being read"))
            return False
        try:
            write_chunk(dir_fd, name, self._header_buf(), key, self._fp, self.ctx.slot_view(slot),
                        self.direct_io, self.modes.file, self._native, self.ctx.fleet_key)
        finally:
            self._index.release(self.file_bytes)
        if self._index.add(key, time.time()):
            self._book.event(TierEventKind.STORED, key)
        self._book.count(TierCounter.STORED)
        return True

    def _unlink(self, name: str) -> None:
        """Remove the chunk file `name` if it is there (never through a link)."""
        with contextlib.suppress(OSError), self._layout.sub(fanout_name(name)) as dir_fd:
            os.unlink(name, dir_fd=dir_fd)

    def _evict(self, victims: list[bytes]) -> None:
        for key in victims:
            name = key_name(key)
            if name is not None:
                self._unlink(name)
            self._book.event(TierEventKind.REMOVED, key)
            self._book.count(TierCounter.EVICTIONS)

    def _load_key(self, key: ChunkKey, slot: int) -> bool:
        name = key.hex()
        self._index.pin(key)
        try:
            with self._layout.sub(fanout_name(name)) as dir_fd:
                now = self._load_in(dir_fd, name, key, slot)
            if now is None:
                return False
        except FileNotFoundError:
            self._book.count(TierCounter.LOAD_MISSES)
            self._forget(key)
            return False
        except OSError as e:
            self._faillog.failed(f"load:{errno.errorcode.get(e.errno or 0, e.errno)}", e)
            return False
        finally:
            self._index.unpin(key)
        if key in self._index:
            self._index.touch(key, now)
        elif self._index.add(key, now):
            self._book.event(TierEventKind.STORED, key)
        self._book.count(TierCounter.LOADED)
        return True

    def _load_in(self, dir_fd: int, name: str, key: ChunkKey, slot: int) -> float | None:
        """Load the chunk file `name` of the fan-out directory `dir_fd` into `slot`; the time of
        the load, or None when the file was bad (counted and removed). Raises FileNotFoundError
        when there is no file, OSError for I/O errors."""
        try:
            fd = open_regular(name, os.O_RDONLY | (O_DIRECT * self.direct_io), dir_fd)
        except HostileFile:
            self._bad(ChunkError.MAGIC, f"removed {self._path(name)}: not a regular file")
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)
            self._forget(key)
            return None
        try:
            bad = read_chunk(fd, self._header_buf(), key, self._fp, self.ctx.slot_view(slot),
                             self.ctx.fleet_key)
            if bad is not None:
                self._drop_bad(dir_fd, name, fd, key, bad)
                return None
            now = time.time()
            if now - os.fstat(fd).st_mtime > MTIME_REFRESH_S:
                with contextlib.suppress(OSError):
                    os.utime(fd)
            return now
        finally:
            os.close(fd)

    def _drop_bad(self, dir_fd: int, name: str, fd: int, key: bytes, reason: ChunkError) -> None:
        """Remove a bad chunk file, unless another instance has replaced it meanwhile."""
        self._bad(reason, f"removed bad chunk file {self._path(name)}")
        with contextlib.suppress(OSError):
            mine, now = os.fstat(fd), os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino):
                os.unlink(name, dir_fd=dir_fd)
        self._forget(key)

    # ---- bookkeeping -------------------------------------------------------------------------

    def _rescan(self, initial: bool = False) -> None:
        """Reconcile the index with the directory (stat only); drop stale temps and wrong sizes,
        counting each wrong size this scan removed as a bad chunk (reported at once)."""
        self._index.start_scan()
        found = scan_layout_dir(self.layout_dir, self.file_bytes, self.temp_grace_s, time.time())
        for path in found.stale_temps:
            remove_scanned(self._layout, path)
        # A load may have found a file bad and removed it since the scan: counted once.
        for reason, paths in ((ChunkError.LENGTH, found.wrong_size),
                              (ChunkError.MAGIC, found.not_regular)):
            removed = sum(remove_scanned(self._layout, path) for path in paths)
            if removed:
                self._book.bad(reason, removed)
        appeared, vanished = self._index.merge_scan(found.files)
        self._book.count(TierCounter.RESCANS)
        if not initial:
            self._book.events(TierEventKind.STORED, appeared)
            self._book.events(TierEventKind.REMOVED, vanished)
        if self._index.max_bytes is not None:
            granted, victims = self._index.reserve(0)
            if granted:
                self._evict(victims)

    def _maintain(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self._rescan()
            except Exception as e:  # the scanner must outlive a transient error
                self._faillog.failed(f"rescan:{type(e).__name__}", e)

