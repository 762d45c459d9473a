"""Chunk-key hashing cost: microseconds per 128-token chunk, for each hash algorithm.

A request's keys are computed on the engine's scheduler thread (`ChunkHasher.keys` over its prompt,
engine/request_state.py), once per prompt chunk before its first lookup. The target is under 50 us
per 128-token chunk on one core (SmolLM2's fingerprint; a key chains its parent's, so the chunks of
a prompt are hashed one after another).

Each algorithm hashes a prompt of `--chunks` chunks `--repeats` times; the best and the median
repeat are reported (the best is the cost without interference from other processes).

Run from the repository root (kvtier installed, or `PYTHONPATH=.`):
`python benchmarks/bench_keys.py [--chunks 256] [--repeats 10] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvtier.format.keys import ALGORITHMS, ChunkHasher, ModelFingerprint

CHUNK_TOKENS = 128
TARGET_US = 50.0
FINGERPRINT = ModelFingerprint(
    model="HuggingFaceTB/SmolLM2-135M-Instruct", revision="main", dtype="bfloat16",
    kv_dtype="bfloat16", num_layers=30, num_kv_heads=3, head_dim=64,
)


def per_chunk_us(algorithm: str, chunks: int, repeats: int) -> list[float]:
    """Microseconds per chunk of each repeat hashing a `chunks`-chunk prompt."""
    hasher = ChunkHasher(algorithm, FINGERPRINT, CHUNK_TOKENS)
    tokens = list(range(CHUNK_TOKENS * chunks))
    hasher.keys(tokens)  # warm-up: imports, first allocations
    runs: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        hasher.keys(tokens)
        runs.append((time.perf_counter() - start) / chunks * 1e6)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=256, help="chunks per prompt")
    parser.add_argument("--repeats", type=int, default=10, help="prompts hashed per algorithm")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    results = {}
    for algorithm in ALGORITHMS:
        runs = per_chunk_us(algorithm, args.chunks, args.repeats)
        results[algorithm] = {"best_us": min(runs), "median_us": statistics.median(runs)}
    if args.json:
        print(json.dumps({"chunk_tokens": CHUNK_TOKENS, "target_us": TARGET_US, "algorithms": results}))
        return
    print(f"us per {CHUNK_TOKENS}-token chunk ({args.chunks} chunks x {args.repeats} repeats)")
    for algorithm, r in results.items():
        verdict = "ok" if r["best_us"] < TARGET_US else f"over the {TARGET_US:g} us target"
        print(f"  {algorithm:8s} best {r['best_us']:6.1f}  median {r['median_us']:6.1f}  {verdict}")


if __name__ == "__main__":
    main()
