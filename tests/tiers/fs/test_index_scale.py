"""The fs index's cost a key and the scan's work a file: what holds a million-chunk tier's start-up
and memory within bounds (benchmarks/bench_fs_scale.py measures them at scale)."""

from __future__ import annotations

import os
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.tiers.fs.index import FsIndex, ScannedFile, scan_layout_dir
from kvtier.tiers.fs.order import UseOrder

FILE = 8192
BYTES_PER_KEY = 200
"""The index's budget a key: its bytes, dict slot, last use and place in the eviction order."""


def scanned(n: int, t0: float = 1000.0) -> Iterator[ScannedFile]:
    for i in range(n):
        yield ScannedFile(os.urandom(32), FILE, t0 + i % 977)


def traced(fn: Callable[[], None]) -> int:
    """The bytes `fn` left allocated."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_index_memory_a_key_stays_within_budget_after_scan_and_churn() -> None:
    n = 30_000
    index = FsIndex(10 * n * FILE, FILE)

    def fill() -> None:
        index.start_scan()
        index.merge_scan(scanned(n))

    held = traced(fill)
    assert held / n <= BYTES_PER_KEY
    assert len(index) == n

    keys = list(index._times)

    def churn() -> None:  # every key used three times: stale items must not pile up
        for round_ in range(3):
            for i, key in enumerate(keys):
                index.touch(key, 5000.0 + round_ * n + i)

    held += traced(churn)
    assert held / n <= BYTES_PER_KEY
    assert index._order.items() <= 2 * n + 64


def test_initial_merge_builds_the_order_once(monkeypatch: pytest.MonkeyPatch) -> None:
    pushes: list[bytes] = []
    real = UseOrder.push

    def push(self: UseOrder, key: bytes, last_use: float) -> None:
        pushes.append(key)
        real(self, key, last_use)

    monkeypatch.setattr(UseOrder, "push", push)
    index = FsIndex(None, FILE)
    index.start_scan()
    appeared, _ = index.merge_scan(scanned(1000))
    assert len(appeared) == 1000 and pushes == []
    index.add(b"n" * 32, 1.0)
    assert pushes == [b"n" * 32]


def test_eviction_takes_oldest_first_across_run_and_heap() -> None:
    index = FsIndex(3 * FILE, FILE)
    index.start_scan()
    a, b, c = (bytes([i]) * 32 for i in (1, 2, 3))
    index.merge_scan([ScannedFile(a, FILE, 10.0), ScannedFile(b, FILE, 20.0),
                      ScannedFile(c, FILE, 30.0)])
    index.touch(a, 40.0)  # a moves from the sorted run to the heap, now the newest
    granted, victims = index.reserve(2 * FILE)
    assert granted and victims == [b, c]
    assert list(index._times) == [a]


def test_a_key_re_added_at_the_same_time_is_evicted_once() -> None:
    index = FsIndex(2 * FILE, FILE)
    a, b = b"a" * 32, b"b" * 32
    index.add(a, 1.0)
    index.remove(a)
    index.add(a, 1.0)  # its first item is current again: two items, one key
    index.add(b, 2.0)
    granted, victims = index.reserve(2 * FILE)
    assert granted and victims == [a, b]
    assert index.bytes_used == 0


def test_pinned_keys_are_skipped_and_kept_in_order() -> None:
    index = FsIndex(2 * FILE, FILE)
    a, b = b"a" * 32, b"b" * 32
    index.add(a, 1.0)
    index.add(b, 2.0)
    index.pin(a)
    assert index.reserve(FILE) == (True, [b])
    assert index.reserve(FILE) == (False, [])
    index.unpin(a)
    index.release(FILE)
    assert index.reserve(2 * FILE) == (True, [a])


def test_scan_joins_paths_only_for_bad_entries(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    fan = tmp_path / "ab"
    fan.mkdir()
    for i in range(50):
        (fan / ("ab" + f"{i:062x}")).write_bytes(bytes(FILE))
    (fan / ("ab" + "f" * 62)).write_bytes(b"short")
    joins: list[tuple[str, ...]] = []
    real = os.path.join

    def join(*parts: str) -> str:
        joins.append(parts)
        return real(*parts)

    monkeypatch.setattr(os.path, "join", join)
    found = scan_layout_dir(str(tmp_path), FILE, 600.0, time.time())
    assert len(found.files) == 50 and len(found.wrong_size) == 1
    assert len(joins) == 1
