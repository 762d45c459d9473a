"""The tiering manager over a real host region and real tier processes, for every eviction policy."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from kvtier.config import KVTierConfig
from kvtier.engine.tiering_start import start_manager
from kvtier.errors import ConfigError
from kvtier.manager import PrefixLookup, TieringManager
from kvtier.tiers.base import LookupResult
from tests.conftest import LAYOUT_FP, random_key, wait_until
from tests.manager_helpers import (
    HOST_SLOTS,
    ROW,
    changes,
    chunks,
    drain,
    evict_all,
    settle,
    start,
    store_in_host,
)


@pytest.fixture(params=["lru", "arc"])
def manager(request, tmp_path: Path) -> Iterator[TieringManager]:
    m = start(request.param, [{"type": "memory"}, {"type": "fs", "root_dir": str(tmp_path / "fs")}],
              tier_restart_backoff_s=0.1)
    yield m
    m.shutdown()


def in_tiers_only(m: TieringManager, n: int) -> list[bytes]:
    """`n` new keys, stored in the host tier, cascaded to every tier, then evicted from the host
    tier: only the tiers hold them."""
    keys = [random_key() for _ in range(n)]
    store_in_host(m, keys)
    drain(m)
    evict_all(m)
    return keys


def test_cascade_then_promotion_restores_identical_rows(manager: TieringManager) -> None:
    keys = [random_key() for _ in range(4)]
    rows = store_in_host(manager, keys)
    drain(manager)
    assert chunks(manager, "memory", "store") == 4
    assert chunks(manager, "fs", "store") == 4
    evict_all(manager)
    assert manager.host.lookup(keys) == 0
    first = manager.lookup_prefix(keys)
    assert (first.ready, first.pending) == (0, True)
    assert settle(manager, keys) == PrefixLookup(4, pending=False)
    slots = manager.host.pin(keys)
    assert slots is not None
    assert [bytes(manager.host.slot_view(s)) for s in slots] == [rows[k] for k in keys]
    manager.host.unpin(keys)
    manager.host.check()


def test_promotion_from_a_chosen_tier(manager: TieringManager) -> None:
    keys = in_tiers_only(manager, 2)
    assert settle(manager, keys, tiers=["fs"]).ready == 2
    assert chunks(manager, "fs", "load") == 2
    assert chunks(manager, "memory", "load") == 0


def test_promotions_report_their_source_tier_and_outcome(manager: TieringManager) -> None:
    keys = in_tiers_only(manager, 3)
    store_in_host(manager, keys[:1])
    drain(manager)
    before = manager.metrics.snapshot()
    promoting: tuple[str, ...] = ()
    deadline = time.monotonic() + 10
    while True:
        manager.poll()
        found = manager.lookup_prefix(keys, tiers=["fs"])
        promoting = promoting or found.promoting
        if not found.pending:
            break
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert found.ready == 3
    assert promoting == ("fs", "fs")
    moved = changes(before, manager.metrics.snapshot())
    fs_load = 'tier="fs"'
    timings = ("kvtier_transfer_seconds", "kvtier_transfer_latency_seconds_sum")
    assert {k: v for k, v in moved.items() if "load" in k and not k.startswith(timings)} == {
        f'kvtier_transfer_chunks_total{{op="load",{fs_load}}}': 2,
        f'kvtier_transfer_bytes_total{{op="load",{fs_load}}}': 2 * ROW,
        f'kvtier_transfer_latency_seconds_count{{op="load",{fs_load}}}': 1,
    }
    assert moved.get(f'kvtier_transfer_seconds_total{{op="load",{fs_load}}}', 0) >= 0
    manager.poll()
    assert chunks(manager, "fs", "load") == 2  # a finished job is counted once


def test_prefix_stops_at_the_first_chunk_no_tier_holds(manager: TieringManager) -> None:
    keys = [random_key() for _ in range(5)]
    store_in_host(manager, keys[:2] + keys[3:])
    drain(manager)
    evict_all(manager)
    assert settle(manager, keys).ready == 2


def test_no_host_space_means_no_promotion(manager: TieringManager) -> None:
    keys = in_tiers_only(manager, 2)
    pinned = [random_key() for _ in range(HOST_SLOTS)]
    assert manager.host.reserve(pinned) is not None
    assert settle(manager, keys) == PrefixLookup(0, pending=False)
    assert manager.metrics.value("kvtier_promotion_refused_chunks_total") >= 1
    manager.host.commit(pinned, success=False)
    manager.host.check()


def test_a_prefix_longer_than_the_host_tier_promotes_its_leading_chunks(
    manager: TieringManager,
) -> None:
    keys = [random_key() for _ in range(HOST_SLOTS + 4)]
    rows: dict[bytes, bytes] = {}
    for i in range(0, len(keys), 4):
        rows |= store_in_host(manager, keys[i : i + 4])
        drain(manager)
    evict_all(manager)
    pinned = [random_key() for _ in range(2)]
    assert manager.host.reserve(pinned) is not None
    first = manager.lookup_prefix(keys, tiers=["fs"])
    assert first.pending and first.promoting == ("fs",) * (HOST_SLOTS - 2)
    found = settle(manager, keys, tiers=["fs"], promote=False)
    assert found.ready == HOST_SLOTS - 2
    for key, slot in zip(keys, manager.host.pin(keys[: found.ready]) or [], strict=False):
        assert bytes(manager.host.slot_view(slot)) == rows[key]
    manager.host.unpin(keys[: found.ready])
    assert manager.metrics.value("kvtier_promotion_refused_chunks_total") == len(keys) - found.ready
    manager.host.commit(pinned, success=False)
    manager.host.check()


def test_a_promotion_never_evicts_the_prefix_it_extends(manager: TieringManager) -> None:
    keys = [random_key() for _ in range(HOST_SLOTS)]
    store_in_host(manager, keys[:4])
    drain(manager)
    store_in_host(manager, keys[4:])
    drain(manager)
    others = [random_key() for _ in range(HOST_SLOTS)]
    store_in_host(manager, others)
    drain(manager)
    store_in_host(manager, keys[:2])
    drain(manager)
    resident = [k for k in others if manager.host.contains(k)]
    assert manager.host.pin(resident) is not None  # an access: the prefix is now LRU
    manager.host.unpin(resident)
    found = settle(manager, keys, tiers=["fs"])
    assert found.ready == HOST_SLOTS
    assert manager.host.lookup(keys) == HOST_SLOTS
    manager.host.check()


def test_a_finished_promotion_is_held_until_released(manager: TieringManager) -> None:
    keys = in_tiers_only(manager, 2)
    assert settle(manager, keys).ready == 2
    drain(manager)  # the promotion's cascade to the other tier
    assert [manager.host.pin_count(k) for k in keys] == [1, 1]
    assert manager.host.reserve([random_key() for _ in range(HOST_SLOTS)]) is None
    manager.release([*keys, random_key()])
    manager.release(keys)  # a second release of the same keys changes nothing
    assert [manager.host.pin_count(k) for k in keys] == [0, 0]
    assert manager.host.reserve([random_key() for _ in range(HOST_SLOTS)]) is not None
    manager.host.check()


def test_a_promotion_released_while_in_flight_is_not_held(manager: TieringManager) -> None:
    keys = in_tiers_only(manager, 2)
    assert manager.lookup_prefix(keys, tiers=["fs"]).pending
    manager.release(keys)  # e.g. the request was aborted while its chunks were being promoted
    assert settle(manager, keys, promote=False).ready == 2
    drain(manager)
    assert [manager.host.pin_count(k) for k in keys] == [0, 0]
    manager.host.check()


def test_a_caller_may_wait_for_the_promotion_it_started(manager: TieringManager) -> None:
    """`await_promotions` returns once the fs tier's loads ended: the next lookup, without a
    step of "ask again" in between, finds every chunk ready with the bytes stored."""
    keys = [random_key() for _ in range(3)]
    rows = store_in_host(manager, keys)
    drain(manager)
    evict_all(manager)
    assert manager.lookup_prefix(keys, tiers=["fs"]).promoting == ("fs",) * 3
    manager.await_promotions(keys, 10.0)
    assert manager.lookup_prefix(keys, promote=False) == PrefixLookup(3, pending=False)
    slots = manager.host.pin(keys)
    assert slots is not None
    assert [bytes(manager.host.slot_view(s)) for s in slots] == [rows[k] for k in keys]
    manager.host.unpin(keys)
    manager.release(keys)
    other = [random_key()]
    manager.await_promotions(other, 10.0)  # nothing of it in flight: returns at once
    manager.host.check()


def test_without_promote_a_lookup_takes_what_the_host_tier_holds(manager: TieringManager) -> None:
    keys = in_tiers_only(manager, 4)
    store_in_host(manager, keys[:1])
    drain(manager)
    assert manager.lookup_prefix(keys, promote=False) == PrefixLookup(1, pending=False)
    assert manager.in_flight == 0


def test_a_cascade_stores_the_chunks_still_resident(manager: TieringManager) -> None:
    keys = [random_key() for _ in range(3)]
    slots = manager.host.reserve(keys)
    assert slots is not None
    manager.host.commit(keys, success=True)
    gone = random_key()
    manager.cascade([*keys, gone])
    drain(manager)
    assert chunks(manager, "fs", "store") == 3
    skipped = manager.metrics.value("kvtier_cascade_skipped_chunks_total", tier="fs")
    assert skipped == 1


def test_a_cascade_is_no_reuse_for_the_host_eviction_order(manager: TieringManager) -> None:
    """Copying a chunk to the secondary tiers does not make it more recent (nor, under ARC,
    frequent): the host tier still evicts it before a chunk stored after it."""
    first, second = random_key(), random_key()
    for key in (first, second):
        slots = manager.host.reserve([key])
        assert slots is not None
        manager.host.commit([key], success=True)
    manager.cascade([first])
    drain(manager)
    filler = [random_key() for _ in range(HOST_SLOTS - 1)]
    assert manager.host.reserve(filler) is not None
    assert not manager.host.contains(first) and manager.host.contains(second)


@pytest.mark.parametrize("wait_s", [0.0, 5.0])
def test_a_new_prompt_is_answered_within_the_lookup_wait(tmp_path: Path, wait_s: float) -> None:
    m = start("lru", [{"type": "fs", "root_dir": str(tmp_path / "fs")}], tier_lookup_wait_s=wait_s)
    try:
        stored = in_tiers_only(m, 2)
        fresh = [random_key() for _ in range(3)]
        first = m.lookup_prefix(fresh)
        # Without a wait the tier's answer is not there yet: "ask again"; with one, a miss now.
        assert first == (PrefixLookup(0, pending=True) if wait_s == 0 else PrefixLookup(0, pending=False))
        found = m.lookup_prefix(stored)
        assert found.pending and (wait_s == 0 or found.promoting == ("fs", "fs"))
    finally:
        m.shutdown()


def test_killed_tier_turns_hits_into_misses_and_comes_back(manager: TieringManager) -> None:
    keys = in_tiers_only(manager, 3)
    os.kill(manager.tiers["memory"].pid, signal.SIGKILL)
    os.kill(manager.tiers["fs"].pid, signal.SIGKILL)
    wait_until(lambda: tiers_ok(manager, lambda t: t.last_failure is not None),
               "both killed tiers marked down")
    assert {t.last_failure[0] for t in manager.tiers.values()} == {"exited"}
    assert settle(manager, keys) == PrefixLookup(0, pending=False)
    manager.host.check()
    wait_until(lambda: tiers_ok(manager, lambda t: t.is_up), "both tiers restarted")
    # The fs tier kept its files across the restart.
    assert settle(manager, keys).ready == 3


def test_bad_second_tier_shuts_down_the_first(tmp_path: Path) -> None:
    def mine() -> set[str]:
        return {n for n in os.listdir("/dev/shm") if n.startswith(f"kvtier-{os.getpid()}-")}

    before = mine()
    with pytest.raises(ConfigError, match="max_bytes"):
        start("lru", [{"type": "memory"}, {"type": "memory", "name": "m2", "max_bytes": 1}])
    assert mine() == before
    # tier processes of this process's session: a command the suite started beside the tests
    # (`tests/early_start.py`) runs in a session of its own, with tier processes of its own
    session = os.getsid(0)
    runners = [p for p in psutil.Process().children(recursive=True)
               if _live_runner(p) and _session(p.pid) == session]
    assert runners == [], "the first tier's process must be shut down"


def _live_runner(p: psutil.Process) -> bool:
    """Whether `p` is a tier process still running (a zombie, or a process gone since it was
    listed, is none; psutil refuses a zombie's command line)."""
    try:
        return p.status() != psutil.STATUS_ZOMBIE and "kvtier.tiers.runner" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def tiers_ok(m: TieringManager, ok) -> bool:
    """Whether `ok` holds of every tier of `m`, after the replies received so far were handled."""
    m.poll()
    return all(ok(t) for t in m.tiers.values())


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except ProcessLookupError:
        return None


def test_region_too_large_for_shm_is_a_config_error() -> None:
    st = os.statvfs("/dev/shm")
    too_big = st.f_bavail * st.f_frsize + (1 << 30)
    cfg = KVTierConfig.from_dict({"cpu_bytes_to_use": too_big})
    with pytest.raises(ConfigError, match=r"cpu_bytes_to_use.*/dev/shm"):
        start_manager(cfg, ROW, LAYOUT_FP)


def test_a_partly_answered_run_is_promoted_whole_once_known(manager: TieringManager) -> None:
    keys = in_tiers_only(manager, 3)
    fs = manager.tiers["fs"]
    real = fs.lookup
    partial = [LookupResult.HIT, LookupResult.RETRY, LookupResult.RETRY]
    answers = iter([partial, partial])  # the first ask, and the ask after the lookup wait
    # As an obj tier whose first HEAD answered before the others.
    fs.lookup = lambda ks: next(answers, None) or real(ks)  # type: ignore[method-assign]
    first = manager.lookup_prefix(keys, tiers=["fs"])
    assert (first.pending, first.promoting, manager.in_flight) == (True, (), 0)
    assert settle(manager, keys, tiers=["fs"]).ready == 3
    assert chunks(manager, "fs", "load") == 3


def test_a_promotion_from_no_tier_fails_only_its_chunks(manager: TieringManager) -> None:
    """A source that names no tier (a caller's stale "host" record) must not raise on the scheduler
    thread: those chunks' rows are rolled back and counted as failed loads; the others load."""
    keys = in_tiers_only(manager, 2)
    assert manager.promote(keys, ["memory", "host"]) == 2
    drain(manager)
    assert manager.host.lookup(keys) == 1 and not manager.host.contains(keys[1])
    assert manager.metrics.value("kvtier_failures_total", tier="host", op="load") == 1
    manager.release(keys)
