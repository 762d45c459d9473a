"""The redis tier against real servers: stored format, bad values, sharing, restarts, the server's own
eviction and TTL, fail-fast setup, and the contract suite again on Valkey."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.exceptions import BusyLoadingError, MovedError, ResponseError

from kvtier.bench.tier_bench import run_tier_bench
from kvtier.errors import ConfigError
from kvtier.format.chunks import ChunkError, TierEventKind
from kvtier.host.region import HostRegion
from kvtier.ops.metrics import TierCounter, TierGauge
from kvtier.tiers.base import Job, JobKind, LookupResult, TierContext
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.process import TierProcess, TierSpec
from kvtier.tiers.redis.tier import RedisTier
from kvtier.tiers.redis.wire import ReplyReader, redact_url
from tests.conftest import (
    LAYOUT_FP,
    ROW_BYTES,
    SLOTS,
    fill_slot,
    random_key,
    settle_lookup,
    wait_jobs,
    wait_until,
)
from tests.services.redis_server import RedisServer, free_port, fresh_prefix
from tests.tiers.contract_suite import ContractSuite

MakeTier = Callable[..., RedisTier]


@pytest.fixture
def make_tier(ctx: TierContext) -> Iterator[MakeTier]:
    """Build in-process redis tiers over `ctx`; all shut down after the test."""
    built: list[RedisTier] = []

    def make(**options: Any) -> RedisTier:
        tier = RedisTier(ctx, **options)
        built.append(tier)
        return tier

    yield make
    for tier in built:
        tier.shutdown()


def client(options: dict[str, Any]) -> redis.Redis:
    return redis.Redis.from_url(options["url"])


def value_key(options: dict[str, Any], key: bytes) -> str:
    return f"{options['key_prefix']}:{LAYOUT_FP}:{key.hex()}"


def store(tier: RedisTier | TierProcess, ctx: TierContext, keys: list[bytes], job_id: int = 1) -> None:
    tier.submit_store(Job(job_id, JobKind.STORE, tuple(keys), tuple(range(len(keys)))))
    [result] = wait_jobs(tier, 1)
    assert result.success


def test_a_value_is_the_chunk_header_then_the_row(make_tier, ctx, redis_tier_options) -> None:
    tier = make_tier(**redis_tier_options)
    key = random_key()
    row = fill_slot(ctx, 0)
    store(tier, ctx, [key])
    value = client(redis_tier_options).get(value_key(redis_tier_options, key))
    assert value == chunkfmt.header_bytes(key, bytes.fromhex(LAYOUT_FP), row) + row
    assert tier.counts()[TierCounter.STORED] == 1 and tier.counts()[TierGauge.HIREDIS] == 1


def _corrupt(kind: str, value: bytes, other: bytes) -> bytes:
    if kind == "checksum":
        flipped = value[-1] ^ 0xFF
        return value[:-1] + bytes([flipped])
    if kind == "wrong_length":
        return value[: chunkfmt.HEADER_BYTES + 100]
    if kind == "short":
        return b"not a chunk"
    if kind == "foreign_format":
        return os.urandom(len(value))
    if kind == "oversized":
        return value + os.urandom(300_000)
    return other  # wrong_key: a valid chunk of another key under this key's name


@pytest.mark.parametrize(("kind", "reason"), [
    ("checksum", ChunkError.CHECKSUM), ("wrong_length", ChunkError.LENGTH), ("oversized", ChunkError.LENGTH),
    ("short", ChunkError.SHORT), ("foreign_format", ChunkError.MAGIC), ("wrong_key", ChunkError.KEY),
], ids=lambda v: getattr(v, "value", v))
def test_a_bad_value_is_counted_deleted_and_fails_its_key(make_tier, ctx, redis_tier_options,
                                                           kind: str, reason: ChunkError) -> None:
    tier = make_tier(**redis_tier_options, lookup_ttl_s=0.05)
    key, other, good = random_key(), random_key(), random_key()
    fill_slot(ctx, 0)
    fill_slot(ctx, 1)
    data = fill_slot(ctx, 2)
    store(tier, ctx, [key, other, good])
    r = client(redis_tier_options)
    name = value_key(redis_tier_options, key)
    r.set(name, _corrupt(kind, r.get(name), r.get(value_key(redis_tier_options, other))))
    tier.take_events()

    tier.submit_load(Job(2, JobKind.LOAD, (key, good), (8, 9)))
    [result] = wait_jobs(tier, 1)
    assert not result.success and result.successful_keys == (good,)
    assert bytes(ctx.slot_view(9)) == data
    counts = tier.counts()
    assert counts.bad_chunks == 1 and counts[reason] == 1
    assert r.exists(name) == 0
    assert settle_lookup(tier, [key, good]) == [LookupResult.MISS, LookupResult.HIT]
    removed = {k for e in tier.take_events() if e.kind is TierEventKind.REMOVED for k in e.keys}
    assert removed == {key}


def test_rounds_sent_before_the_previous_is_read_keep_every_reply_in_order(make_tier, ctx,
                                                                           redis_tier_options) -> None:
    # One thread, one key per round: each round is sent before the one before it is read, and the
    # bad value's delete goes over its own connection meanwhile.
    tier = make_tier(**redis_tier_options, io_threads=1, pipeline_depth=1, lookup_ttl_s=0.05)
    keys = [random_key() for _ in range(12)]
    rows = [fill_slot(ctx, i) for i in range(12)]
    store(tier, ctx, keys)
    r = client(redis_tier_options)
    bad = value_key(redis_tier_options, keys[5])
    r.set(bad, _corrupt("checksum", r.get(bad), b""))
    tier.submit_load(Job(2, JobKind.LOAD, tuple(keys), tuple(range(16, 28))))
    [result] = wait_jobs(tier, 1)
    assert result.successful_keys == tuple(k for i, k in enumerate(keys) if i != 5)
    assert all(bytes(ctx.slot_view(16 + i)) == row for i, row in enumerate(rows) if i != 5)
    assert tier.counts()[ChunkError.CHECKSUM] == 1 and r.exists(bad) == 0


def test_the_reply_reader_gives_what_redis_py_gives_and_raises_its_connection_errors() -> None:
    ours, server = socket.socketpair()
    with ours, server:
        server.sendall(b"+OK\r\n:3\r\n$-1\r\n_\r\n$5\r\nhello\r\n*2\r\n$1\r\na\r\n*1\r\n:7\r\n"
                       b"%1\r\n$1\r\nk\r\n#t\r\n-MOVED 3999 127.0.0.1:6381\r\n-ERR nope\r\n"
                       b"-LOADING busy\r\n")
        reader = ReplyReader(ours)
        expected = [b"OK", 3, None, None, b"hello", [b"a", [7]], {b"k": True}]
        assert [reader.reply() for _ in range(7)] == expected
        moved = reader.reply()
        assert isinstance(moved, MovedError) and (moved.slot_id, moved.port) == (3999, 6381)
        assert isinstance(reader.reply(), ResponseError)
        with pytest.raises(BusyLoadingError):
            reader.reply()
        assert reader.idle()


def test_a_value_of_another_type_fails_its_key_only(make_tier, ctx, redis_tier_options) -> None:
    tier = make_tier(**redis_tier_options)
    key, good = random_key(), random_key()
    data = fill_slot(ctx, 1)
    tier.submit_store(Job(1, JobKind.STORE, (good,), (1,)))
    assert wait_jobs(tier, 1)[0].success
    client(redis_tier_options).rpush(value_key(redis_tier_options, key), b"x")
    tier.submit_load(Job(2, JobKind.LOAD, (key, good), (5, 6)))
    [result] = wait_jobs(tier, 1)
    assert result.successful_keys == (good,) and bytes(ctx.slot_view(6)) == data
    assert tier.counts().bad_chunks == 0 and tier.counts()[TierGauge.SERVER_DOWN] == 0


@pytest.mark.parametrize("protocol", [2, 3])
def test_resp2_and_resp3_round_trip_and_miss(make_tier, ctx, redis_server, protocol: int) -> None:
    tier = make_tier(url=f"{redis_server.url}?protocol={protocol}", key_prefix=fresh_prefix())
    key = random_key()
    data = fill_slot(ctx, 0)
    store(tier, ctx, [key])
    tier.submit_load(Job(2, JobKind.LOAD, (random_key(), key), (3, 4)))
    [result] = wait_jobs(tier, 1)
    assert result.successful_keys == (key,) and bytes(ctx.slot_view(4)) == data
    assert tier.counts()[TierCounter.LOAD_MISSES] == 1


def test_a_bad_value_replaced_meanwhile_by_a_good_one_is_kept(make_tier, ctx, redis_tier_options) -> None:
    tier = make_tier(**redis_tier_options)
    key = random_key()
    fill_slot(ctx, 0)
    store(tier, ctx, [key])
    tier._chunks.delete_bad([(key, hashlib.sha1(b"the bad value that was read").hexdigest())])
    assert client(redis_tier_options).exists(value_key(redis_tier_options, key)) == 1


def _tier_process(region: HostRegion, options: dict[str, Any], **kw: Any) -> TierProcess:
    spec = TierSpec(
        tier_name="redis", type="redis", module_path=None, options=options,
        config_key="secondary_tiers[0]", region_name=region.name, shm_dir="/dev/shm",
        row_bytes=ROW_BYTES, num_slots=SLOTS, layout_fingerprint=LAYOUT_FP,
    )
    return TierProcess(spec, job_timeout_s=20, **kw)


def test_two_instances_share_one_server_and_prefix(region, ctx, redis_tier_options) -> None:
    keys = [random_key() for _ in range(4)]
    rows = [fill_slot(ctx, s) for s in range(4)]
    region_b = HostRegion.create(ROW_BYTES * SLOTS)
    a = _tier_process(region, redis_tier_options)
    b = _tier_process(region_b, redis_tier_options)
    try:
        a.start()
        b.start()
        store(a, ctx, keys)
        assert settle_lookup(b, keys) == [LookupResult.HIT] * 4
        b.submit_load(Job(1, JobKind.LOAD, tuple(keys), (10, 11, 12, 13)))
        [result] = wait_jobs(b, 1)
        assert result.success
        view = region_b.buf
        for i, row in enumerate(rows):
            assert bytes(view[(10 + i) * ROW_BYTES : (11 + i) * ROW_BYTES]) == row
    finally:
        a.shutdown()
        b.shutdown()
        region_b.close()


def test_a_restarted_server_fails_jobs_as_values_then_the_tier_recovers(
    make_tier, ctx, redis_server_factory, caplog
) -> None:
    server: RedisServer = redis_server_factory()
    tier = make_tier(url=server.url, key_prefix=fresh_prefix(), socket_timeout_s=1.0,
                     connect_timeout_s=0.5, reconnect_interval_s=0.2, lookup_ttl_s=0.05)
    before = random_key()
    fill_slot(ctx, 0)
    store(tier, ctx, [before])

    server.kill()
    caplog.set_level(logging.WARNING, logger="kvtier.tier")
    keys = [random_key() for _ in range(20)]
    for j, key in enumerate(keys):
        kind = JobKind.STORE if j % 2 else JobKind.LOAD
        (tier.submit_store if j % 2 else tier.submit_load)(Job(10 + j, kind, (key, before), (j, 31)))
    results = wait_jobs(tier, len(keys), timeout_s=5)
    assert all(not r.success and r.successful_keys == () for r in results)
    assert settle_lookup(tier, [before], timeout_s=2) == [LookupResult.MISS]
    assert tier.counts()[TierCounter.CONNECTION_ERRORS] >= 1
    assert len(caplog.records) <= 3, [r.getMessage() for r in caplog.records]

    server.start()
    key = random_key()
    data = fill_slot(ctx, 0)
    deadline = time.monotonic() + 10
    while True:
        tier.submit_store(Job(100, JobKind.STORE, (key,), (0,)))
        if wait_jobs(tier, 1)[0].success:
            break
        assert time.monotonic() < deadline, "the tier did not recover after the server came back"
        time.sleep(0.1)
    tier.submit_load(Job(101, JobKind.LOAD, (key, before), (5, 6)))
    [result] = wait_jobs(tier, 1)
    # The restarted server kept nothing: the old chunk is a miss, never garbage.
    assert result.successful_keys == (key,) and bytes(ctx.slot_view(5)) == data
    assert tier.counts().bad_chunks == 0


def test_a_hung_server_fails_jobs_within_the_socket_timeout(make_tier, ctx, redis_server_factory) -> None:
    server: RedisServer = redis_server_factory()
    tier = make_tier(url=server.url, key_prefix=fresh_prefix(), socket_timeout_s=0.5,
                     reconnect_interval_s=0.2, lookup_ttl_s=0.05)
    key = random_key()
    data = fill_slot(ctx, 0)
    assert server.proc is not None
    server.proc.send_signal(signal.SIGSTOP)
    try:
        # The store fails as a value, and the lookup answers, while the server is still stopped
        # (a store without the socket timeout would wait for the server, past the deadline).
        tier.submit_store(Job(1, JobKind.STORE, (key,), (0,)))
        [result] = wait_jobs(tier, 1, timeout_s=3)
        assert not result.success
        assert settle_lookup(tier, [key], timeout_s=3) == [LookupResult.MISS]
    finally:
        server.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 5
    while True:
        tier.submit_store(Job(2, JobKind.STORE, (key,), (0,)))
        if wait_jobs(tier, 1)[0].success:
            break
        assert time.monotonic() < deadline
        time.sleep(0.1)
    tier.submit_load(Job(3, JobKind.LOAD, (key,), (1,)))
    assert wait_jobs(tier, 1)[0].success and bytes(ctx.slot_view(1)) == data


def test_a_job_with_an_invalid_slot_fails_as_a_value(make_tier, ctx, redis_tier_options) -> None:
    tier = make_tier(**redis_tier_options)
    tier.submit_store(Job(1, JobKind.STORE, (random_key(),), (SLOTS + 5,)))
    [result] = wait_jobs(tier, 1)
    assert not result.success
    key = random_key()
    fill_slot(ctx, 0)
    store(tier, ctx, [key], job_id=2)


def test_the_servers_own_maxmemory_eviction_gives_misses_never_bad_data(
    make_tier, ctx, redis_server_factory
) -> None:
    server = redis_server_factory("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    options = {"url": server.url, "key_prefix": fresh_prefix()}
    tier = make_tier(**options, lookup_ttl_s=0.05)
    stored: dict[bytes, str] = {}
    batch = SLOTS // 2
    for j in range(40):  # 640 chunks of 16 KiB: about 10 MiB into 4 MiB
        keys = [random_key() for _ in range(batch)]
        for s, key in enumerate(keys):
            stored[key] = hashlib.sha256(fill_slot(ctx, s)).hexdigest()
        store(tier, ctx, keys, job_id=j)
    evicted = client(options).info("stats")["evicted_keys"]
    assert evicted > 0
    loaded = missed = 0
    keys = list(stored)
    for j in range(0, len(keys), batch):
        part = keys[j : j + batch]
        tier.submit_load(Job(1000 + j, JobKind.LOAD, tuple(part), tuple(range(batch, batch + len(part)))))
        [result] = wait_jobs(tier, 1)
        for i, key in enumerate(part):
            if key in result.successful_keys:
                loaded += 1
                assert hashlib.sha256(ctx.slot_view(batch + i)).hexdigest() == stored[key]
            else:
                missed += 1
    counts = tier.counts()
    assert loaded > 0 and missed > 0
    assert counts.bad_chunks == 0 and counts[TierCounter.LOAD_MISSES] == missed


def test_ttl_expires_values_and_loads_refresh_it(make_tier, ctx, redis_tier_options) -> None:
    """Values carry the tier's TTL (the server's own expiry) and a load sets it afresh. Time is the
    server's: the test ages a value by shortening its TTL on the server, rather than waiting."""
    tier = make_tier(**redis_tier_options, ttl_s=3600, lookup_ttl_s=0.05)
    kept, dropped = random_key(), random_key()
    fill_slot(ctx, 0)
    fill_slot(ctx, 1)
    store(tier, ctx, [kept, dropped])
    r = client(redis_tier_options)
    names = [value_key(redis_tier_options, key) for key in (kept, dropped)]
    assert all(3_590_000 < r.pttl(name) <= 3_600_000 for name in names)
    r.pexpire(names[0], 60_000)  # 59 minutes old
    r.pexpire(names[1], 1)  # at its end
    tier.submit_load(Job(2, JobKind.LOAD, (kept,), (5,)))
    assert wait_jobs(tier, 1)[0].success
    assert r.pttl(names[0]) > 3_590_000  # the load gave it the whole TTL again
    wait_until(lambda: r.exists(names[1]) == 0, "the server expired the value")
    wait_until(lambda: tier.lookup([dropped]) == [LookupResult.MISS], "the expired value is a miss")
    assert settle_lookup(tier, [kept, dropped]) == [LookupResult.HIT, LookupResult.MISS]


