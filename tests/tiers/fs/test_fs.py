"""The fs tier on real directories: round trips, validation, corruption, restart, eviction, faults,
and several processes sharing one directory."""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import random
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from kvtier.bench.chaos.runner import tmpfs
from kvtier.errors import ConfigError
from kvtier.format.chunks import ChunkError, TierEventKind
from kvtier.ops.metrics import TierCounter, TierGauge
from kvtier.tiers.base import LookupResult
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.fs import store_helper
from kvtier.tiers.fs.fsck import fsck
from kvtier.tiers.fs.tier import FsTier
from tests.conftest import random_key
from tests.optional import NATIVE_OFF
from tests.tiers.fs.helpers import (
    LAYOUT_FP,
    OTHER_FP,
    all_files,
    chunk_path,
    immutable,
    load_keys,
    make_ctx,
    payload,
    set_mtime,
    store_keys,
    stress_worker,
    temp_files,
)

ROW = 4 * 4096
FILE = chunkfmt.HEADER_BYTES + ROW
LOGGER = "kvtier.tier.fs-test"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "kv"


def new_tier(root: Path, slots: int = 16, fp: str = LAYOUT_FP, **options: object) -> FsTier:
    return FsTier(make_ctx(ROW, slots, fp), root_dir=str(root), **options)


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# ---- round trip and layout --------------------------------------------------------------------


@pytest.mark.parametrize("direct_io", [None, False])
def test_round_trip_is_byte_identical_and_files_follow_the_layout(root: Path, direct_io) -> None:
    tier = new_tier(root, direct_io=direct_io)
    try:
        assert tier.direct_io is (direct_io is None)  # every filesystem here supports O_DIRECT
        keys = [random_key() for _ in range(6)]
        assert tier.lookup(keys) == [LookupResult.MISS] * 6
        stored = store_keys(tier, tier.ctx, keys)
        assert stored.success and stored.successful_keys == tuple(keys)
        assert stored.bytes_moved == 6 * ROW
        assert tier.lookup(keys) == [LookupResult.HIT] * 6
        for key in keys:
            path = chunk_path(root, key)
            assert path.stat().st_size == FILE
            assert path.read_bytes()[chunkfmt.HEADER_BYTES:] == payload(key, ROW)
        loaded = load_keys(tier, tier.ctx, keys[::-1])
        assert loaded.success and loaded.successful_keys == tuple(keys[::-1])
        for slot, key in enumerate(keys[::-1]):
            assert bytes(tier.ctx.slot_view(slot)) == payload(key, ROW)
        counts, usage = tier.counts(), tier.usage()
        assert (usage.chunks, usage.bytes_used) == (6, 6 * FILE)
        assert (counts[TierCounter.STORED], counts[TierCounter.LOADED], counts.bad_chunks) == (6, 6, 0)
        [event] = tier.take_events()
        assert event.kind is TierEventKind.STORED and set(event.keys) == set(keys)
        assert temp_files(root) == []
    finally:
        tier.shutdown()
        tier.shutdown()


def test_storing_a_present_key_rewrites_nothing(root: Path) -> None:
    tier = new_tier(root)
    try:
        key = random_key()
        store_keys(tier, tier.ctx, [key])
        inode = chunk_path(root, key).stat().st_ino
        assert store_keys(tier, tier.ctx, [key], job_id=3).success
        assert chunk_path(root, key).stat().st_ino == inode
        assert tier.counts()[TierCounter.STORED] == 1
    finally:
        tier.shutdown()


def test_buffered_fallback_when_the_filesystem_refuses_o_direct(root: Path, monkeypatch) -> None:
    # Every filesystem on these machines (tmpfs included, kernel >= 6.6) accepts O_DIRECT, so a
    # filesystem that refuses it is simulated: open() with O_DIRECT fails with EINVAL.
    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    with pytest.raises(ConfigError) as e:
        new_tier(root, direct_io=True)
    assert e.value.key == "direct_io"
    tier = new_tier(root)
    try:
        assert tier.direct_io is False
        keys = [random_key() for _ in range(3)]
        assert store_keys(tier, tier.ctx, keys).success
        assert load_keys(tier, tier.ctx, keys).success
        assert bytes(tier.ctx.slot_view(2)) == payload(keys[2], ROW)
    finally:
        tier.shutdown()


