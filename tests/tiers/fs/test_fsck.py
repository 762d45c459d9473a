"""`kvtier fsck`: a clean directory passes; every kind of bad file and orphaned temp is reported, and
removed with --repair; the exit status and JSON report say what was found."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest

from kvtier.tiers.fs import fsck as fsck_module
from kvtier.tiers.fs.fsck import STRAY, WRONG_DIR, add_fsck_parser, fsck
from kvtier.tiers.fs.tier import FsTier
from tests.conftest import random_key
from tests.tiers.fs.helpers import (
    LAYOUT_FP,
    OTHER_FP,
    all_files,
    chunk_path,
    make_ctx,
    set_mtime,
    store_keys,
)

ROW = 2 * 4096


def populate(root: Path, n: int, fp: str = LAYOUT_FP) -> list[bytes]:
    tier = FsTier(make_ctx(ROW, n, fp), root_dir=str(root))
    try:
        keys = [random_key() for _ in range(n)]
        if not store_keys(tier, tier.ctx, keys).success:
            raise RuntimeError("populate: store failed")
        return keys
    finally:
        tier.shutdown()


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="kvtier")
    add_fsck_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    code = args.func(args)
    return code, capsys.readouterr().out


def test_a_clean_directory_is_ok(tmp_path: Path, capsys) -> None:
    populate(tmp_path, 5)
    populate(tmp_path, 3, OTHER_FP)
    report = fsck(str(tmp_path), repair=False)
    assert report.ok
    assert (report.files, report.good_files) == (8, 8)
    assert report.good_bytes == 8 * (4096 + ROW)
    code, out = cli(["fsck", str(tmp_path), "--json"], capsys)
    doc = json.loads(out)
    assert code == 0
    assert doc["ok"] is True and doc["files"] == 8 and doc["bad"] == [] and doc["orphans"] == []


def damage_everything(root: Path) -> dict[str, str]:
    """Make one file of each kind of damage; returns {path: expected reason}."""
    keys = populate(root, 8)
    expected: dict[str, str] = {}

    def flip(path: Path, offset: int) -> None:
        data = bytearray(path.read_bytes())
        data[offset] ^= 0xFF
        path.write_bytes(bytes(data))

    p = chunk_path(root, keys[0])
    flip(p, 4096 + 7)
    expected[str(p)] = "checksum"
    p = chunk_path(root, keys[1])
    os.truncate(p, 4096 + ROW // 2)
    expected[str(p)] = "short"
    p = chunk_path(root, keys[2])
    p.write_bytes(b"not a chunk at all" * 300)
    expected[str(p)] = "foreign_format"
    wrong_key = random_key()
    p = chunk_path(root, wrong_key)
    p.parent.mkdir(exist_ok=True)
    shutil.copyfile(chunk_path(root, keys[3]), p)
    expected[str(p)] = "wrong_key"
    other_dir = next(k for k in (random_key() for _ in range(50)) if k[0] != keys[4][0])
    p = chunk_path(root, keys[4]).parent.parent / other_dir.hex()[:2] / keys[4].hex()
    p.parent.mkdir(exist_ok=True)
    shutil.copyfile(chunk_path(root, keys[4]), p)
    expected[str(p)] = WRONG_DIR
    p = chunk_path(root, keys[5], OTHER_FP)
    p.parent.mkdir(parents=True)
    shutil.copyfile(chunk_path(root, keys[5]), p)
    expected[str(p)] = "wrong_layout"
    p = chunk_path(root, keys[6]).parent / "notes.txt"
    p.write_text("hello")
    expected[str(p)] = STRAY
    return expected


def test_bad_files_and_orphans_are_reported_then_removed_with_repair(tmp_path: Path, capsys) -> None:
    root = tmp_path / "kv"
    expected = damage_everything(root)
    some_dir = next(iter((root / LAYOUT_FP).iterdir()))
    orphan = some_dir / f".{'ab' * 32}.tmp.12345.0badcafe"
    orphan.write_bytes(b"half written")
    set_mtime(orphan, 3600)
    in_progress = some_dir / f".{'cd' * 32}.tmp.12345.00c0ffee"
    in_progress.write_bytes(b"being written")
    foreign_top = root / "README"
    foreign_top.write_text("not ours")
    before = set(all_files(root))

    report = fsck(str(root), repair=False)
    assert not report.ok
    assert {b.path: b.reason for b in report.bad} == expected
    assert report.orphans == [str(orphan)]
    assert report.in_progress == [str(in_progress)]
    assert report.ignored == [str(foreign_top)]
    assert report.removed == [] and set(all_files(root)) == before
    assert report.good_files == 5

    code, out = cli(["fsck", str(root), "--repair", "--json"], capsys)
    doc = json.loads(out)
    assert code == 1
    assert doc["ok"] is False
    assert sorted(doc["removed"]) == sorted([*expected, str(orphan)])
    assert {b["path"] for b in doc["bad"]} == set(expected)
    assert set(all_files(root)) == before - {Path(p) for p in doc["removed"]}
    assert in_progress.exists() and foreign_top.exists()

    code, out = cli(["fsck", str(root)], capsys)
    assert code == 0
    assert "5 chunk files, 5 good" in out
    again = fsck(str(root), repair=False)
    assert again.ok and again.files == 5


def test_text_output_lists_bad_files(tmp_path: Path, capsys) -> None:
    [key] = populate(tmp_path, 1)
    os.truncate(chunk_path(tmp_path, key), 10)
    code, out = cli(["fsck", str(tmp_path)], capsys)
    assert code == 1
    assert f"bad (short): {chunk_path(tmp_path, key)}" in out


def test_a_missing_directory_cannot_be_checked(tmp_path: Path, capsys) -> None:
    code, out = cli(["fsck", str(tmp_path / "nope")], capsys)
    assert code == 2 and "cannot check" in out
    with pytest.raises(FileNotFoundError):
        fsck(str(tmp_path / "nope"), repair=False)


def test_repair_never_removes_through_a_fanout_swapped_for_a_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between fsck's listing of a fan-out directory and its removal of a bad file there, a writer
    of the root swaps the directory for a link to another directory holding a file of the same
    name: the removal goes through the descriptor of the directory fsck listed, never the link."""
    root, outside = tmp_path / "kv", tmp_path / "outside"
    outside.mkdir()
    [key] = populate(root, 1)
    path = Path(chunk_path(root, key))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))  # bad: fsck --repair removes it
    victim = outside / path.name
    victim.write_bytes(b"not fsck's to remove")
    verify = fsck_module._verify

    def swapped_then_verified(name: str, dir_fd: int, *args: object) -> tuple[str | None, int]:
        result = verify(name, dir_fd, *args)  # type: ignore[arg-type]
        fan = path.parent
        fan.rename(tmp_path / "moved-away")
        fan.symlink_to(outside)
        return result

    monkeypatch.setattr(fsck_module, "_verify", swapped_then_verified)
    report = fsck(str(root), repair=True)
    assert [b.reason for b in report.bad] == ["checksum"] and report.removed == [str(path)]
    assert victim.read_bytes() == b"not fsck's to remove"
    assert not (tmp_path / "moved-away" / path.name).exists()  # the bad file itself is gone
