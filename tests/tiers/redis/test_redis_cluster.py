"""The redis tier on a real three-master cluster (the session's `redis_cluster`): routing over every
node, MOVED and ASK redirects after slot migrations, a killed node turning into misses while the
other nodes serve, bad values found on any node, settings that name what is wrong, and the tier in a
tier process through `tier-bench`. The contract suite runs on the cluster too (test_contract.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from redis.crc import key_slot

from kvtier.bench.tier_bench import run_tier_bench
from kvtier.errors import ConfigError
from kvtier.format.chunks import ChunkError
from kvtier.ops.metrics import TierCounter, TierGauge
from kvtier.tiers.base import Job, JobKind, LookupResult, TierContext
from kvtier.tiers.redis.tier import RedisTier
from tests.conftest import LAYOUT_FP, fill_slot, random_key, settle_lookup, wait_jobs
from tests.services.redis_cluster import Cluster
from tests.services.redis_server import RedisServer, free_port, fresh_prefix

MakeTier = Callable[..., RedisTier]


@pytest.fixture
def make_tier(ctx: TierContext) -> Iterator[MakeTier]:
    """Build in-process redis tiers over `ctx`; all shut down after the test."""
    built: list[RedisTier] = []

    def make(**options: Any) -> RedisTier:
        built.append(RedisTier(ctx, **options))
        return built[-1]

    yield make
    for tier in built:
        tier.shutdown()


def rkey(options: dict[str, Any], key: bytes) -> bytes:
    return f"{options['key_prefix']}:{LAYOUT_FP}:{key.hex()}".encode()


def keys_on(cluster: Cluster, options: dict[str, Any], node: int, n: int) -> list[bytes]:
    """`n` fresh chunk keys whose values the cluster keeps on node `node`."""
    owners = cluster.slot_owners()
    keys: list[bytes] = []
    while len(keys) < n:
        key = random_key()
        if owners[key_slot(rkey(options, key))] == node:
            keys.append(key)
    return keys


def run(tier: RedisTier, kind: JobKind, keys: list[bytes], slots: list[int], job_id: int = 1) -> set[bytes]:
    """Submit one job and wait for it: the keys it moved."""
    (tier.submit_store if kind is JobKind.STORE else tier.submit_load)(
        Job(job_id, kind, tuple(keys), tuple(slots)))
    [result] = wait_jobs(tier, 1)
    return set(result.successful_keys)


def test_chunks_spread_over_every_node_and_round_trip(make_tier, ctx, redis_cluster,
                                                      cluster_tier_options) -> None:
    tier = make_tier(**cluster_tier_options)
    keys = [k for node in range(3) for k in keys_on(redis_cluster, cluster_tier_options, node, 4)]
    rows = [fill_slot(ctx, s) for s in range(12)]
    assert run(tier, JobKind.STORE, keys, list(range(12))) == set(keys)
    for i, key in enumerate(keys):
        assert redis_cluster.client(i // 4).exists(rkey(cluster_tier_options, key)) == 1
    assert run(tier, JobKind.LOAD, keys, list(range(12, 24))) == set(keys)
    assert [bytes(ctx.slot_view(12 + i)) for i in range(12)] == rows
    assert settle_lookup(tier, keys) == [LookupResult.HIT] * 12


def test_a_moved_slot_is_followed_for_stores_and_loads(make_tier, ctx, redis_cluster,
                                                       cluster_tier_options) -> None:
    tier = make_tier(**cluster_tier_options)
    stored, fresh = keys_on(redis_cluster, cluster_tier_options, 0, 2)
    data = fill_slot(ctx, 0)
    assert run(tier, JobKind.STORE, [stored], [0]) == {stored}
    for key in (stored, fresh):  # the tier still maps both slots to node 0
        redis_cluster.move_slot(key_slot(rkey(cluster_tier_options, key)), 0, 1)
    fill_slot(ctx, 1)
    assert run(tier, JobKind.STORE, [fresh], [1], 2) == {fresh}  # MOVED, read by redis-py
    assert run(tier, JobKind.LOAD, [stored], [2], 3) == {stored}  # MOVED, read by ReplyReader
    assert bytes(ctx.slot_view(2)) == data
    assert all(redis_cluster.client(1).exists(rkey(cluster_tier_options, k)) for k in (stored, fresh))


def test_an_ask_during_a_migration_is_followed(make_tier, ctx, redis_cluster, cluster_tier_options) -> None:
    tier = make_tier(**cluster_tier_options)
    [key] = keys_on(redis_cluster, cluster_tier_options, 2, 1)
    slot = key_slot(rkey(cluster_tier_options, key))
    redis_cluster.move_slot(slot, 2, 0, finish=False)
    try:
        data = fill_slot(ctx, 0)
        assert run(tier, JobKind.STORE, [key], [0]) == {key}  # absent on node 2: ASK node 0
        assert run(tier, JobKind.LOAD, [key], [1], 2) == {key}
        assert bytes(ctx.slot_view(1)) == data
    finally:
        redis_cluster.move_slot(slot, 2, 0)
    assert run(tier, JobKind.LOAD, [key], [2], 3) == {key}
    assert tier.counts().bad_chunks == 0


def test_a_bad_value_on_a_node_is_counted_deleted_and_fails_its_key(make_tier, ctx, redis_cluster,
                                                                    cluster_tier_options) -> None:
    tier = make_tier(**cluster_tier_options)
    [bad, good] = keys_on(redis_cluster, cluster_tier_options, 1, 2)
    fill_slot(ctx, 0)
    data = fill_slot(ctx, 1)
    assert run(tier, JobKind.STORE, [bad, good], [0, 1]) == {bad, good}
    node = redis_cluster.client(1)
    value = node.get(rkey(cluster_tier_options, bad))
    node.set(rkey(cluster_tier_options, bad), value[:-1] + bytes([value[-1] ^ 0xFF]))
    assert run(tier, JobKind.LOAD, [bad, good], [2, 3], 2) == {good}
    assert bytes(ctx.slot_view(3)) == data
    assert tier.counts()[ChunkError.CHECKSUM] == 1
    assert node.exists(rkey(cluster_tier_options, bad)) == 0


def test_a_killed_node_turns_into_misses_and_the_others_keep_serving(make_tier, ctx, redis_cluster,
                                                                      cluster_tier_options) -> None:
    tier = make_tier(**cluster_tier_options, socket_timeout_s=1.0, connect_timeout_s=0.5,
                     reconnect_interval_s=0.2, lookup_ttl_s=0.05)
    lost, kept = keys_on(redis_cluster, cluster_tier_options, 2, 3), \
        keys_on(redis_cluster, cluster_tier_options, 0, 3)
    for s in range(6):
        fill_slot(ctx, s)
    assert run(tier, JobKind.STORE, lost + kept, list(range(6))) == set(lost + kept)
    redis_cluster.kill(2)
    try:
        assert run(tier, JobKind.LOAD, lost + kept, list(range(6, 12)), 2) == set(kept)
        new_lost, new_kept = keys_on(redis_cluster, cluster_tier_options, 2, 1) + \
            keys_on(redis_cluster, cluster_tier_options, 1, 1)
        assert run(tier, JobKind.STORE, [new_lost, new_kept], [0, 1], 3) == {new_kept}
        counts = tier.counts()
        assert counts[TierCounter.STORE_FAILURES] == 1 and counts[TierCounter.LOAD_FAILURES] == 3
        assert counts[TierGauge.SERVER_DOWN] == 1
        answers = settle_lookup(tier, lost + kept, timeout_s=3)
        assert answers == [LookupResult.MISS] * 3 + [LookupResult.HIT] * 3
    finally:
        redis_cluster.restart(2)
    key = keys_on(redis_cluster, cluster_tier_options, 2, 1)[0]
    data = fill_slot(ctx, 0)
    deadline = time.monotonic() + 5
    while not run(tier, JobKind.STORE, [key], [0], 4):
        assert time.monotonic() < deadline, "the tier did not store on the restarted node again"
        time.sleep(0.1)
    # The restarted node kept nothing: its old chunks are misses, never garbage.
    assert run(tier, JobKind.LOAD, [key, *lost], [20, 21, 22, 23], 5) == {key}
    assert bytes(ctx.slot_view(20)) == data and tier.counts().bad_chunks == 0


def test_settings_that_do_not_name_a_cluster_say_which_and_why(ctx, redis_cluster,
                                                               redis_server: RedisServer) -> None:
    dead = f"redis://127.0.0.1:{free_port()}"
    cases: list[tuple[dict[str, Any], str, object, str]] = [
        ({"url": redis_server.url, "cluster": True}, "url", redis_server.url,
         "not a node of a Redis/Valkey Cluster"),
        ({"urls": [redis_server.url]}, "urls", redis_server.url, "not a node of a Redis/Valkey Cluster"),
        ({"url": redis_cluster.urls[0], "cluster": False}, "cluster", False,
         "is a node of a Redis/Valkey Cluster"),
        ({"urls": [dead]}, "urls", dead, "no seed node gave the cluster's slot map"),
        ({"urls": redis_cluster.urls, "cluster": False}, "urls", redis_cluster.urls, "cluster must be true"),
        ({"urls": redis_cluster.urls, "url": redis_cluster.urls[0]}, "urls", redis_cluster.urls,
         "either url or urls"),
        ({"urls": []}, "urls", [], "at least one seed"),
        ({"url": "unix:///tmp/x.sock", "cluster": True}, "url", "unix:///tmp/x.sock", "over TCP"),
        ({"url": redis_cluster.unix_url(0)}, "url", redis_cluster.unix_url(0), "over TCP"),
        ({}, "url", None, "required"),
    ]
    for options, key, value, why in cases:
        with pytest.raises(ConfigError, match=why) as e:
            RedisTier(ctx, **options).shutdown()
        assert (e.value.key, e.value.value) == (key, value), options


def test_any_node_or_a_seed_list_with_a_dead_seed_reaches_the_cluster(make_tier, ctx, redis_cluster) -> None:
    dead = f"redis://127.0.0.1:{free_port()}"
    for options in ({"url": redis_cluster.urls[1]}, {"urls": [dead, redis_cluster.urls[2]]}):
        tier = make_tier(**options, key_prefix=fresh_prefix())
        keys = [random_key() for _ in range(6)]
        for s in range(6):
            fill_slot(ctx, s)
        assert run(tier, JobKind.STORE, keys, list(range(6))) == set(keys)


def test_tier_bench_runs_against_the_cluster_in_a_tier_process(cluster_tier_options) -> None:
    report = run_tier_bench("redis", cluster_tier_options, chunk_bytes=64 << 10, chunks=8, threads=2)
    assert report["tier_counts"]["tier_counter"][TierCounter.LOADED.value] == 8
    assert report["store_gib_s"] > 0 and report["tier_counts"]["tier_gauge"][TierGauge.SERVER_DOWN.value] == 0
