"""The region reaper: a guarded region whose owner is SIGKILLed (or leaves a zombie) is removed within
a second, outside the owner's process tree; a region closed normally, or an unguarded one, is left
to its owner, and the reaper exits once the region is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from kvtier.host.reaper import owner_alive, start_time
from kvtier.host.region import HostRegion

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


def _gone_within(path: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while os.path.exists(path) or _reapers(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_region_of_a_killed_owner_is_removed_at_once() -> None:
    proc, path = _owner(guard=True, close=False)
    reapers = _reapers(path)
    assert len(reapers) == 1
    with open(f"/proc/{reapers[0]}/stat", "rb") as f:
        ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
    assert ppid != proc.pid, "the reaper must be outside the owner's process tree"
    proc.kill()  # the parent has not reaped it yet: a zombie owner is dead too
    t0 = time.monotonic()
    assert _gone_within(path, 2.0), "the reaper did not remove the region"
    print(f"removed {time.monotonic() - t0:.2f} s after SIGKILL")
    proc.wait()


def test_reaper_leaves_a_live_owner_alone_and_exits_after_close() -> None:
    proc, path = _owner(guard=True, close=True)
    time.sleep(0.5)
    assert os.path.exists(path) and len(_reapers(path)) == 1
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert _gone_within(path, 2.0), "the reaper outlived its region"
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
