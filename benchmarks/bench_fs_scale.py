"""The fs tier at scale: start-up, lookups, index memory, eviction and fsck at N chunk files.

For each N the tier directory is filled with N chunk files of `--row-bytes` rows, written straight
in the tier's on-disk format (the `chunkfmt` header, then the row; every row is zeros, so one
checksum serves them all; files already there are kept, so a second run only tops up). Then, with
the real `FsTier`:

- start-up: from the tier's constructor (its initial directory scan) to the first answered lookup;
- lookups: batches of `--batch` keys, half stored and half never stored, in random order; keys per
  second and the p50/p99 of one batch;
- index memory: tracemalloc's traced bytes held after a second tier's start (its index, nothing
  else of the scan survives it), divided by N;
- eviction: `max_bytes` lowered to `--evict-share` of what the tier holds, then the time to get
  under it (the eviction pass a rescan runs: victims chosen and unlinked);
- fsck: `kvtier fsck` of the directory (every file read and checked), without repair.

The files are synced to disk after the fill (so evicting one frees allocated blocks at every N),
and the page cache is warm (the files were just written or listed): these are warm-cache figures.
Usage: python -m benchmarks.bench_fs_scale --root /var/tmp/kvtier-fs-scale --n 10000 1000000 --out R.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import mmap
import os
import time
import tracemalloc
from typing import Any

from benchmarks.scale import LAYOUT_FP, ChunkHeaders, keys_for, measure_lookups, report
from kvtier.tiers.base import TierContext
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.fs.fsck import fsck
from kvtier.tiers.fs.index import fanout_name
from kvtier.tiers.fs.tier import FsTier


def fill(layout_dir: str, keys: list[bytes], row_bytes: int) -> tuple[int, float]:
    """Write the chunk files of `keys` that are not there yet; (files written, seconds)."""
    t0 = time.perf_counter()
    headers = ChunkHeaders(row_bytes)
    header = bytearray(chunkfmt.HEADER_BYTES)
    fds = {}
    for i in range(256):
        fan = f"{i:02x}"
        os.makedirs(os.path.join(layout_dir, fan), mode=0o700, exist_ok=True)
        fds[fan] = os.open(os.path.join(layout_dir, fan), os.O_RDONLY | os.O_DIRECTORY)
    written = 0
    try:
        for key in keys:
            name = key.hex()
            dir_fd = fds[fanout_name(name)]
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd)
            except FileExistsError:
                continue
            try:
                wrote = os.writev(fd, [headers.pack(key, header), headers.row])
                if wrote != chunkfmt.HEADER_BYTES + row_bytes:
                    raise OSError(f"short write of {name}")
            finally:
                os.close(fd)
            written += 1
    finally:
        for fd in fds.values():
            os.close(fd)
    return written, time.perf_counter() - t0


def make_tier(root: str, row_bytes: int, max_bytes: int | None) -> FsTier:
    region = memoryview(mmap.mmap(-1, row_bytes * 4))
    ctx = TierContext(region=region, row_bytes=row_bytes, num_slots=4, layout_fingerprint=LAYOUT_FP,
                      tier_name="fs-scale", log=logging.getLogger("kvtier.tier.fs-scale"))
    return FsTier(ctx, root_dir=root, max_bytes=max_bytes, n_read_threads=1, n_write_threads=1,
                  rescan_interval_s=None, direct_io=False)


def run_one(root: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    keys = keys_for(n)
    layout_dir = os.path.join(root, LAYOUT_FP)
    written, fill_s = fill(layout_dir, keys, args.row_bytes)
    os.sync()  # unlinking a file whose blocks were never allocated is cheaper: compare like with like
    file_bytes = chunkfmt.HEADER_BYTES + args.row_bytes
    out: dict[str, Any] = {"n": n, "filled": written, "fill_s": fill_s}

    gc.collect()
    t0 = time.perf_counter()
    tier = make_tier(root, args.row_bytes, 2 * n * file_bytes)
    tier.lookup(keys[:1])
    out["startup_to_first_lookup_s"] = time.perf_counter() - t0
    try:
        if len(tier._index) != n:
            raise RuntimeError(f"the tier found {len(tier._index)} files, expected {n}")
        out.update(measure_lookups(tier, keys, args.batch, args.batches))
    finally:
        tier.shutdown()
    del tier

    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    tier = make_tier(root, args.row_bytes, 2 * n * file_bytes)
    gc.collect()
    out["index_bytes_per_chunk"] = (tracemalloc.get_traced_memory()[0] - before) / n
    tracemalloc.stop()
    try:
        t0 = time.perf_counter()
        report = fsck(root, repair=False)
        out["fsck_s"] = time.perf_counter() - t0
        if not report.ok or report.good_files != n:
            raise RuntimeError(f"fsck: {report.good_files} good files of {n}, ok={report.ok}")

        index = tier._index
        index.max_bytes = int(index.bytes_used * args.evict_share)
        t0 = time.perf_counter()
        granted, victims = index.reserve(0)
        tier._evict(victims)
        out["evict_s"] = time.perf_counter() - t0
        out["evicted"] = len(victims)
        if not granted or index.bytes_used > index.max_bytes:
            raise RuntimeError("eviction did not get under max_bytes")
    finally:
        tier.shutdown()
    return out


FIGURES = ("startup_to_first_lookup_s", "lookups_per_s", "batch_p50_us", "batch_p99_us",
           "index_bytes_per_chunk", "evict_s", "fsck_s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", required=True, help="tier directory (kept, to be reused)")
    p.add_argument("--n", type=int, nargs="+", default=[10_000, 1_000_000])
    p.add_argument("--row-bytes", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--evict-share", type=float, default=0.9)
    p.add_argument("--out", help="write the raw results here (JSON)")
    args = p.parse_args()
    runs = []
    for n in args.n:
        runs.append(run_one(os.path.join(args.root, str(n)), n, args))
        print(json.dumps(runs[-1]), flush=True)
    report(runs, FIGURES, args)


if __name__ == "__main__":
    main()
