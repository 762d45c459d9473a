"""Hostile files planted in a real fs tier directory: a FIFO or a symlink at a chunk path, a fan-out
directory replaced by a symlink to a directory outside the root, a sidecar linked to /dev/zero, a
sparse file whose header claims a huge payload. Each is refused before it is read: a counted bad
chunk or a miss, never served, never a hang, and nothing outside the root is written or removed."""

from __future__ import annotations

import contextlib
import os
import shutil
import tracemalloc
from array import array
from pathlib import Path

import pytest

from kvtier.engine.events.block_sidecar import BlockSidecar
from kvtier.engine.events.chunk_blocks import ChunkBlocks
from kvtier.format.chunks import ChunkError, TierEventKind
from kvtier.ops.metrics import TierCounter
from kvtier.tiers.base import LookupResult
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.fs.fsck import fsck
from kvtier.tiers.fs.tier import FsTier
from tests.conftest import random_key, wait_until
from tests.tiers.fs.helpers import (
    LAYOUT_FP,
    all_files,
    chunk_path,
    load_keys,
    make_ctx,
    payload,
    store_keys,
)

ROW = 4 * 4096
WAIT_S = 10.0


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "kv"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the root: nothing in it may be written, read or removed."""
    path = tmp_path / "outside"
    path.mkdir()
    return path


def new_tier(root: Path, **options: object) -> FsTier:
    return FsTier(make_ctx(ROW, 8), root_dir=str(root), rescan_interval_s=None, **options)


@contextlib.contextmanager
def unblocking(fifo: Path):
    """Run the block; after it, open `fifo` read-write once, so a reader blocked opening it (on a
    tier that would block) is let go and the test ends instead of hanging."""
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))


@pytest.mark.parametrize("direct_io", [None, False])
def test_a_fifo_at_a_chunk_path_fails_its_load_at_once_and_is_counted(root: Path, direct_io) -> None:
    tier = new_tier(root, direct_io=direct_io)
    try:
        key, other = random_key(), random_key()
        assert store_keys(tier, tier.ctx, [key, other]).success
        fifo = chunk_path(root, key)
        fifo.unlink()
        os.mkfifo(fifo)
        with unblocking(fifo):
            result = load_keys(tier, tier.ctx, [key], job_id=2)
        assert result.successful_keys == ()
        assert tier.lookup([key]) == [LookupResult.MISS]
        assert tier.counts()[ChunkError.MAGIC] == 1
        assert not fifo.exists()
        # The tier is still up: the other chunk loads, and the key stores and loads again.
        assert load_keys(tier, tier.ctx, [other], job_id=3).success
        assert store_keys(tier, tier.ctx, [key], job_id=4).success
        assert load_keys(tier, tier.ctx, [key], job_id=5).success
        assert bytes(tier.ctx.slot_view(0)) == payload(key, ROW)
    finally:
        tier.shutdown()


@pytest.mark.parametrize("direct_io", [None, False])
def test_a_symlinked_chunk_file_is_never_followed(root: Path, outside: Path, direct_io) -> None:
    tier = new_tier(root, direct_io=direct_io)
    try:
        key = random_key()
        assert store_keys(tier, tier.ctx, [key]).success
        path = chunk_path(root, key)
        target = outside / key.hex()
        shutil.copy(path, target)  # a valid chunk of this key, but outside the root
        path.unlink()
        path.symlink_to(target)
        assert load_keys(tier, tier.ctx, [key], job_id=2).successful_keys == ()
        assert tier.counts()[ChunkError.MAGIC] == 1
        assert not path.is_symlink() and target.read_bytes()[:8] == chunkfmt.MAGIC
    finally:
        tier.shutdown()


def test_a_store_into_a_fanout_replaced_by_a_symlink_writes_nothing_outside(
    root: Path, outside: Path
) -> None:
    tier = new_tier(root)
    try:
        key = random_key()
        fanout = root / LAYOUT_FP / key.hex()[:2]
        fanout.rmdir()
        fanout.symlink_to(outside, target_is_directory=True)
        assert store_keys(tier, tier.ctx, [key]).success
        assert list(outside.iterdir()) == []
        assert fanout.is_dir() and not fanout.is_symlink()
        assert load_keys(tier, tier.ctx, [key], job_id=2).success
    finally:
        tier.shutdown()


def test_a_chunk_behind_a_symlinked_fanout_is_not_served(root: Path, outside: Path) -> None:
    tier = new_tier(root)
    try:
        key = random_key()
        assert store_keys(tier, tier.ctx, [key]).success
        fanout = root / LAYOUT_FP / key.hex()[:2]
        shutil.copy(chunk_path(root, key), outside / key.hex())
        shutil.rmtree(fanout)
        fanout.symlink_to(outside, target_is_directory=True)
        result = load_keys(tier, tier.ctx, [key], job_id=2)
        assert result.successful_keys == ()
        assert tier.counts()[TierCounter.LOADED] == 0
        assert [p.name for p in outside.iterdir()] == [key.hex()]
    finally:
        tier.shutdown()


def test_the_rescan_never_walks_into_a_symlinked_fanout(root: Path, outside: Path) -> None:
    tier = FsTier(make_ctx(ROW, 8), root_dir=str(root), rescan_interval_s=0.02)
    try:
        key = random_key()
        victim = outside / key.hex()  # a chunk name of the wrong size: a scan inside root removes it
        victim.write_bytes(b"the operator's file")
        stale = outside / f".{key.hex()}.tmp.1.00000000"  # a stale temp: a scan removes it too
        stale.write_bytes(b"another")
        os.utime(stale, (0, 0))
        fanout = root / LAYOUT_FP / key.hex()[:2]
        fanout.rmdir()
        fanout.symlink_to(outside, target_is_directory=True)
        scans = tier.counts()[TierCounter.RESCANS]
        wait_until(lambda: tier.counts()[TierCounter.RESCANS] >= scans + 2, "two rescans", WAIT_S)
        assert tier.usage().chunks == 0 and tier.counts().bad_chunks == 0
        assert victim.read_bytes() == b"the operator's file" and stale.exists()
    finally:
        tier.shutdown()


def sidecar_answer(sidecar: BlockSidecar, key: bytes) -> list:
    sidecar.ask(TierEventKind.STORED, key)
    return wait_until(sidecar.take_answers, "the sidecar's answer", WAIT_S)


@pytest.mark.parametrize("planted", ["/dev/zero", "fifo"])
def test_a_hostile_sidecar_is_not_read_and_names_nothing(
    root: Path, planted: str, caplog: pytest.LogCaptureFixture
) -> None:
    root.mkdir()  # the fs tier's root, which the tier makes: a sidecar never does
    sidecar = BlockSidecar(str(root), LAYOUT_FP, 16, lambda: bytes(32))
    try:
        key = random_key()
        good = random_key()
        sidecar.save(good, ChunkBlocks((bytes(32),), None, array("I", range(16))))
        path = Path(sidecar.path(key))
        path.parent.mkdir(parents=True, exist_ok=True)
        if planted == "fifo":
            os.mkfifo(path)
        else:
            path.symlink_to(planted)
        with unblocking(path):
            assert sidecar_answer(sidecar, key) == [(TierEventKind.STORED, key, None)]
        assert not path.exists() and not path.is_symlink()
        [(_, _, blocks)] = sidecar_answer(sidecar, good)
        assert blocks is not None and list(blocks.tokens) == list(range(16))
        assert not [r for r in caplog.records if "failed" in r.getMessage()]
    finally:
        sidecar.close()


def test_fsck_refuses_a_huge_claimed_payload_without_allocating_it(root: Path) -> None:
    tier = new_tier(root)
    try:
        assert store_keys(tier, tier.ctx, [random_key() for _ in range(3)]).success
    finally:
        tier.shutdown()
    huge = 1 << 30
    key = random_key()
    sparse = chunk_path(root, key)
    header = bytearray(chunkfmt.HEADER_BYTES)
    chunkfmt.pack_header_digest(header, key, bytes.fromhex(LAYOUT_FP), huge, bytes(16))
    with open(sparse, "wb") as f:
        f.write(header)
        f.truncate(chunkfmt.HEADER_BYTES + huge)  # 4 KiB on disk
    for row_bytes in (None, ROW):
        tracemalloc.start()
        try:
            given = {} if row_bytes is None else {"row_bytes": row_bytes}
            report = fsck(str(root), repair=False, **given)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert [(b.path, b.reason) for b in report.bad] == [(str(sparse), "wrong_length")]
        assert report.good_files == 3 and report.row_bytes == {LAYOUT_FP: ROW}
        assert peak < 16 << 20


def test_fsck_streams_the_checksum_of_a_payload_it_cannot_judge_by_length(root: Path) -> None:
    huge = 1 << 30
    key = random_key()
    (root / LAYOUT_FP / key.hex()[:2]).mkdir(parents=True)
    sparse = chunk_path(root, key)
    header = bytearray(chunkfmt.HEADER_BYTES)
    chunkfmt.pack_header_digest(header, key, bytes.fromhex(LAYOUT_FP), huge, bytes(16))
    with open(sparse, "wb") as f:
        f.write(header)
        f.truncate(chunkfmt.HEADER_BYTES + huge)
    tracemalloc.start()
    try:
        report = fsck(str(root), repair=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [(b.path, b.reason) for b in report.bad] == [(str(sparse), "checksum")]
    assert report.removed == [str(sparse)] and all_files(root) == []
    assert peak < 16 << 20


def test_a_sidecar_fanout_replaced_by_a_symlink_leads_nowhere_outside(root: Path, outside: Path) -> None:
    """A sidecar's fan-out directory replaced by a link to a directory outside the root: a save
    replaces the link with a directory of its own, a read or a removal never reaches through it."""
    root.mkdir(exist_ok=True)
    sidecar = BlockSidecar(str(root), LAYOUT_FP, 16, lambda: bytes(32))
    try:
        key = random_key()
        blocks = ChunkBlocks((bytes(32),), None, array("I", range(16)))
        sidecar.save(key, blocks)
        path = Path(sidecar.path(key))
        assert sidecar_answer(sidecar, key)[0][2] is not None  # saved and read back
        victim = outside / path.name
        victim.write_bytes(path.read_bytes())  # a valid sidecar, reachable only through the link
        fanout = path.parent
        for entry in fanout.iterdir():
            entry.unlink()
        fanout.rmdir()
        fanout.symlink_to(outside)
        assert sidecar_answer(sidecar, key) == [(TierEventKind.STORED, key, None)]
        sidecar.drop(key)
        assert victim.exists()  # the drop did not reach through the link
        other = key[:1] + random_key()[1:]  # a key of the same fan-out directory
        sidecar.save(other, blocks)
        assert sidecar_answer(sidecar, other)[0][2] is not None
        assert sorted(p.name for p in outside.iterdir()) == [victim.name]  # nothing written outside
        assert fanout.is_dir() and not fanout.is_symlink()  # the link replaced by our directory
    finally:
        sidecar.close()
