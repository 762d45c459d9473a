"""The campaign's shared tiers beyond one server: its Valkey Cluster (a node killed then restarted
empty while the others keep their values) and its p2p peer (a real p2p tier process serving bad
rows to a real requesting p2p tier: refused, counted, detected by the ledger and repaired; killed,
its loads fail; restarted, it serves again), the ledger's blind spans, and injections that never
race a load of their key."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvtier.bench.chaos.corrupt import CORRUPTIONS, WRONG_SIZE
from kvtier.bench.chaos.ledger import Ledger, TierSpy, process_started
from kvtier.bench.chaos.media import ClusterMedium, FsMedium
from kvtier.bench.chaos.peer import KINDS, Peer, PeerMedium, peer_address, tier_options
from kvtier.bench.chaos.valkey_cluster import Cluster
from kvtier.host import generations
from kvtier.host.region import HostRegion
from kvtier.tiers.base import Job, JobKind, LookupResult
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.process import TierProcess, TierSpec
from tests.conftest import LAYOUT_FP, ROW_BYTES, SLOTS, settle_lookup, wait_jobs, wait_until
from tests.tiers.process_helpers import reported_counts

SECRET = "chaos-test-secret-0123456789"


def _chunk(key: bytes, row: bytes) -> bytes:
    return chunkfmt.header_bytes(key, chunkfmt.fingerprint_bytes(LAYOUT_FP), row) + row


def test_a_killed_cluster_node_comes_back_empty_and_the_others_keep_theirs(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / "cluster")
    cluster.start()
    try:
        medium = ClusterMedium("cluster", LAYOUT_FP, cluster, "chaos")
        keys = [os.urandom(32) for _ in range(30)]
        for key in keys:
            medium.write(key, _chunk(key, os.urandom(256)))
        on = {n: {k for k in keys if medium.node_of(k) == n} for n in range(3)}
        assert all(on[n] for n in range(3)) and set(medium.keys()) == set(keys)
        assert all(medium.verify(k) for k in keys)
        cluster.kill(1)
        assert set(medium.keys()) == on[0] | on[2]  # a dead node is skipped, not an error
        with pytest.raises(redis.ConnectionError):
            medium.read(next(iter(on[1])))
        cluster.restart(1)
        assert set(medium.keys()) == on[0] | on[2]
        assert all(medium.verify(k) is None for k in on[1])
        assert all(medium.verify(k) for k in on[0] | on[2])
    finally:
        cluster.stop()
    assert not cluster.pids


@pytest.fixture
def peer_and_requester(tmp_path: Path) -> Iterator[tuple[PeerMedium, FsMedium, TierSpy, Ledger, TierProcess]]:
    """A peer fed 4 chunks from an fs medium, and a requesting p2p tier process wrapped in a spy."""
    address = peer_address()
    peer = Peer(address, ROW_BYTES, 8, LAYOUT_FP, SECRET)
    region = HostRegion.create(ROW_BYTES * SLOTS + generations.nbytes(SLOTS))
    spec = TierSpec(tier_name="p2p", type="p2p", module_path=None, options=tier_options(address, SECRET),
                    config_key="secondary_tiers[0]", region_name=region.name, shm_dir="/dev/shm",
                    row_bytes=ROW_BYTES, num_slots=SLOTS, layout_fingerprint=LAYOUT_FP,
                    generations_offset=ROW_BYTES * SLOTS)
    requester = TierProcess(spec, job_timeout_s=30, lookup_ttl_s=0.2)
    try:
        peer.start()
        requester.start()
        fs = FsMedium("fs", LAYOUT_FP, tmp_path / "fs")
        for _ in range(4):
            key = os.urandom(32)
            fs.path(key).parent.mkdir(parents=True, exist_ok=True)
            fs.write(key, _chunk(key, os.urandom(ROW_BYTES)))
        medium = PeerMedium("p2p", LAYOUT_FP, peer)
        assert medium.feed(fs) == 4 and set(medium.keys()) == set(fs.keys())
        ledger = Ledger(lambda tier, key: medium.verify(key), lambda tier, key: medium.repair(key))
        yield medium, fs, TierSpy(requester, ledger, refusals=True), ledger, requester
    finally:
        requester.shutdown()
        region.close()
        peer.close()


def _load(spy: TierSpy, keys: list[bytes], job_id: int) -> set[bytes]:
    spy.submit_load(Job(job_id, JobKind.LOAD, tuple(keys), tuple(range(len(keys)))))
    [result] = wait_jobs(spy, 1)
    return set(result.successful_keys)


def test_a_peer_serving_bad_rows_is_refused_detected_and_repaired(peer_and_requester) -> None:
    medium, fs, spy, ledger, requester = peer_and_requester
    keys = fs.keys()
    rng = random.Random(0)
    for n, kind in enumerate(KINDS):
        key, other = keys[n], keys[-1]
        good, start = medium.read(key), time.monotonic()
        medium.write(key, CORRUPTIONS[kind](medium.read(key) or b"", medium.read(other) or b"", rng))
        ledger.injected("p2p", key, kind, start)
        assert medium.verify(key) is False
        assert settle_lookup(spy, [key]) == [LookupResult.HIT]
        assert _load(spy, [key, other], 10 + n) == {other}
        assert ledger.counts()["outcomes"]["detected"] == n + 1, kind
        assert medium.verify(key) is True and medium.read(key) == good  # repaired
    assert reported_counts(requester).bad_chunks == len(KINDS)
    # The answers a refusal left (MISS, cached for the p2p tier's `lookup_ttl_s`) expire.
    wait_until(lambda: settle_lookup(spy, keys) == [LookupResult.HIT] * 4, "the repaired keys found")
    assert _load(spy, keys, 20) == set(keys)
    assert ledger.counts()["outcomes"]["served"] == 0


def test_a_killed_peer_fails_loads_as_values_then_serves_again(peer_and_requester) -> None:
    medium, fs, spy, ledger, _ = peer_and_requester
    keys = fs.keys()
    assert settle_lookup(spy, keys) == [LookupResult.HIT] * 4
    medium.write(keys[0], medium.read(keys[1]) or b"")
    ledger.injected("p2p", keys[0], "swap", time.monotonic())
    ledger.blind("p2p", time.monotonic())
    medium.kill_peer()
    ledger.lose_tier("p2p")
    assert medium.keys() == [] and ledger.blinded("p2p")
    assert _load(spy, keys, 1) == set()  # a miss, not an error
    medium.peer.start()
    ledger.blind("p2p", 0.0, time.monotonic())
    assert medium.feed(fs) == 4
    # as an engine does: load what its lookups find
    wait_until(lambda: settle_lookup(spy, keys) == [LookupResult.HIT] * 4, "the restarted peer's keys")
    assert _load(spy, keys, 2) == set(keys)
    assert ledger.counts()["outcomes"] == {"detected": 0, "served": 0, "overwritten": 0, "lost": 1,
                                           "unread": 0, "open": 0}


def test_refusals_in_a_blind_span_detect_nothing() -> None:
    ledger = Ledger(lambda tier, key: False)
    key = os.urandom(32)
    ledger.injected("p2p", key, "swap", time.monotonic())
    now = time.monotonic()
    ledger.blind("p2p", now - 1.0, now + 5.0)
    assert ledger.blinded("p2p")
    ledger.refused("p2p", [key], now + 0.1)
    assert ledger.counts()["outcomes"]["open"] == 1
    ledger.blind("p2p", now - 1.0, now)
    ledger.refused("p2p", [key], now + 0.1)
    assert ledger.counts()["outcomes"]["detected"] == 1


def test_an_injection_never_races_a_load_and_a_load_during_one_is_counted_once(peer_and_requester) -> None:
    """A key whose load is in flight is not offered for corruption (a load that read the bytes as
    they changed would be counted by kvtier and not by the ledger). A load submitted after an
    injection began, before the ledger recorded the bad bytes in place, reads them: the ledger
    counts that read, as kvtier's metric does, once."""
    medium, fs, spy, ledger, requester = peer_and_requester
    keys = fs.keys()
    # A peer's answer that came after the lookup's wait (a loaded machine) is a MISS, cached for
    # the p2p tier's `lookup_ttl_s`: ask again until every key is found.
    wait_until(lambda: settle_lookup(spy, keys) == [LookupResult.HIT] * 4, "the peer's keys found")
    spy.submit_load(Job(1, JobKind.LOAD, (keys[0],), (0,)))
    assert keys[0] not in ledger.free("p2p", keys)
    wait_jobs(spy, 1)
    start = time.monotonic()
    assert keys[0] in ledger.free("p2p", keys)
    medium.write(keys[0], medium.read(keys[1]) or b"")
    spy.submit_load(Job(2, JobKind.LOAD, (keys[0],), (0,)))
    ledger.injected("p2p", keys[0], "swap", start)
    [result] = wait_jobs(spy, 1)
    assert not result.success
    assert ledger.counts()["outcomes"]["detected"] == 1 == reported_counts(requester).bad_chunks
    assert medium.verify(keys[0]) is True  # repaired


