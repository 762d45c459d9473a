"""`load_policy` with a slow remote tier and a fast recompute: the choice by prefix length.

    python -m benchmarks.bench_choice_remote --json benchmarks/results/load_choice_remote_obj.json

A real SeaweedFS (`weed mini`, as the tests start it) behind `benchmarks.throttle_proxy` (each S3
request held `--latency-s`, each connection's answers capped at `--mib-s`), the obj tier pointed at
the proxy with `--io-threads` requests in flight. Three engines, each in its own process
(`benchmarks.choice_engines`; SmolLM2, CPU backend, float32, blocks and chunks of 32 tokens, a
host tier that holds the longest prompt): `vllm` (no connector), and kvtier `auto` and `always`,
each with the obj tier in a bucket of its own.

A case is a prefix of real text of L tokens (`--lengths`) and a 16-token question: on each kvtier
engine a first request stores the prefix (device prefix cache emptied first), the benchmark waits
until its cascade to the obj tier ended, then the measured request with another question is
served with the device prefix cache and the host tier emptied, so its prefix can come only from
the obj tier (or be recomputed); vLLM alone serves the measured request with its prefix cache
emptied. The three measured requests run one after the other, the order rotating every case. Two
warm-up cases (the longest length, then the shortest) come first on every engine, so that `auto`
has timed loads of both sizes; they are reported apart. `--repeats` cases per length, the lengths'
order rotating every repeat.

Per length: each engine's median TTFT (engine-side, to the first token), its ratio to vLLM alone's,
and the prompt tokens `auto` loaded from the obj tier and recomputed by choice; the tier's measured
load cost (`load_fixed_seconds`, `load_bytes_per_second`) and the prefill rate at the end.
Prints a table and one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_ttft import prompt_ids
from benchmarks.choice_engines import Child
from benchmarks.throttle_proxy import ThrottleProxy
from kvtier.bench.chaos.services import REGION
from kvtier.bench.multiturn.presets import kv_bytes_per_token
from kvtier.tools.models import model_dir
from tests.services.s3 import SeaweedServer

BLOCK_SIZE = 32
QUESTION = 16
ENGINES = ("vllm", "auto", "always")
GAUGES = ("kvtier_load_fixed_seconds", "kvtier_load_bytes_per_second")


def settings(longest: int, row: int) -> dict[str, Any]:
    """The `LLM` arguments of every engine: room for one prompt of `longest` tokens."""
    blocks = (longest + QUESTION) // BLOCK_SIZE + 8
    return {"block_size": BLOCK_SIZE, "num_gpu_blocks_override": blocks,
            "kv_cache_memory_bytes": (blocks + 1) * row, "max_model_len": (blocks - 4) * BLOCK_SIZE,
            "max_num_seqs": 1}


def case(engines: dict[str, Child], order: list[str], prefix: list[int], questions: list[list[int]]
         ) -> dict[str, dict[str, Any]]:
    """One case (see the module docstring): per engine, the measured request's answer."""
    for name in order:
        if name != "vllm":
            engines[name].serve(prefix + questions[0], 1, reset="device")
            engines[name].ask(op="drain")
    return {name: engines[name].serve(prefix + questions[1], 1, reset="device" if name == "vllm" else "all")
            for name in order}


