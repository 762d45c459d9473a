"""Per-chunk overhead of the fs, obj and redis tiers at chunks of 16, 64 and 256 tokens.

The grid: tier (fs, obj, redis) x row (`8b`: 128 KiB a token, a Llama-3-8B row in bf16; `1b`:
32 KiB a token) x chunk size in tokens. Each cell is `kvtier tier-bench` (`run_tier_bench`: a real
tier process over a real host region, every chunk a job, rows checked after the load) moving about
`--mib` MiB (`--obj-mib` for obj) both ways: chunks = MiB / chunk size. Every round runs every cell
once, in an order shuffled per round; `--repeats` rounds; each figure is the median of the rounds,
with its min and max.

- fs: a fresh directory under `--root` per cell (the tier's defaults: O_DIRECT where the file
  system has it), removed after it.
- obj: a real SeaweedFS (`weed mini`, data under `--root`, its Prometheus metrics on), one bucket
  created before the first cell (its volumes grown then, as a serving bucket's are) and a fresh
  object prefix (the tier's `prefix`) per cell, its objects deleted after it; the tier's options
  plus `OBJ_OPTIONS`. The server's `SeaweedFS_s3_request_total` for the bucket before and after a
  cell gives the cell's S3 requests by type; those of a tier's start (its probe, measured once at
  the start of the run) are taken off, leaving requests per chunk stored and loaded.
- redis: one redis-server (no persistence), FLUSHALL after each cell.

A cell whose jobs failed is recorded with its error and left out of the figures (`rounds` says how
many rounds a cell's figures have). Per cell: GiB/s and chunks (requests) per second both ways.
Per tier and direction, a line fitted through the medians of all its cells, seconds a chunk =
overhead + bytes / bandwidth, gives the tier's fixed cost per chunk at this concurrency. For obj,
S3 requests per 1M tokens and their price at `PRICES`. Servers run on this machine, sharing its
CPUs with the tier: loopback figures. Prints one JSON document (and writes it to `--out`).
Usage: python -m benchmarks.bench_chunk_sizes --root /var/tmp/kvtier-chunk-sizes --out R.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import mmap
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvtier.bench.chaos.services import Redis, Seaweed, free_ports
from kvtier.bench.neutral_paths import neutral_path
from kvtier.bench.tier_bench import run_tier_bench
from kvtier.tiers.base import TierContext
from kvtier.tiers.obj.tier import ObjTier

ROWS = {"8b": 128 << 10, "1b": 32 << 10}
"""Bytes a token of KV cache: Llama-3-8B (32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes) and a
1B model of a quarter of that (Llama-3.2-1B: 16 layers, 8 KV heads of 64)."""
TOKENS = (16, 64, 256)
THREADS = {"fs": 4, "obj": 8, "redis": 4}
"""Each tier's I/O threads: its default."""
OBJ_OPTIONS = {"read_timeout_s": 120.0, "connect_timeout_s": 30.0}
"""A loaded loopback SeaweedFS can stall reading a 32 MiB PUT's body for seconds, and botocore's
socket keeps the connect timeout (the tier's 2 s) while it sends a body: the PUT fails with
ConnectionClosedError (8 of 8 at once, 2.4 s in). Both timeouts raised, so that the cell measures
the server's pace."""
PRICES = {"put_per_1000_usd": 0.005, "get_per_1000_usd": 0.0004}
"""Amazon S3 Standard request prices (us-east-1): PUT, COPY, POST, LIST $0.005 per 1,000; GET,
SELECT and all other requests (HEAD too) $0.0004 per 1,000."""
MTOK = 1_000_000


