"""The redis tier's lookups at N keys in one redis-server, and the server's memory per key.

One redis-server (no persistence) per N, all running at once. Each is filled through redis-py
pipelines (not through the tier) with N values of `--value-bytes` under the tier's own key names
(`kvtier:<layout fingerprint>:<chunk key hex>`; a lookup only asks EXISTS, so the value's content
does not matter); the server's `used_memory` before and after the fill gives its memory per key.

Then `--rounds` rounds, the servers' order alternating, each with a fresh `RedisTier` (so no answer
is cached from an earlier round) asking `--batches` batches of `--batch` keys: half stored keys
(drawn without replacement within the round, so the tier's answer cache never answers) and half
never stored. `lookup_wait_s` is raised so that `lookup` returns when every key is answered: a batch's
time is the time to its answers. Every answer is checked (stored: HIT, others: MISS). The same
batches are also asked with a bare redis-py pipeline of EXISTS (`raw_*`): the server's share.
Figures: keys per second and the p50/p99 of a batch (median of the rounds, with min and max), and
the server's own `usec_per_call` for EXISTS. The servers share this machine's CPUs with the tier.

Chunk values: on the first server, emptied, `--value-count` values of each `--chunk-rows` size plus
the 4 KiB `chunkfmt` header (what the tier stores a chunk) are SET; `MEMORY USAGE` of each against its
length is the server's memory per stored byte (its allocator's size classes); `used_memory` per
value also counts what the client's query buffer holds.
Usage: python -m benchmarks.bench_redis_scale --root /var/tmp/kvtier-redis-scale --n 10000 1000000 \
    --out R.json
"""

from __future__ import annotations

import argparse
import logging
import mmap
import random
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.scale import LAYOUT_FP, SEED, keys_for, report
from kvtier.bench.chaos.services import Redis
from kvtier.tiers.base import LookupResult, TierContext
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.redis.tier import RedisTier

KEY_PREFIX = "kvtier"
FILL_BATCH = 10_000


def rkey(key: bytes) -> bytes:
    """The tier's Redis key of a chunk key (`ChunkStore.rkey` with the default prefix)."""
    return f"{KEY_PREFIX}:{LAYOUT_FP}:{key.hex()}".encode()


def memory(server: Redis) -> dict[str, float]:
    client = server.client()
    info = client.info("memory")
    client.close()
    return {k: float(info[k]) for k in ("used_memory", "used_memory_rss", "mem_fragmentation_ratio")}


def fill(server: Redis, keys: list[bytes], value_bytes: int) -> dict[str, Any]:
    """SET every key (pipelines of FILL_BATCH); seconds taken and memory per key."""
    before = memory(server)
    client = server.client()
    value = bytes(value_bytes)
    t0 = time.perf_counter()
    for i in range(0, len(keys), FILL_BATCH):
        pipe = client.pipeline(transaction=False)
        for key in keys[i : i + FILL_BATCH]:
            pipe.set(rkey(key), value)
        pipe.execute()
    fill_s = time.perf_counter() - t0
    if client.dbsize() != len(keys):
        raise RuntimeError(f"the server holds {client.dbsize()} keys, expected {len(keys)}")
    client.close()
    after = memory(server)
    per_key = (after["used_memory"] - before["used_memory"]) / len(keys)
    return {"fill_s": fill_s, "memory_before": before, "memory_after": after,
            "memory_bytes_per_key": per_key,
            "memory_overhead_bytes_per_key": per_key - len(rkey(keys[0])) - value_bytes}


def chunk_values(server: Redis, rows: list[int], count: int) -> list[dict[str, float]]:
    """Memory a chunk value of each row size takes in the server (emptied before each size)."""
    client = server.client()
    out = []
    for row in rows:
        client.flushall()
        base = float(client.info("memory")["used_memory"])
        value = bytes(row + chunkfmt.HEADER_BYTES)
        for i in range(count):
            client.set(f"chunk-{i}", value)
        per_value = (float(client.info("memory")["used_memory"]) - base) / count
        usage = statistics.mean(float(client.memory_usage(f"chunk-{i}")) for i in range(count))
        out.append({"row_bytes": row, "value_bytes": len(value), "used_memory_per_value": per_value,
                    "memory_usage_per_value": usage, "memory_usage_per_value_byte": usage / len(value)})
    client.flushall()
    client.close()
    return out


def make_tier(server: Redis) -> RedisTier:
    region = memoryview(mmap.mmap(-1, 4096 * 2))
    ctx = TierContext(region=region, row_bytes=4096, num_slots=2, layout_fingerprint=LAYOUT_FP,
                      tier_name="redis-scale", log=logging.getLogger("kvtier.tier.redis-scale"))
    return RedisTier(ctx, url=server.url, io_threads=1, lookup_wait_s=10.0)


