"""`load_policy` against a tier that turns slow and fast again: each request's TTFT next to vLLM
alone's for the same prompt, and how soon the recovered tier's reloads come back.

    python -m benchmarks.bench_slow_tier_choice --json benchmarks/results/load_choice_slow_tier.json

A round has a pass per policy, `auto` then `always` (the order alternating every round). A pass
starts two engines, each in its own process (`benchmarks.choice_engines`; SmolLM2, CPU backend,
float32, blocks of 32 tokens, the small device cache and host tier of `bench_guard`): vLLM alone
(no connector) and kvtier with that `load_policy` and no SLO guard, in front of the plug-in tier
`benchmarks/slow_tier.py` (loaded by `module_path`) which holds everything. The client serves the
endless multi-turn conversations of `bench_guard` one request at a time, each prompt on both
engines one after the other (which first alternating), so every ratio compares two TTFTs taken
moments apart on the same prompt and cache history. Before request `--slow-from` the benchmark
creates the tier's flag file (every load from the tier then takes `--delay-s` seconds after it was
submitted) and removes it before request `--slow-to`; the pass serves `--requests` requests. (The
phases are counted in requests, not seconds: on a machine shared with other work the seconds a
request takes vary tenfold, and a phase must hold enough requests for `auto` to act on.)

TTFT is the engine's: from adding the request to the step that returns its first token. Per pass:
one row per `--bucket` requests with the median, p99 and max of kvtier's TTFT over vLLM alone's;
the same before, during and after the slow spell, with the requests over 1.10x; `reloads_back_s`
(and `_requests`), from the flag's removal to the arrival of the first request that loaded tokens
from the tier; the tier's counters
(`recomputed_by_choice_tokens`, `load_probes`); and every request (arrival, vLLM alone's and
kvtier's TTFT, kvtier's prompt tokens by source, then kvtier's measured prefill rate and the
tier's load cost).
Prints a table per pass and one JSON document.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.choice_engines import Child
from kvtier.bench.multiturn.conversation import Conversation, WorkloadSpec
from kvtier.bench.multiturn.presets import kv_bytes_per_token
from kvtier.bench.multiturn.summary import percentile
from kvtier.bench.multiturn.workload import Workload
from kvtier.tools.models import model_dir

BLOCK_SIZE = 32
TIER = "slow"
POLICIES = ("auto", "always")
BY_CHOICE = "recomputed_by_choice"
COUNTERS = ("kvtier_recomputed_by_choice_tokens_total", "kvtier_load_probes_total")
GAUGES = ("kvtier_load_fixed_seconds", "kvtier_load_bytes_per_second")
OVER = 1.10
"""The issue's bound: a request over this ratio to vLLM alone is counted."""


@dataclass
class Record:
    """One prompt: its arrival in seconds since the pass started, vLLM alone's TTFT and kvtier's,
    and kvtier's prompt tokens by source."""

    arrival: float
    vllm_s: float
    kvtier_s: float
    split: dict[str, int]
    rates: dict[str, float] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.kvtier_s / self.vllm_s


@dataclass
class Pass:
    records: list[Record] = field(default_factory=list)
    slow_at: float | None = None
    fast_at: float | None = None
    replies_differ: int = 0
    counters: dict[str, Any] = field(default_factory=dict)


def engine_settings(args: argparse.Namespace, spec: WorkloadSpec) -> tuple[dict[str, Any], int]:
    """The `LLM` arguments every engine of the run shares, and the bytes of one block's row."""
    row = BLOCK_SIZE * kv_bytes_per_token(model_dir(), "float32")
    longest = spec.max_prompt_tokens() + spec.output_tokens + BLOCK_SIZE
    return {"block_size": BLOCK_SIZE, "num_gpu_blocks_override": args.device_blocks,
            "kv_cache_memory_bytes": (args.device_blocks + 1) * row,
            "max_model_len": math.ceil(longest / BLOCK_SIZE) * BLOCK_SIZE, "max_num_seqs": 1}, row


def serve(args: argparse.Namespace, policy: str, flag: Path) -> Pass:
    """One pass: vLLM alone and kvtier with `policy`, in lockstep (see the module docstring)."""
    from transformers import AutoTokenizer

    spec = WorkloadSpec(args.initial_tokens, args.tokens_per_turn, args.turns, args.conversations, 1,
                        args.output_tokens)
    llm, row = engine_settings(args, spec)
    slow = {"type": "FlaggedSlowTier", "module_path": "benchmarks.slow_tier", "name": TIER,
            "delay_s": args.delay_s, "flag_path": str(flag)}
    kvtier = {"cpu_bytes_to_use": args.host_chunks * row, "blocks_per_chunk": 1, "load_policy": policy,
              "secondary_tiers": [slow]}
    flag.unlink(missing_ok=True)
    engines = [Child("vllm", {**llm, "kvtier": None}), Child(policy, {**llm, "kvtier": kvtier})]
    workload = Workload(spec, AutoTokenizer.from_pretrained(str(model_dir())), "guard", endless=True)
    run = Pass()
    start = time.perf_counter()
    try:
        while len(run.records) < args.requests:
            now = time.perf_counter() - start
            if len(run.records) == args.slow_from:
                flag.touch()
                run.slow_at = now
            if len(run.records) == args.slow_to:
                flag.unlink()
                run.fast_at = now
            conv: Conversation | None = workload.take()
            assert conv is not None
            conv.ask()
            prompt = conv.prompt_ids()
            order = engines if len(run.records) % 2 == 0 else engines[::-1]
            got = {e.name: e.serve(prompt, spec.output_tokens) for e in order}
            base, mine = got["vllm"], got[policy]
            rates = {**engines[1].ask(op="metrics", tier=None, names=["kvtier_prefill_tokens_per_second"]),
                     **engines[1].ask(op="metrics", tier=TIER, names=list(GAUGES))}
            run.records.append(Record(now, base["ttft_s"], mine["ttft_s"], mine["split"],
                                      {k.removeprefix("kvtier_"): round(v, 3) for k, v in rates.items()}))
            run.replies_differ += base["text"] != mine["text"]
            conv.answer(base["text"])
            workload.put_back(conv)
        run.counters = engines[1].ask(op="metrics", tier=TIER, names=list(COUNTERS))
    finally:
        for e in engines:
            e.close()
    return run


