"""Bad stored chunks reach kvtier's own counters: a tier process reports each chunk it rejects,
by reason, right after the load that found it, and the engine side adds them up over every
generation of the process (a restarted process counts from zero again)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from kvtier.host.region import HostRegion
from kvtier.tiers.base import Job, JobKind, TierContext
from kvtier.tiers.process import TierProcess
from tests.conftest import LAYOUT_FP, fill_slot, random_key, wait_jobs
from tests.tiers.test_process import make_proc


def _chunk_file(root: Path, key: bytes) -> Path:
    return root / LAYOUT_FP / key.hex()[:2] / key.hex()


def _flip_payload_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _bad_after(proc: TierProcess, timeout_s: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    seen: dict[str, float] = {}
    while time.monotonic() < deadline:
        for reason, n in proc.take_bad_chunks().items():
            seen[reason] = seen.get(reason, 0.0) + n
        if seen:
            return seen
        time.sleep(0.01)
    return seen


def _store_then_corrupt_load(proc: TierProcess, ctx: TierContext, root: Path, job: int) -> None:
    key = random_key()
    fill_slot(ctx, 0)
    proc.submit_store(Job(job, JobKind.STORE, (key,), (0,)))
    assert wait_jobs(proc, 1)[0].success
    _flip_payload_bit(_chunk_file(root, key))
    proc.submit_load(Job(job + 1, JobKind.LOAD, (key,), (1,)))
    assert not wait_jobs(proc, 1)[0].success


def test_bad_chunks_are_counted_by_reason_across_restarts(
    region: HostRegion, ctx: TierContext, tmp_path: Path
) -> None:
    # No periodic report gets in the way of "right after the load": the count comes with it.
    proc = make_proc(region, "fs", options={"root_dir": str(tmp_path), "rescan_interval_s": None},
                     restart_backoff_s=0.05)
    proc.start()
    try:
        _store_then_corrupt_load(proc, ctx, tmp_path, 1)
        assert _bad_after(proc) == {"checksum": 1.0}
        assert proc.take_bad_chunks() == {}
        pid = proc.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not (proc.is_up and proc.pid != pid):
            assert time.monotonic() < deadline, "the tier process was not restarted"
            proc.poll()
            time.sleep(0.02)
        # The new process counts from zero: its first bad chunk is one more, not a drop.
        _store_then_corrupt_load(proc, ctx, tmp_path, 3)
        assert _bad_after(proc) == {"checksum": 1.0}
    finally:
        proc.shutdown()