def test_a_unix_socket_url_works_and_its_query_cannot_starve_the_threads(make_tier, ctx,
                                                                         redis_server) -> None:
    url = f"{redis_server.unix_url}?max_connections=1&socket_timeout=3"
    tier = make_tier(url=url, key_prefix=fresh_prefix(), io_threads=3)
    key = random_key()
    data = fill_slot(ctx, 0)
    store(tier, ctx, [key])
    tier.submit_load(Job(2, JobKind.LOAD, (key,), (3,)))
    assert wait_jobs(tier, 1)[0].success and bytes(ctx.slot_view(3)) == data


def test_rediss_with_the_servers_ca_works_and_an_unverifiable_server_is_refused(
    make_tier, ctx, redis_server_factory, tmp_path
) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key_file), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    tls_port = free_port()
    redis_server_factory("--tls-port", str(tls_port), "--tls-cert-file", str(cert),
                         "--tls-key-file", str(key_file), "--tls-ca-cert-file", str(cert),
                         "--tls-auth-clients", "no")
    url = f"rediss://127.0.0.1:{tls_port}/0"
    tier = make_tier(url=f"{url}?ssl_ca_certs={cert}", key_prefix=fresh_prefix())
    key = random_key()
    data = fill_slot(ctx, 0)
    store(tier, ctx, [key])
    tier.submit_load(Job(2, JobKind.LOAD, (key,), (3,)))
    assert wait_jobs(tier, 1)[0].success and bytes(ctx.slot_view(3)) == data
    with pytest.raises(ConfigError, match="certificate verify failed") as e:
        RedisTier(ctx, url=url)
    assert e.value.key == "url"


