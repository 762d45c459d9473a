"""The obj tier against a real SeaweedFS S3 server: round trips, bad objects, sharing between tier
processes, a server killed and restarted, and the start-up probe (credentials, bucket, endpoint)."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.throttle_proxy import ThrottleProxy
from kvtier.bench.chaos.services import free_ports
from kvtier.errors import ConfigError
from kvtier.format.chunks import ChunkError, TierEventKind
from kvtier.host import generations
from kvtier.host.region import HostRegion
from kvtier.ops.metrics import TierCounter
from kvtier.tiers.base import Job, JobKind, LookupResult, TierContext
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.obj.s3_client import make_client
from kvtier.tiers.obj.tier import ObjTier
from kvtier.tiers.process import TierProcess, TierSpec
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
from tests.services.s3 import SeaweedServer

OBJECT_BYTES = chunkfmt.HEADER_BYTES + ROW_BYTES
OTHER_FP = "ffeeddccbbaa99887766554433221100"
LOGGER = "kvtier.tier"


@pytest.fixture
def make_tier(ctx: TierContext) -> Iterator[Any]:
    """Build in-process obj tiers on the test's context; all are shut down after the test."""
    built: list[ObjTier] = []

    def make(options: dict[str, Any], **extra: Any) -> ObjTier:
        tier = ObjTier(ctx, **{**options, **extra})
        built.append(tier)
        return tier

    yield make
    for tier in built:
        tier.shutdown()


def object_name(key: bytes, fp: str = LAYOUT_FP) -> str:
    return f"kvtier/{fp}/{key.hex()}"


def store(tier: Any, ctx: TierContext, keys: list[bytes], job_id: int = 1) -> list[bytes]:
    data = [fill_slot(ctx, s) for s in range(len(keys))]
    tier.submit_store(Job(job_id, JobKind.STORE, tuple(keys), tuple(range(len(keys)))))
    [result] = wait_jobs(tier, 1)
    assert result.success
    return data


def load(tier: Any, keys: list[bytes], job_id: int = 2, first_slot: int = 16) -> Any:
    slots = tuple(range(first_slot, first_slot + len(keys)))
    tier.submit_load(Job(job_id, JobKind.LOAD, tuple(keys), slots))
    [result] = wait_jobs(tier, 1, timeout_s=30)
    return result


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# ---- round trip and stored form ---------------------------------------------------------------


def test_an_object_is_the_chunk_header_then_the_row(make_tier, ctx, s3_server, s3_tier_options) -> None:
    tier = make_tier(s3_tier_options)
    keys = [random_key() for _ in range(3)]
    data = store(tier, ctx, keys)
    client = s3_server.client()
    for key, row in zip(keys, data, strict=True):
        body = client.get_object(Bucket=s3_tier_options["bucket"], Key=object_name(key))["Body"].read()
        assert len(body) == OBJECT_BYTES and body[chunkfmt.HEADER_BYTES :] == row
        assert chunkfmt.verify(body[: chunkfmt.HEADER_BYTES], body[chunkfmt.HEADER_BYTES :], key,
                               bytes.fromhex(LAYOUT_FP)) is None
    for s in range(16, 19):
        ctx.slot_view(s)[:] = bytes(ROW_BYTES)
    assert load(tier, keys).success
    assert [bytes(ctx.slot_view(16 + i)) for i in range(3)] == data
    counts = tier.counts()
    assert counts[TierCounter.STORED] == 3 and counts[TierCounter.LOADED] == 3
    assert tier.usage().bytes_used == 3 * OBJECT_BYTES


