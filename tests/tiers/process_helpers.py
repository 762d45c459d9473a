"""Helpers for tests that drive a real tier process: build one over the test region, get a report
from it now, and read what it counted from kvtier's metrics."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvtier.host.region import HostRegion
from kvtier.ops.metrics import TierCounter, TierCounts
from kvtier.tiers.process import TierProcess, TierSpec
from tests.conftest import LAYOUT_FP, ROW_BYTES, SLOTS


def make_proc(region: HostRegion, type_: str, module_path: str | None = None, **kw) -> TierProcess:
    """A tier process named "t" over `region` (not started); `options` are the tier's, the rest
    `TierProcess`'s own keywords."""
    options = kw.pop("options", {})
    spec = TierSpec(
        tier_name="t", type=type_, module_path=module_path, options=options,
        config_key="secondary_tiers[0]", region_name=region.name, shm_dir="/dev/shm",
        row_bytes=ROW_BYTES, num_slots=SLOTS, layout_fingerprint=LAYOUT_FP,
    )
    return TierProcess(spec, **kw)


def report_now(proc: TierProcess, timeout_s: float = 5.0) -> None:
    """Wait for a stats report requested now: its counts are in `proc.metrics`, its usage in
    `proc.last_usage`. The reports already received (a periodic one sent while nothing polled
    `proc`, with counts from before what the caller waited for) are taken in first, so that the
    report waited for is not one of them."""
    proc.poll()
    seen = proc.stats_version
    proc.request_stats()
    deadline = time.monotonic() + timeout_s
    while proc.stats_version == seen:
        proc.poll()
        if time.monotonic() > deadline:
            pytest.fail(f"no stats report from tier {proc.name!r} within {timeout_s} s")
        time.sleep(0.002)


def reported_counts(proc: TierProcess, timeout_s: float = 5.0) -> TierCounts:
    """What the metrics hold of `proc`'s tier after a report requested now."""
    report_now(proc, timeout_s)
    return proc.metrics.tier_counts(proc.name)


def bench_count(report: dict[str, Any], counter: TierCounter) -> float:
    """A `kvtier tier-bench` report's count of `counter` (its `tier_counts`, from the metrics)."""
    return float(report["tier_counts"]["tier_counter"].get(counter.value, 0.0))