class MeteredSeaweed(Seaweed):
    """`weed mini` with its Prometheus metrics served, to count the S3 requests per bucket."""

    name = "seaweedfs"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.metrics_port = free_ports(1)[0]

    def _args(self) -> list[str]:
        return [*super()._args(), f"-metricsPort={self.metrics_port}"]

    def requests(self, bucket: str) -> dict[str, int]:
        """S3 requests answered for `bucket` so far, by type (PUT, GET, HEAD, ...)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        out: dict[str, int] = {}
        for line in text.splitlines():
            if line.startswith("SeaweedFS_s3_request_total{") and f'bucket="{bucket}"' in line:
                kind = line.split('type="', 1)[1].split('"', 1)[0]
                out[kind] = out.get(kind, 0) + int(float(line.rsplit(" ", 1)[1]))
        return out

    def drop_objects(self, bucket: str, prefix: str) -> None:
        """Delete every object of `bucket` under `prefix`."""
        client = self.client()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if objects:
                client.delete_objects(Bucket=bucket, Delete={"Objects": objects, "Quiet": True})
        client.close()


def diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}


class Servers:
    """The run's SeaweedFS (one bucket, created at start: its volumes are grown before any cell)
    and redis-server, and what a tier's start costs in S3 requests."""

    def __init__(self, root: Path, tiers: list[str]) -> None:
        self.root = root
        self.seaweed = MeteredSeaweed(root / "seaweedfs") if "obj" in tiers else None
        self.redis = Redis(root / "redis") if "redis" in tiers else None
        self.startup_requests: dict[str, int] = {}
        self._cells = itertools.count()

    def start(self) -> None:
        for server in (self.seaweed, self.redis):
            if server is not None:
                server.start()
        if self.seaweed is not None:
            ctx = TierContext(region=memoryview(mmap.mmap(-1, 8192)), row_bytes=4096, num_slots=2,
                              layout_fingerprint="0" * 32, tier_name="startup",
                              log=logging.getLogger("kvtier.tier.startup"))
            ObjTier(ctx, **self.seaweed.tier_options()).shutdown()  # creates the bucket
            before = self.seaweed.requests(self.seaweed.bucket)
            ObjTier(ctx, **self.seaweed.tier_options()).shutdown()
            self.startup_requests = diff(self.seaweed.requests(self.seaweed.bucket), before)

    def prefix(self) -> str:
        """A fresh object prefix for a cell."""
        return f"cell{next(self._cells)}"

    def stop(self) -> None:
        for server in (self.seaweed, self.redis):
            if server is not None:
                server.kill()


