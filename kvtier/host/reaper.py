"""The region reaper: removes a host region whose owner process died without closing it.

vLLM's API server stops its engine-core process with SIGTERM and, with the default
`--shutdown-timeout 0`, SIGKILLs it and every process below it a moment later: no cleanup in the
engine core (the connector's `shutdown`, `atexit`, a finalizer) runs then, nor after an OOM kill or
a crash. So the owner of a region starts one reaper per region (`start_reaper`, startup only): a
small process outside the owner's process tree (double fork, own session), which a kill of that tree
does not reach. It checks every `POLL_S` seconds whether the owner is still the same live process
(pid and start time, a zombie counts as dead) and whether the segment still exists; it removes the
segment once the owner is gone, and exits when either is gone. An owner that closes its region
normally removes the segment itself, and the reaper then exits on its own.

`python -m kvtier.host.reaper PATH PID START` is the reaper's body; it imports nothing else from kvtier.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time

POLL_S = 0.2
"""How often the reaper checks its owner: the delay between the owner's death and the removal."""
START_TIMEOUT_S = 30.0
log = logging.getLogger("kvtier.host")


def _stat(pid: int) -> list[bytes] | None:
    """The fields of /proc/`pid`/stat after the command name (state first), or None when no such
    process exists."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its closing ')'.
    return stat[stat.rindex(b")") + 2 :].split()


def start_time(pid: int) -> int | None:
    """The start time (clock ticks since boot) of `pid`, or None when no such process exists."""
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


def owner_alive(pid: int, started: int) -> bool:
    """Whether process `pid` exists, was started at `started` (not a reused pid) and is not a
    zombie (killed, waiting for its parent to reap it)."""
    fields = _stat(pid)
    return fields is not None and int(fields[19]) == started and fields[0] != b"Z"


def start_reaper(path: str, pid: int, started: int) -> None:
    """Start the reaper of the segment at `path`, owned by process `pid` started at `started`
    (clock ticks since boot). Returns once the reaper has detached (its first process has exited).
    A reaper that cannot start is logged, not raised: the region works without it, and a later
    start on this host removes a segment left behind (`remove_stale_regions`)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in sys.path if p)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.host.reaper", path, str(pid), str(started)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env, cwd="/",
            start_new_session=True,
        )
    except OSError as e:
        log.warning("kvtier: no reaper for host region %s (%s)", path, e)
        return
    try:
        proc.wait(START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        log.warning("kvtier: the reaper of host region %s did not start in %.0f s", path, START_TIMEOUT_S)


def watch(path: str, pid: int, started: int, poll_s: float = POLL_S) -> bool:
    """Wait until the owner dies (then remove `path`, return True) or `path` is gone (False)."""
    while os.path.exists(path):
        if not owner_alive(pid, started):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return True
        time.sleep(poll_s)
    return False


def main() -> None:
    path, pid, started = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if os.fork() != 0:
        os._exit(0)  # the first process exits at once: its child leaves the owner's process tree
    watch(path, pid, started)


if __name__ == "__main__":
    main()
