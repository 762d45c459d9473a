"""The CPU copy path on vLLM's CPU layout against a flat copy of the same bytes.

One job is `--chunks` chunks of one engine block each, every layer of SmolLM2-135M (30 layers,
3 KV heads, head_dim 64) in vLLM's CPU layout (K transposed per block and head). Three ways move
the same bytes, one after the other in each round, rounds repeated: `CopyPlan` through the C
kernel, `CopyPlan` through torch's strided copies, and one `copy_` of a flat tensor of the job's
size. Stores (engine -> host rows) and loads (host rows -> engine) are timed apart; the figure is
GB/s of KV moved, median [min-max] over the rounds, and each path's ratio to the flat copy.

    python -m benchmarks.bench_copies --block-size 64,128 --dtype float32,bfloat16 --threads 1,2 \
        --out benchmarks/results/copies.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from kvtier.bench.neutral_paths import neutral_path
from kvtier.format.layout import CanonicalLayout, TPShard, host_rows
from kvtier.integrations.vllm.model.backend_layouts import engine_layout
from kvtier.transfer.copy_plan import CopyPlan

LAYERS, HEADS, HEAD_DIM = 30, 3, 64


def _timed(fn: Callable[[], None], iters: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def measure(block: int, dtype: torch.dtype, chunks: int, rounds: int, iters: int) -> dict[str, object]:
    layout = CanonicalLayout(LAYERS, HEADS, HEAD_DIM, block, dtype)
    plans = {"kernel": CopyPlan(layout, engine_layout("vllm_cpu"), TPShard(HEADS), block),
             "torch": CopyPlan(layout, engine_layout("vllm_cpu"), TPShard(HEADS), block, native=False)}
    assert plans["kernel"].native is not None, "the copy kernel did not build"
    num_blocks = 4 * chunks
    tensors = [torch.randn(num_blocks, HEADS, block, 2 * HEAD_DIM).to(dtype) for _ in range(LAYERS)]
    buf = bytearray(chunks * layout.row_bytes)
    rows = host_rows(memoryview(buf), layout.row_bytes, chunks)
    blocks = [[b] for b in range(0, num_blocks, 4)][:chunks]
    slots = list(range(chunks))
    flat_src = torch.empty(chunks * layout.row_bytes, dtype=torch.uint8).random_()
    flat_dst = torch.empty_like(flat_src)
    ways: dict[str, Callable[[], None]] = {"flat": lambda: flat_dst.copy_(flat_src)}
    for name, plan in plans.items():
        ways[f"{name} store"] = lambda p=plan: p.engine_to_host(tensors, blocks, rows, slots)
        ways[f"{name} load"] = lambda p=plan: p.host_to_engine(tensors, blocks, rows, slots)
    gbps: dict[str, list[float]] = {name: [] for name in ways}
    nbytes = chunks * layout.row_bytes
    for _ in range(rounds):
        for name, fn in ways.items():
            gbps[name].append(nbytes / _timed(fn, iters) / 1e9)
    flat = statistics.median(gbps["flat"])
    return {
        "block_size": block, "dtype": str(dtype).removeprefix("torch."), "chunks": chunks,
        "bytes_per_job": nbytes,
        "gbps": {name: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                 for name, v in gbps.items()},
        "vs_flat": {name: statistics.median(v) / flat for name, v in gbps.items() if name != "flat"},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-size", default="64,128")
    ap.add_argument("--dtype", default="float32,bfloat16")
    ap.add_argument("--threads", default="1", help="torch threads, one run each")
    ap.add_argument("--chunks", type=int, default=14)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    results = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for block in (int(b) for b in args.block_size.split(",")):
            for name in args.dtype.split(","):
                point = measure(block, getattr(torch, name), args.chunks, args.rounds, args.iters)
                point["torch_threads"] = threads
                results.append(point)
                g = point["gbps"]
                assert isinstance(g, dict)
                print(f"threads {threads} block {block} {name}: flat {g['flat']['median']:.2f} GB/s; "
                      + "; ".join(f"{k} {v['median']:.2f} [{v['min']:.2f}-{v['max']:.2f}] "
                                  f"({point['vs_flat'][k]:.2f}x)"  # type: ignore[index]
                                  for k, v in g.items() if k != "flat"), flush=True)
    out = {"meta": {"command": "python -m benchmarks.bench_copies " + neutral_path(" ".join(
                        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v != "")),
                    "machine": {"node": platform.node(), "cpus": os.cpu_count(),
                                "loadavg": os.getloadavg()}},
           "points": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
