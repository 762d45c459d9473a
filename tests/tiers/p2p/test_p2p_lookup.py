"""The p2p tier's lookup cache between real tier processes over loopback: what a failed load does
to it. The requester caches answers for a minute here, so only a refresh, never an expiry, can
change what it believes within a test. Loads go straight to the requester's tier process (its
engine-side answers are not in the way)."""

from __future__ import annotations

from kvtier.tiers.base import Job, JobKind, LookupResult
from tests.conftest import fill_slot, random_key, settle_lookup, wait_jobs
from tests.tiers.p2p.helpers import address, ctx_of, store

TTL_S = 60.0


def _loads(proc, key: bytes, job_id: int) -> bool:
    proc.submit_load(Job(job_id, JobKind.LOAD, (key,), (0,)))
    [result] = wait_jobs(proc, 1)
    return result.success


def test_a_cached_holder_whose_load_fails_is_forgotten(make_peer) -> None:
    """B learnt that A holds the key; A dropped it (its slot took another chunk), so B's load fails;
    A holds the key again: B's next load asks again and finds it, rather than trusting that nobody
    holds it for the rest of the minute."""
    a, a_region = make_peer()
    b, _ = make_peer(peers=[address(a)], lookup_ttl_s=TTL_S)
    a_ctx = ctx_of(a_region)
    key = random_key()
    fill_slot(a_ctx, 0)
    store(a, [key], [0])
    assert settle_lookup(b, [key]) == [LookupResult.HIT]
    fill_slot(a_ctx, 0)
    store(a, [random_key()], [0], job_id=2)  # the slot's new chunk: A no longer holds the key
    assert not _loads(b, key, 10)
    fill_slot(a_ctx, 1)
    store(a, [key], [1], job_id=3)
    assert _loads(b, key, 11)


def test_a_cached_nobody_is_asked_again_after_a_load_it_failed(make_peer) -> None:
    """B asked before A held the key (nobody); a load that fails on that answer forgets it, so the
    next load asks the peers and loads the key A holds now."""
    a, a_region = make_peer()
    b, _ = make_peer(peers=[address(a)], lookup_ttl_s=TTL_S)
    key = random_key()
    assert settle_lookup(b, [key]) == [LookupResult.MISS]
    fill_slot(ctx_of(a_region), 0)
    store(a, [key], [0])
    assert not _loads(b, key, 10)  # the cached "nobody", trusted once
    assert _loads(b, key, 11)
