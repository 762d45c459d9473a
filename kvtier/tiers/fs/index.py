"""The fs tier's directory: file naming, directory scans, and the accounting of what it holds.

Layout under `root_dir`: `<layout fingerprint, 32 hex>/<first 2 hex of the key>/<key, 64 hex>` for
a published chunk; a file being written is `.<key>.tmp.<pid>.<8 random hex>` in the same directory,
and becomes the chunk by an atomic rename. Any other name inside a layout directory is not ours.

The index is a cache of the directory, never the truth: files may vanish (another instance evicted
them) or appear (another instance stored them) at any time, and `merge_scan` reconciles the two.
Last use is wall-clock seconds so that it is comparable with file mtimes, which is how the order
survives restarts and is shared with other instances (a load refreshes the file's mtime).

Threading: every method takes the index lock; methods are called from the tier's I/O threads and
from the dispatch thread (`stats`). Invariant: `bytes_used` is the sum of the sizes of the entries,
and `reserved` is the sum of the reservations handed out by `reserve` and not yet released.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import re
import secrets
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtier.tiers.common.io_tier import KeyIndex
from kvtier.tiers.fs.safe_files import HostileFile, LayoutDir, open_dir

KEY_BYTES = 32
LAYOUT_DIR_RE = re.compile(r"^[0-9a-f]{32}$")
FANOUT_DIR_RE = re.compile(r"^[0-9a-f]{2}$")
CHUNK_NAME_RE = re.compile(r"^[0-9a-f]{64}$")
TEMP_NAME_RE = re.compile(r"^\.([0-9a-f]{64}|probe)\.tmp\.(\d+)\.([0-9a-f]{8})$")


def key_name(key: object) -> str | None:
    """The file name of a chunk key, or None when `key` is not a 32-byte key."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        return None
    return key.hex()


def fanout_name(name: str) -> str:
    """The fan-out directory of a chunk file name."""
    return name[:2]


def temp_name(name: str) -> str:
    """A fresh temp-file name for chunk `name` (or "probe"), unique across processes and threads."""
    return f".{name}.tmp.{os.getpid()}.{secrets.token_hex(4)}"


@dataclass(frozen=True)
class ScannedFile:
    """One published chunk file found by a directory scan."""

    key: bytes
    size: int
    mtime: float


@dataclass
class ScanResult:
    """What a scan of one layout directory found (stat only, no file is read). Paths are
    `layout_dir/<fan-out>/<name>`: remove them with `remove_scanned`."""

    files: list[ScannedFile] = field(default_factory=list)
    wrong_size: list[str] = field(default_factory=list)
    not_regular: list[str] = field(default_factory=list)
    stale_temps: list[str] = field(default_factory=list)


def _scan_fanout(fd: int, fan: str, base: str, expected_size: int, temp_grace_s: float,
                 now: float, result: ScanResult) -> None:
    for entry in os.scandir(fd):
        path = os.path.join(base, fan, entry.name)
        with contextlib.suppress(FileNotFoundError):
            if CHUNK_NAME_RE.match(entry.name) and fanout_name(entry.name) == fan:
                st = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    result.not_regular.append(path)
                elif st.st_size != expected_size:
                    result.wrong_size.append(path)
                else:
                    result.files.append(
                        ScannedFile(bytes.fromhex(entry.name), st.st_size, st.st_mtime)
                    )
            elif TEMP_NAME_RE.match(entry.name):
                st = entry.stat(follow_symlinks=False)
                if now - st.st_mtime > temp_grace_s:
                    result.stale_temps.append(path)


def scan_layout_dir(
    layout_dir: str, expected_size: int, temp_grace_s: float, now: float
) -> ScanResult:
    """Published chunk files of `layout_dir`, plus entries certainly bad without reading them:
    chunk names that are not regular files (a FIFO, a symlink) or have the wrong size, and temp
    files older than `temp_grace_s` (their writer is gone).

    The walk goes through directory fds opened without following links: a fan-out directory that
    is a symlink is not entered, so nothing outside `layout_dir` is listed. Entries may vanish
    while scanning (another instance evicting): they are skipped. A layout directory that does not
    exist, or is not a directory, scans as empty.
    """
    result = ScanResult()
    try:
        top = open_dir(layout_dir)
    except (FileNotFoundError, HostileFile):
        return result
    try:
        fanouts = [e.name for e in os.scandir(top) if FANOUT_DIR_RE.match(e.name)]
        for fan in fanouts:
            try:
                fd = open_dir(fan, top)
            except (FileNotFoundError, HostileFile):
                continue
            try:
                _scan_fanout(fd, fan, layout_dir, expected_size, temp_grace_s, now, result)
            finally:
                os.close(fd)
    finally:
        os.close(top)
    return result


