"""What the tier scale benchmarks (`bench_fs_scale`, `bench_obj_scale`) share: the stored keys of a
run, a chunk's stored bytes, the lookup measure, and the report of each figure's growth from the
smallest run to the largest."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any, Protocol

from kvtier.bench.neutral_paths import neutral_path
from kvtier.tiers.common import chunkfmt

LAYOUT_FP = "5ca1ab1e5ca1ab1e5ca1ab1e5ca1ab1e"
SEED = 38


class LooksUp(Protocol):
    def lookup(self, keys: Sequence[bytes]) -> Any: ...


def keys_for(n: int) -> list[bytes]:
    """The N stored keys of a run (the same for every run with this N)."""
    rng = random.Random(SEED)
    return [rng.randbytes(32) for _ in range(n)]


class ChunkHeaders:
    """Stored headers of chunks whose rows are all zeros of `row_bytes` (one digest for all)."""

    def __init__(self, row_bytes: int) -> None:
        self.row = bytes(row_bytes)
        self.fp = chunkfmt.fingerprint_bytes(LAYOUT_FP)
        self.digest = chunkfmt.digest_of(bytes(32), self.fp, self.row)

    def pack(self, key: bytes, out: bytearray) -> bytearray:
        """`key`'s header written into `out` (HEADER_BYTES long), returned."""
        chunkfmt.pack_header_digest(out, key, self.fp, len(self.row), self.digest)
        return out


def measure_lookups(tier: LooksUp, keys: list[bytes], batch: int, batches: int) -> dict[str, float]:
    """Lookups per second and batch latency (p50, p99) of `batches` batches, half hits."""
    rng = random.Random(SEED + 1)
    lat: list[float] = []
    t_all = time.perf_counter()
    for _ in range(batches):
        ks = [rng.choice(keys) if i % 2 else rng.randbytes(32) for i in range(batch)]
        t0 = time.perf_counter()
        tier.lookup(ks)
        lat.append(time.perf_counter() - t0)
    total = time.perf_counter() - t_all
    q = statistics.quantiles(lat, n=100)
    return {"lookups_per_s": batch * batches / total, "batch_p50_us": q[49] * 1e6,
            "batch_p99_us": q[98] * 1e6}


def report(runs: list[dict[str, Any]], figures: Sequence[str], args: argparse.Namespace) -> None:
    """Print each figure by run and its growth; with `args.out`, write the raw JSON there (paths
    through `neutral_path`)."""
    print(f"{'figure':28}" + "".join(f"{r['n']:>14,}" for r in runs) + "  growth")
    for fig in figures:
        vals = [r[fig] for r in runs]
        growth = vals[-1] / vals[0] if vals[0] else float("nan")
        print(f"{fig:28}" + "".join(f"{v:14.4g}" for v in vals) + f"  {growth:.2f}x")
    if args.out:
        recorded = {k: neutral_path(v) if isinstance(v, str) else v for k, v in vars(args).items()}
        result = {"args": recorded, "runs": runs,
                  "growth": {f: runs[-1][f] / runs[0][f] for f in figures if runs[0][f]}}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