def test_unaligned_rows_use_buffered_io(root: Path) -> None:
    ctx = make_ctx(4096 + 512, 4)
    with pytest.raises(ConfigError) as e:
        FsTier(ctx, root_dir=str(root), direct_io=True)
    assert e.value.key == "direct_io"
    tier = FsTier(ctx, root_dir=str(root))
    try:
        assert tier.direct_io is False
        key = random_key()
        assert store_keys(tier, ctx, [key]).success
        assert load_keys(tier, ctx, [key]).success
        assert bytes(ctx.slot_view(0)) == payload(key, ctx.row_bytes)
    finally:
        tier.shutdown()


# ---- options ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("root_dir", ""),
        ("root_dir", 7),
        ("max_bytes", FILE - 1),
        ("max_bytes", -1),
        ("max_bytes", True),
        ("max_bytes", "1e9"),
        ("max_bytes", float("inf")),
        ("n_read_threads", 0),
        ("n_read_threads", 2.0),
        ("n_write_threads", True),
        ("n_write_threads", 1000),
        ("direct_io", "yes"),
        ("rescan_interval_s", 0),
        ("temp_grace_s", -1),
    ],
)
def test_bad_options_raise_config_error_naming_the_option(root: Path, option, value) -> None:
    options: dict[str, object] = {"root_dir": str(root), option: value}
    with pytest.raises(ConfigError) as e:
        FsTier(make_ctx(ROW, 2), **options)
    assert e.value.key == option


def test_root_dir_that_cannot_be_created_or_written_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    with pytest.raises(ConfigError) as e:
        new_tier(blocker / "kv")
    assert e.value.key == "root_dir"
    locked = tmp_path / "locked"
    locked.mkdir()
    with immutable([locked]) as ok:
        if not ok:
            pytest.skip("chattr +i is not permitted here")
        with pytest.raises(ConfigError) as e:
            new_tier(locked)
        assert e.value.key == "root_dir"
    assert os.listdir(locked) == []


def test_float_max_bytes_is_accepted(root: Path) -> None:
    tier = new_tier(root, max_bytes=1e9)
    try:
        assert tier.usage().capacity_bytes == 1e9
    finally:
        tier.shutdown()


# ---- bad files --------------------------------------------------------------------------------

HEADER_FIELDS = {
    "magic": (0, ChunkError.MAGIC),
    "version": (8, ChunkError.VERSION),
    "flags": (10, ChunkError.VERSION),
    "header_length": (12, ChunkError.VERSION),
    "key": (16 + 31, ChunkError.KEY),
    "layout": (48, ChunkError.LAYOUT),
    "payload_length": (64, ChunkError.LENGTH),
    "checksum": (72 + 15, ChunkError.CHECKSUM),
    "payload_first_byte": (chunkfmt.HEADER_BYTES, ChunkError.CHECKSUM),
    "payload_last_byte": (FILE - 1, ChunkError.CHECKSUM),
}


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def expect_dropped(
    tier: FsTier, root: Path, bad: bytes, good: bytes, reason: ChunkError, known: bool = True
) -> None:
    """A load of [bad, good] fails for `bad` only; the bad file is gone and counted, and its
    removal announced when the tier knew it (had stored it)."""
    tier.take_events()
    result = load_keys(tier, tier.ctx, [bad, good], job_id=9)
    assert not result.success and result.successful_keys == (good,)
    assert bytes(tier.ctx.slot_view(1)) == payload(good, ROW)
    assert not chunk_path(root, bad).exists()
    assert tier.lookup([bad, good]) == [LookupResult.MISS, LookupResult.HIT]
    counts = tier.counts()
    assert counts.bad_chunks == 1 and counts[reason] == 1
    assert counts[TierCounter.LOAD_FAILURES] == 1
    removed = any(e.kind is TierEventKind.REMOVED and bad in e.keys for e in tier.take_events())
    assert removed is known


@pytest.mark.parametrize("field", list(HEADER_FIELDS))
def test_each_corrupted_field_is_detected_and_removed(root: Path, field: str) -> None:
    tier = new_tier(root)
    try:
        bad, good = random_key(), random_key()
        store_keys(tier, tier.ctx, [bad, good])
        offset, reason = HEADER_FIELDS[field]
        flip_byte(chunk_path(root, bad), offset)
        expect_dropped(tier, root, bad, good, reason)
    finally:
        tier.shutdown()


