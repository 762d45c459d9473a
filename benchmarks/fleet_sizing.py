"""What a fleet asks of each shared tier, computed from the measured per-chunk figures.

A fleet of `--engines` N engines serves `--tokens-per-s` T prompt tokens a second in all, of which
a share `--reuse` R was computed before (a prefix some engine stored). Chunks hold `--chunk-tokens`
C tokens of a `--row` model. Then, for the shared tier:

- stores: the tokens computed, T (1 - R), in chunks of C: T (1 - R) / C requests a second;
- loads: at most the reused tokens, T R (none found on the engine's own device or host tier):
  T R / C requests a second;
- lookups: every chunk of every prompt asked once, T / C keys a second;
- bytes: tokens x bytes a token, plus the 4 KiB `chunkfmt` header a chunk;
- kept `--retention-s` seconds, T (1 - R) x retention / C chunks: disk (fs, obj) or memory (redis),
  the fs and obj tiers' index in each engine, the redis server's memory a key (its value's
  allocation, measured per byte at the nearest row size, plus the key and its overhead);
- S3: a PUT a chunk stored, a GET a chunk loaded (measured: `requests_per_chunk`), a DELETE a chunk
  evicted when the tier itself bounds the bucket (`max_bytes`); their price per 1M prompt tokens;
  the rates against S3's published limits of a partitioned prefix (3,500 PUT/COPY/POST/DELETE and
  5,500 GET/HEAD a second);
- each tier's measured requests a second for one engine's tier process at this chunk size (the
  chunk-size grid, loopback servers; redis from its own rerun of the grid), against what one
  engine asks of it.

The measured inputs are read from the raw JSON named by the options (defaults: the files in
benchmarks/results/ this page's figures come from). Prints one JSON document.
Usage: python -m benchmarks.fleet_sizing --engines 8 --tokens-per-s 50000 --reuse 0.6 --row 8b
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
HEADER_BYTES = 4096
S3_PREFIX_LIMITS = {"put_class_per_s": 3500, "get_class_per_s": 5500}
"""Amazon S3's published request rates a partitioned prefix sustains (docs: "Best practices design
patterns: optimizing Amazon S3 performance")."""
REDIS_MAXCLIENTS = 10_000
"""redis-server's and valkey-server's default `maxclients`."""
REDIS_CLUSTER_NODES = 1000
"""The Redis Cluster specification's bound for linear scaling ("up to 1000 nodes")."""


def load(name: str) -> dict[str, Any]:
    with open(RESULTS / name if "/" not in name else name) as f:
        data: dict[str, Any] = json.load(f)
    return data


def by_n(runs: list[dict[str, Any]], n: int) -> dict[str, Any]:
    return next(r for r in runs if r["n"] == n)


