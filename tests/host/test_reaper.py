"""The region reaper: a guarded region whose owner is SIGKILLed (or leaves a zombie) is removed by a
process outside the owner's process tree; a live owner's region is left alone, a region closed
normally or an unguarded one is left to its owner, and the reaper exits once the region is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvtier.host import reaper
from kvtier.host.reaper import owner_alive, start_time
from kvtier.host.region import HostRegion
from tests.conftest import wait_until

OWNER = ("import sys, time; from kvtier.host.region import HostRegion;"
         "r = HostRegion.create(4096, guard=sys.argv[1] == 'guard'); print(r.path, flush=True);"
         "sys.stdin.readline(); r.close() if sys.argv[2] == 'close' else None; time.sleep(60)")


def _owner(guard: bool, close: bool) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER, "guard" if guard else "-", "close" if close else "-"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def _reapers(path: str) -> list[int]:
    """Pids of the processes whose command line names `path`."""
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if path.encode() in f.read():
                    found.append(int(name))
        except OSError:
            continue
    return found


def _wait_gone(path: str, what: str) -> None:
    """Until neither the region at `path` nor a reaper naming it is left."""
    wait_until(lambda: not (os.path.exists(path) or _reapers(path)), what, interval_s=0.05)


def test_region_of_a_killed_owner_is_removed() -> None:
    proc, path = _owner(guard=True, close=False)
    reapers = _reapers(path)
    assert len(reapers) == 1
    with open(f"/proc/{reapers[0]}/stat", "rb") as f:
        ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
    assert ppid != proc.pid, "the reaper must be outside the owner's process tree"
    proc.kill()  # the parent has not reaped it yet: a zombie owner is dead too
    _wait_gone(path, "the reaper removed the region")
    proc.wait()


def test_the_reaper_leaves_a_live_owners_region_alone(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The reaper's loop (`watch`) checks a live owner again and again without touching its region,
    and returns, removing nothing, once the region is gone."""
    path = tmp_path / "region"
    path.write_bytes(b"")
    checks: list[bool] = []

    def checked(pid: int, started: int) -> bool:
        checks.append(owner_alive(pid, started))
        return checks[-1]

    monkeypatch.setattr(reaper, "owner_alive", checked)
    pid, returned = os.getpid(), []
    started = start_time(pid)
    assert started is not None
    watcher = threading.Thread(
        target=lambda: returned.append(reaper.watch(str(path), pid, started, poll_s=0.001)))
    watcher.start()
    wait_until(lambda: len(checks) >= 3, "the reaper checked its owner three times")
    assert path.exists() and all(checks)
    path.unlink()
    watcher.join(10)
    assert returned == [False]


def test_reaper_exits_once_its_owner_closed_the_region() -> None:
    proc, path = _owner(guard=True, close=True)
    assert os.path.exists(path) and len(_reapers(path)) == 1
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    _wait_gone(path, "the reaper exited after its region was closed")
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_unguarded_region_has_no_reaper() -> None:
    proc, path = _owner(guard=False, close=False)
    try:
        assert _reapers(path) == []
    finally:
        proc.kill()
        proc.wait()
    assert os.path.exists(path)
    with HostRegion.create(4096):  # a later start removes what a crashed owner left
        assert not os.path.exists(path)


def test_owner_alive_tells_a_reused_pid_from_its_owner() -> None:
    started = start_time(os.getpid())
    assert started is not None and owner_alive(os.getpid(), started)
    assert not owner_alive(os.getpid(), started + 1)