@pytest.mark.parametrize(
    "damage", ["truncated_payload", "truncated_header", "empty", "extended", "foreign"]
)
def test_truncated_extended_and_foreign_files_are_detected(root: Path, damage: str) -> None:
    tier = new_tier(root)
    try:
        bad, good = random_key(), random_key()
        store_keys(tier, tier.ctx, [bad, good])
        path = chunk_path(root, bad)
        if damage == "truncated_payload":
            os.truncate(path, FILE - 4096)
        elif damage == "truncated_header":
            os.truncate(path, 100)
        elif damage == "empty":
            os.truncate(path, 0)
        elif damage == "extended":
            with open(path, "ab") as f:
                f.write(b"\0" * 4096)
        else:
            path.write_bytes(os.urandom(FILE))
        reason = {"extended": ChunkError.LENGTH, "foreign": ChunkError.MAGIC}.get(damage, ChunkError.SHORT)
        expect_dropped(tier, root, bad, good, reason)
    finally:
        tier.shutdown()


def test_a_chunk_of_another_key_or_layout_is_detected(root: Path) -> None:
    tier = new_tier(root)
    other = new_tier(root, fp=OTHER_FP)
    try:
        a, b, c, good = (random_key() for _ in range(4))
        store_keys(tier, tier.ctx, [a, good])
        store_keys(other, other.ctx, [c])
        chunk_path(root, b).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(chunk_path(root, a), chunk_path(root, b))
        expect_dropped(tier, root, b, good, ChunkError.KEY, known=False)
        chunk_path(root, c).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(chunk_path(root, c, OTHER_FP), chunk_path(root, c))
        result = load_keys(tier, tier.ctx, [c, good], job_id=10)
        assert result.successful_keys == (good,)
        assert not chunk_path(root, c).exists() and chunk_path(root, c, OTHER_FP).exists()
        assert tier.counts()[ChunkError.LAYOUT] == 1
    finally:
        tier.shutdown()
        other.shutdown()


def test_invalid_keys_fail_as_values_and_create_no_file(root: Path) -> None:
    tier = new_tier(root)
    try:
        short = b"\x01" * 31
        good = random_key()
        assert tier.lookup([short, "x" * 32]) == [LookupResult.MISS] * 2  # type: ignore[list-item]
        result = store_keys(tier, tier.ctx, [short, good])
        assert result.successful_keys == (good,) and not result.success
        assert load_keys(tier, tier.ctx, [short]).successful_keys == ()
        assert len(all_files(root)) == 1
    finally:
        tier.shutdown()


# ---- accounting, eviction, restart -------------------------------------------------------------


def test_eviction_follows_last_use_and_bounds_bytes(root: Path) -> None:
    tier = new_tier(root, max_bytes=3 * FILE)
    try:
        a, b, c, d = keys = [random_key() for _ in range(4)]
        for i, key in enumerate(keys[:3]):
            store_keys(tier, tier.ctx, [key], job_id=10 + i)
        assert load_keys(tier, tier.ctx, [a]).success
        tier.take_events()
        store_keys(tier, tier.ctx, [d], job_id=20)
        assert tier.lookup(keys) == [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT,
                                     LookupResult.HIT]
        events = tier.take_events()
        assert [(e.kind, e.keys) for e in events] == [
            (TierEventKind.REMOVED, (b,)), (TierEventKind.STORED, (d,))
        ]
        assert tier.usage().bytes_used == 3 * FILE and tier.counts()[TierCounter.EVICTIONS] == 1
        assert sum(p.stat().st_size for p in all_files(root)) <= 3 * FILE
        del c
    finally:
        tier.shutdown()


