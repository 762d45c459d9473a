"""Host copies per job on the device path: how many `copy_` calls a store or load issues between
device staging and the host rows, and how large they are, by TP degree and chunk size.

Each copy is one DMA when the rows are pinned: small ones cannot reach the bus's rate, and each is
a call on the engine thread. The counts are the staged path's own (`StagedCopy.runs`, the copies
it queues), for a Llama-3-8B-sized model (32 layers, 8 KV heads, head_dim 128, bf16) and a job of
`--chunks` chunks of 16-token blocks, on consecutive host slots and on scattered ones (a copy of a
run of consecutive slots is one 2-D copy, its size the bytes it moves). Nothing is timed: the
figures are exact, the same on any machine.

    python -m benchmarks.bench_copy_counts --out benchmarks/results/copy_counts.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from kvtier.bench.neutral_paths import neutral_path
from kvtier.format.layout import CanonicalLayout, TPShard
from kvtier.integrations.vllm.model.backend_layouts import engine_layout
from kvtier.transfer.copy_plan import CopyPlan
from kvtier.transfer.staged import StagedCopy

LAYERS, HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def counts(tp: int, blocks_per_chunk: int, chunks: int) -> dict[str, object]:
    """Copies per job and their sizes for rank 0 of `tp`, consecutive and scattered slots."""
    layout = CanonicalLayout(LAYERS, HEADS, HEAD_DIM, BLOCK * blocks_per_chunk, torch.bfloat16)
    shard = TPShard(HEADS, tp, 0)
    plan = CopyPlan(layout, engine_layout("vllm_flash_attn"), shard, BLOCK)
    tensors = [torch.empty((2, shard.num_heads, BLOCK, 2 * HEAD_DIM), dtype=torch.bfloat16)
               for _ in range(LAYERS)]
    staged = StagedCopy(plan, tensors)
    out: dict[str, object] = {"tp": tp, "chunk_tokens": layout.chunk_tokens, "chunks": chunks,
                              "rank_bytes_per_chunk": staged.chunk_bytes}
    for name, slots in (("consecutive", list(range(chunks))), ("scattered", list(range(0, 2 * chunks, 2)))):
        runs = staged.runs(slots)
        sizes = [width * n for _, _, width, n in runs]
        out[name] = {"copies": len(runs), "copies_per_chunk": len(runs) / chunks,
                     "median_bytes": statistics.median(sizes), "min_bytes": min(sizes)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--out", help="results JSON")
    args = parser.parse_args()
    rows = [counts(tp, bpc, args.chunks) for tp in (1, 2, 8) for bpc in (1, 16)]
    print(f"{'tp':>3} {'tokens':>7} {'slots':<12} {'copies':>7} {'per chunk':>10} {'median size':>12}")
    for r in rows:
        for name in ("consecutive", "scattered"):
            c = r[name]
            assert isinstance(c, dict)
            print(f"{r['tp']:>3} {r['chunk_tokens']:>7} {name:<12} {c['copies']:>7} "
                  f"{c['copies_per_chunk']:>10.2f} {c['median_bytes'] / 1024:>10.0f} KiB")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python -m benchmarks.bench_copy_counts", "model":
                       {"layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16",
                        "block_size": BLOCK}, "results": rows, "out": neutral_path(args.out)}, f, indent=1)


if __name__ == "__main__":
    main()