def remove_scanned(layout: LayoutDir, path: str) -> bool:
    """Remove the entry `path` of a `ScanResult` of `layout` (never through a link); True when it
    was there to remove."""
    fan, name = os.path.split(os.path.relpath(path, layout.path))
    try:
        with layout.sub(fan) as fd:
            os.unlink(name, dir_fd=fd)
    except OSError:
        return False
    return True


@dataclass
class _Entry:
    size: int
    last_use: float
    seq: int


class FsIndex(KeyIndex):
    """Known chunk files, evicted by least recent use, bounded by `max_bytes` (None: unbounded)."""

    def __init__(self, max_bytes: int | None) -> None:
        super().__init__()
        self.max_bytes = max_bytes
        self._entries: dict[bytes, _Entry] = {}
        self._heap: list[tuple[float, int, bytes]] = []
        self._seq = 0
        self.bytes_used = 0
        self.reserved = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _push(self, key: bytes, entry: _Entry) -> None:
        heapq.heappush(self._heap, (entry.last_use, entry.seq, key))
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._heap = [(e.last_use, e.seq, k) for k, e in self._entries.items()]
            heapq.heapify(self._heap)

    def add(self, key: bytes, size: int, last_use: float) -> bool:
        """Record a published file (or refresh it); True when the key was not known before."""
        with self._lock:
            old = self._entries.get(key)
            if old is not None:
                self.bytes_used -= old.size
            entry = _Entry(size, max(last_use, old.last_use) if old else last_use, self._next_seq())
            self._entries[key] = entry
            self.bytes_used += size
            self._push(key, entry)
            return old is None

    def touch(self, key: bytes, now: float) -> None:
        """Mark a known key as used at `now` (no-op for unknown keys)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            entry.last_use = max(entry.last_use, now)
            entry.seq = self._next_seq()
            self._push(key, entry)

    def remove(self, key: bytes) -> bool:
        """Forget a key; True when it was known."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self.bytes_used -= entry.size
            return True

    def reserve(self, size: int) -> tuple[bool, list[bytes]]:
        """Make room for a new file of `size` bytes.

        Returns (granted, victims). When granted, `size` is reserved (release it with `release`)
        and the victims, already forgotten, are the files the caller must unlink. When not granted
        (every remaining file is pinned), nothing changed.
        """
        with self._lock:
            if self.max_bytes is None:
                self.reserved += size
                return True, []
            victims: list[bytes] = []
            skipped: list[tuple[float, int, bytes]] = []
            need = self.bytes_used + self.reserved + size - self.max_bytes
            freed = 0
            while freed < need and self._heap:
                item = heapq.heappop(self._heap)
                _last_use, seq, key = item
                entry = self._entries.get(key)
                if entry is None or entry.seq != seq:
                    continue
                if key in self._pins:
                    skipped.append(item)
                    continue
                victims.append(key)
                freed += entry.size
            for item in skipped:
                heapq.heappush(self._heap, item)
            if freed < need:
                for key in victims:
                    entry = self._entries[key]
                    heapq.heappush(self._heap, (entry.last_use, entry.seq, key))
                return False, []
            for key in victims:
                self.bytes_used -= self._entries.pop(key).size
            self.reserved += size
            return True, victims

    def release(self, size: int) -> None:
        """Return a reservation (the file was published, or the write failed)."""
        with self._lock:
            self.reserved -= size

    def start_scan(self) -> int:
        """A marker to pass to `merge_scan`: entries changed after it are newer than the scan."""
        with self._lock:
            return self._seq

    def merge_scan(
        self, marker: int, found: Iterable[ScannedFile]
    ) -> tuple[list[bytes], list[bytes]]:
        """Reconcile with a directory scan started at `marker`; returns (appeared, vanished) keys.

        A file on disk that is unknown is added with its mtime as last use; a known file whose mtime
        is newer (another instance used it) moves up. A known key missing from the scan is
        forgotten unless it changed after the scan started (it was stored meanwhile).
        """
        appeared: list[bytes] = []
        vanished: list[bytes] = []
        with self._lock:
            seen: set[bytes] = set()
            for f in found:
                seen.add(f.key)
                entry = self._entries.get(f.key)
                if entry is None:
                    entry = _Entry(f.size, f.mtime, self._next_seq())
                    self._entries[f.key] = entry
                    self.bytes_used += f.size
                    appeared.append(f.key)
                    self._push(f.key, entry)
                elif f.mtime > entry.last_use:
                    entry.last_use = f.mtime
                    entry.seq = self._next_seq()
                    self._push(f.key, entry)
            for key, entry in list(self._entries.items()):
                if key not in seen and entry.seq <= marker:
                    del self._entries[key]
                    self.bytes_used -= entry.size
                    vanished.append(key)
        return appeared, vanished
