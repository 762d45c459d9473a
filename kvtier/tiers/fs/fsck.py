"""`kvtier fsck DIR`: verify an fs tier directory, and with `--repair` remove what is bad.

Every chunk file is read in full: the header must be a valid `chunkfmt` header, its key must be the
file name, its layout fingerprint the name of the layout directory, its payload length the layout's
row size, the fan-out directory the first two hex digits of the name, the file size the header plus
its payload length, and the payload must match the checksum (the fleet key's MAC with
`--fleet-key-file`). A layout's row size is `--row-bytes`
when given, else the payload size most of its chunk files have (by their sizes, none read; a tie
leaves it unknown and each file is held to its own header). Nothing is allocated by what a header
claims: a wrong length is refused before the payload is read, and the checksum is computed over
fixed-size pieces as they are read. Chunk files are opened without following links or blocking,
and only regular files are read. Temp files older than `temp_grace_s` are orphans (their writer died); younger
ones are writes in progress and are left alone. Entries of the root that are not layout directories
are not ours: they are listed as ignored and never touched.

fsck is safe to run while tier instances use the directory: a file that vanishes during the check
is skipped, and a repair only removes files that failed the check (or orphaned temps). Directories
are never removed.

Exit status of `kvtier fsck`: 0 when the directory is clean; 1 when bad files or orphaned temp
files were found, whether or not `--repair` removed them (so a script notices that there was
damage); 2 when the directory cannot be checked at all.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.errors import ConfigError
from kvtier.format.chunks import ChunkError
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.common.fleetkey import FleetKey
from kvtier.tiers.fs.index import (
    CHUNK_NAME_RE,
    FANOUT_DIR_RE,
    LAYOUT_DIR_RE,
    TEMP_NAME_RE,
    fanout_name,
)
from kvtier.tiers.fs.safe_files import O_CLOEXEC, O_DIRECTORY, HostileFile, open_dir, open_regular

STRAY = "stray"
"""Reason for an entry inside a layout directory whose name is not a chunk, temp or fan-out name."""
WRONG_DIR = "wrong_dir"
"""Reason for a chunk file that is not in the fan-out directory its name calls for."""
PIECE_BYTES = 1 << 20
"""The checksum is computed over pieces of this size, whatever the payload length."""


@dataclass(frozen=True)
class BadFile:
    path: str
    reason: str


@dataclass
class FsckReport:
    """The outcome of one check. `ok` holds iff no bad file and no orphaned temp file was found."""

    root: str
    repair: bool
    row_bytes: dict[str, int | None] = field(default_factory=dict)
    files: int = 0
    good_files: int = 0
    good_bytes: int = 0
    bad: list[BadFile] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    in_progress: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    not_removed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad and not self.orphans

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        return out


def _verify(name: str, dir_fd: int, layout_fp: bytes, row_bytes: int | None,
            buf: memoryview, fleet: FleetKey | None) -> tuple[str | None, int]:
    """(why the chunk file `name` in the directory `dir_fd` is bad, MACed with `fleet` when given,
    or None when it is good; its size); the payload is read into `buf` piece by piece. Raises
    FileNotFoundError."""
    try:
        fd = open_regular(name, dir_fd=dir_fd)
    except HostileFile:
        return ChunkError.MAGIC.value, 0
    with open(fd, "rb", buffering=0) as f:
        return _verify_open(f, name, layout_fp, row_bytes, buf, fleet), os.fstat(fd).st_size


def _verify_open(f: io.FileIO, name: str, layout_fp: bytes, row_bytes: int | None,
                 buf: memoryview, fleet: FleetKey | None) -> str | None:
    """`_verify` of the open file `f`."""
    header = f.read(chunkfmt.HEADER_BYTES)
    err, digest = chunkfmt.check_header(header, bytes.fromhex(name), layout_fp, row_bytes, fleet)
    if err is not None:
        return err.value
    _key, _fp, payload_len = chunkfmt.header_fields(header)
    size = os.fstat(f.fileno()).st_size
    if size < chunkfmt.HEADER_BYTES + payload_len:
        return ChunkError.SHORT.value
    if size > chunkfmt.HEADER_BYTES + payload_len:
        return ChunkError.LENGTH.value
    hasher = chunkfmt.payload_digest(header, fleet)
    left = payload_len
    while left:
        n = f.readinto(buf[: min(left, len(buf))])
        if not n:
            return ChunkError.SHORT.value
        hasher.update(buf[:n])
        left -= n
    bad = chunkfmt.check_digest(hasher.digest(), digest, fleet)
    return None if bad is None else bad.value


def layout_row_bytes(path: str) -> int | None:
    """The payload size most chunk files of the layout directory `path` have (stat only); None
    when there are none or two sizes tie."""
    sizes: collections.Counter[int] = collections.Counter()
    for fan in os.scandir(path):
        if not (FANOUT_DIR_RE.match(fan.name) and fan.is_dir(follow_symlinks=False)):
            continue
        try:
            entries = list(os.scandir(fan.path))
        except FileNotFoundError:
            continue
        for entry in entries:
            if CHUNK_NAME_RE.match(entry.name) and entry.is_file(follow_symlinks=False):
                try:
                    sizes[entry.stat(follow_symlinks=False).st_size] += 1
                except FileNotFoundError:
                    continue
    top = sizes.most_common(2)
    if not top or (len(top) == 2 and top[0][1] == top[1][1]):
        return None
    return max(top[0][0] - chunkfmt.HEADER_BYTES, 0)


class _Checker:
    def __init__(self, report: FsckReport, temp_grace_s: float, row_bytes: int | None,
                 fleet: FleetKey | None) -> None:
        self.report = report
        self.fleet = fleet
        self.temp_grace_s = temp_grace_s
        self.row_bytes = row_bytes
        self.layout_rows: int | None = None
        self.now = time.time()
        self.buf = memoryview(bytearray(PIECE_BYTES))

    def bad(self, path: str, dir_fd: int, reason: str, removable: bool = True) -> None:
        self.report.bad.append(BadFile(path, reason))
        if removable:
            self.remove(path, dir_fd)

    def remove(self, path: str, dir_fd: int) -> None:
        """Remove the entry `path` names, through its directory's descriptor `dir_fd` (a link
        swapped in above it leads nowhere)."""
        if not self.report.repair:
            return
        try:
            os.unlink(os.path.basename(path), dir_fd=dir_fd)
            self.report.removed.append(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            self.report.not_removed.append(f"{path}: {e.strerror}")

    def temp(self, entry: os.DirEntry[str], path: str, dir_fd: int) -> None:
        try:
            age = self.now - entry.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            return
        if age > self.temp_grace_s:
            self.report.orphans.append(path)
            self.remove(path, dir_fd)
        else:
            self.report.in_progress.append(path)

    def layout_dir(self, path: str, layout_fp: bytes, fd: int) -> None:
        rows = self.row_bytes if self.row_bytes is not None else layout_row_bytes(path)
        self.report.row_bytes[layout_fp.hex()] = self.layout_rows = rows
        for entry in sorted(os.scandir(fd), key=lambda e: e.name):
            at = os.path.join(path, entry.name)
            if FANOUT_DIR_RE.match(entry.name) and entry.is_dir(follow_symlinks=False):
                try:
                    fan = open_dir(entry.name, fd)
                except (FileNotFoundError, HostileFile):  # gone, or swapped for a link meanwhile
                    continue
                try:
                    self.fanout_dir(at, entry.name, layout_fp, fan)
                finally:
                    os.close(fan)
            elif TEMP_NAME_RE.match(entry.name) and entry.is_file(follow_symlinks=False):
                self.temp(entry, at, fd)
            else:
                self.bad(at, fd, STRAY, removable=entry.is_file(follow_symlinks=False))

    def fanout_dir(self, path: str, fanout: str, layout_fp: bytes, fd: int) -> None:
        for entry in sorted(os.scandir(fd), key=lambda e: e.name):
            at = os.path.join(path, entry.name)
            is_file = entry.is_file(follow_symlinks=False)
            if not is_file:
                self.bad(at, fd, STRAY, removable=False)
            elif TEMP_NAME_RE.match(entry.name):
                self.temp(entry, at, fd)
            elif not CHUNK_NAME_RE.match(entry.name):
                self.bad(at, fd, STRAY)
            elif fanout_name(entry.name) != fanout:
                self.report.files += 1
                self.bad(at, fd, WRONG_DIR)
            else:
                self.chunk(at, entry.name, layout_fp, fd)

    def chunk(self, path: str, name: str, layout_fp: bytes, dir_fd: int) -> None:
        try:
            reason, size = _verify(name, dir_fd, layout_fp, self.layout_rows, self.buf, self.fleet)
        except FileNotFoundError:
            return
        self.report.files += 1
        if reason is not None:
            self.bad(path, dir_fd, reason)
        else:
            self.report.good_files += 1
            self.report.good_bytes += size


def fsck(root: str, repair: bool, *, temp_grace_s: float = 600.0,
         row_bytes: int | None = None, fleet: FleetKey | None = None) -> FsckReport:
    """Check every layout directory under `root`; with `repair`, remove bad files and orphans.
    `row_bytes` is every layout's row size (None: each layout's is judged from its files); with
    `fleet`, chunks must carry its MAC (without, a MACed chunk is bad: `ChunkError.MAC`).

    Raises OSError (FileNotFoundError, NotADirectoryError, PermissionError) when `root` itself
    cannot be listed.
    """
    report = FsckReport(root=os.path.abspath(root), repair=repair)
    checker = _Checker(report, temp_grace_s, row_bytes, fleet)
    root_fd = os.open(root, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC)  # the operator's: may be a link
    try:
        for entry in sorted(os.scandir(root_fd), key=lambda e: e.name):
            at = os.path.join(root, entry.name)
            if not (LAYOUT_DIR_RE.match(entry.name) and entry.is_dir(follow_symlinks=False)):
                report.ignored.append(at)
                continue
            try:
                fd = open_dir(entry.name, root_fd)
            except (FileNotFoundError, HostileFile):
                continue
            try:
                checker.layout_dir(at, bytes.fromhex(entry.name), fd)
            finally:
                os.close(fd)
    finally:
        os.close(root_fd)
    return report


def add_fsck_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `fsck` sub-command; its handler is `run_fsck_command` (also set as `func`)."""
    p = subparsers.add_parser(
        "fsck",
        help="verify (and repair) an fs tier directory",
        description="Verify every chunk file of an fs tier directory. Exit status: 0 clean, "
        "1 bad or orphaned files found (even when --repair removed them), 2 cannot check.",
    )
    p.add_argument("dir", metavar="DIR", help="the fs tier's root_dir")
    p.add_argument("--repair", action="store_true", help="remove bad files and orphaned temps")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--temp-grace", type=float, default=600.0, metavar="SECONDS",
        help="temp files older than this are orphans (default: 600)",
    )
    p.add_argument(
        "--row-bytes", type=int, default=None, metavar="BYTES",
        help="the layout's row size: any other payload length is bad (default: the size most "
        "chunk files of each layout directory have)",
    )
    p.add_argument(
        "--fleet-key-file", default=None, metavar="PATH",
        help="the fleet key file the tier's instances use (fleet_key_file): chunks must carry its "
        "MAC; without it, a chunk MACed with a key is bad (reason mac)",
    )
    p.set_defaults(func=run_fsck_command)


def run_fsck_command(args: argparse.Namespace) -> int:
    """Run `kvtier fsck` for parsed arguments; returns the exit status."""
    try:
        fleet = None if args.fleet_key_file is None else FleetKey.from_file(args.fleet_key_file)
        report = fsck(args.dir, args.repair, temp_grace_s=args.temp_grace,
                      row_bytes=args.row_bytes, fleet=fleet)
    except ConfigError as e:
        print(f"kvtier fsck: {e}")
        return 2
    except OSError as e:
        print(f"kvtier fsck: cannot check {args.dir}: {e.strerror or e}")
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(
            f"{report.root}: {report.files} chunk files, {report.good_files} good "
            f"({report.good_bytes} bytes), {len(report.bad)} bad, "
            f"{len(report.orphans)} orphaned temp files, {len(report.in_progress)} in progress"
        )
        for bad in report.bad:
            print(f"bad ({bad.reason}): {bad.path}")
        for path in report.orphans:
            print(f"orphan: {path}")
        for path in report.removed:
            print(f"removed: {path}")
        for line in report.not_removed:
            print(f"not removed: {line}")
    return 0 if report.ok else 1
