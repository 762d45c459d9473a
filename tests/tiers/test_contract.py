"""The secondary-tier contract, checked for every built-in tier, in-process and in a tier process.

The memory tier is the model: every tier must give the same observable answers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.format.chunks import TierEventKind
from kvtier.host.region import HostRegion
from kvtier.tiers.base import Job, JobKind, LookupResult, SecondaryTier, TierContext, TierUsage
from kvtier.tiers.process import TierProcess, TierSpec
from kvtier.tiers.registry import BUILTIN_TIERS, resolve_tier
from tests.conftest import (
    LAYOUT_FP,
    ROW_BYTES,
    SLOTS,
    fill_slot,
    random_key,
    settle_lookup,
    wait_jobs,
)

SERVICE_TIERS = {"obj": "s3_tier_options", "redis": "redis_tier_options"}
"""Tiers backed by a server: the fixture (in tests/services/) giving options for a fresh namespace."""
PEER_TIERS = {"p2p"}
"""Tiers whose contract needs a second instance: covered by their own tests."""
CONTRACT_TIERS = [t for t in ("memory", "fs", *SERVICE_TIERS) if t in BUILTIN_TIERS]


def tier_options(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, object]:
    if kind == "fs":
        return {"root_dir": str(tmp_path / "fs")}
    if kind in SERVICE_TIERS:
        return dict(request.getfixturevalue(SERVICE_TIERS[kind]))
    return {}


@pytest.fixture(params=[(k, mode) for k in CONTRACT_TIERS for mode in ("inproc", "process")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def tier(request, ctx: TierContext, region: HostRegion, tmp_path: Path) -> Iterator[object]:
    kind, mode = request.param
    options = tier_options(kind, request, tmp_path)
    if mode == "inproc":
        t = resolve_tier("t", kind, None)(ctx, **options)
        yield t
        t.shutdown()
        return
    spec = TierSpec(
        tier_name=kind, type=kind, module_path=None, options=options, config_key="secondary_tiers[0]",
        region_name=region.name, shm_dir="/dev/shm", row_bytes=ROW_BYTES, num_slots=SLOTS,
        layout_fingerprint=LAYOUT_FP,
    )
    proc = TierProcess(spec, job_timeout_s=20)
    proc.start()
    yield proc
    proc.shutdown()


def usage_of(tier: SecondaryTier | TierProcess) -> TierUsage | None:
    """The tier's usage now (a tier process: a report requested now)."""
    if isinstance(tier, SecondaryTier):
        return tier.usage()
    seen = tier.stats_version
    tier.request_stats()
    deadline = time.monotonic() + 5
    while tier.stats_version == seen and time.monotonic() < deadline:
        tier.poll()
        time.sleep(0.002)
    return tier.last_usage


def test_every_builtin_tier_is_covered() -> None:
    assert set(BUILTIN_TIERS) - PEER_TIERS == set(CONTRACT_TIERS)


def test_store_then_load_round_trips_bytes(tier, ctx: TierContext) -> None:
    keys = [random_key() for _ in range(4)]
    originals = [fill_slot(ctx, s) for s in range(4)]
    assert settle_lookup(tier, keys) == [LookupResult.MISS] * 4
    tier.submit_store(Job(1, JobKind.STORE, tuple(keys), (0, 1, 2, 3)))
    [result] = wait_jobs(tier, 1)
    assert result.success and set(result.successful_keys) == set(keys)
    assert result.bytes_moved == 4 * ROW_BYTES
    assert settle_lookup(tier, keys) == [LookupResult.HIT] * 4
    for s in range(4, 8):
        ctx.slot_view(s)[:] = bytes(ROW_BYTES)
    tier.submit_load(Job(2, JobKind.LOAD, tuple(reversed(keys)), (7, 6, 5, 4)))
    [result] = wait_jobs(tier, 1)
    assert result.job_id == 2 and result.success
    for i, data in enumerate(originals):
        assert bytes(ctx.slot_view(4 + i)) == data


def test_load_of_missing_keys_fails_as_a_value(tier, ctx: TierContext) -> None:
    present, absent = random_key(), random_key()
    data = fill_slot(ctx, 0)
    tier.submit_store(Job(1, JobKind.STORE, (present,), (0,)))
    wait_jobs(tier, 1)
    tier.submit_load(Job(2, JobKind.LOAD, (absent, present), (5, 6)))
    [result] = wait_jobs(tier, 1)
    assert not result.success
    assert result.successful_keys == (present,)
    assert bytes(ctx.slot_view(6)) == data


def test_each_job_is_reported_exactly_once(tier, ctx: TierContext) -> None:
    keys = [random_key() for _ in range(6)]
    for s in range(6):
        fill_slot(ctx, s)
    for j in range(6):
        tier.submit_store(Job(10 + j, JobKind.STORE, (keys[j],), (j,)))
    results = wait_jobs(tier, 6)
    assert sorted(r.job_id for r in results) == list(range(10, 16))
    assert all(r.success for r in results)
    assert wait_jobs(tier, 0) == [] and tier.get_finished_jobs() == []


def test_store_emits_stored_events(tier, ctx: TierContext) -> None:
    keys = (random_key(), random_key())
    fill_slot(ctx, 0)
    fill_slot(ctx, 1)
    tier.submit_store(Job(1, JobKind.STORE, keys, (0, 1)))
    wait_jobs(tier, 1)
    stored: set[bytes] = set()
    deadline = time.monotonic() + 5
    while stored != set(keys) and time.monotonic() < deadline:
        tier.get_finished_jobs()
        stored |= {k for e in tier.take_events() if e.kind is TierEventKind.STORED for k in e.keys}
        time.sleep(0.005)
    assert stored == set(keys)


def test_storing_a_key_again_keeps_it_readable(tier, ctx: TierContext) -> None:
    key = random_key()
    data = fill_slot(ctx, 0)
    tier.submit_store(Job(1, JobKind.STORE, (key,), (0,)))
    tier.submit_store(Job(2, JobKind.STORE, (key,), (0,)))
    assert all(r.success for r in wait_jobs(tier, 2))
    tier.submit_load(Job(3, JobKind.LOAD, (key,), (9,)))
    assert wait_jobs(tier, 1)[0].success
    assert bytes(ctx.slot_view(9)) == data


def test_usage_counts_the_chunks_stored(tier, ctx: TierContext) -> None:
    before = usage_of(tier)
    assert before is not None and (before.chunks, before.bytes_used) == (0, 0)
    keys = tuple(random_key() for _ in range(3))
    for s in range(3):
        fill_slot(ctx, s)
    tier.submit_store(Job(1, JobKind.STORE, keys, (0, 1, 2)))
    assert wait_jobs(tier, 1)[0].success
    after = usage_of(tier)
    assert after is not None and after.chunks == 3
    assert 3 * ROW_BYTES <= after.bytes_used <= 3 * (ROW_BYTES + 4096)
    assert after.capacity_bytes == before.capacity_bytes
