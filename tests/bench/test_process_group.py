"""`stop_process_group` on real process groups: a group that exits on SIGTERM and one that has to be
killed leave no process and no shared-memory entry of their own, and entries another live
process holds, or that are older than the group, stay however the group used them.

The group's leader is a Python process that creates what a vLLM server creates: a segment with
`multiprocessing.shared_memory` (so Python's resource tracker, which unlinks it when the leader
exits, runs in the group as it does in a server) and a semaphore registered with that tracker by a
child that exited without closing it (mapped by no process, as one of vLLM's is). It also creates an
entry of its own that no tracker knows, which only `stop_process_group` can remove, and maps the
entries it is given by name."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from kvtier.bench.process_group import SHM_DIR, group_members, stop_process_group

LEADER = """
import mmap, multiprocessing, os, signal, sys
from multiprocessing import shared_memory
if sys.argv[1] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
own = shared_memory.SharedMemory(create=True, size=4096)
if os.fork() == 0:
    lock = multiprocessing.get_context("spawn").Lock()
    print("sem." + lock._semlock.name.lstrip("/"), flush=True)
    os._exit(0)
os.wait()
raw = f"kvtier-test-untracked-{os.getpid()}"
fd = os.open(f"/dev/shm/{raw}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(fd, 4096)
maps = [mmap.mmap(fd, 4096)]
os.close(fd)
for name in sys.argv[2:]:
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    maps.append(mmap.mmap(fd, 4096))
    os.close(fd)
print(own.name, raw, flush=True)
while True:
    signal.pause()
"""


def _entry(name: str) -> Path:
    path = SHM_DIR / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 4096)
    os.close(fd)
    return path


@pytest.fixture
def others() -> Iterator[tuple[shared_memory.SharedMemory, Path]]:
    """A segment this (live) process holds, and an entry nobody holds, made before the group."""
    held = shared_memory.SharedMemory(create=True, size=4096)
    older = _entry(f"kvtier-test-older-{os.getpid()}")
    try:
        yield held, older
    finally:
        held.close()
        held.unlink()
        older.unlink(missing_ok=True)


@pytest.mark.parametrize("mode", ["polite", "stubborn"])
def test_a_stopped_group_leaves_only_what_is_not_its_own(
    mode: str, others: tuple[shared_memory.SharedMemory, Path],
) -> None:
    held, older = others
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-c", LEADER, mode, held.name, older.name],
                            stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None
        sem = proc.stdout.readline().decode().strip()
        own, raw = proc.stdout.readline().decode().split()
        assert all((SHM_DIR / name).exists() for name in (sem, own, raw))
        assert len(group_members(proc.pid)) == 2  # the leader and its resource tracker
        removed = stop_process_group(proc, term_timeout_s=0.5 if mode == "stubborn" else 20.0,
                                     started=started)
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert not group_members(proc.pid)
    # the tracker unlinked what was registered with it, the leader killed or not; stop removed the
    # entry no tracker knew of
    assert not [name for name in (sem, own, raw) if (SHM_DIR / name).exists()]
    assert removed == [raw]
    assert (SHM_DIR / held.name).exists() and older.exists()


def test_stopping_twice_is_harmless() -> None:
    proc = subprocess.Popen([sys.executable, "-c", LEADER, "polite"], stdout=subprocess.PIPE,
                            start_new_session=True)
    assert proc.stdout is not None
    with proc.stdout:
        proc.stdout.readline()
        own, raw = proc.stdout.readline().decode().split()
    assert stop_process_group(proc, 20.0) == [raw]
    assert stop_process_group(proc, 20.0) == []
    assert proc.returncode is not None and not (SHM_DIR / own).exists()
