"""The secondary-tier contract suite: every tier must give the observable answers of the memory
tier, the model. A test module subclasses `ContractSuite` (as `Test...`) and gives it a `tier`
fixture: a tier over the `ctx` fixture's region, in this process or in a tier process."""

from __future__ import annotations

import time

from kvtier.format.chunks import TierEventKind
from kvtier.tiers.base import Job, JobKind, LookupResult, SecondaryTier, TierContext, TierUsage
from kvtier.tiers.process import TierProcess
from tests.conftest import ROW_BYTES, fill_slot, random_key, settle_lookup, wait_jobs
from tests.tiers.process_helpers import report_now


def usage_of(tier: SecondaryTier | TierProcess) -> TierUsage | None:
    """The tier's usage now (a tier process: a report requested now)."""
    if isinstance(tier, SecondaryTier):
        return tier.usage()
    report_now(tier)
    return tier.last_usage


class ContractSuite:
    """The contract's tests, for the `tier` fixture of the subclass."""

    def test_store_then_load_round_trips_bytes(self, tier, ctx: TierContext) -> None:
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

    def test_load_of_missing_keys_fails_as_a_value(self, tier, ctx: TierContext) -> None:
        present, absent = random_key(), random_key()
        data = fill_slot(ctx, 0)
        tier.submit_store(Job(1, JobKind.STORE, (present,), (0,)))
        wait_jobs(tier, 1)
        tier.submit_load(Job(2, JobKind.LOAD, (absent, present), (5, 6)))
        [result] = wait_jobs(tier, 1)
        assert not result.success
        assert result.successful_keys == (present,)
        assert bytes(ctx.slot_view(6)) == data

    def test_each_job_is_reported_exactly_once(self, tier, ctx: TierContext) -> None:
        keys = [random_key() for _ in range(6)]
        for s in range(6):
            fill_slot(ctx, s)
        for j in range(6):
            tier.submit_store(Job(10 + j, JobKind.STORE, (keys[j],), (j,)))
        results = wait_jobs(tier, 6)
        assert sorted(r.job_id for r in results) == list(range(10, 16))
        assert all(r.success for r in results)
        assert wait_jobs(tier, 0) == [] and tier.get_finished_jobs() == []

    def test_store_emits_stored_events(self, tier, ctx: TierContext) -> None:
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

    def test_storing_a_key_again_keeps_it_readable(self, tier, ctx: TierContext) -> None:
        key = random_key()
        data = fill_slot(ctx, 0)
        tier.submit_store(Job(1, JobKind.STORE, (key,), (0,)))
        tier.submit_store(Job(2, JobKind.STORE, (key,), (0,)))
        assert all(r.success for r in wait_jobs(tier, 2))
        tier.submit_load(Job(3, JobKind.LOAD, (key,), (9,)))
        assert wait_jobs(tier, 1)[0].success
        assert bytes(ctx.slot_view(9)) == data

    def test_usage_counts_the_chunks_stored(self, tier, ctx: TierContext) -> None:
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
