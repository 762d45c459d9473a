"""The p2p tier between real tier processes over loopback: each peer maps its own host region.

A stores (a cascade STORE job), B finds the chunks at A and loads them into its own slots. Also:
a slot A reused after the store, A killed mid-transfer, a holder closing mid-row, wrong secrets,
malformed messages, redis discovery, and option checks.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import zmq

from kvtier.errors import ConfigError
from kvtier.host.tier import HostTier
from kvtier.ops.metrics import TierCounter
from kvtier.policies.lru import LRUPolicy
from kvtier.tiers.base import Job, JobKind, JobResult, LookupResult, TierContext, TierUsage
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.common.book import FailureLog, TierBook
from kvtier.tiers.p2p import P2PTier, protocol
from kvtier.tiers.p2p.auth import Secret
from kvtier.tiers.p2p.fetch import Fetcher
from tests.conftest import LAYOUT_FP, ROW_BYTES, SLOTS, fill_slot, random_key, settle_lookup, wait_jobs
from tests.tiers.p2p.helpers import CURVE_KEY, FP, SECRET, address, ctx_of, data_address, store
from tests.tiers.process_helpers import bench_count, report_now, reported_counts


def test_b_finds_and_loads_what_a_stored(make_peer) -> None:
    a, a_region = make_peer()
    b, b_region = make_peer(peers=[address(a)])
    a_ctx, b_ctx = ctx_of(a_region), ctx_of(b_region)
    keys = [random_key() for _ in range(4)]
    rows = [fill_slot(a_ctx, s) for s in range(4)]
    store(a, keys, [0, 1, 2, 3])
    absent = random_key()
    assert b.lookup([*keys, absent]) == [LookupResult.RETRY] * 5
    assert settle_lookup(b, [*keys, absent]) == [LookupResult.HIT] * 4 + [LookupResult.MISS]
    b.submit_load(Job(2, JobKind.LOAD, tuple(keys), (9, 8, 7, 6)))
    [result] = wait_jobs(b, 1)
    assert result.success and result.successful_keys == tuple(keys)
    assert [bytes(b_ctx.slot_view(s)) for s in (9, 8, 7, 6)] == rows
    assert reported_counts(a)[TierCounter.CHUNKS_SERVED] == 4
    assert reported_counts(b)[TierCounter.LOADED] == 4


def test_usage_is_the_rows_a_peer_offers(make_peer) -> None:
    a, a_region = make_peer()
    report_now(a)
    assert a.last_usage == TierUsage(0, 0, SLOTS * ROW_BYTES)
    for s in range(2):
        fill_slot(ctx_of(a_region), s)
    store(a, [random_key(), random_key()], [0, 1])
    report_now(a)
    assert a.last_usage == TierUsage(2 * ROW_BYTES, 2, SLOTS * ROW_BYTES)


def test_own_stores_are_not_hits_for_the_instance_that_stored_them(make_peer) -> None:
    a, a_region = make_peer()
    keys = [random_key() for _ in range(2)]
    for s in range(2):
        fill_slot(ctx_of(a_region), s)
    store(a, keys, [0, 1])
    # A's p2p tier serves these to peers; it cannot load them itself (no peer holds them).
    assert settle_lookup(a, keys) == [LookupResult.MISS] * 2


def test_the_keys_of_a_load_share_few_data_requests(make_peer) -> None:
    a, a_region = make_peer()
    b, b_region = make_peer(peers=[address(a)], io_threads=2)
    keys = [random_key() for _ in range(SLOTS)]
    rows = [fill_slot(ctx_of(a_region), s) for s in range(SLOTS)]
    store(a, keys, list(range(SLOTS)))
    assert settle_lookup(b, keys) == [LookupResult.HIT] * SLOTS
    b.submit_load(Job(2, JobKind.LOAD, tuple(keys), tuple(reversed(range(SLOTS)))))
    [result] = wait_jobs(b, 1)
    assert result.success
    assert [bytes(ctx_of(b_region).slot_view(s)) for s in reversed(range(SLOTS))] == rows
    served = reported_counts(a)
    assert served[TierCounter.CHUNKS_SERVED] == SLOTS and 2 <= served[TierCounter.DATA_REQUESTS] <= SLOTS // 4


def test_slot_reused_after_store_is_a_miss_never_wrong_bytes(make_peer) -> None:
    a, a_region = make_peer()
    b, b_region = make_peer(peers=[address(a)])
    a_ctx, b_ctx = ctx_of(a_region), ctx_of(b_region)
    host = HostTier(a_region.buf[: 2 * ROW_BYTES], ROW_BYTES, LRUPolicy(2), a_ctx.generations)
    keys = [random_key(), random_key()]
    assert host.reserve(keys) == {keys[0]: 0, keys[1]: 1}
    fill_slot(a_ctx, 0)
    kept = fill_slot(a_ctx, 1)
    host.commit(keys, True)
    store(a, keys, [0, 1])
    assert settle_lookup(b, keys) == [LookupResult.HIT] * 2
    assert host.reserve([random_key()]) is not None  # evicts keys[0]: its slot, reused
    fill_slot(a_ctx, 0)
    b_ctx.slot_view(3)[:] = bytes(ROW_BYTES)
    b.submit_load(Job(2, JobKind.LOAD, tuple(keys), (3, 4)))
    [result] = wait_jobs(b, 1)
    assert not result.success and result.successful_keys == (keys[1],)
    assert bytes(b_ctx.slot_view(4)) == kept
    assert reported_counts(a)[TierCounter.STALE_DROPPED] == 1
    assert settle_lookup(b, keys[:1]) == [LookupResult.MISS]


def test_a_newer_store_in_a_slot_drops_the_key_it_held(make_peer) -> None:
    a, a_region = make_peer()
    b, _ = make_peer(peers=[address(a)])
    old, new = random_key(), random_key()
    fill_slot(ctx_of(a_region), 0)
    store(a, [old], [0])
    fill_slot(ctx_of(a_region), 0)
    store(a, [new], [0], job_id=2)
    assert settle_lookup(b, [old, new]) == [LookupResult.MISS, LookupResult.HIT]


def test_holder_killed_mid_transfer_fails_the_job_as_a_value(make_peer) -> None:
    row, slots = 4 << 20, 24
    a, a_region = make_peer(row_bytes=row, slots=slots)
    b, b_region = make_peer(row_bytes=row, slots=slots, peers=[address(a)], transfer_timeout_s=2.0)
    a_ctx, b_ctx = ctx_of(a_region, row, slots), ctx_of(b_region, row, slots)
    keys = [random_key() for _ in range(slots)]
    rows = [fill_slot(a_ctx, s) for s in range(slots)]
    store(a, keys, list(range(slots)))
    assert settle_lookup(b, keys) == [LookupResult.HIT] * slots
    for i, key in enumerate(keys):
        b.submit_load(Job(100 + i, JobKind.LOAD, (key,), (i,)))
    results = wait_jobs(b, 1)
    os.kill(a.pid, signal.SIGKILL)
    results += wait_jobs(b, slots - len(results), timeout_s=10)  # failed as values, none hangs
    failed = [r for r in results if not r.success]
    assert failed, "every chunk arrived before the kill: the test did not interrupt a transfer"
    for r in results:
        if r.success:
            i = r.job_id - 100
            assert bytes(b_ctx.slot_view(i)) == rows[i]
    assert settle_lookup(b, [random_key()]) == [LookupResult.MISS]


def test_holder_closing_mid_row_is_a_failed_key() -> None:
    secret = Secret(SECRET.encode())
    key, row = random_key(), os.urandom(ROW_BYTES)
    listener = socket.create_server(("127.0.0.1", 0))

    def serve_half() -> None:
        conn, _ = listener.accept()
        with conn:
            protocol.server_handshake(conn, secret, FP, ROW_BYTES)
            protocol.read_get(conn)
            conn.sendall(protocol.STATUS_CHUNK + chunkfmt.header_bytes(key, FP, row))
            conn.sendall(row[: ROW_BYTES // 2])

    server = threading.Thread(target=serve_half)
    server.start()
    book = TierBook(TierContext(memoryview(bytearray(0)), ROW_BYTES, 0, LAYOUT_FP, "t"))
    fetcher = Fetcher(secret, FP, ROW_BYTES, book, FailureLog(book.ctx.log, "t"),
                      connect_timeout_s=2, transfer_timeout_s=2, reconnect_interval_s=1)
    out = memoryview(bytearray(ROW_BYTES))
    try:
        assert fetcher.fetch(listener.getsockname(), [(key, out)]) == [False]
        assert book.counts()[TierCounter.PEER_ERRORS] == 1
    finally:
        fetcher.close()
        server.join()
        listener.close()


def test_peer_with_the_wrong_secret_is_refused_and_logged_once(make_peer, capfd) -> None:
    a, a_region = make_peer()
    intruder, _ = make_peer(secret="not-the-shared-secret-at-all", peers=[address(a)],
                            lookup_timeout_s=0.2, lookup_ttl_s=0.05)
    keys = [random_key()]
    fill_slot(ctx_of(a_region), 0)
    store(a, keys, [0])
    for ask in (keys, [random_key()], [random_key()]):  # fresh keys: each is a new message to A
        assert settle_lookup(intruder, ask) == [LookupResult.MISS]
    book = TierBook(TierContext(memoryview(bytearray(0)), ROW_BYTES, 0, LAYOUT_FP, "t"))
    fetcher = Fetcher(Secret(b"not-the-shared-secret-at-all"), FP, ROW_BYTES, book,
                      FailureLog(book.ctx.log, "t"), connect_timeout_s=2, transfer_timeout_s=2,
                      reconnect_interval_s=0.01)
    data = data_address(a)
    try:
        assert fetcher.fetch(data, [(keys[0], memoryview(bytearray(ROW_BYTES)))]) == [False]
    finally:
        fetcher.close()
    a_counts = reported_counts(a)
    assert a_counts[TierCounter.AUTH_REFUSED] >= 3 and a_counts[TierCounter.CHUNKS_SERVED] == 0
    err = capfd.readouterr().err
    assert err.count("auth:control") == 1 and err.count("auth:data") == 1
    assert SECRET not in err and "not-the-shared-secret" not in err


def test_malformed_messages_are_rejected_and_the_server_keeps_serving(make_peer) -> None:
    a, a_region = make_peer()
    secret = Secret(SECRET.encode())
    ctl = address(a)
    zctx = zmq.Context()
    dealer = zctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(ctl)
    inst = os.urandom(16)
    try:
        bad_key = protocol.encode_control(secret, protocol.OP_LOOKUP, 1, inst, FP, ROW_BYTES,
                                          b"x" * 31, 1)
        huge = protocol.encode_control(secret, protocol.OP_LOOKUP, 2, inst, FP, ROW_BYTES,
                                       b"x" * 32, 10**6)
        for frames in (bad_key, huge, [b"garbage"], [b"a", b"b", b"c", b"d"], [*huge[:2], b"\x00" * 32]):
            dealer.send_multipart(frames)
        assert not dealer.poll(300)  # nothing answered
    finally:
        dealer.close()
        zctx.term()
    data = data_address(a)
    with socket.create_connection(data, timeout=5) as conn:
        protocol.client_handshake(conn, secret, FP, ROW_BYTES)
        conn.sendall(protocol.GET_MAGIC + (10**6).to_bytes(4, "little"))
        assert conn.recv(1) == b""  # closed by the server
    with socket.create_connection(data, timeout=5) as conn:
        conn.sendall(os.urandom(200))
        assert conn.recv(4096, socket.MSG_WAITALL)[:8] == b"KVTP2PD2"
    assert reported_counts(a)[TierCounter.MALFORMED] >= 4
    b, b_region = make_peer(peers=[ctl])
    key = random_key()
    data_row = fill_slot(ctx_of(a_region), 0)
    store(a, [key], [0])
    assert settle_lookup(b, [key]) == [LookupResult.HIT]
    b.submit_load(Job(2, JobKind.LOAD, (key,), (5,)))
    assert wait_jobs(b, 1)[0].success
    assert bytes(ctx_of(b_region).slot_view(5)) == data_row


def test_peers_find_each_other_through_redis(make_peer, redis_server) -> None:
    opts = {"discovery_url": redis_server.url, "discovery_prefix": f"p2p-{os.urandom(4).hex()}",
            "discovery_ttl_s": 1.0}
    a, a_region = make_peer(**opts)
    b, b_region = make_peer(**opts)
    key = random_key()
    row = fill_slot(ctx_of(a_region), 2)
    store(a, [key], [2])
    deadline = time.monotonic() + 10
    while settle_lookup(b, [key]) != [LookupResult.HIT]:
        assert time.monotonic() < deadline, "B never found A through redis"
        time.sleep(0.1)
    b.submit_load(Job(2, JobKind.LOAD, (key,), (0,)))
    assert wait_jobs(b, 1)[0].success
    assert bytes(ctx_of(b_region).slot_view(0)) == row


@pytest.mark.skipif(not zmq.has("curve"), reason="this pyzmq's libzmq has no CURVE support")
def test_curve_peers_talk_and_a_peer_without_the_key_is_refused(make_peer) -> None:
    fleet = zmq.curve_keypair()[1].decode()
    a, a_region = make_peer(curve_secret_key=fleet)
    ctl = address(a)
    b, b_region = make_peer(peers=[ctl], curve_secret_key=fleet)
    other_key = make_peer(peers=[ctl], curve_secret_key=zmq.curve_keypair()[1].decode(),
                          lookup_timeout_s=0.2)
    no_key = make_peer(peers=[ctl], lookup_timeout_s=0.2)
    key = random_key()
    row = fill_slot(ctx_of(a_region), 1)
    store(a, [key], [1])
    assert settle_lookup(b, [key]) == [LookupResult.HIT]
    b.submit_load(Job(2, JobKind.LOAD, (key,), (3,)))
    assert wait_jobs(b, 1)[0].success
    assert bytes(ctx_of(b_region).slot_view(3)) == row
    # Same HMAC secret, but another CURVE key or none: the ZMQ handshake never completes.
    for intruder, _ in (other_key, no_key):
        assert settle_lookup(intruder, [key]) == [LookupResult.MISS]
        intruder.submit_load(Job(3, JobKind.LOAD, (key,), (0,)))
        assert not wait_jobs(intruder, 1)[0].success
    assert reported_counts(a)[TierCounter.LOOKUPS_SERVED] == 1
    # A client that knows A's public key but holds another key pair is refused by A's ZAP gate.
    zctx = zmq.Context()
    dealer = zctx.socket(zmq.DEALER)
    public, secret = zmq.curve_keypair()
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.CURVE_SERVERKEY, zmq.curve_public(fleet.encode()))
    dealer.setsockopt(zmq.CURVE_PUBLICKEY, public)
    dealer.setsockopt(zmq.CURVE_SECRETKEY, secret)
    dealer.connect(ctl)
    try:
        dealer.send_multipart(protocol.encode_control(Secret(SECRET.encode()), protocol.OP_LOOKUP, 1,
                                                      os.urandom(16), FP, ROW_BYTES, key, 1))
        assert not dealer.poll(500)
    finally:
        dealer.close()
        zctx.term()
    a_counts = reported_counts(a)
    assert a_counts[TierCounter.AUTH_REFUSED] >= 1 and a_counts[TierCounter.LOOKUPS_SERVED] == 1


@pytest.mark.parametrize(("options", "key"), [
    ({}, "secret"),
    ({"secret": "short"}, "secret"),
    ({"secret": SECRET, "secret_file": "/x"}, "secret"),
    ({"secret": SECRET, "listen": "ipc:///tmp/x"}, "listen"),
    ({"secret": SECRET, "peers": "tcp://127.0.0.1:1"}, "peers"),
    ({"secret": SECRET, "io_threads": 0}, "io_threads"),
    ({"secret": SECRET, "lookup_timeout_s": -1}, "lookup_timeout_s"),
    ({"secret": SECRET, "curve_secret_key": "short"}, "curve_secret_key"),
    ({"secret": SECRET, "curve_secret_key": "~" * 40}, "curve_secret_key"),
    ({"secret": SECRET, "curve_secret_key": CURVE_KEY, "curve_secret_key_file": "/x"}, "curve_secret_key"),
    ({"secret": SECRET, "curve_secret_key_file": "/nonexistent/key"}, "curve_secret_key_file"),
])
def test_bad_options_name_the_option_and_never_show_the_secret(options, key, ctx) -> None:
    with pytest.raises(ConfigError) as info:
        P2PTier(ctx, **options)
    assert info.value.key == key
    for secret in (SECRET, "short", "~" * 40, CURVE_KEY):
        assert secret not in str(info.value)


def test_secret_from_a_file(ctx, tmp_path) -> None:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    tier = P2PTier(ctx, secret_file=str(path))
    try:
        assert tier.address.startswith("tcp://127.0.0.1:") and not tier.address.endswith(":0")
    finally:
        tier.shutdown()


def test_tier_bench_times_p2p_loads_alone_and_with_their_lookups() -> None:
    from kvtier.bench.tier_bench import run_tier_bench

    report = run_tier_bench("p2p", {}, chunk_bytes=64 << 10, chunks=8, threads=2)
    assert report["load_s"] > 0 and report["load_lookups_s"] > report["lookup_s"] > 0
    assert report["load_gib_s"] > 0 and report["load_lookups_gib_s"] > 0
    assert bench_count(report, TierCounter.LOADED) == 3 * 8  # the warm-up and both timed passes


def test_tier_bench_loads_in_jobs_of_several_chunks() -> None:
    """Jobs of 3 over 8 chunks (3, 3, 2): every row still lands in its own slot (tier-bench checks
    each loaded row against what was stored, and fails the run otherwise)."""
    from kvtier.bench.tier_bench import run_tier_bench

    report = run_tier_bench("p2p", {}, chunk_bytes=64 << 10, chunks=8, threads=2, keys_per_job=3)
    assert report["keys_per_job"] == 3
    assert bench_count(report, TierCounter.LOADED) == 3 * 8
    assert bench_count(report, TierCounter.LOAD_FAILURES) == 0


def test_tier_bench_groups_consecutive_chunks_into_each_job() -> None:
    from kvtier.bench.tier_bench import _run_jobs

    class Recorder:
        """Takes jobs as a tier process would and finishes each by the next wait."""

        def __init__(self) -> None:
            self.submitted: list[Job] = []
            self._open: list[Job] = []

        def submit_load(self, job: Job) -> None:
            self.submitted.append(job)
            self._open.append(job)

        def await_jobs(self, job_ids: range, timeout_s: float) -> None:
            pass

        def get_finished_jobs(self) -> list[JobResult]:
            done, self._open = self._open, []
            return [JobResult(j.job_id, success=True) for j in done]

    proc = Recorder()
    keys = [bytes([i]) * 32 for i in range(8)]
    _run_jobs(proc, JobKind.LOAD, keys, 100, per_job=3)  # type: ignore[arg-type]
    jobs = proc.submitted
    assert [j.job_id for j in jobs] == [100, 101, 102]
    assert [j.slots for j in jobs] == [(0, 1, 2), (3, 4, 5), (6, 7)]
    assert [k for j in jobs for k in j.keys] == keys
