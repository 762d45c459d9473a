"""What kvtier costs when there is nothing to reuse: TTFT of fresh prompts with and without it.

    python -m benchmarks.bench_miss --tokens 512,2048,8000 --repeats 5

Three engines, each in its own process (SmolLM2, CPU backend, float32, the same device cache and
`max_num_seqs=1`): `none` is vLLM without a connector; `host` has the KVTierConnector with a host
tier; `host+fs` adds an fs tier in a temp directory. The parent sends one prompt at a time to one
engine and waits for its answer, so only one engine works at any moment; the order rotates every
repeat. Each prompt is distinct real text never seen before by either engine (a pure miss:
kvtier looks it up in its tiers, stores every chunk device → host and cascades it to the fs tier)
and is served with one output token after the device prefix cache is emptied: its generate() time
is its TTFT. After each kvtier request its engine waits until its cascades have finished (timed
apart as `drain_s`), so the fs writes of one request do not land in the next measurement of either
engine; the no-reuse throughput benchmark (BENCHMARKS.md) covers the cascade competing with work.

SmolLM2's context is 8192 tokens, hence 8000 as the largest default size.

Prints per size the median and min-max TTFT of each, the ratios of medians to `none`, and one
JSON document.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_ttft import prompt_ids, serve
from kvtier.bench.multiturn.presets import kv_bytes_per_token
from kvtier.integrations.vllm.serving.launch import in_process_env, transfer_config
from kvtier.tools.models import model_dir

CONFIGS = ("none", "host", "host+fs")
"""vLLM alone; kvtier with a host tier only; kvtier with a host tier and an fs tier."""
BLOCK_SIZE = 128


def engine(config: str, max_tokens: int) -> int:
    """The child: serve `{"tokens": n, "index": i}` lines from stdin, answer one JSON line each on
    stdout; everything else written to stdout (vLLM's logs) goes to stderr."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from vllm import LLM

    model = model_dir()
    per_token = kv_bytes_per_token(model, "float32")
    blocks = max_tokens // BLOCK_SIZE + 4
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-miss-", dir="/var/tmp")))
        stack.enter_context(in_process_env(tmp))
        options: dict[str, Any] = {}
        if config != "none":
            tiers = [{"type": "fs", "root_dir": str(tmp / "fs")}] if config == "host+fs" else []
            options["kv_transfer_config"] = transfer_config({
                "cpu_bytes_to_use": 2 * max_tokens * per_token, "secondary_tiers": tiers,
            })
        llm = LLM(model=str(model), dtype="float32", enforce_eager=True, block_size=BLOCK_SIZE,
                  num_gpu_blocks_override=blocks, kv_cache_memory_bytes=(blocks + 1) * BLOCK_SIZE * per_token,
                  max_model_len=max_tokens + 16, max_num_seqs=1, seed=0, **options)
        tokenizer = llm.get_tokenizer()
        serve(llm, tokenizer.encode("Warm-up request, not measured."))
        print(json.dumps({"ready": config}), file=answers)
        for line in sys.stdin:
            ask = json.loads(line)
            seconds, split = serve(llm, prompt_ids(tokenizer, ask["index"], ask["tokens"]))
            start = time.perf_counter()
            scheduler = getattr(llm.llm_engine.engine_core.engine_core.scheduler.connector, "planner", None)
            while scheduler is not None and scheduler.manager.in_flight:
                scheduler.manager.poll()  # what the next engine step would do first
                time.sleep(0.002)
            print(json.dumps({"seconds": seconds, "split": split,
                              "drain_s": time.perf_counter() - start}), file=answers)
        llm.llm_engine.engine_core.shutdown()
    return 0


class Child:
    """One engine process, driven one request at a time."""

    def __init__(self, config: str, max_tokens: int) -> None:
        self.config = config
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.bench_miss", "--engine", config,
             "--max-tokens", str(max_tokens)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.answer()

    def answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine {self.config} exited (code {self.proc.wait()})")
        return dict(json.loads(line))

    def ask(self, tokens: int, index: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"tokens": tokens, "index": index}) + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(60)


def run(sizes: list[int], repeats: int) -> dict[str, Any]:
    children = {config: Child(config, max(sizes)) for config in CONFIGS}
    samples: dict[int, dict[str, list[float]]] = {n: {c: [] for c in CONFIGS} for n in sizes}
    drains: list[float] = []
    index = 0
    try:
        for rep in range(repeats):
            for n in sizes:
                for config in CONFIGS[rep % len(CONFIGS):] + CONFIGS[: rep % len(CONFIGS)]:
                    index += 1
                    got = children[config].ask(n, index)
                    if config != "none":
                        drains.append(got["drain_s"])
                        if got["split"].get("recomputed", 0) != n:
                            raise RuntimeError(f"prompt {index} was not a pure miss: {got['split']}")
                    samples[n][config].append(got["seconds"])
                print(f"  repeat {rep + 1} {n:>5} tokens: " + "  ".join(
                    f"{c} {samples[n][c][-1]:.3f}s" for c in CONFIGS), file=sys.stderr, flush=True)
    finally:
        for child in children.values():
            child.close()
    rows = {}
    for n in sizes:
        med = {c: statistics.median(samples[n][c]) for c in CONFIGS}
        rows[str(n)] = {
            "median_ttft_s": {c: round(v, 4) for c, v in med.items()},
            "min_max_ttft_s": {
                c: [round(min(samples[n][c]), 4), round(max(samples[n][c]), 4)] for c in CONFIGS
            },
            "ttft_s": {c: [round(x, 4) for x in samples[n][c]] for c in CONFIGS},
            "over_none": {c: round(med[c] / med["none"], 4) for c in CONFIGS[1:]},
        }
    return {"repeats": repeats, "block_size": BLOCK_SIZE, "dtype": "float32", "sizes": rows,
            "drain_s_median": round(statistics.median(drains), 4) if drains else None}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", default="512,2048,8000", help="prompt sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engine", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--max-tokens", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        return engine(args.engine, args.max_tokens)
    sizes = [int(x) for x in args.tokens.split(",")]
    if any(n < BLOCK_SIZE for n in sizes) or args.repeats < 1:
        parser.error(f"--tokens: each size must be >= {BLOCK_SIZE}; --repeats >= 1")
    result = run(sizes, args.repeats)
    print(f"{'tokens':>7} " + " ".join(f"{c + ' (s)':>24}" for c in CONFIGS)
          + " " + " ".join(f"{c + '/none':>13}" for c in CONFIGS[1:]))
    for n, row in result["sizes"].items():
        cells = [f"{row['median_ttft_s'][c]:.3f} [{row['min_max_ttft_s'][c][0]:.3f}-"
                 f"{row['min_max_ttft_s'][c][1]:.3f}]" for c in CONFIGS]
        ratios = [f"{row['over_none'][c]:>13.3f}" for c in CONFIGS[1:]]
        print(f"{n:>7} " + " ".join(f"{cell:>24}" for cell in cells) + " " + " ".join(ratios))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
