"""The fs tier's directory: file naming, directory scans, and the accounting of what it holds.

Layout under `root_dir`: `<layout fingerprint, 32 hex>/<first 2 hex of the key>/<key, 64 hex>` for
a published chunk; a file being written is `.<key>.tmp.<pid>.<8 random hex>` in the same directory,
and becomes the chunk by an atomic rename. Any other name inside a layout directory is not ours.

The index is a cache of the directory, never the truth: files may vanish (another instance evicted
them) or appear (another instance stored them) at any time, and `merge_scan` reconciles the two.
Last use is wall-clock seconds so that it is comparable with file mtimes, which is how the order
survives restarts and is shared with other instances (a load refreshes the file's mtime).

Threading: every method takes the index lock; methods are called from the tier's I/O threads and
from the dispatch thread (`stats`). Invariant: `bytes_used` is `file_bytes` times the number of
known keys (a scan keeps only files of that size), and `reserved` is the sum of the reservations
handed out by `reserve` and not yet released.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from kvtier.tiers.common.io_tier import KeyIndex
from kvtier.tiers.fs.order import UseOrder
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


class ScannedFile(NamedTuple):
    """One published chunk file found by a directory scan (a tuple: a scan makes one per file)."""

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
    """Scan one fan-out directory into `result`. Per good file: one regex match, one `stat` and
    one tuple; paths are joined only for the entries reported as bad."""
    files = result.files
    for entry in os.scandir(fd):
        name = entry.name
        try:
            if CHUNK_NAME_RE.match(name) and name[:2] == fan:
                st = entry.stat(follow_symlinks=False)
                if st.st_size == expected_size and stat.S_ISREG(st.st_mode):
                    files.append(ScannedFile(bytes.fromhex(name), expected_size, st.st_mtime))
                elif not stat.S_ISREG(st.st_mode):
                    result.not_regular.append(os.path.join(base, fan, name))
                else:
                    result.wrong_size.append(os.path.join(base, fan, name))
            elif (TEMP_NAME_RE.match(name)
                  and now - entry.stat(follow_symlinks=False).st_mtime > temp_grace_s):
                result.stale_temps.append(os.path.join(base, fan, name))
        except FileNotFoundError:
            continue


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


class FsIndex(KeyIndex):
    """Known chunk files, all `file_bytes` long, evicted by least recent use, bounded by
    `max_bytes` (None: unbounded). A key costs its bytes object, a dict slot, its last use (a float)
    and its place in the `UseOrder`: no per-key object beyond those."""

    def __init__(self, max_bytes: int | None, file_bytes: int) -> None:
        super().__init__()
        self.max_bytes = max_bytes
        self.file_bytes = file_bytes
        self._times: dict[bytes, float] = {}
        self._order = UseOrder(self._times)
        self._changed: set[bytes] | None = None
        self.reserved = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._times)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._times

    @property
    def bytes_used(self) -> int:
        """The bytes of the known files."""
        return len(self._times) * self.file_bytes

    def _set(self, key: bytes, last_use: float) -> None:
        """Make `last_use` the key's time (caller holds the lock), noting the change for a scan."""
        if self._times.get(key) != last_use:
            self._times[key] = last_use
            self._order.push(key, last_use)
        if self._changed is not None:
            self._changed.add(key)

    def add(self, key: bytes, last_use: float) -> bool:
        """Record a published file (or refresh it); True when the key was not known before."""
        with self._lock:
            old = self._times.get(key)
            self._set(key, last_use if old is None else max(last_use, old))
            return old is None

    def touch(self, key: bytes, now: float) -> None:
        """Mark a known key as used at `now` (no-op for unknown keys)."""
        with self._lock:
            old = self._times.get(key)
            if old is not None:
                self._set(key, max(old, now))

    def remove(self, key: bytes) -> bool:
        """Forget a key; True when it was known."""
        with self._lock:
            return self._times.pop(key, None) is not None

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
            victims: list[tuple[float, bytes]] = []
            chosen: set[bytes] = set()
            skipped: list[tuple[float, bytes]] = []
            need = self.bytes_used + self.reserved + size - self.max_bytes
            while len(victims) * self.file_bytes < need:
                item = self._order.pop()
                if item is None:
                    break
                key = item[1]
                if key in chosen:  # a second current item of a key re-added at the same time
                    continue
                if key in self._pins:
                    skipped.append(item)
                    continue
                victims.append(item)
                chosen.add(key)
            for last_use, key in skipped:
                self._order.push(key, last_use)
            if len(victims) * self.file_bytes < need:
                for last_use, key in victims:
                    self._order.push(key, last_use)
                return False, []
            for _last_use, key in victims:
                del self._times[key]
            self.reserved += size
            return True, [key for _last_use, key in victims]

    def release(self, size: int) -> None:
        """Return a reservation (the file was published, or the write failed)."""
        with self._lock:
            self.reserved -= size

    def start_scan(self) -> None:
        """Begin noting the keys changed from now on: `merge_scan` keeps them whatever it found.
        One scan at a time."""
        with self._lock:
            self._changed = set()

    def merge_scan(self, found: Iterable[ScannedFile]) -> tuple[list[bytes], list[bytes]]:
        """Reconcile with the directory scan begun by `start_scan`; returns (appeared, vanished).

        A file on disk that is unknown is added with its mtime as last use; a known file whose mtime
        is newer (another instance used it) moves up. A known key missing from the scan is
        forgotten unless it changed after the scan started (it was stored meanwhile). When most
        keys moved, the order is rebuilt once rather than pushed key by key.
        """
        appeared: list[bytes] = []
        vanished: list[bytes] = []
        with self._lock:
            times = self._times
            changed, self._changed = self._changed or set(), None
            seen: set[bytes] = set()
            moved: list[bytes] = []
            for f in found:
                seen.add(f.key)
                old = times.get(f.key)
                if old is None:
                    appeared.append(f.key)
                elif f.mtime <= old:
                    continue
                times[f.key] = f.mtime
                moved.append(f.key)
            for key in [k for k in times if k not in seen and k not in changed]:
                del times[key]
                vanished.append(key)
            if len(moved) > len(times) // 4:
                self._order.rebuild()
            else:
                for key in moved:
                    self._order.push(key, times[key])
        return appeared, vanished