def _stats(ratios: list[float]) -> dict[str, Any]:
    if not ratios:
        return {"requests": 0}
    return {"requests": len(ratios), "median": round(statistics.median(ratios), 3),
            "p99": round(percentile(ratios, 99), 3), "max": round(max(ratios), 3),
            "over_1_10": sum(r > OVER for r in ratios)}


def _seconds(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values or [0.0]), 3), "max": round(max(values or [0.0]), 3)}


def compare(run: Pass, args: argparse.Namespace) -> dict[str, Any]:
    """A pass's ratios by bucket and by phase, and its recovery (see the module docstring)."""
    rs = run.records
    buckets = [{"requests_from": i, **_stats([r.ratio for r in rs[i: i + args.bucket]]),
                "tier_tokens": sum(r.split.get(TIER, 0) for r in rs[i: i + args.bucket]),
                "by_choice_tokens": sum(r.split.get(BY_CHOICE, 0) for r in rs[i: i + args.bucket])}
               for i in range(0, len(rs), args.bucket)]
    spell = rs[args.slow_from: args.slow_to]
    back = next((i for i in range(args.slow_to, len(rs)) if rs[i].split.get(TIER, 0) > 0), None)
    return {"requests": len(rs), "replies_differ": run.replies_differ,
            "slow_at_s": run.slow_at, "fast_at_s": run.fast_at,
            "before_slow": _stats([r.ratio for r in rs[: args.slow_from]]),
            "slow_spell": _stats([r.ratio for r in spell]),
            "after_fast": _stats([r.ratio for r in rs[args.slow_to:]]),
            "slow_spell_ttft_s": _seconds([r.kvtier_s for r in spell]),
            "slow_spell_vllm_ttft_s": _seconds([r.vllm_s for r in spell]),
            "reloads_back_requests": None if back is None else back - args.slow_to,
            "reloads_back_s": None if back is None or run.fast_at is None
            else round(rs[back].arrival - run.fast_at, 2),
            "counters": {k.removeprefix("kvtier_"): v for k, v in run.counters.items()},
            "buckets": buckets,
            "by_request": [[round(r.arrival, 2), round(r.vllm_s, 4), round(r.kvtier_s, 4),
                            {k: v for k, v in r.split.items() if v}, r.rates] for r in rs]}


def show(name: str, r: int, result: dict[str, Any]) -> None:
    s = result["slow_spell"]
    print(f"round {r} {name}: {result['requests']} requests; slow spell: {s.get('requests')} requests, "
          f"ratio median {s.get('median')} p99 {s.get('p99')} max {s.get('max')}, "
          f"{s.get('over_1_10')} over {OVER}x; reloads back {result['reloads_back_s']} s "
          f"({result['reloads_back_requests']} requests) after the tier turned fast; "
          f"counters {result['counters']}", flush=True)
    print("   from  requests  median  p99     max     tier tokens  by choice")
    for b in result["buckets"]:
        print(f"  {b['requests_from']:5d}  {b['requests']:8d}  {b['median']:6.2f}  {b['p99']:6.2f}  "
              f"{b['max']:6.2f}  {b['tier_tokens']:11d}  {b['by_choice_tokens']:9d}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delay-s", type=float, default=3.0)
    for name, default in (("rounds", 2), ("requests", 120), ("slow-from", 30), ("slow-to", 80),
                          ("bucket", 10), ("conversations", 6), ("turns", 6), ("initial-tokens", 160),
                          ("tokens-per-turn", 64), ("output-tokens", 2), ("device-blocks", 36),
                          ("host-chunks", 24)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, of auto and always")
    p.add_argument("--json", type=Path, default=None, help="also write the JSON document here")
    args = p.parse_args()
    policies = tuple(args.policies.split(","))
    rounds: list[dict[str, Any]] = []
    load = [list(os.getloadavg())]
    with tempfile.TemporaryDirectory(prefix="kvtier-choice-slow-", dir="/var/tmp") as tmp:
        for r in range(args.rounds):
            order = policies[r % len(policies):] + policies[: r % len(policies)]
            results = {}
            for policy in order:
                results[policy] = compare(serve(args, policy, Path(tmp) / "slow.flag"), args)
                show(policy, r, results[policy])
                load.append(list(os.getloadavg()))
            rounds.append({"order": list(order), **results})
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    text = json.dumps({"settings": settings, "rounds": rounds, "loadavg": load}, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