def test_restart_rebuilds_accounting_from_mtimes_and_respects_max_bytes(root: Path) -> None:
    tier = new_tier(root)
    keys = [random_key() for _ in range(5)]
    try:
        store_keys(tier, tier.ctx, keys)
        for age, key in zip([50, 40, 30, 20, 10], keys, strict=True):
            set_mtime(chunk_path(root, key), age)
        assert load_keys(tier, tier.ctx, [keys[0]]).success  # refreshes keys[0]'s mtime
    finally:
        tier.shutdown()
    mtimes = [chunk_path(root, key).stat().st_mtime for key in keys]
    assert mtimes[0] > max(mtimes[1:])  # the oldest is now the most recently used
    stale = chunk_path(root, keys[1]).parent / f".{keys[1].hex()}.tmp.1.0badc0de"
    stale.write_bytes(b"partial")
    set_mtime(stale, 3600)
    fresh = chunk_path(root, keys[2]).parent / f".{keys[2].hex()}.tmp.1.00c0ffee"
    fresh.write_bytes(b"being written")
    wrong_size = chunk_path(root, random_key())
    wrong_size.parent.mkdir(parents=True, exist_ok=True)
    wrong_size.write_bytes(b"short")

    again = new_tier(root)
    try:
        counts, usage = again.counts(), again.usage()
        assert (usage.chunks, usage.bytes_used) == (5, 5 * FILE)
        assert counts[ChunkError.LENGTH] == 1
        assert not stale.exists() and fresh.exists() and not wrong_size.exists()
        assert again.take_events() == []
    finally:
        again.shutdown()
    fresh.unlink()

    bounded = new_tier(root, max_bytes=3 * FILE)
    try:
        # Least recently used first: keys[1], keys[2] go; keys[0] was refreshed by the load.
        assert bounded.lookup(keys) == [LookupResult.HIT, LookupResult.MISS, LookupResult.MISS,
                                        LookupResult.HIT, LookupResult.HIT]
        assert bounded.usage().bytes_used == 3 * FILE
        assert load_keys(bounded, bounded.ctx, [keys[0], keys[3], keys[4]]).success
    finally:
        bounded.shutdown()


def test_instances_sharing_a_directory_see_each_others_files(root: Path) -> None:
    one = new_tier(root, rescan_interval_s=0.05)
    two = new_tier(root, rescan_interval_s=0.05)
    try:
        a, b = random_key(), random_key()
        store_keys(one, one.ctx, [a, b])
        assert two.lookup([a, b]) == [LookupResult.HIT] * 2
        assert load_keys(two, two.ctx, [a]).success
        assert bytes(two.ctx.slot_view(0)) == payload(a, ROW)
        chunk_path(root, b).unlink()  # as if a third instance evicted it
        result = load_keys(one, one.ctx, [b, a], job_id=5)
        assert result.successful_keys == (a,)
        assert one.counts()[TierCounter.LOAD_MISSES] == 1
        deadline = time.monotonic() + 5
        while two.usage().chunks != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert two.usage().chunks == 1  # the rescan found a (stored by one) and lost b
        kinds = {(e.kind, k) for e in two.take_events() for k in e.keys}
        assert (TierEventKind.STORED, a) in kinds
    finally:
        one.shutdown()
        two.shutdown()


# ---- faults -------------------------------------------------------------------------------------


def test_disk_full_fails_keys_as_values_with_one_log_line(tmp_path: Path, caplog, monkeypatch) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    small = tmp_path / "small"
    row = 64 * 1024
    with tmpfs(small, 1) as mounted:
        if not mounted:  # fall back to a simulated ENOSPC when mount is not permitted
            monkeypatch.setattr(store_helper, "load", lambda: None)  # the Python path calls os.pwritev
            monkeypatch.setattr(os, "pwritev", _fail_after(8, errno.ENOSPC))
        ctx = make_ctx(row, 32)
        tier = FsTier(ctx, root_dir=str(small / "kv"), n_write_threads=4)
        try:
            keys = [random_key() for _ in range(32)]
            result = store_keys(tier, ctx, keys)
            assert not result.success
            assert 0 < len(result.successful_keys) < 32
            assert temp_files(small) == []
            assert [m for m in warnings(caplog) if "ENOSPC" in m] == warnings(caplog)
            assert len(warnings(caplog)) == 1
            assert tier.counts()[TierCounter.STORE_FAILURES] == 32 - len(result.successful_keys)
            done = list(result.successful_keys)
            loaded = load_keys(tier, ctx, done, job_id=7)
            assert loaded.success
            for slot, key in enumerate(done):
                assert bytes(ctx.slot_view(slot)) == payload(key, row)
        finally:
            tier.shutdown()


def _fail_after(n: int, err: int):
    real = os.pwritev
    calls = {"n": 0}

    def pwritev(fd, bufs, offset):
        calls["n"] += 1
        if calls["n"] > n:
            raise OSError(err, os.strerror(err))
        return real(fd, bufs, offset)

    return pwritev


