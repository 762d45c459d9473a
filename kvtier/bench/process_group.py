"""Stop a process group so that it leaves nothing behind, in /dev/shm included.

A vLLM server is a process group: the API server, its engine core, the engine's worker, Python's
resource tracker, kvtier's tier processes. vLLM's engine core and worker create shared-memory
segments (`psm_*`: the message queues between them, 160 and 240 MiB) and semaphores (`sem.mp-*`,
one of which no process maps once the server is up), and leave their removal to the resource
tracker, which unlinks what was registered with it once every other process of the group has
exited. SIGKILL of the whole group kills the tracker too, and those entries stay in /dev/shm until
the machine reboots; so does a SIGKILL sent while the group is still exiting after SIGTERM (the
API server exits first; its engine core, worker and tracker a moment later).

`stop_process_group` sends SIGTERM to the group, and SIGKILL to what is left of it after the grace
time except the resource trackers, which ignore SIGTERM and exit once they have unlinked what the
killed processes registered; a tracker still alive `KILL_WAIT_S` later is killed too. It waits for
every process of the group, not only its leader, and then removes what the group left: the
/dev/shm entries the group's processes mapped or held open (seen before each signal), created
after the group's leader started, that no live process holds any more. An entry another process
holds, or one older than the group, is never removed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PROC = Path("/proc")
KILL_WAIT_S = 10.0
POLL_S = 0.05
Entry = tuple[str, int]
"""A /dev/shm entry: its name and inode (a later entry of the same name is another one)."""


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, ...); None when
    the process is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def group_members(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (zombies, which hold nothing, left out)."""
    members = []
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and fields[2] == str(pgid) and fields[0] not in "ZX":
                members.append(int(entry.name))
    return members


def started_at(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch, to a clock tick); None when gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    ticks = int(fields[19]) / os.sysconf("SC_CLK_TCK")
    uptime = float((PROC / "uptime").read_text().split()[0])
    return time.time() - (uptime - ticks)


def shm_held(pid: int) -> set[Entry]:
    """The /dev/shm entries process `pid` maps or holds open (empty when it is gone or not ours
    to read)."""
    held: set[Entry] = set()
    prefix = f"{SHM_DIR}/"
    with contextlib.suppress(OSError):
        for line in (PROC / str(pid) / "maps").read_text().splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(prefix) and not fields[5].endswith(" (deleted)"):
                held.add((fields[5][len(prefix):], int(fields[4])))
    with contextlib.suppress(OSError):
        for fd in (PROC / str(pid) / "fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith(prefix) and not target.endswith(" (deleted)"):
                    held.add((target[len(prefix):], os.stat(fd).st_ino))
    return held


def shm_held_by_anyone() -> set[Entry]:
    """The /dev/shm entries some live process maps or holds open (those this user may read)."""
    held: set[Entry] = set()
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            held |= shm_held(int(entry.name))
    return held


def remove_left_behind(seen: set[Entry], since: float) -> list[str]:
    """Remove each entry of `seen` that still exists, is the same file, was changed last at or
    after `since` (so was created after it) and that no live process holds; the names removed."""
    held = shm_held_by_anyone()
    removed = []
    for name, inode in sorted(seen - held):
        path = SHM_DIR / name
        try:
            st = path.stat()
            if st.st_ino == inode and st.st_ctime >= since:
                path.unlink()
                removed.append(name)
        except FileNotFoundError:
            continue
    return removed


def _is_resource_tracker(pid: int) -> bool:
    """Whether process `pid` is Python's multiprocessing resource tracker."""
    try:
        return b"multiprocessing.resource_tracker" in (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return False


def _kill_all_but_trackers(pgid: int, deadline: float) -> None:
    """SIGKILL every process of group `pgid` but its resource trackers, until none but those is
    left or `deadline` passes (a process may start another as it is killed)."""
    while time.monotonic() < deadline:
        others = [pid for pid in group_members(pgid) if not _is_resource_tracker(pid)]
        if not others:
            return
        for pid in others:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(POLL_S)


def _wait_gone(proc: subprocess.Popen[bytes], deadline: float) -> bool:
    """Wait until `proc` has exited and no other process of its group is alive; False at
    `deadline`."""
    while True:
        if proc.poll() is not None and not group_members(proc.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


def stop_process_group(proc: subprocess.Popen[bytes], term_timeout_s: float,
                       started: float | None = None) -> list[str]:
    """Stop the process group `proc` leads (started with `start_new_session=True`), so that no
    process of it is left and nothing it created stays in /dev/shm: SIGTERM to the group, up to
    `term_timeout_s` for every process of it to exit (vLLM's resource tracker unlinks its segments
    as the last one does), then SIGKILL to what is left but the resource trackers, and to those if
    they are still there `KILL_WAIT_S` later; once the group is gone, the /dev/shm entries it left
    are removed (see the module docstring). `started`: `time.time()` just before
    `proc` was started (default: its start time in /proc, to a clock tick; none once `proc` was
    reaped, and then nothing is removed). Returns the names it removed. Idempotent; called by the
    thread that started `proc`."""
    since = started if started is not None else started_at(proc.pid) if proc.returncode is None else None
    seen: set[Entry] = set()
    for pid in group_members(proc.pid):
        seen |= shm_held(pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    if not _wait_gone(proc, time.monotonic() + term_timeout_s):
        for pid in group_members(proc.pid):
            seen |= shm_held(pid)
        deadline = time.monotonic() + KILL_WAIT_S
        _kill_all_but_trackers(proc.pid, deadline)
        if not _wait_gone(proc, deadline):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            _wait_gone(proc, time.monotonic() + KILL_WAIT_S)
    return remove_left_behind(seen, since) if since is not None and seen else []
