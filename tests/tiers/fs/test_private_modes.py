"""What the fs tier, its block sidecars and the trace writer create is private to the serving user
(files 0600, directories 0700) whatever the umask, even 0; `shared_group` opens the tier's to the
root's group (0660, directories 2770) on purpose; directories an older version made more open are
tightened at start."""

from __future__ import annotations

import contextlib
import os
import stat
from array import array
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.engine.events.block_sidecar import BlockSidecar
from kvtier.engine.events.chunk_blocks import ChunkBlocks
from kvtier.errors import ConfigError
from kvtier.tiers.fs import store_helper
from kvtier.tiers.fs.tier import FsTier
from kvtier.trace.records import TraceHeader
from kvtier.trace.writer import TraceWriter
from tests.conftest import random_key
from tests.tiers.fs.helpers import LAYOUT_FP, make_ctx, store_keys

ROW = 4 * 4096


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes_under(root: Path) -> tuple[set[int], set[int]]:
    """The permission bits of the files, and of the directories, under `root` (itself included)."""
    files: set[int] = set()
    dirs = {stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        mode = path.lstat().st_mode
        (dirs if stat.S_ISDIR(mode) else files).add(stat.S_IMODE(mode))
    return files, dirs


@pytest.mark.parametrize("native", [True, False])
def test_chunk_files_and_directories_are_private_under_umask_0(
    tmp_path: Path, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if native and store_helper.load() is None:
        pytest.skip("no C compiler here: the fs tier runs its Python store path only")
    if not native:
        monkeypatch.setattr(store_helper, "load", lambda: None)
    root = tmp_path / "kv"
    with umask(0):
        tier = FsTier(make_ctx(ROW, 4), root_dir=str(root))
        try:
            assert store_keys(tier, tier.ctx, [random_key() for _ in range(4)]).success
        finally:
            tier.shutdown()
    files, dirs = modes_under(root)
    assert files == {0o600} and dirs == {0o700}


def test_shared_group_opens_files_and_directories_to_the_group(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    with umask(0o077):  # a umask that would keep the group out
        tier = FsTier(make_ctx(ROW, 4), root_dir=str(root), shared_group=True)
        try:
            assert store_keys(tier, tier.ctx, [random_key() for _ in range(4)]).success
        finally:
            tier.shutdown()
    files, dirs = modes_under(root)
    assert files == {0o660} and dirs == {0o2770}


def test_directories_an_older_version_left_open_are_tightened(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    with umask(0o022):
        (root / LAYOUT_FP / "00").mkdir(parents=True)
    tier = FsTier(make_ctx(ROW, 4), root_dir=str(root))
    tier.shutdown()
    assert stat.S_IMODE((root / LAYOUT_FP).stat().st_mode) == 0o700
    assert stat.S_IMODE((root / LAYOUT_FP / "00").stat().st_mode) == 0o700


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_shared_group_must_be_a_boolean(tmp_path: Path, value: object) -> None:
    with pytest.raises(ConfigError) as e:
        FsTier(make_ctx(ROW, 2), root_dir=str(tmp_path), shared_group=value)
    assert e.value.key == "shared_group"


@pytest.mark.parametrize("shared_group", [False, True])
def test_sidecar_files_take_the_tier_modes_under_umask_0(tmp_path: Path, shared_group: bool) -> None:
    root = tmp_path / "kv"
    FsTier(make_ctx(ROW, 2), root_dir=str(root), shared_group=shared_group).shutdown()
    with umask(0):
        sidecar = BlockSidecar(str(root), LAYOUT_FP, 16, lambda: bytes(32))
        try:
            sidecar.save(random_key(), ChunkBlocks((bytes(32),), None, array("I", range(16))))
        finally:
            sidecar.close()
    files, dirs = modes_under(root / f"{LAYOUT_FP}.blocks")
    assert (files, dirs) == (({0o660}, {0o2770}) if shared_group else ({0o600}, {0o700}))


def test_trace_files_are_private_under_umask_0(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    with umask(0):
        writer = TraceWriter(path, TraceHeader("connector", 16, 1, 1000), max_bytes=1 << 20)
        assert writer.write({"t": 0.0})
        writer.close()  # joins the writer thread: the file is written
    assert writer.written == 1 and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_sidecar_directory_an_older_version_left_open_is_tightened(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    FsTier(make_ctx(ROW, 2), root_dir=str(root)).shutdown()
    base = root / f"{LAYOUT_FP}.blocks"
    with umask(0o022):
        base.mkdir()
    BlockSidecar(str(root), LAYOUT_FP, 16, lambda: bytes(32)).close()
    assert stat.S_IMODE(base.stat().st_mode) == 0o700