@pytest.mark.parametrize("url", ["http://127.0.0.1:1", "redis://127.0.0.1:{port}",
                                 "unix:///nonexistent/kvtier.sock", "redis://127.0.0.1:notaport", 42])
def test_a_bad_or_unreachable_url_is_a_config_error(ctx, url: object) -> None:
    if isinstance(url, str):
        url = url.format(port=free_port())
    with pytest.raises(ConfigError) as e:
        RedisTier(ctx, url=url)
    assert e.value.key == "url"


def test_a_wrong_password_is_a_config_error_that_never_shows_it(
    region, ctx, redis_server_factory, caplog
) -> None:
    server = redis_server_factory("--requirepass", "right-Pa55word")
    port = server.port
    caplog.set_level(logging.DEBUG)
    for url in (f"redis://:wr0ng-Pa55word@127.0.0.1:{port}", f"redis://127.0.0.1:{port}",
                f"redis://127.0.0.1:{port}?password=wr0ng-Pa55word"):
        with pytest.raises(ConfigError) as e:
            RedisTier(ctx, url=url)
        assert e.value.key == "url" and "wr0ng" not in str(e.value)
        assert "uthentication" in str(e.value)
    proc = _tier_process(region, {"url": f"redis://:wr0ng-Pa55word@127.0.0.1:{port}"})
    with pytest.raises(ConfigError) as e:
        proc.start()
    assert e.value.key == "secondary_tiers[0].url" and "wr0ng" not in str(e.value)

    tier = RedisTier(ctx, url=f"redis://default:right-Pa55word@127.0.0.1:{port}",
                     key_prefix=fresh_prefix())
    try:
        key = random_key()
        fill_slot(ctx, 0)
        store(tier, ctx, [key])
        server.kill()
        tier.submit_store(Job(2, JobKind.STORE, (key,), (0,)))
        assert not wait_jobs(tier, 1)[0].success
        assert "Pa55word" not in repr(tier) and "Pa55word" not in str(tier.counts())
    finally:
        tier.shutdown()
    assert caplog.records and "Pa55word" not in caplog.text