def test_lookups_are_asynchronous_and_misses_expire(make_tier, ctx, s3_server, s3_tier_options) -> None:
    """A lookup answers RETRY and asks the server in the background; a miss is remembered for
    `negative_ttl_s` (to the boundary, on a set clock: test_obj_index.py), then asked once more, so
    another writer's object is found."""
    tier = make_tier(s3_tier_options, negative_ttl_s=0.3)
    key = random_key()
    assert tier.lookup([key]) == [LookupResult.RETRY]
    assert settle_lookup(tier, [key]) == [LookupResult.MISS]
    assert tier.counts()[TierCounter.HEADS] == 1
    header = chunkfmt.header_bytes(key, bytes.fromhex(LAYOUT_FP), bytes(ROW_BYTES))
    s3_server.client().put_object(Bucket=s3_tier_options["bucket"], Key=object_name(key),
                                  Body=header + bytes(ROW_BYTES))
    wait_until(lambda: tier.lookup([key]) == [LookupResult.HIT], "another writer's object found")
    assert tier.counts()[TierCounter.HEADS] == 2  # one HEAD when the miss expired, not one per poll
    assert load(tier, [key]).success


def test_credentials_may_come_from_the_environment(make_tier, ctx, s3_tier_options, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_tier_options.pop("access_key_id"))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_tier_options.pop("secret_access_key"))
    tier = make_tier(s3_tier_options)
    key = random_key()
    data = store(tier, ctx, [key])
    assert load(tier, [key]).success and bytes(ctx.slot_view(16)) == data[0]


def _listed(tier: ObjTier) -> None:
    """Wait for the start-up listing of a tier with max_bytes."""
    deadline = time.monotonic() + 10
    while tier.counts()[TierCounter.LISTINGS] < 1:
        assert time.monotonic() < deadline, "the start-up listing did not finish"
        time.sleep(0.01)


def test_max_bytes_evicts_the_least_recently_used_objects(make_tier, ctx, s3_server,
                                                          s3_tier_options) -> None:
    tier = make_tier(s3_tier_options, max_bytes=2 * OBJECT_BYTES)
    _listed(tier)
    keys = [random_key() for _ in range(3)]
    for i, key in enumerate(keys):
        store(tier, ctx, [key], job_id=i)
    client, bucket = s3_server.client(), s3_tier_options["bucket"]
    assert [_exists(client, bucket, object_name(k)) for k in keys] == [False, True, True]
    removed = {k for e in tier.take_events() if e.kind is TierEventKind.REMOVED for k in e.keys}
    assert removed == {keys[0]}
    assert tier.counts()[TierCounter.EVICTIONS] == 1 and tier.usage().bytes_used == 2 * OBJECT_BYTES
    # A restarted instance learns the existing objects and keeps the bound.
    tier.shutdown()
    again = make_tier(s3_tier_options, max_bytes=2 * OBJECT_BYTES)
    _listed(again)
    assert again.usage().chunks >= 2
    newest = random_key()
    store(again, ctx, [newest], job_id=9)
    # SeaweedFS may still list the object deleted above for a moment (it is then evicted again), and
    # keys[1] and keys[2] may share a last-modified second: either may be the one evicted.
    assert again.usage().chunks == 2 and again.counts()[TierCounter.EVICTIONS] >= 1
    assert _exists(client, bucket, object_name(newest))


def _exists(client: Any, bucket: str, name: str) -> bool:
    try:
        client.head_object(Bucket=bucket, Key=name)
        return True
    except client.exceptions.ClientError:
        return False


# ---- bad objects --------------------------------------------------------------------------------