def run_cell(servers: Servers, tier: str, row: str, tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    """One tier-bench pass of the cell; its figures (obj: and its S3 requests by type)."""
    chunk_bytes = tokens * ROWS[row]
    mib = args.obj_mib if tier == "obj" else args.mib
    chunks = max(1, (mib << 20) // chunk_bytes)
    out: dict[str, Any] = {"tier": tier, "row": row, "tokens": tokens, "chunk_bytes": chunk_bytes,
                           "chunks": chunks}
    prefix = ""
    if tier == "fs":
        path = servers.root / "fs" / f"{row}-{tokens}"
        options: dict[str, Any] = {"root_dir": str(path)}
    elif tier == "obj":
        assert servers.seaweed is not None
        prefix = servers.prefix()
        options = {**servers.seaweed.tier_options(), **OBJ_OPTIONS, "prefix": prefix}
        before = servers.seaweed.requests(servers.seaweed.bucket)
    else:
        assert servers.redis is not None
        options = {"url": servers.redis.url}
    try:
        report = run_tier_bench(tier, options, chunk_bytes, chunks, THREADS[tier])
    except RuntimeError as e:  # failed jobs: recorded, the cell left out of the figures
        report = {}
        out["error"] = str(e)
    finally:
        if tier == "fs":
            shutil.rmtree(path, ignore_errors=True)
        elif tier == "obj":
            assert servers.seaweed is not None
            out["s3_requests"] = diff(servers.seaweed.requests(servers.seaweed.bucket), before)
            servers.seaweed.drop_objects(servers.seaweed.bucket, prefix)
        else:
            assert servers.redis is not None
            client = servers.redis.client()
            client.flushall()
            client.close()
    if report:
        out.update({k: report[k] for k in ("store_s", "load_s", "store_gib_s", "load_gib_s")})
        out["store_chunks_per_s"] = chunks / report["store_s"]
        out["load_chunks_per_s"] = chunks / report["load_s"]
    return out


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def s3_figures(samples: list[dict[str, Any]], startup: dict[str, int]) -> dict[str, Any]:
    """Requests per chunk (the tier's start taken off), per 1M tokens, and their price."""
    tokens, chunks = samples[0]["tokens"], samples[0]["chunks"]
    per_chunk = {kind: statistics.median((s["s3_requests"].get(kind, 0) - startup.get(kind, 0)) / chunks
                                         for s in samples)
                 for kind in sorted({k for s in samples for k in s["s3_requests"]})}
    puts = per_chunk.get("PUT", 0.0) * MTOK / tokens
    gets = per_chunk.get("GET", 0.0) * MTOK / tokens
    return {"requests_per_chunk": per_chunk, "puts_per_mtok": puts, "gets_per_mtok": gets,
            "store_usd_per_mtok": puts / 1000 * PRICES["put_per_1000_usd"],
            "load_usd_per_mtok": gets / 1000 * PRICES["get_per_1000_usd"]}


def fit(cells: list[dict[str, Any]], direction: str) -> dict[str, float]:
    """Least squares of seconds a chunk (1 / median chunks per second) on chunk bytes: the fixed
    cost of a chunk (µs) and the bandwidth the bytes move at (GiB/s)."""
    xs = [float(c["chunk_bytes"]) for c in cells]
    ys = [1.0 / c[f"{direction}_chunks_per_s"]["median"] for c in cells]
    slope, intercept = statistics.linear_regression(xs, ys)
    return {"overhead_us_per_chunk": intercept * 1e6,
            "bandwidth_gib_s": (1.0 / slope) / 2**30 if slope > 0 else float("inf")}


def summarize(samples: list[dict[str, Any]], startup: dict[str, int]) -> dict[str, Any]:
    cells: dict[str, dict[str, Any]] = {}
    done = [s for s in samples if "error" not in s]
    for (tier, row, tokens), group in itertools.groupby(
            sorted(done, key=lambda s: (s["tier"], s["row"], s["tokens"])),
            key=lambda s: (s["tier"], s["row"], s["tokens"])):
        runs = list(group)
        cell: dict[str, Any] = {"tier": tier, "row": row, "tokens": tokens,
                                "chunk_bytes": runs[0]["chunk_bytes"], "chunks": runs[0]["chunks"],
                                "rounds": len(runs)}
        for fig in ("store_gib_s", "load_gib_s", "store_chunks_per_s", "load_chunks_per_s"):
            cell[fig] = spread([r[fig] for r in runs])
        if tier == "obj":
            cell.update(s3_figures(runs, startup))
        cells[f"{tier}/{row}/{tokens}"] = cell
    fits = {tier: {d: fit([c for c in cells.values() if c["tier"] == tier], d) for d in ("store", "load")}
            for tier in sorted({c["tier"] for c in cells.values()})}
    return {"cells": cells, "fits": fits}


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name, cmd in (("redis", ["redis-server", "--version"]),
                      ("seaweedfs", [str(Path(sys.executable).parent / "weed"), "version"])):
        try:
            out[name] = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
        except OSError:
            out[name] = "absent"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", required=True, help="working directory (fs chunks, server data)")
    p.add_argument("--tiers", nargs="+", default=["fs", "obj", "redis"], choices=sorted(THREADS))
    p.add_argument("--rows", nargs="+", default=sorted(ROWS), choices=sorted(ROWS))
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--mib", type=int, default=512, help="MiB moved each way per cell (fs, redis)")
    p.add_argument("--obj-mib", type=int, default=256, help="MiB moved each way per obj cell")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    root = Path(args.root)
    servers = Servers(root, args.tiers)
    cells = list(itertools.product(args.tiers, args.rows, args.tokens))
    samples: list[dict[str, Any]] = []
    loads = [os.getloadavg()[0]]
    t0 = time.monotonic()
    servers.start()
    try:
        for r in range(args.repeats):
            order = cells[:]
            random.Random(38 + r).shuffle(order)
            for tier, row, tokens in order:
                samples.append({"round": r, **run_cell(servers, tier, row, tokens, args)})
                s = samples[-1]
                if "error" in s:
                    print(f"round {r} {tier}/{row}/{tokens}: {s['error']}", file=sys.stderr, flush=True)
                    continue
                print(f"round {r} {tier}/{row}/{tokens}: store {s['store_gib_s']:.2f} GiB/s "
                      f"{s['store_chunks_per_s']:.0f}/s, load {s['load_gib_s']:.2f} GiB/s "
                      f"{s['load_chunks_per_s']:.0f}/s", file=sys.stderr, flush=True)
            loads.append(os.getloadavg()[0])
    finally:
        servers.stop()
    result = {
        "args": {k: neutral_path(v) if isinstance(v, str) else v for k, v in vars(args).items()},
        "command": neutral_path(" ".join(["python -m benchmarks.bench_chunk_sizes", *sys.argv[1:]])),
        "rows_bytes_per_token": ROWS, "threads": THREADS, "obj_options": OBJ_OPTIONS, "prices": PRICES,
        "versions": versions(),
        "cpus": os.cpu_count(), "load_average_1m": loads, "seconds": time.monotonic() - t0,
        "startup_s3_requests": servers.startup_requests,
        **summarize(samples, servers.startup_requests), "samples": samples,
    }
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