def test_redact_url_hides_passwords_only() -> None:
    assert redact_url("redis://user:secret@h:6379/0") == "redis://user:***@h:6379/0"
    assert redact_url("rediss://:secret@h") == "rediss://:***@h"
    assert redact_url("redis://h:1/2?password=secret&db=3") == "redis://h:1/2?password=***&db=3"
    assert redact_url("unix:///run/redis.sock") == "unix:///run/redis.sock"
    assert redact_url("unix://:secret@/run/redis.sock?db=1") == "unix://:***@/run/redis.sock?db=1"


@pytest.mark.parametrize(("option", "value"), [
    ("key_prefix", ""), ("ttl_s", 0), ("io_threads", 0), ("pipeline_depth", 1.5),
    ("batch_bytes", -1), ("socket_timeout_s", float("nan")), ("lookup_wait_s", "1"),
])
def test_bad_options_name_themselves(ctx, redis_tier_options, option: str, value: object) -> None:
    with pytest.raises(ConfigError) as e:
        RedisTier(ctx, **{**redis_tier_options, option: value})
    assert e.value.key == option


def test_tier_bench_runs_against_redis(redis_tier_options) -> None:
    report = run_tier_bench("redis", redis_tier_options, chunk_bytes=64 << 10, chunks=8, threads=2)
    assert report["store_gib_s"] > 0 and report["load_gib_s"] > 0
    assert report["tier_counts"]["tier_counter"][TierCounter.LOADED.value] == 8


class TestContractOnValkey(ContractSuite):
    """Every contract test again, against a valkey-server (skipped when Valkey is not installed)."""

    @pytest.fixture(params=["inproc", "process"])
    def tier(self, request, ctx, region, valkey_tier_options) -> Iterator[object]:
        if request.param == "inproc":
            t = RedisTier(ctx, **valkey_tier_options)
            yield t
            t.shutdown()
            return
        proc = _tier_process(region, valkey_tier_options)
        proc.start()
        yield proc
        proc.shutdown()

