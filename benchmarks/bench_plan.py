"""How fast `kvtier plan` is: a synthetic trace of N chunk references, read and planned on one core.

    python -m benchmarks.bench_plan --requests 100000 --chunks 100 [--json]

The trace models chat traffic: each request's prompt is one of `prefixes` shared prefixes (half
its chunks) followed by chunks of its own, 16-token chunks of SmolLM2's float32 KV. The file is
written first (not timed), then `read_traces` and `plan` are timed in CPU seconds of this process
(`time.process_time`, so a loaded machine does not inflate it) and wall seconds, with the peak
resident memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvtier.trace.plan import plan
from kvtier.trace.records import TraceHeader, read_traces


def write(path: Path, requests: int, chunks: int, prefixes: int, seed: int) -> int:
    rng = np.random.default_rng(seed)
    shared = chunks // 2
    golden = np.uint64(0x9E3779B97F4A7C15)
    with open(path, "w") as f:
        f.write(TraceHeader("connector", 16, 1, 16 * 46080).to_json() + "\n")
        for r in range(requests):
            p = int(rng.integers(prefixes))
            keys = np.concatenate([
                (np.uint64(p) * np.uint64(1 << 16) + np.arange(shared, dtype=np.uint64)) * golden,
                rng.integers(0, 1 << 63, chunks - shared, dtype=np.int64).astype(np.uint64),
            ])
            f.write(json.dumps({"t": r * 0.01, "prompt": chunks * 16, "prio": 50,
                                "keys": keys.astype(">u8").tobytes().hex()}) + "\n")
    return requests * chunks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--chunks", type=int, default=100)
    ap.add_argument("--prefixes", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.jsonl"
        refs = write(path, args.requests, args.chunks, args.prefixes, args.seed)
        size = path.stat().st_size
        c0, w0 = time.process_time(), time.perf_counter()
        trace = read_traces([path])
        c1, w1 = time.process_time(), time.perf_counter()
        report = plan(trace, host_bytes_per_s=10 * (1 << 30)).report
        c2, w2 = time.process_time(), time.perf_counter()
    result = {
        "chunk_references": refs, "trace_bytes": size,
        "read_cpu_s": round(c1 - c0, 2), "read_wall_s": round(w1 - w0, 2),
        "plan_cpu_s": round(c2 - c1, 2), "plan_wall_s": round(w2 - w1, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "reusable_token_fraction": report["reusable_token_fraction"],
        "recommend": report["recommend"],
    }
    print(json.dumps(result, indent=1) if args.json else
          f"{refs} references: read {result['read_cpu_s']} s CPU, plan {result['plan_cpu_s']} s CPU, "
          f"peak RSS {result['peak_rss_mib']} MiB", file=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
