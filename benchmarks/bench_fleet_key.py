"""What the fleet key costs: fs and redis tier-bench with and without it, interleaved, in one run.

    python -m benchmarks.bench_fleet_key --chunks 64 --chunk-mib 2 --threads 2 --repeats 5

Each repeat runs `kvtier tier-bench`'s measurement (`run_tier_bench`: a real tier process over a
real host region, every job submitted at once) four times: fs and redis, each unkeyed and keyed
(`fleet_key_file`: every chunk MACed with keyed BLAKE3 on store and verified on load, instead of
the xxh3-128 checksum), the keyed and unkeyed order alternating from one repeat to the next. fs
writes a fresh directory under `--dir` each time (removed after); redis is a redis-server this
script starts (loopback TCP, persistence off), flushed after each run. Prints medians with their
spread and the keyed / unkeyed ratio of the medians, and writes every sample as JSON, with the
single-thread rate of each digest over one chunk (`chunkfmt.digest_of`, the CPU the key adds per
chunk on each side).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import redis

from kvtier.bench.tier_bench import run_tier_bench
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.common.fleetkey import FleetKey
from tests.services.redis_server import start_server, stop_server

MiB = 1 << 20
PHASES = ("store_gib_s", "load_gib_s")


def _key_file(directory: str) -> str:
    path = os.path.join(directory, "fleet.key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    return path


def _one(tier: str, keyed: bool, args: argparse.Namespace, key_file: str, url: str) -> dict[str, Any]:
    if tier == "fs":
        root = tempfile.mkdtemp(prefix="kvtier-fleet-key-", dir=args.dir)
        options: dict[str, Any] = {"root_dir": root}
    else:
        options = {"url": url, "key_prefix": f"bench-{secrets.token_hex(4)}"}
    try:
        return run_tier_bench(tier, options, args.chunk_mib * MiB, args.chunks, args.threads,
                              fleet_key_file=key_file if keyed else None)
    finally:
        if tier == "fs":
            shutil.rmtree(root, ignore_errors=True)
        else:
            redis.Redis.from_url(url).flushall()


def _digest_rates(chunk_bytes: int, key_file: str, passes: int = 50) -> dict[str, float]:
    """GiB/s of one thread digesting a chunk: the checksum, and the MAC under the key."""
    payload, key, fp = os.urandom(chunk_bytes), os.urandom(32), os.urandom(16)
    rates: dict[str, float] = {}
    for name, fleet in (("xxh3_checksum", None), ("blake3_mac", FleetKey.from_file(key_file))):
        chunkfmt.digest_of(key, fp, payload, fleet)
        start = time.perf_counter()
        for _ in range(passes):
            chunkfmt.digest_of(key, fp, payload, fleet)
        rates[name] = passes * chunk_bytes / 2**30 / (time.perf_counter() - start)
    return rates


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/var/tmp", help="where fs roots are made")
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--chunk-mib", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json-out", help="write the JSON document here")
    args = p.parse_args()
    server = start_server("redis-server")
    samples: dict[str, list[dict[str, Any]]] = {}
    try:
        with tempfile.TemporaryDirectory() as keys:
            key_file = _key_file(keys)
            rates = _digest_rates(args.chunk_mib * MiB, key_file)
            for repeat in range(args.repeats):
                for tier in ("fs", "redis"):
                    for keyed in (False, True) if repeat % 2 == 0 else (True, False):
                        report = _one(tier, keyed, args, key_file, server.url)
                        name = f"{tier}{'+key' if keyed else ''}"
                        samples.setdefault(name, []).append(report)
                        print(f"repeat {repeat} {name}: " + ", ".join(
                            f"{ph} {report[ph]:.2f}" for ph in PHASES), file=sys.stderr, flush=True)
    finally:
        stop_server(server)
    summary = {name: {ph: _summary([r[ph] for r in runs]) for ph in PHASES}
               for name, runs in samples.items()}
    ratios = {tier: {ph: summary[f"{tier}+key"][ph]["median"] / summary[tier][ph]["median"]
                     for ph in PHASES} for tier in ("fs", "redis")}
    print("GiB/s, median [min-max]      store                load")
    for name, phases in summary.items():
        cells = [f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]" for s in phases.values()]
        print(f"  {name:10} {cells[0]:>20} {cells[1]:>20}")
    for tier, r in ratios.items():
        print(f"  {tier} keyed / unkeyed: store {r['store_gib_s']:.3f}, load {r['load_gib_s']:.3f}")
    print("  one thread, GiB/s: " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()))
    doc = {"chunks": args.chunks, "chunk_bytes": args.chunk_mib * MiB, "threads": args.threads,
           "repeats": args.repeats, "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
           "summary": summary, "keyed_over_unkeyed": ratios, "digest_gib_s_one_thread": rates,
           "samples": {name: [{k: r[k] for k in ("store_s", "load_s", *PHASES, "tier_counts")}
                              for r in runs] for name, runs in samples.items()}}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
