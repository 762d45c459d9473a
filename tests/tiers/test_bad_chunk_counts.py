"""What a tier counts reaches kvtier's metrics: a tier process reports each chunk it rejects, by
reason, as soon as it found it (after the load, or the fs tier's directory scan, that found it), and
the engine side adds the counts up in its metrics over every generation of the process (a restarted
process counts from zero again). A bad chunk is counted once, however many of the tier's threads
come across it. Every count a real tier makes, not only bad chunks, is in the metrics the same way."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest

from kvtier.format.chunks import ChunkError
from kvtier.host.region import HostRegion
from kvtier.ops.metrics import TierCounter, TierCounts, TierGauge, TierStat
from kvtier.tiers.base import Job, JobKind, TierContext
from kvtier.tiers.fs import tier as fs_tier
from kvtier.tiers.fs.index import scan_layout_dir
from kvtier.tiers.fs.tier import FsTier
from kvtier.tiers.process import TierProcess
from tests.conftest import LAYOUT_FP, fill_slot, random_key, wait_jobs
from tests.tiers.fs.helpers import chunk_path, load_keys, make_ctx, store_keys
from tests.tiers.process_helpers import make_proc, reported_counts


def _chunk_file(root: Path, key: bytes) -> Path:
    return root / LAYOUT_FP / key.hex()[:2] / key.hex()


def _flip_payload_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _bad_after(proc: TierProcess, before: float, timeout_s: float = 10.0) -> TierCounts:
    """The metrics' counts of `proc`'s tier once they hold more than `before` bad chunks (without
    asking for a report), or when `timeout_s` ran out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        proc.poll()
        counts = proc.metrics.tier_counts(proc.name)
        if counts.bad_chunks > before:
            return counts
        time.sleep(0.01)
    return proc.metrics.tier_counts(proc.name)


def _bad_by_reason(counts: TierCounts) -> dict[ChunkError, float]:
    return {reason: counts[reason] for reason in ChunkError if counts[reason]}


def _store_then_corrupt_load(proc: TierProcess | FsTier, ctx: TierContext, root: Path, job: int) -> None:
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
        assert _bad_by_reason(_bad_after(proc, 0)) == {ChunkError.CHECKSUM: 1.0}
        assert proc.metrics.value("kvtier_bad_chunks_total", tier="t", reason="checksum") == 1
        assert _bad_by_reason(reported_counts(proc)) == {ChunkError.CHECKSUM: 1.0}  # counted once
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
        assert _bad_by_reason(_bad_after(proc, 1)) == {ChunkError.CHECKSUM: 2.0}
    finally:
        proc.shutdown()


def test_every_count_of_a_real_tier_reaches_the_metrics(
    region: HostRegion, ctx: TierContext, tmp_path: Path
) -> None:
    """Whatever a real tier counts reaches the metrics: the same steps run on an fs tier in a tier
    process and on one in this process leave in the first one's metrics exactly the counts the
    second one's `counts()` holds (bad chunks by reason and gauges included)."""

    def steps(tier: TierProcess | FsTier, root: Path) -> None:
        _store_then_corrupt_load(tier, ctx, root, 1)
        tier.submit_load(Job(3, JobKind.LOAD, (random_key(),), (2,)))  # a key never stored
        assert not wait_jobs(tier, 1)[0].success

    proc = make_proc(region, "fs", options={"root_dir": str(tmp_path / "p"), "rescan_interval_s": None})
    proc.start()
    try:
        steps(proc, tmp_path / "p")
        in_metrics = reported_counts(proc)
    finally:
        proc.shutdown()
    own = FsTier(ctx, root_dir=str(tmp_path / "own"), rescan_interval_s=None)
    try:
        steps(own, tmp_path / "own")
        counted = own.counts()
    finally:
        own.shutdown()
    assert counted[ChunkError.CHECKSUM] == 1 and counted[TierCounter.LOAD_MISSES] == 1
    assert {TierGauge.DIRECT_IO, TierGauge.NATIVE_IO} <= set(counted.values)
    assert _nonzero(in_metrics) == _nonzero(counted)
    snapshot = proc.metrics.snapshot()
    assert snapshot['kvtier_bad_chunks_total{reason="checksum",tier="t"}'] == 1
    assert snapshot['kvtier_tier_counter_total{counter="load_misses",tier="t"}'] == 1
    assert snapshot['kvtier_tier_counter_total{counter="stored",tier="t"}'] == 1


def _nonzero(counts: TierCounts) -> dict[TierStat, float]:
    return {stat: value for stat, value in counts.values.items() if value}


def test_a_bad_chunk_a_scan_removes_is_reported_at_once(tmp_path: Path) -> None:
    """The directory scan removes a file of the wrong size with no job waiting for it; the count
    must still go out at once (it wakes the tier process's dispatch loop), not with the next
    periodic report: a tier process killed in between would lose a detection whose file is gone."""
    counted_at_wakeups: list[float] = []
    tier: FsTier | None = None

    def wakeup() -> None:
        if tier is not None:
            counted_at_wakeups.append(tier.counts()[ChunkError.LENGTH])

    ctx = dataclasses.replace(make_ctx(4096, 2), wakeup=wakeup)
    tier = FsTier(ctx, root_dir=str(tmp_path), rescan_interval_s=0.05)
    try:
        key = random_key()
        assert store_keys(tier, ctx, [key]).success
        path = chunk_path(tmp_path, key)
        os.truncate(path, 100)
        deadline = time.monotonic() + 10
        while 1.0 not in counted_at_wakeups:
            assert time.monotonic() < deadline, "the scan's bad chunk woke no one"
            time.sleep(0.01)
        assert not path.exists()
    finally:
        tier.shutdown()


def test_a_file_a_load_removed_is_not_counted_again_by_a_scan_that_saw_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scan lists a truncated file; before it removes it, a load finds the file bad, removes and
    counts it. The scan then finds nothing to remove: one bad chunk, counted once. (The scan's
    listing from before the load is replayed: the interleaving cannot be forced for real.)"""
    ctx = make_ctx(4096, 2)
    loader = FsTier(ctx, root_dir=str(tmp_path), rescan_interval_s=None)
    try:
        key = random_key()
        assert store_keys(loader, ctx, [key]).success
        path = chunk_path(tmp_path, key)
        os.truncate(path, 100)
        seen = scan_layout_dir(str(path.parent.parent), loader.file_bytes, 600.0, time.time())
        assert seen.wrong_size == [str(path)]
        assert not load_keys(loader, ctx, [key]).success
        assert loader.counts().bad_chunks == 1 and not path.exists()
    finally:
        loader.shutdown()
    monkeypatch.setattr(fs_tier, "scan_layout_dir", lambda *args: seen)
    scanner = FsTier(make_ctx(4096, 2), root_dir=str(tmp_path), rescan_interval_s=None)
    try:
        assert scanner.counts().bad_chunks == 0
    finally:
        scanner.shutdown()
