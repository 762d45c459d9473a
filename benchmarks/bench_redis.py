"""redis tier throughput next to raw redis-py pipelined SET/GET, on one redis-server, in one run.

    python -m benchmarks.bench_redis --chunks 128 --chunk-bytes 2097152 --threads 4 --repeats 5

Starts its own redis-server (loopback TCP, persistence off) unless `--url` names one. Each repeat
runs both contenders, in alternating order, against an emptied server (FLUSHALL before each):

- raw: `threads` threads, each with its own `redis.Redis` client, SET then GET the same number of
  values of the same size as the tier stores (chunk + 4 KiB header), through
  `pipeline(transaction=False)`, `depth` values per round trip (the tier's batch at this size:
  `batch_bytes` / value size). The values are ready-made `bytes`; GET results are only received.
- raw-deep: the same with each thread's whole share in one pipeline.
- tier: `kvtier tier-bench --tier redis --url URL --chunk-bytes N --chunks K --threads T --json`
  (a real tier process over a real host region: rows go out from and come back into the region,
  with the header checksummed on store and verified on load).

Throughput counts chunk payload bytes (the same for all). Prints a table and a JSON document with
the medians and the ratios tier / best raw (the higher of raw and raw-deep, per phase).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import redis

from kvtier.tiers.common import chunkfmt
from tests.services.redis_server import start_server, stop_server

DEFAULT_BATCH_BYTES = 8 << 20
"""The redis tier's default `batch_bytes` (the raw client gets the same values per round trip)."""


def raw_redis_py(url: str, value_bytes: int, chunks: int, threads: int, depth: int) -> dict[str, float]:
    """Seconds for raw redis-py to SET then GET `chunks` values over `threads` connections."""
    shares = [list(range(t, chunks, threads)) for t in range(threads)]
    values = [os.urandom(value_bytes) for _ in range(min(chunks, 8))]
    clients = [redis.Redis.from_url(url) for _ in range(threads)]
    for c in clients:
        c.ping()
    errors: list[BaseException] = []

    def run(phase: str) -> float:
        barrier = threading.Barrier(threads + 1)

        def worker(t: int) -> None:
            try:
                barrier.wait()
                share = shares[t]
                for j in range(0, len(share), depth):
                    pipe = clients[t].pipeline(transaction=False)
                    for i in share[j : j + depth]:
                        if phase == "set":
                            pipe.set(f"raw:{i}", values[i % len(values)])
                        else:
                            pipe.get(f"raw:{i}")
                    replies = pipe.execute()
                    if phase == "get" and any(len(r) != value_bytes for r in replies):
                        raise RuntimeError("a GET returned a value of the wrong size")
            except BaseException as e:
                errors.append(e)

        pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
        for th in pool:
            th.start()
        barrier.wait()
        start = time.perf_counter()
        for th in pool:
            th.join()
        if errors:
            raise errors[0]
        return time.perf_counter() - start

    try:
        return {"store_s": run("set"), "load_s": run("get")}
    finally:
        for c in clients:
            c.close()


def tier_bench(url: str, chunk_bytes: int, chunks: int, threads: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvtier.cli", "tier-bench", "--tier", "redis", "--url", url,
           "--chunk-bytes", str(chunk_bytes), "--chunks", str(chunks), "--threads", str(threads),
           "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    report: dict[str, Any] = json.loads(out.stdout)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", help="an existing server (default: start a redis-server)")
    p.add_argument("--server", default="redis-server", help="the binary to start (valkey-server)")
    p.add_argument("--chunks", type=int, default=128)
    p.add_argument("--chunk-bytes", type=int, default=2 << 20)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json-out", help="also write the JSON document here")
    args = p.parse_args(argv)

    server = None if args.url else start_server(args.server)
    url = args.url or server.url  # type: ignore[union-attr]
    value_bytes = chunkfmt.HEADER_BYTES + args.chunk_bytes
    depth = max(1, DEFAULT_BATCH_BYTES // value_bytes)
    gib = args.chunk_bytes * args.chunks / 2**30
    deep = -(-args.chunks // args.threads)
    contenders = ["raw", "raw-deep", "tier"]
    rows: dict[str, dict[str, list[float]]] = {c: {"store": [], "load": []} for c in contenders}
    try:
        admin = redis.Redis.from_url(url)
        for rep in range(args.repeats):
            order = contenders[rep % 3 :] + contenders[: rep % 3]
            for who in order:
                admin.flushall()
                time.sleep(0.2)
                if who == "tier":
                    r = tier_bench(url, args.chunk_bytes, args.chunks, args.threads)
                else:
                    d = depth if who == "raw" else deep
                    r = raw_redis_py(url, value_bytes, args.chunks, args.threads, d)
                rows[who]["store"].append(gib / r["store_s"])
                rows[who]["load"].append(gib / r["load_s"])
                print(f"repeat {rep} {who:8s}: store {gib / r['store_s']:.3f} GiB/s, "
                      f"load {gib / r['load_s']:.3f} GiB/s", file=sys.stderr, flush=True)
        admin.flushall()
        admin.close()
    finally:
        if server is not None:
            stop_server(server)

    med = {who: {ph: statistics.median(v) for ph, v in by.items()} for who, by in rows.items()}
    best = {ph: max(med["raw"][ph], med["raw-deep"][ph]) for ph in ("store", "load")}
    doc = {
        "server": args.url or args.server, "chunks": args.chunks, "chunk_bytes": args.chunk_bytes,
        "value_bytes": value_bytes, "threads": args.threads, "raw_pipeline_depth": depth,
        "raw_deep_pipeline_depth": deep,
        "repeats": args.repeats, "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
        "median_gib_s": med, "all_gib_s": rows,
        "ratio": {ph: med["tier"][ph] / best[ph] for ph in ("store", "load")},
    }
    print(f"{'':9s} {'store GiB/s':>12s} {'load GiB/s':>12s}")
    for who in contenders:
        print(f"{who:9s} {med[who]['store']:12.3f} {med[who]['load']:12.3f}")
    print(f"{'tier/raw':9s} {doc['ratio']['store']:12.2f} {doc['ratio']['load']:12.2f}")
    print(json.dumps(doc))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
