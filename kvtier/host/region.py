"""The host region: one shared-memory segment holding every host-tier row.

The owner creates the segment as a file under /dev/shm with a name unique to the process
(`kvtier-<pid>-<process start time>-<random>`), so two instances on one host never collide. Tier
processes and TP ranks attach to it by name. The owner removes it on `close()`; a segment left by an
owner that crashed is found by `remove_stale_regions()` and removed on the next start, or at once by
the region's reaper (`reaper.py`) when the owner asked for one.

A pid says nothing across PID namespaces: containers that share /dev/shm (`--ipc=host`, a pod's
shared memory) see each other's segments, with names whose pids are another namespace's. So the
owner holds an exclusive `flock` on its segment for as long as it lives (the kernel drops it when
the owner dies, however it dies), taken before the segment gets its name; `remove_stale_regions`
removes a segment only when its name's pid is not that live process *and* it can take that lock.

Pages are touched once at creation, and an attaching process maps them all at once
(`MAP_POPULATE`), so no copy pays a page fault per page: on an engine thread that fault made stores
into a freshly attached region 2.5x slower than into a mapped one (BENCHMARKS.md, "copies").

A process that copies to and from an accelerator pins its own mapping (`pin`, e.g. CUDA's
`cudaHostRegister`) so device copies are DMA straight into the shared pages; `close()` unpins
before unmapping.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import re
import secrets
from typing import Protocol

from kvtier.errors import ConfigError
from kvtier.host.reaper import owner_alive, start_reaper, start_time

SHM_DIR = "/dev/shm"
PAGE = 4096
_NAME_RE = re.compile(r"^kvtier-(\d+)-(\d+)-[0-9a-f]{8}$")


def remove_stale_regions(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove segments whose owner process no longer exists; return their names."""
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        m = _NAME_RE.match(name)
        if m is None or owner_alive(int(m.group(1)), int(m.group(2))):
            continue
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner holds the lock: alive, in another PID namespace
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(name)
        finally:
            os.close(fd)
    return removed


class HostPinner(Protocol):
    """Registers host memory with an accelerator driver as page-locked (pinned) for DMA."""

    def register(self, address: int, size: int) -> None:
        """Pin `[address, address + size)`; raise when the driver refuses."""

    def unregister(self, address: int) -> None:
        """Unpin the range registered at `address`; never raises."""


def check_region_size(size: int, shm_dir: str, key: str, min_bytes: int = 1) -> int:
    """`size` rounded up to a page, or ConfigError naming `key` when it is below `min_bytes` (e.g.
    one chunk row) or the region would not fit in the free space of `shm_dir` now. The one check of
    a host region's placement: the host tier's start and `kvtier serve`'s early check both call it.
    /dev/shm is a tmpfs whose size is its own limit; whether the machine's memory holds the host
    tier beside the engine is the memory plan's question (`budget.py`), asked first."""
    if size < max(min_bytes, 1):
        what = f"at least one chunk row ({min_bytes} bytes)" if min_bytes > 1 else "a positive number"
        raise ConfigError(key, size, f"must hold {what}")
    size = -(-size // PAGE) * PAGE
    st = os.statvfs(shm_dir)
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise ConfigError(key, size, f"the host region must fit in {shm_dir}, which has {free} bytes free")
    return size


class HostRegion:
    """A mapped shared-memory segment. `buf` is writable and page-aligned."""

    def __init__(self, name: str, path: str, size: int, owner: bool) -> None:
        self.name = name
        self.path = path
        self.size = size
        self.owner = owner
        flags = mmap.MAP_SHARED if owner else mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        fd = os.open(path, os.O_RDWR)
        try:
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size, flags)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)
        self._pinner: HostPinner | None = None
        self._lock_fd: int | None = None
        """The owner's descriptor of the segment, holding its `flock` while the owner lives."""

    @classmethod
    def create(
        cls,
        size: int,
        *,
        shm_dir: str = SHM_DIR,
        pretouch: bool = True,
        key: str = "cpu_bytes_to_use",
        min_bytes: int = 1,
        guard: bool = False,
    ) -> HostRegion:
        """Create and map a fresh segment of `size` bytes (rounded up to a page). With `guard`, a
        reaper (`reaper.py`) removes the segment within a second if this process dies without
        closing it, however it dies (SIGKILL included).

        Raises ConfigError naming `key` when the size is below `min_bytes` or does not fit in the
        free space of `shm_dir` (`check_region_size`).
        """
        remove_stale_regions(shm_dir)
        size = check_region_size(size, shm_dir, key, min_bytes)
        pid = os.getpid()
        started = start_time(pid)
        assert started is not None  # this process exists
        token = secrets.token_hex(4)
        name = f"kvtier-{pid}-{started}-{token}"
        path = os.path.join(shm_dir, name)
        unnamed = os.path.join(shm_dir, f".kvtier-new-{pid}-{token}")
        fd = os.open(unnamed, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, size)
            os.rename(unnamed, path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(unnamed)
            raise
        try:
            region = cls(name, path, size, owner=True)
            region._lock_fd = fd
            if pretouch:
                region.pretouch()
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        if guard:
            start_reaper(path, pid, started)
        return region

    @classmethod
    def attach(cls, name: str, *, shm_dir: str = SHM_DIR) -> HostRegion:
        """Map an existing segment created by another process, every page mapped now (its owner
        touched them: mapping them allocates nothing)."""
        if _NAME_RE.match(name) is None:
            raise ValueError(f"not a kvtier host region name: {name!r}")
        path = os.path.join(shm_dir, name)
        return cls(name, path, os.stat(path).st_size, owner=False)

    def pretouch(self) -> None:
        """Fault every page in now (writes one zero byte per page, which the kernel zeroed anyway)."""
        import numpy as np  # only the owner pays for importing numpy, not every tier process

        if self._mmap is None:
            raise ValueError(f"host region {self.name} is closed")
        np.frombuffer(self._mmap, dtype=np.uint8)[::PAGE] = 0

    @property
    def address(self) -> int:
        """The virtual address of the mapping in this process."""
        if self._mmap is None:
            raise ValueError(f"host region {self.name} is closed")
        anchor = ctypes.c_char.from_buffer(self._mmap)
        try:
            return ctypes.addressof(anchor)
        finally:
            del anchor  # releases the buffer export, so close() can unmap

    @property
    def pinned(self) -> bool:
        return self._pinner is not None

    def pin(self, pinner: HostPinner) -> None:
        """Pin the whole mapping with `pinner` (once; `close()` unpins it before unmapping).

        Raises what `pinner.register` raises, the region left unpinned.
        """
        if self._pinner is not None:
            return
        pinner.register(self.address, self.size)
        self._pinner = pinner

    def close(self) -> None:
        """Unpin, unmap; the owner also removes the segment. Idempotent. The caller first ends
        every device copy still using the mapping."""
        if self._mmap is None:
            return
        if self._pinner is not None:
            self._pinner.unregister(self.address)
            self._pinner = None
        # Tensors over the rows (`host_rows`) may still be alive: the mapping then stays until the
        # last of them is gone, never unmapped under them.
        with contextlib.suppress(BufferError):
            self.buf.release()
            self._mmap.close()
        self._mmap = None
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> HostRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