def _bad_body(kind: str, key: bytes, row: bytes) -> bytes:
    fp = bytes.fromhex(LAYOUT_FP)
    good = chunkfmt.header_bytes(key, fp, row) + row
    if kind == "checksum":
        return good[:-1] + bytes([good[-1] ^ 1])
    if kind == "truncated":
        return good[: chunkfmt.HEADER_BYTES + ROW_BYTES // 2]
    if kind == "short":
        return good[:100]
    if kind == "foreign_format":
        return os.urandom(OBJECT_BYTES)
    if kind == "wrong_layout":
        return chunkfmt.header_bytes(key, bytes.fromhex(OTHER_FP), row) + row
    if kind == "wrong_key":
        return chunkfmt.header_bytes(random_key(), fp, row) + row
    raise ValueError(kind)


@pytest.mark.parametrize("kind, reason", [
    ("checksum", ChunkError.CHECKSUM), ("truncated", ChunkError.LENGTH), ("short", ChunkError.SHORT),
    ("foreign_format", ChunkError.MAGIC), ("wrong_layout", ChunkError.LAYOUT), ("wrong_key", ChunkError.KEY),
], ids=lambda v: getattr(v, "value", v))
def test_a_bad_object_is_counted_deleted_and_fails_its_key(make_tier, ctx, s3_server, s3_tier_options,
                                                           kind: str, reason: ChunkError, caplog) -> None:
    tier = make_tier(s3_tier_options)
    good, bad = random_key(), random_key()
    data = store(tier, ctx, [good, bad])
    client, bucket = s3_server.client(), s3_tier_options["bucket"]
    client.put_object(Bucket=bucket, Key=object_name(bad), Body=_bad_body(kind, bad, data[1]))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        result = load(tier, [bad, good])
    assert not result.success and result.successful_keys == (good,)
    assert bytes(ctx.slot_view(17)) == data[0]
    counts = tier.counts()
    assert counts.bad_chunks == 1 and counts[reason] == 1
    assert client.list_objects_v2(Bucket=bucket, Prefix=object_name(bad)).get("KeyCount") == 0
    assert any(e.kind is TierEventKind.REMOVED and bad in e.keys for e in tier.take_events())
    assert settle_lookup(tier, [bad, good]) == [LookupResult.MISS, LookupResult.HIT]
    assert len([m for m in warnings(caplog) if reason.value in m]) == 1


def test_invalid_keys_fail_as_values(make_tier, ctx, s3_tier_options) -> None:
    tier = make_tier(s3_tier_options)
    fill_slot(ctx, 0)
    tier.submit_store(Job(1, JobKind.STORE, (b"short",), (0,)))
    tier.submit_load(Job(2, JobKind.LOAD, (b"short",), (1,)))
    assert [r.success for r in wait_jobs(tier, 2)] == [False, False]


# ---- several instances --------------------------------------------------------------------------


def _tier_process(region: HostRegion, options: dict[str, Any], **kw: Any) -> TierProcess:
    spec = TierSpec(
        tier_name="obj", type="obj", module_path=None, options=options, config_key="secondary_tiers[0]",
        region_name=region.name, shm_dir=os.path.dirname(region.path), row_bytes=ROW_BYTES,
        num_slots=SLOTS, layout_fingerprint=LAYOUT_FP,
    )
    return TierProcess(spec, job_timeout_s=30, **kw)


def test_two_tier_processes_share_one_bucket(region, ctx, s3_tier_options) -> None:
    other = HostRegion.create(ROW_BYTES * SLOTS)
    a, b = _tier_process(region, s3_tier_options), _tier_process(other, s3_tier_options)
    try:
        a.launch()
        b.launch()
        a.wait_ready()
        b.wait_ready()
        keys = [random_key() for _ in range(4)]
        data = store(a, ctx, keys)
        assert settle_lookup(b, keys) == [LookupResult.HIT] * 4
        assert load(b, keys, first_slot=8).success
        other_ctx = TierContext(other.buf, ROW_BYTES, SLOTS, LAYOUT_FP, "other")
        assert [bytes(other_ctx.slot_view(8 + i)) for i in range(4)] == data
    finally:
        a.shutdown()
        b.shutdown()
        other.close()


# ---- a server that dies and comes back ----------------------------------------------------------


def test_a_killed_server_fails_jobs_as_values_then_the_tier_recovers(tmp_path: Path, ctx, caplog) -> None:
    server = SeaweedServer(tmp_path)
    server.start()
    tier: ObjTier | None = None
    try:
        options = server.bucket_options(server.new_bucket())
        tier = ObjTier(ctx, **options, connect_timeout_s=1.0, read_timeout_s=3.0)
        before = [random_key() for _ in range(4)]
        data = store(tier, ctx, before)
        # Kill the server with a burst of stores in flight.
        keys = [random_key() for _ in range(8)]
        for s in range(8):
            fill_slot(ctx, 8 + s)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            tier.submit_store(Job(10, JobKind.STORE, tuple(keys), tuple(range(8, 16))))
            server.kill()
            tier.submit_load(Job(11, JobKind.LOAD, tuple(before), tuple(range(16, 20))))
            fresh = [random_key() for _ in range(20)]
            # A lookup never waits for the dead server: it asks in the background.
            assert tier.lookup(fresh) == [LookupResult.RETRY] * len(fresh)
            results = {r.job_id: r for r in wait_jobs(tier, 2, timeout_s=15)}
            assert not results[11].success and results[11].successful_keys == ()
            assert settle_lookup(tier, fresh) == [LookupResult.MISS] * len(fresh)
        # One line per cause, however many chunks it hit.
        lines = warnings(caplog)
        assert 0 < len(lines) <= 6, lines

        # Recovered: loads, then stores, succeed again (a restarted SeaweedFS serves reads before
        # its volume takes writes: on a busy machine its first store may still time out).
        server.restart()
        deadline = time.monotonic() + 20
        for job in (Job(12, JobKind.LOAD, tuple(before), tuple(range(16, 20))),
                    Job(13, JobKind.STORE, (random_key(),), (0,))):
            while True:
                (tier.submit_load if job.kind is JobKind.LOAD else tier.submit_store)(job)
                if wait_jobs(tier, 1, timeout_s=15)[0].success:
                    break
                assert time.monotonic() < deadline, f"the tier did not recover: {job.kind.name}"
                time.sleep(0.2)
        assert [bytes(ctx.slot_view(16 + i)) for i in range(4)] == data
    finally:
        if tier is not None:
            tier.shutdown()
        server.kill()


def test_a_hung_server_fails_jobs_within_the_timeouts_and_lookups_answer(tmp_path: Path, ctx) -> None:
    server = SeaweedServer(tmp_path)
    server.start()
    tier: ObjTier | None = None
    try:
        tier = ObjTier(ctx, **server.bucket_options(server.new_bucket()), connect_timeout_s=1.0,
                       read_timeout_s=1.5, io_threads=4)
        before = [random_key() for _ in range(4)]
        store(tier, ctx, before)
        server.pause()
        keys = [random_key() for _ in range(16)]
        # A lookup returns while the server answers nothing: every key RETRY, its HEAD queued (one
        # that waited for its HEAD would get an answer, or a failure: a MISS).
        assert tier.lookup(keys) == [LookupResult.RETRY] * len(keys)
        tier.submit_load(Job(5, JobKind.LOAD, tuple(keys), tuple(range(16, 32))))
        # The load fails as a value while the server is still stopped: two attempts of one read
        # timeout for the keys in flight, then the server is known down and the backlog fails at
        # once (a read timeout per key would take 16 keys x 2 attempts x 1.5 s / 2 threads = 24 s,
        # past this wait's deadline).
        [result] = wait_jobs(tier, 1, timeout_s=15)
        assert not result.success
        server.resume()
        deadline = time.monotonic() + 20
        while not load(tier, before, job_id=6).success:
            assert time.monotonic() < deadline, "the tier did not recover"
            time.sleep(0.2)
    finally:
        server.resume()
        if tier is not None:
            tier.shutdown()
        server.kill()


# ---- the start-up probe ---------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["access_key_id", "secret_access_key"])
def test_wrong_credentials_are_a_config_error_that_never_shows_them(ctx, s3_tier_options, option,
                                                                    caplog) -> None:
    wrong = f"wrong-{option}-{random_key().hex()}"
    options = {**s3_tier_options, option: wrong}
    with caplog.at_level(logging.DEBUG), pytest.raises(ConfigError) as info:
        ObjTier(ctx, **options)
    assert info.value.key == option
    for secret in (wrong, s3_tier_options["secret_access_key"]):
        assert secret not in str(info.value) and secret not in repr(info.value.value)
    # botocore's own DEBUG lines show the access key id (never the secret); nothing else does.
    assert s3_tier_options["secret_access_key"] not in caplog.text
    if option == "secret_access_key":
        assert wrong not in caplog.text
    shown = [r for r in caplog.records if r.levelno >= logging.INFO or r.name.startswith("kvtier")]
    assert not any(wrong in r.getMessage() for r in shown)


def test_wrong_credentials_in_a_tier_process_are_a_config_error(region, s3_tier_options) -> None:
    secret = f"wrong-{random_key().hex()}"
    proc = _tier_process(region, {**s3_tier_options, "secret_access_key": secret})
    with pytest.raises(ConfigError) as info:
        proc.start()
    assert info.value.key == "secondary_tiers[0].secret_access_key"
    assert secret not in str(info.value)


def test_a_missing_bucket_is_a_config_error_unless_asked_to_create_it(make_tier, ctx, s3_server,
                                                                      s3_tier_options) -> None:
    options = {**s3_tier_options, "bucket": f"{s3_tier_options['bucket']}-missing"}
    with pytest.raises(ConfigError) as info:
        ObjTier(ctx, **options)
    assert info.value.key == "bucket" and "create_bucket" in str(info.value)
    tier = make_tier(options, create_bucket=True, region="eu-west-1")  # with a LocationConstraint
    store(tier, ctx, [random_key()])
    s3_server.client().delete_bucket(Bucket=options["bucket"])


def _silent_listener() -> tuple[socket.socket, int]:
    """A socket that accepts connections (through its backlog) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock, sock.getsockname()[1]


@pytest.mark.parametrize("where", ["closed_port", "silent_server"])
def test_an_unreachable_endpoint_is_a_config_error_after_one_probe(ctx, s3_tier_options, where) -> None:
    """A closed port, or a server that never answers, fails the start-up probe: one request, not
    retried, and a config error naming the endpoint."""
    listener = None
    if where == "closed_port":
        port = free_ports(1)[0]
    else:
        listener, port = _silent_listener()
    options = {**s3_tier_options, "endpoint": f"http://127.0.0.1:{port}"}
    try:
        with pytest.raises(ConfigError) as info:
            ObjTier(ctx, **options)
        if listener is not None:
            assert _accepted(listener) == 1
    finally:
        if listener is not None:
            listener.close()
    assert info.value.key == "endpoint"


def _accepted(listener: socket.socket) -> int:
    """How many connections wait in `listener`'s backlog (each accepted and closed)."""
    listener.setblocking(False)
    count = 0
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1


@pytest.mark.parametrize("option, value", [
    ("bucket", ""), ("bucket", 3), ("io_threads", 0), ("io_threads", 1.5), ("io_threads", True),
    ("max_bytes", 10), ("negative_ttl_s", -1), ("connect_timeout_s", float("nan")),
    ("create_bucket", "yes"), ("endpoint", 5),
])
def test_bad_options_name_themselves(ctx, s3_tier_options, option: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        ObjTier(ctx, **{**s3_tier_options, option: value})
    assert info.value.key == option


def test_a_secret_without_its_key_id_is_a_config_error(ctx, s3_tier_options) -> None:
    s3_tier_options.pop("access_key_id")
    with pytest.raises(ConfigError) as info:
        ObjTier(ctx, **s3_tier_options)
    assert info.value.key == "access_key_id"
    assert s3_tier_options["secret_access_key"] not in str(info.value)


def test_a_burst_of_lookups_never_blocks_the_caller(make_tier, ctx, s3_server, s3_tier_options) -> None:
    """Lookups of 200 keys return while the server answers nothing (SIGSTOP): every key RETRY, no
    HEAD answered, none asked twice; once the server is back, every key is a MISS after one HEAD."""
    # Misses are kept long enough here that none expires before the last HEAD of the burst is done.
    tier = make_tier(s3_tier_options, negative_ttl_s=30.0)
    keys = [random_key() for _ in range(200)]
    s3_server.pause()
    try:
        for _ in range(3):
            assert tier.lookup(keys) == [LookupResult.RETRY] * len(keys)
        assert tier.counts()[TierCounter.HEADS] == 0
    finally:
        s3_server.resume()
    assert settle_lookup(tier, keys, timeout_s=30) == [LookupResult.MISS] * len(keys)
    assert tier.counts()[TierCounter.HEADS] == len(keys)


def test_tier_bench_runs_against_seaweedfs(s3_tier_options) -> None:
    from kvtier.bench.tier_bench import run_tier_bench

    report = run_tier_bench("obj", s3_tier_options, chunk_bytes=64 << 10, chunks=16, threads=4)
    assert report["tier_counts"]["tier_counter"][TierCounter.STORED.value] == 16
    assert report["load_gib_s"] > 0


@pytest.mark.parametrize(("endpoint", "signed"), [("http://127.0.0.1:9", True), ("HTTP://s3.local", True),
                                                  ("https://s3.local", False), (None, False)])
def test_payloads_are_signed_where_no_tls_protects_them(endpoint: str | None, signed: bool) -> None:
    """Over plain HTTP a body's SHA-256 is in the signed request, so a man in the middle cannot
    swap it; over TLS (or AWS's default https endpoints) the channel protects it already."""
    client = make_client(endpoint=endpoint, region="us-east-1", access_key_id="k", secret_access_key="s",
                         session_token=None, connect_timeout_s=1, read_timeout_s=1, pool_connections=1,
                         path_style=True, attempts=1)
    try:
        assert client.meta.config.s3["payload_signing_enabled"] is signed
    finally:
        client.close()


def test_a_server_that_stalls_reading_a_chunk_past_the_connect_timeout_still_stores_it(
    s3_tier_options: dict[str, Any],
) -> None:
    """The HTTP library bounds sending a body by the connect timeout: a 16 MiB row sent through a
    proxy that holds each request 1.5 s once the tier started (the client's send buffers fill
    meanwhile) must store with `connect_timeout_s` 0.5 and `read_timeout_s` 10, and load back."""
    row_bytes, slots = 16 << 20, 2
    region = HostRegion.create(row_bytes * slots + generations.nbytes(slots))
    big = TierContext(region=region.buf, row_bytes=row_bytes, num_slots=slots,
                      layout_fingerprint=LAYOUT_FP, tier_name="test",
                      generations=generations.view(region.buf, row_bytes * slots, slots))
    endpoint = s3_tier_options["endpoint"].removeprefix("http://")
    host, port = endpoint.rsplit(":", 1)
    proxy = ThrottleProxy(host, int(port), latency_s=0.0).start()
    tier = ObjTier(big, **{**s3_tier_options, "endpoint": proxy.endpoint}, connect_timeout_s=0.5,
                   read_timeout_s=10.0, io_threads=1)
    proxy.latency_s = 1.5  # from now on: the start-up probe passed
    try:
        key = random_key()
        data = fill_slot(big, 0)
        tier.submit_store(Job(1, JobKind.STORE, (key,), (0,)))
        [stored] = wait_jobs(tier, 1, timeout_s=60)
        assert stored.success
        tier.submit_load(Job(2, JobKind.LOAD, (key,), (1,)))
        [loaded] = wait_jobs(tier, 1, timeout_s=60)
        assert loaded.success and bytes(big.slot_view(1)) == data
    finally:
        tier.shutdown()
        proxy.close()
        region.close()