def test_permission_denied_fails_stores_and_keeps_serving(root: Path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    tier = new_tier(root)
    try:
        old = [random_key() for _ in range(3)]
        store_keys(tier, tier.ctx, old)
        dirs = [root / LAYOUT_FP, *(root / LAYOUT_FP).iterdir()]
        with immutable(dirs) as ok:
            if not ok:
                pytest.skip("chattr +i is not permitted here")
            new = [random_key() for _ in range(12)]
            result = store_keys(tier, tier.ctx, new, job_id=3)
            assert not result.success and result.successful_keys == ()
            assert len(warnings(caplog)) == 1 and "EPERM" in warnings(caplog)[0]
            loaded = load_keys(tier, tier.ctx, old, job_id=4)
            assert loaded.success
            assert bytes(tier.ctx.slot_view(2)) == payload(old[2], ROW)
        assert store_keys(tier, tier.ctx, new, job_id=5).success
    finally:
        tier.shutdown()


def test_root_dir_removed_while_running(root: Path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    tier = new_tier(root, rescan_interval_s=0.05)
    try:
        kept = random_key()
        store_keys(tier, tier.ctx, [kept])
        shutil.rmtree(root)
        keys = [random_key() for _ in range(10)]
        result = store_keys(tier, tier.ctx, [kept, *keys], job_id=2)
        assert not result.success and result.successful_keys == ()
        assert len(warnings(caplog)) == 1 and "ENOENT" in warnings(caplog)[0]
        assert tier.lookup(keys) == [LookupResult.MISS] * 10
        assert load_keys(tier, tier.ctx, [kept], job_id=3).successful_keys == ()
        assert tier.counts()[TierCounter.STORE_FAILURES] == 11
        assert not root.exists()  # root_dir is never recreated by the tier
        root.mkdir()
        result = store_keys(tier, tier.ctx, keys, job_id=4)
        assert result.success
        assert load_keys(tier, tier.ctx, keys, job_id=5).success
        assert tier.usage().chunks == 10
    finally:
        tier.shutdown()


def test_failures_are_logged_once_per_cause(root: Path, caplog, monkeypatch) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    monkeypatch.setattr(store_helper, "load", lambda: None)  # EIO is simulated in os.pwritev
    tier = new_tier(root)
    try:
        monkeypatch.setattr(os, "pwritev", _fail_after(0, errno.EIO))
        assert store_keys(tier, tier.ctx, [random_key() for _ in range(8)]).successful_keys == ()
        monkeypatch.setattr(os, "pwritev", _fail_after(0, errno.ENOSPC))
        assert store_keys(tier, tier.ctx, [random_key() for _ in range(8)], job_id=2).success is False
        messages = warnings(caplog)
        assert len(messages) == 2
        assert "EIO" in messages[0] and "ENOSPC" in messages[1]
    finally:
        tier.shutdown()


# ---- several processes ----------------------------------------------------------------------------


def test_processes_sharing_a_directory_stay_consistent(root: Path) -> None:
    keys = [random_key() for _ in range(24)]
    spawn = multiprocessing.get_context("spawn")
    seeds = [random.randrange(1 << 30) for _ in range(3)]
    with ProcessPoolExecutor(3, mp_context=spawn) as pool:
        outcomes = list(pool.map(stress_worker, [str(root)] * 3, seeds, [keys] * 3))
    for seed, (counts, mismatches) in zip(seeds, outcomes, strict=True):
        assert mismatches == 0, (seed, counts)
        assert counts[TierCounter.LOADED] > 0 and counts[TierCounter.STORED] > 0, (seed, counts)
    report = fsck(str(root), repair=False, temp_grace_s=0)
    assert report.ok, report
    assert report.in_progress == [] and report.orphans == []
    assert report.files == report.good_files > 0


def test_native_and_python_store_paths_write_the_same_file(root: Path, monkeypatch) -> None:
    if os.environ.get("KVTIER_NATIVE") == "0":
        NATIVE_OFF.skip()
    if store_helper.load() is None:
        pytest.skip("no C compiler here: the fs tier runs its Python store path only")
    files = []
    for use_native in (True, False):
        if not use_native:
            monkeypatch.setattr(store_helper, "load", lambda: None)
        tier = new_tier(root / str(use_native))
        try:
            assert tier.counts()[TierGauge.NATIVE_IO] == float(use_native)
            tier.ctx.slot_view(0)[:] = bytes(range(256)) * (tier.ctx.row_bytes // 256)
            key = bytes(32)
            assert store_keys(tier, tier.ctx, [key]).success
            [path] = [p for p in (root / str(use_native)).rglob(key.hex())]
            files.append(path.read_bytes())
            assert temp_files(root / str(use_native)) == []
        finally:
            tier.shutdown()
    assert files[0] == files[1]