def test_a_store_the_ledger_could_not_check_is_checked_at_the_next_load() -> None:
    """A store of a corrupted key completes while its server cannot be read (SeaweedFS restarting):
    whether it replaced the bad copy is unknown then, so the next successful load of the key looks:
    a valid copy was overwritten unread, a bad one would have been served."""
    medium: dict[bytes, bool | None] = {}
    down = False

    def verify(tier: str, key: bytes) -> bool | None:
        if down:
            raise ConnectionError("the server is restarting")
        return medium.get(key)

    ledger = Ledger(verify)
    replaced, kept = os.urandom(32), os.urandom(32)
    for key in (replaced, kept):
        medium[key] = False
        ledger.injected("obj", key, "swap", time.monotonic())
    down = True
    medium[replaced] = True  # rewritten by the store; `kept` was skipped (the tier knew the key)
    ledger.store_finished("obj", (replaced, kept), {replaced, kept})
    assert ledger.counts()["outcomes"]["open"] == 2
    down = False
    ledger.loaded("obj", [replaced, kept], time.monotonic())
    outcomes = ledger.counts()["outcomes"]
    assert (outcomes["overwritten"], outcomes["served"], outcomes["open"]) == (1, 1, 0)


def test_wrong_sizes_in_place_before_a_restart_were_detected_by_its_scan() -> None:
    """An fs tier process's first scan removes (and counts) the copies of a wrong size, with no
    REMOVED event; a store of such a key may complete before the spy first sees the new process,
    so the medium shows a valid copy. Those in place before the process started are detected; a
    swap (same size) and a wrong size made after the start are judged by the medium."""
    medium: dict[bytes, bool | None] = {}
    ledger = Ledger(lambda tier, key: medium.get(key))
    cut, swapped, late = os.urandom(32), os.urandom(32), os.urandom(32)
    for key, kind in ((cut, "truncate"), (swapped, "swap")):
        medium[key] = True  # stored again since
        ledger.injected("fs", key, kind, time.monotonic())
    started = time.monotonic()
    medium[late] = False
    ledger.injected("fs", late, "extend", time.monotonic())
    ledger.recheck("fs", started, WRONG_SIZE)
    assert ledger.counts()["outcomes"]["detected"] == 1 and ledger.open_count("fs") == 2
    ledger.store_finished("fs", (swapped,), {swapped})
    assert ledger.counts()["outcomes"]["overwritten"] == 1


def test_a_process_start_is_read_on_the_monotonic_clock() -> None:
    started = process_started(os.getpid())
    assert started is not None and started <= time.monotonic()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        before = time.monotonic()
        child_started = process_started(child.pid)
        assert child_started is not None and abs(child_started - before) < 5.0
    finally:
        child.kill()
        child.wait()
    assert process_started(child.pid) is None
