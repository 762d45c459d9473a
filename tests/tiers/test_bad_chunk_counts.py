"""What a tier counts reaches kvtier's metrics: a tier process reports each chunk it rejects, by
reason, right after the load that found it, and the engine side adds the counts up in its metrics
over every generation of the process (a restarted process counts from zero again). Every count a
real tier makes, not only bad chunks, is in the metrics the same way."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from kvtier.format.chunks import ChunkError
from kvtier.host.region import HostRegion
from kvtier.ops.metrics import TierCounter, TierCounts, TierGauge, TierStat
from kvtier.tiers.base import Job, JobKind, TierContext
from kvtier.tiers.fs.tier import FsTier
from kvtier.tiers.process import TierProcess
from tests.conftest import LAYOUT_FP, fill_slot, random_key, wait_jobs
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