def run(args: argparse.Namespace, server: SeaweedServer, proxy: ThrottleProxy) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir()))
    row = BLOCK_SIZE * kv_bytes_per_token(model_dir(), "float32")
    longest = max(args.lengths)
    llm = settings(longest, row)
    engines: dict[str, Child] = {}
    try:
        for name in ENGINES:
            kvtier = None if name == "vllm" else {
                "cpu_bytes_to_use": ((longest + QUESTION) // BLOCK_SIZE + 8) * row, "blocks_per_chunk": 1,
                "load_policy": name, "secondary_tiers": [{
                    "type": "obj", "name": "obj", **server.bucket_options(server.new_bucket()),
                    "endpoint": proxy.endpoint, "io_threads": args.io_threads}]}
            engines[name] = Child(name, {**llm, "kvtier": kvtier})
        index = 0

        def one(tokens: int, r: int) -> dict[str, Any]:
            nonlocal index
            index += 1
            prefix = prompt_ids(tokenizer, index, tokens)
            questions = [tokenizer.encode(f" Question {index}-{q}: what comes next, and why?")[:QUESTION]
                         for q in (0, 1)]
            order = list(ENGINES[r % 3:] + ENGINES[: r % 3])
            got = case(engines, order, prefix, questions)
            line = "  ".join(f"{n} {got[n]['ttft_s']:.3f}s {got[n]['split']}" for n in ENGINES)
            print(f"{tokens:5d} tokens: {line}", file=sys.stderr, flush=True)
            return {"tokens": tokens, "order": order,
                    **{n: {"ttft_s": round(got[n]["ttft_s"], 4), "split": got[n]["split"]} for n in ENGINES}}

        warmup = [one(longest, 0), one(min(args.lengths), 1)]
        cases = []
        for rep in range(args.repeats):
            lengths = args.lengths[rep % len(args.lengths):] + args.lengths[: rep % len(args.lengths)]
            cases += [one(n, rep + i) for i, n in enumerate(lengths)]
        measured = {name: {**engines[name].ask(op="metrics", tier="obj", names=list(GAUGES)),
                           **engines[name].ask(op="metrics", tier=None,
                                               names=["kvtier_prefill_tokens_per_second"])}
                    for name in ("auto", "always")}
    finally:
        for child in engines.values():
            child.close()
    return {"warmup": warmup, "cases": cases, "measured_at_end": measured, "summary": summary(cases)}


def summary(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Per length: median TTFT per engine, ratio to vLLM alone's, and `auto`'s choice."""
    out = {}
    for tokens in sorted({c["tokens"] for c in cases}):
        mine = [c for c in cases if c["tokens"] == tokens]
        med = {n: statistics.median(c[n]["ttft_s"] for c in mine) for n in ENGINES}
        auto = [c["auto"]["split"] for c in mine]
        out[str(tokens)] = {
            "cases": len(mine), "median_ttft_s": {n: round(v, 4) for n, v in med.items()},
            "vs_vllm": {n: round(med[n] / med["vllm"], 3) for n in ("auto", "always")},
            "auto_loaded_tokens": [s.get("obj", 0) for s in auto],
            "auto_recomputed_by_choice_tokens": [s.get("recomputed_by_choice", 0) for s in auto],
            "always_loaded_tokens": [c["always"]["split"].get("obj", 0) for c in mine]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256, 1024, 4096])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--latency-s", type=float, default=0.3)
    p.add_argument("--mib-s", type=float, default=0.0, help="per connection; 0: no cap")
    p.add_argument("--io-threads", type=int, default=64)
    p.add_argument("--json", type=Path, default=None, help="also write the JSON document here")
    args = p.parse_args()
    load = [list(os.getloadavg())]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvtier-choice-remote-", dir="/var/tmp") as tmp:
        server = SeaweedServer(Path(tmp))
        server.start()
        host, port = server.endpoint.removeprefix("http://").split(":")
        proxy = ThrottleProxy(host, int(port), args.latency_s, args.mib_s * 2**20).start()
        try:
            result = run(args, server, proxy)
        finally:
            proxy.close()
            server.kill()
    load.append(list(os.getloadavg()))
    print(f"{'tokens':>6}  {'vllm s':>7}  {'auto s':>7}  {'always s':>8}  auto/vllm  always/vllm  "
          "auto loaded / recomputed by choice")
    for tokens, row in result["summary"].items():
        m, v = row["median_ttft_s"], row["vs_vllm"]
        print(f"{tokens:>6}  {m['vllm']:7.3f}  {m['auto']:7.3f}  {m['always']:8.3f}  {v['auto']:9.2f}  "
              f"{v['always']:11.2f}  {row['auto_loaded_tokens']} / {row['auto_recomputed_by_choice_tokens']}")
    settings_ = {k: v for k, v in vars(args).items() if k != "json"}
    text = json.dumps({"settings": settings_, **result, "seconds": round(time.perf_counter() - start),
                       "loadavg_start_end": load, "region": REGION}, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