def batches_for(keys: list[bytes], batch: int, batches: int, rng: random.Random) -> list[list[bytes]]:
    """`batches` batches, odd positions stored keys (none twice), even ones never stored."""
    hits = rng.sample(keys, batches * (batch // 2))
    out = []
    for b in range(batches):
        mine = iter(hits[b * (batch // 2) : (b + 1) * (batch // 2)])
        out.append([next(mine) if i % 2 else rng.randbytes(32) for i in range(batch // 2 * 2)])
    return out


def stats(lat: list[float], keys: int) -> dict[str, float]:
    q = statistics.quantiles(lat, n=100)
    return {"lookups_per_s": keys / sum(lat), "batch_p50_us": q[49] * 1e6, "batch_p99_us": q[98] * 1e6}


def measure_round(server: Redis, keys: list[bytes], args: argparse.Namespace, rnd: int) -> dict[str, Any]:
    """One round: the tier's lookups, then the same batches as bare EXISTS pipelines."""
    todo = batches_for(keys, args.batch, args.batches, random.Random(SEED * 1000 + rnd))
    stored = set(keys)
    tier = make_tier(server)
    lat: list[float] = []
    try:
        for ks in todo:
            t0 = time.perf_counter()
            out = tier.lookup(ks)
            lat.append(time.perf_counter() - t0)
            want = [LookupResult.HIT if k in stored else LookupResult.MISS for k in ks]
            if out != want:
                raise RuntimeError(f"wrong answers: {sum(a != b for a, b in zip(out, want, strict=True))}")
    finally:
        tier.shutdown()
    client = server.client()
    raw: list[float] = []
    for ks in todo:
        t0 = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for k in ks:
            pipe.exists(rkey(k))
        pipe.execute()
        raw.append(time.perf_counter() - t0)
    client.close()
    n_keys = len(todo) * len(todo[0])
    return {**stats(lat, n_keys), **{f"raw_{k}": v for k, v in stats(raw, n_keys).items()}}


FIGURES = ("memory_bytes_per_key", "memory_overhead_bytes_per_key", "lookups_per_s", "batch_p50_us",
           "batch_p99_us", "raw_lookups_per_s", "raw_batch_p99_us", "server_exists_usec_per_call")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", required=True, help="the servers' working directory")
    p.add_argument("--n", type=int, nargs="+", default=[10_000, 1_000_000])
    p.add_argument("--value-bytes", type=int, default=100)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--chunk-rows", type=int, nargs="+", default=[512 << 10, 2 << 20, 8 << 20, 32 << 20])
    p.add_argument("--value-count", type=int, default=8)
    p.add_argument("--out", help="write the raw results here (JSON)")
    args = p.parse_args()
    if args.batches * (args.batch // 2) > min(args.n):
        raise SystemExit("--batches x --batch / 2 must not exceed the smallest --n")
    servers = {n: Redis(Path(args.root) / str(n)) for n in args.n}
    runs: dict[int, dict[str, Any]] = {}
    try:
        first = servers[args.n[0]]
        first.start()
        chunk_mem = chunk_values(first, args.chunk_rows, args.value_count)
        print(chunk_mem, flush=True)
        for n, server in servers.items():
            if server is not first:
                server.start()
            runs[n] = {"n": n, **fill(server, keys_for(n), args.value_bytes), "rounds": []}
            print(runs[n], flush=True)
        for rnd in range(args.rounds):
            for n in (args.n if rnd % 2 == 0 else args.n[::-1]):
                runs[n]["rounds"].append(measure_round(servers[n], keys_for(n), args, rnd))
                print(n, runs[n]["rounds"][-1], flush=True)
        for n, server in servers.items():
            client = server.client()
            runs[n]["server_exists_usec_per_call"] = float(
                client.info("commandstats")["cmdstat_exists"]["usec_per_call"])
            runs[n]["redis_version"] = client.info("server")["redis_version"]
            client.close()
    finally:
        for server in servers.values():
            server.kill()
    for run in runs.values():
        for fig in ("lookups_per_s", "batch_p50_us", "batch_p99_us", "raw_lookups_per_s",
                    "raw_batch_p50_us", "raw_batch_p99_us"):
            values = [r[fig] for r in run["rounds"]]
            run[fig] = statistics.median(values)
            run[f"{fig}_range"] = [min(values), max(values)]
    runs[args.n[0]]["chunk_values"] = chunk_mem
    report([runs[n] for n in args.n], FIGURES, args)


if __name__ == "__main__":
    main()