def size(args: argparse.Namespace) -> dict[str, Any]:
    grid = load(args.chunk_sizes)
    fs_scale, obj_scale, redis_scale = load(args.fs_scale), load(args.obj_scale), load(args.redis_scale)
    bpt = grid["rows_bytes_per_token"][args.row]
    t, r, c, n = args.tokens_per_s, args.reuse, args.chunk_tokens, args.engines
    chunk_bytes = c * bpt + HEADER_BYTES
    store_rps, load_rps, lookup_rps = t * (1 - r) / c, t * r / c, t / c
    kept_chunks = store_rps * args.retention_s
    kept_bytes = kept_chunks * chunk_bytes
    fs_1m = by_n(fs_scale["runs"], 1_000_000)
    obj_100k = by_n(obj_scale["runs"], 100_000)
    redis_big = max(redis_scale["runs"], key=lambda x: x["n"])
    values = by_n(redis_scale["runs"], redis_scale["args"]["n"][0])["chunk_values"]
    value = min(values, key=lambda v: abs(v["row_bytes"] - c * bpt))
    value_ratio = value["memory_usage_per_value_byte"]
    redis_key_bytes = (chunk_bytes * value_ratio + redis_big["memory_overhead_bytes_per_key"]
                       + len(f"kvtier:{'0' * 32}:{'0' * 64}"))
    prices = grid["prices"]
    obj_cell = grid["cells"].get(f"obj/{args.row}/{c}", {})
    per_chunk = obj_cell.get("requests_per_chunk", {"PUT": 1.0, "GET": 1.0})
    puts, gets = store_rps * per_chunk["PUT"], load_rps * per_chunk["GET"]
    deletes = puts if args.evicting else 0.0
    usd_per_mtok = ((1 - r) * per_chunk["PUT"] * prices["put_per_1000_usd"]
                    + r * per_chunk["GET"] * prices["get_per_1000_usd"]) * 1e6 / c / 1000
    out: dict[str, Any] = {
        "inputs": {**vars(args), "bytes_per_token": bpt, "chunk_bytes_stored": chunk_bytes},
        "fleet": {"store_requests_per_s": store_rps, "load_requests_per_s_at_most": load_rps,
                  "lookup_keys_per_s": lookup_rps,
                  "store_gib_s": store_rps * chunk_bytes / 2**30,
                  "load_gib_s_at_most": load_rps * chunk_bytes / 2**30,
                  "kept_chunks": kept_chunks, "kept_tib": kept_bytes / 2**40},
        "per_engine": {"store_requests_per_s": store_rps / n, "load_requests_per_s_at_most": load_rps / n},
        "fs": {"index_mib_per_engine": kept_chunks * fs_1m["index_bytes_per_chunk"] / 2**20,
               "startup_scan_s_est": kept_chunks * fs_1m["startup_to_first_lookup_s"] / fs_1m["n"],
               "files_created_per_s": store_rps, "files_opened_per_s_at_most": load_rps},
        "obj": {"put_per_s": puts, "get_per_s_at_most": gets, "delete_per_s": deletes,
                "put_class_share_of_one_prefix": (puts + deletes) / S3_PREFIX_LIMITS["put_class_per_s"],
                "get_class_share_of_one_prefix": gets / S3_PREFIX_LIMITS["get_class_per_s"],
                "head_class_share_if_no_index": (gets + lookup_rps) / S3_PREFIX_LIMITS["get_class_per_s"],
                "usd_per_mtok_prompt": usd_per_mtok,
                "usd_per_hour": usd_per_mtok * t * 3600 / 1e6,
                "listing_s_at_start_est": kept_chunks * obj_100k["startup_to_listed_s"] / obj_100k["n"],
                "list_requests_per_engine_start": kept_chunks / 1000},
        "redis": {"memory_per_value_byte": value_ratio,
                  "memory_gib": kept_chunks * redis_key_bytes / 2**30,
                  "nodes_for_memory": kept_chunks * redis_key_bytes / (args.node_gib * 2**30),
                  "connections_per_node": n * (args.redis_io_threads + 2),
                  "engines_per_node_max": REDIS_MAXCLIENTS // (args.redis_io_threads + 2),
                  "max_retention_s_one_cluster": REDIS_CLUSTER_NODES * args.node_gib * 2**30
                  / (store_rps * redis_key_bytes)},
    }
    redis_grid = load(args.redis_chunk_sizes)
    for tier in ("fs", "obj", "redis"):
        cell = (redis_grid if tier == "redis" else grid)["cells"].get(f"{tier}/{args.row}/{c}")
        if cell is None:
            continue
        measured = {d: cell[f"{d}_chunks_per_s"]["median"] for d in ("store", "load")}
        out[tier]["measured_chunks_per_s_one_engine"] = measured
        out[tier]["one_engine_share"] = {
            "store": store_rps / n / measured["store"], "load_at_most": load_rps / n / measured["load"]}
        if tier == "redis":
            gib = {d: cell[f"{d}_gib_s"]["median"] for d in ("store", "load")}
            out[tier]["nodes_for_bandwidth_at_measured_rate"] = (
                out["fleet"]["store_gib_s"] / gib["store"] + out["fleet"]["load_gib_s_at_most"] / gib["load"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--tokens-per-s", type=float, default=50_000, help="prompt tokens a second, fleet-wide")
    p.add_argument("--reuse", type=float, default=0.6, help="share of prompt tokens computed before")
    p.add_argument("--row", default="8b", help="8b (128 KiB a token) or 1b (32 KiB)")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--retention-s", type=float, default=3600.0, help="how long a stored chunk is kept")
    p.add_argument("--evicting", action="store_true", help="the obj tier bounds the bucket (max_bytes)")
    p.add_argument("--node-gib", type=float, default=64.0, help="memory of one redis/valkey node")
    p.add_argument("--redis-io-threads", type=int, default=4)
    p.add_argument("--chunk-sizes", default="chunk_sizes_fs_obj_redis_2026-12-06.json")
    p.add_argument("--redis-chunk-sizes", default="chunk_sizes_redis_2026-12-06.json",
                   help="the grid's redis cells (rerun on the redis tier as committed)")
    p.add_argument("--fs-scale", default="fs_scale_10k_1m_2026-12-06.json")
    p.add_argument("--obj-scale", default="obj_scale_1k_100k_2026-12-06.json")
    p.add_argument("--redis-scale", default="redis_scale_10k_1m_2026-12-06.json")
    print(json.dumps(size(p.parse_args()), indent=1))


if __name__ == "__main__":
    main()
