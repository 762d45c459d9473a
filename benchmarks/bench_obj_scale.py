"""The obj tier at scale: start-up listing, lookups and HEADs at N objects in one bucket.

A real SeaweedFS server (`weed mini`, data under `--root`) is started; for each N a bucket is
filled with N chunk objects of `--row-bytes` rows, written straight in the tier's format and names
(`kvtier/<layout fingerprint>/<key hex>`: the `chunkfmt` header, then a row of zeros, so one
checksum serves them all) by `--fill-threads` threads of boto3 `put_object`. Then, with the real
`ObjTier`:

- start-up (with `max_bytes`, so the tier lists its layout prefix at start): the constructor (its
  probe), the first answered lookup (a stored key: answered by a HEAD while the listing runs), and
  the end of the listing (every object known: the index holds N keys);
- lookups after the listing: batches of `--batch` keys, half stored (HIT from the index) and half
  never stored (RETRY, a HEAD queued); keys per second and the p50/p99 of one batch;
- HEADs: a tier without `max_bytes` (no listing) asked about `--heads` stored keys at once, every
  key answered by a HEAD; HEADs per second until all are answered.

The server runs on this machine, sharing its CPUs with the benchmark: these are loopback figures.
Usage: python -m benchmarks.bench_obj_scale --root /var/tmp/kvtier-obj-scale --n 1000 100000 --out R.json
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.scale import LAYOUT_FP, SEED, ChunkHeaders, keys_for, measure_lookups, report
from kvtier.bench.chaos.services import Seaweed
from kvtier.ops.metrics import TierCounter
from kvtier.tiers.base import LookupResult, TierContext
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.obj.tier import ObjTier


def fill(server: Seaweed, bucket: str, keys: list[bytes], row_bytes: int, threads: int) -> float:
    """Create `bucket` and put one chunk object per key; seconds taken."""
    t0 = time.perf_counter()
    client = server.client(max_pool_connections=threads)
    client.create_bucket(Bucket=bucket)
    headers = ChunkHeaders(row_bytes)

    def put(key: bytes) -> None:
        header = headers.pack(key, bytearray(chunkfmt.HEADER_BYTES))
        client.put_object(Bucket=bucket, Key=f"kvtier/{LAYOUT_FP}/{key.hex()}",
                          Body=bytes(header) + headers.row)

    with ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(put, keys):
            pass
    client.close()
    return time.perf_counter() - t0


def make_tier(server: Seaweed, bucket: str, row_bytes: int, max_bytes: int | None,
              io_threads: int) -> ObjTier:
    region = memoryview(mmap.mmap(-1, row_bytes * 4))
    ctx = TierContext(region=region, row_bytes=row_bytes, num_slots=4, layout_fingerprint=LAYOUT_FP,
                      tier_name="obj-scale", log=logging.getLogger("kvtier.tier.obj-scale"))
    options = {**server.tier_options(), "bucket": bucket, "create_bucket": False}
    return ObjTier(ctx, **options, max_bytes=max_bytes, io_threads=io_threads)


def wait_for(what: str, done: Any, timeout_s: float = 300.0) -> float:
    """Poll `done()` until true; the time it became true (perf_counter)."""
    deadline = time.perf_counter() + timeout_s
    while not done():
        if time.perf_counter() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.001)
    return time.perf_counter()


def measure_startup(server: Seaweed, bucket: str, keys: list[bytes],
                    args: argparse.Namespace) -> dict[str, Any]:
    object_bytes = chunkfmt.HEADER_BYTES + args.row_bytes
    t0 = time.perf_counter()
    tier = make_tier(server, bucket, args.row_bytes, 2 * len(keys) * object_bytes, args.io_threads)
    try:
        t_ctor = time.perf_counter()
        t_first = wait_for("the first lookup", lambda: tier.lookup(keys[:1]) == [LookupResult.HIT])
        t_listed = wait_for("the listing", lambda: tier.counts()[TierCounter.LISTINGS] >= 1)
        if tier._index.present != len(keys):
            raise RuntimeError(f"the listing found {tier._index.present} objects, expected {len(keys)}")
        out: dict[str, Any] = {"constructor_s": t_ctor - t0,
                               "startup_to_first_lookup_s": t_first - t0,
                               "startup_to_listed_s": t_listed - t0}
        out.update(measure_lookups(tier, keys, args.batch, args.batches))
    finally:
        tier.shutdown()
    return out


def measure_heads(server: Seaweed, bucket: str, keys: list[bytes],
                  args: argparse.Namespace) -> dict[str, float]:
    asked = random.Random(SEED + 2).sample(keys, min(args.heads, len(keys)))
    tier = make_tier(server, bucket, args.row_bytes, None, args.io_threads)
    try:
        t0 = time.perf_counter()
        tier.lookup(asked)
        wait_for("the HEADs", lambda: tier.counts()[TierCounter.HEADS] >= len(asked))
        seconds = time.perf_counter() - t0
        if tier.lookup(asked) != [LookupResult.HIT] * len(asked):
            raise RuntimeError("a stored key was not found by its HEAD")
    finally:
        tier.shutdown()
    return {"heads": len(asked), "heads_per_s": len(asked) / seconds}


def run_one(server: Seaweed, n: int, args: argparse.Namespace) -> dict[str, Any]:
    keys = keys_for(n)
    bucket = f"kvt-scale-{n}"
    out: dict[str, Any] = {"n": n, "fill_s": fill(server, bucket, keys, args.row_bytes,
                                                  args.fill_threads)}
    out.update(measure_startup(server, bucket, keys, args))
    out.update(measure_heads(server, bucket, keys, args))
    return out


FIGURES = ("constructor_s", "startup_to_first_lookup_s", "startup_to_listed_s", "lookups_per_s",
           "batch_p50_us", "batch_p99_us", "heads_per_s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", required=True, help="the server's data directory (removed by the caller)")
    p.add_argument("--n", type=int, nargs="+", default=[1_000, 100_000])
    p.add_argument("--row-bytes", type=int, default=4096)
    p.add_argument("--io-threads", type=int, default=8)
    p.add_argument("--fill-threads", type=int, default=32)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--heads", type=int, default=1000)
    p.add_argument("--out", help="write the raw results here (JSON)")
    args = p.parse_args()
    server = Seaweed(Path(args.root))
    server.start()
    runs = []
    try:
        for n in args.n:
            runs.append(run_one(server, n, args))
            print(json.dumps(runs[-1]), flush=True)
    finally:
        server.kill()
    report(runs, FIGURES, args)


if __name__ == "__main__":
    main()
