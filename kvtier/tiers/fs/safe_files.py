"""Files and directories under an fs tier's root: created private, opened without trusting them.

A root shared with other writers may hold what one of them planted: a FIFO or a symlink at a chunk
path, a fan-out directory replaced by a symlink, a sidecar linked to `/dev/zero`. What holds here:

- a file is created with an explicit mode and `fchmod`ed to it, a directory `mkdir`ed and
  `chmod`ed to its own, so the process umask neither widens nor narrows either (`Modes`);
- an existing file is opened with `O_NOFOLLOW | O_NONBLOCK` and used only when `fstat` says it is
  a regular file (`open_regular`): a symlink fails at once (ELOOP), a FIFO opens at once and is
  refused, and neither is ever read; small files are read up to a bound (`read_regular`);
- a directory below the root is opened with `O_DIRECTORY | O_NOFOLLOW` relative to its parent's
  descriptor (`open_dir`), so nothing reached through the descriptors it gives leaves the root.

A refused entry raises `HostileFile`, an OSError; other OSErrors are the file system's own.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

O_CLOEXEC: int = getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW: int = getattr(os, "O_NOFOLLOW", 0)
O_NONBLOCK: int = getattr(os, "O_NONBLOCK", 0)
O_DIRECTORY: int = getattr(os, "O_DIRECTORY", 0)
O_NOCTTY: int = getattr(os, "O_NOCTTY", 0)
O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_OPEN_FLAGS = O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC


@dataclass(frozen=True)
class Modes:
    """The permission bits of the files and directories a tier creates."""

    file: int
    dir: int


PRIVATE = Modes(file=0o600, dir=0o700)
"""The default: only the serving user reads or lists anything."""
SHARED_GROUP = Modes(file=0o660, dir=0o2770)
"""`shared_group`: the directory's group reads and writes too; set-group-ID directories hand
their group to what is created in them, so a root owned by the fleet's group stays its."""


def modes(shared_group: bool) -> Modes:
    """The modes for the `shared_group` option's value."""
    return SHARED_GROUP if shared_group else PRIVATE


def modes_of(directory: str) -> Modes:
    """The modes a tier chose for `directory` (group-writable: shared), PRIVATE when it is absent
    or not a directory. For files a tier's companions keep beside its own."""
    try:
        st = os.lstat(directory)
    except OSError:
        return PRIVATE
    return modes(stat.S_ISDIR(st.st_mode) and bool(st.st_mode & stat.S_IWGRP))


class HostileFile(OSError):
    """An entry that is not what its name says: a symlink, a FIFO, a device, a directory where a
    file belongs (or a file or link where a directory belongs)."""


def _refused(e: OSError, name: str, what: str) -> OSError:
    if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EISDIR):
        return HostileFile(e.errno, f"not a {what}", name)
    return e


def open_regular(name: str, flags: int = os.O_RDONLY, dir_fd: int | None = None) -> int:
    """An fd of the regular file `name` (relative to `dir_fd` when given), never following a
    symlink at `name` and never blocking on a FIFO or device. Raises HostileFile when `name` is
    not a regular file, FileNotFoundError when it is absent, OSError otherwise."""
    try:
        fd = os.open(name, flags | _OPEN_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.EINVAL and flags & O_DIRECT:
            # O_DIRECT is refused on a FIFO or device: HostileFile when that is what `name` is.
            os.close(open_regular(name, flags & ~O_DIRECT, dir_fd))
        raise _refused(e, name, "regular file") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise HostileFile(errno.EINVAL, "not a regular file", name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str, limit: int, dir_fd: int | None = None) -> bytes:
    """The content of the regular file `path` (relative to `dir_fd` when given; see
    `open_regular`); raises HostileFile when it is not one or holds more than `limit` bytes, which
    are never read."""
    fd = open_regular(path, dir_fd=dir_fd)
    try:
        if os.fstat(fd).st_size > limit:
            raise HostileFile(errno.EFBIG, f"larger than {limit} bytes", path)
        data = os.read(fd, limit + 1)
        if len(data) > limit:
            raise HostileFile(errno.EFBIG, f"larger than {limit} bytes", path)
        return data
    finally:
        os.close(fd)


def create_file(path: str, mode: int, flags: int = os.O_WRONLY, dir_fd: int | None = None) -> int:
    """A new file `path` (created exclusively, never through a symlink) opened with `flags`, with
    exactly `mode` whatever the umask. Raises FileExistsError when the name is taken."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path, dir_fd=dir_fd)
        raise
    return fd


def make_dir(name: str, mode: int, dir_fd: int | None = None) -> None:
    """Create the directory `name` with exactly `mode` whatever the umask; FileExistsError when
    the name is taken (by anything)."""
    os.mkdir(name, mode, dir_fd=dir_fd)
    fd = open_dir(name, dir_fd)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def open_dir(name: str, dir_fd: int | None = None) -> int:
    """An fd of the directory `name` (relative to `dir_fd` when given), refused (HostileFile) when
    `name` is a symlink or not a directory."""
    try:
        return os.open(name, os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        raise _refused(e, name, "directory") from None


def tighten(name: str, mode: int, dir_fd: int | None = None) -> None:
    """Set the directory `name`'s mode to `mode` when this user owns it and it differs (a directory
    made by an older version or under another umask); left alone otherwise."""
    with contextlib.suppress(OSError):
        fd = open_dir(name, dir_fd)
        try:
            st = os.fstat(fd)
            if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != mode:
                os.fchmod(fd, mode)
        finally:
            os.close(fd)


def tighten_like(name: str, directory: str) -> None:
    """`tighten` the directory `name` to the modes a tier chose for `directory` (`modes_of`), when
    that exists (without it, which modes were chosen is not known yet)."""
    if os.path.isdir(directory):
        tighten(name, modes_of(directory).dir)


class LayoutDir:
    """The directory `root/name` and its subdirectories, each opened by `open_dir` from its
    parent's fd: `root` is the operator's and trusted (followed when it is a link); nothing below
    it is. Thread-safe: every call opens its own fds."""

    def __init__(self, root: str, name: str, dir_modes: Modes) -> None:
        self.path = os.path.join(root, name)
        self.modes = dir_modes

    def _open(self, name: str, dir_fd: int | None, create: bool) -> int:
        try:
            return open_dir(name, dir_fd)
        except (FileNotFoundError, HostileFile) as e:
            if not create:
                raise
            if isinstance(e, HostileFile):  # a file or a link where our directory belongs
                os.unlink(name, dir_fd=dir_fd)
        with contextlib.suppress(FileExistsError):
            make_dir(name, self.modes.dir, dir_fd)
        return open_dir(name, dir_fd)

    def open_top(self, create: bool = False) -> int:
        """An fd of the layout directory itself (see `sub`)."""
        return self._open(self.path, None, create)

    @contextlib.contextmanager
    def sub(self, name: str, create: bool = False) -> Iterator[int]:
        """An fd of the subdirectory `name` (a relative path: each of its components is opened
        from the one before), closed after the block. With `create`, a missing layout directory
        or subdirectory is made (`root` never is), and an entry that is not a directory where one
        belongs is replaced by one. Raises FileNotFoundError, HostileFile (without `create`) or
        the file system's OSError."""
        fd = self.open_top(create)
        try:
            for part in name.split("/"):
                parent, fd = fd, -1
                try:
                    fd = self._open(part, parent, create)
                finally:
                    os.close(parent)
            yield fd
        finally:
            if fd >= 0:
                os.close(fd)
