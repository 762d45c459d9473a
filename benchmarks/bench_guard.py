"""The SLO guard against a tier that turns slow while serving: how long until p99 TTFT is back
under budget.

    python -m benchmarks.bench_guard --json benchmarks/results/guard_timeline_delay30s_$(date +%F).json

One in-process engine (SmolLM2, CPU backend, float32, blocks of 32 tokens) with a small device
cache and host tier in front of a plug-in secondary tier (`benchmarks/slow_tier.py`, loaded by
`module_path`) that holds everything, and the SLO guard (`ttft_p99_s` budget, `window_s`,
`sustain_s`, action `disable_newest_tier`, a cooldown longer than the run). The client keeps
`--conversations` multi-turn conversations active (a finished one is replaced by a new one;
`kvtier.bench.multiturn.workload`) at `--concurrency` requests in flight, so most turns promote
their prefix from the secondary tier. `--slow-after-s` seconds into the run the benchmark creates
the tier's flag file: from then on every load from it takes `--delay-s` seconds. Serving goes on
for `--run-s` seconds in all.

TTFT is the client's: from adding the request to the engine step that returns its first token.
The timeline has one row per `--bucket-s` of request arrival: requests, their p99 TTFT, and the
guard's own p99 (over its window, cleared when it disables a tier) at the end of the bucket.
`recovery_s` is from the slowdown to the start of the first bucket from which on every bucket's
p99 is under budget (after at least one bucket over it); the target is `window_s + sustain_s`.
Prints the timeline and one JSON document.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.bench.multiturn.conversation import Conversation, WorkloadSpec
from kvtier.bench.multiturn.presets import kv_bytes_per_token
from kvtier.bench.multiturn.summary import percentile
from kvtier.bench.multiturn.workload import Workload
from kvtier.integrations.vllm.serving.launch import in_process_env, transfer_config
from kvtier.tools.models import model_dir

BLOCK_SIZE = 32
TIER = "slow"


@dataclass
class _Request:
    conv: Conversation
    start: float
    first: float | None = None
    tokens: int = 0


@dataclass
class Run:
    """What the run saw, in seconds since it started."""

    requests: list[tuple[float, float]] = field(default_factory=list)  # (arrival, TTFT)
    guard_p99: list[tuple[float, float | None]] = field(default_factory=list)
    slow_at: float | None = None
    disabled_at: float | None = None


def _connector(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.planner


def serve(args: argparse.Namespace, flag: Path) -> Run:
    """Build the engine, serve for `args.run_s`, return what was seen."""
    from vllm import LLM, SamplingParams

    model = model_dir()
    spec = WorkloadSpec(args.initial_tokens, args.tokens_per_turn, args.turns, args.conversations,
                        args.concurrency, args.output_tokens)
    row = BLOCK_SIZE * kv_bytes_per_token(model, "float32")
    longest = spec.max_prompt_tokens() + spec.output_tokens + BLOCK_SIZE
    max_len = math.ceil(longest / BLOCK_SIZE) * BLOCK_SIZE
    guard = {"ttft_p99_s": args.budget_s, "window_s": args.window_s, "sustain_s": args.sustain_s,
             "cooldown_s": 3600}
    slow = {"type": "FlaggedSlowTier", "module_path": "benchmarks.slow_tier", "name": TIER,
            "delay_s": args.delay_s, "flag_path": str(flag)}
    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, block_size=BLOCK_SIZE,
              num_gpu_blocks_override=args.device_blocks,
              kv_cache_memory_bytes=(args.device_blocks + 1) * row,
              max_model_len=max_len, max_num_seqs=args.concurrency, seed=0,
              kv_transfer_config=transfer_config({
                  "cpu_bytes_to_use": args.host_chunks * row, "blocks_per_chunk": 1,
                  "secondary_tiers": [slow], "slo_guard": guard}))
    engine, scheduler = llm.llm_engine, _connector(llm)
    params = SamplingParams(temperature=0.0, max_tokens=spec.output_tokens, ignore_eos=True)
    workload = Workload(spec, llm.get_tokenizer(), "guard", endless=True)
    run, ids = Run(), 0
    inflight: dict[str, _Request] = {}
    start = time.perf_counter()
    next_sample = args.bucket_s
    while True:
        now = time.perf_counter() - start
        if run.slow_at is None and now >= args.slow_after_s:
            flag.touch()
            run.slow_at = now
        if now >= args.run_s and not inflight:
            break
        while now < args.run_s and len(inflight) < args.concurrency:
            conv = workload.take()
            if conv is None:
                break
            conv.ask()
            ids += 1
            engine.add_request(str(ids), {"prompt_token_ids": conv.prompt_ids()}, params)
            inflight[str(ids)] = _Request(conv, time.perf_counter() - start)
        outputs = engine.step()
        now = time.perf_counter() - start
        for out in outputs:
            job = inflight.get(out.request_id)
            if job is None:
                continue
            if job.first is None and out.outputs and out.outputs[0].token_ids:
                job.first = now
            if out.finished:
                del inflight[out.request_id]
                run.requests.append((job.start, (job.first or now) - job.start))
                job.conv.answer(out.outputs[0].text if out.outputs else "")
                workload.put_back(job.conv)
        if run.disabled_at is None and not scheduler.manager.is_enabled(TIER):
            run.disabled_at = now
        while now >= next_sample:
            run.guard_p99.append((next_sample, scheduler.ops.guard.state()["p99_s"].get("ttft")))
            next_sample += args.bucket_s
    llm.llm_engine.engine_core.shutdown()
    return run


def timeline(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    """Buckets by arrival, and the recovery time (see the module docstring)."""
    buckets = []
    guard = dict(run.guard_p99)
    for i in range(math.ceil(args.run_s / args.bucket_s)):
        lo = i * args.bucket_s
        ttfts = [t for a, t in run.requests if lo <= a < lo + args.bucket_s]
        p99 = percentile(ttfts, 99) if ttfts else None
        buckets.append({"t_s": lo, "requests": len(ttfts), "ttft_p99_s": p99,
                        "over_budget": p99 is not None and p99 > args.budget_s,
                        "guard_p99_s": guard.get(lo + args.bucket_s)})
    recovered = None
    if run.slow_at is not None:
        after = [b for b in buckets if b["t_s"] + args.bucket_s > run.slow_at]
        overs = [i for i, b in enumerate(after) if b["over_budget"]]
        if overs and overs[-1] + 1 < len(after):
            recovered = after[overs[-1] + 1]["t_s"]
    recovery = None if recovered is None or run.slow_at is None else max(recovered - run.slow_at, 0.0)
    target = args.window_s + args.sustain_s
    before = [t for a, t in run.requests if run.slow_at is None or a < run.slow_at]
    return {"slow_at_s": run.slow_at, "disabled_at_s": run.disabled_at,
            "disabled_after_slowdown_s": None if run.disabled_at is None or run.slow_at is None
            else run.disabled_at - run.slow_at,
            "ttft_p99_before_slowdown_s": percentile(before, 99) if before else None,
            "recovered_at_s": recovered, "recovery_s": recovery, "target_s": target,
            "met": recovery is not None and recovery <= target, "requests": len(run.requests),
            "buckets": buckets}


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:6.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("delay-s", 30.0), ("budget-s", 15.0), ("window-s", 40.0), ("sustain-s", 5.0),
                          ("slow-after-s", 60.0), ("run-s", 180.0), ("bucket-s", 5.0)):
        p.add_argument(f"--{name}", type=float, default=default)
    for name, default in (("conversations", 10), ("concurrency", 2), ("turns", 6), ("initial-tokens", 160),
                          ("tokens-per-turn", 64), ("output-tokens", 4), ("device-blocks", 36),
                          ("host-chunks", 24)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--json", type=Path, default=None, help="also write the JSON document here")
    args = p.parse_args()
    load = [list(os.getloadavg())]
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-guard-")))
        stack.enter_context(in_process_env(tmp))
        run = serve(args, tmp / "slow.flag")
    load.append(list(os.getloadavg()))
    result = {"settings": {k: v for k, v in vars(args).items() if k != "json"}, **timeline(run, args),
              "loadavg_start_end": load}
    print(f"slowdown at {fmt(run.slow_at)} s, tier disabled at {fmt(run.disabled_at)} s; "
          f"p99 TTFT back under {args.budget_s} s after {fmt(result['recovery_s'])} s "
          f"(target {result['target_s']} s): {'met' if result['met'] else 'NOT met'}")
    print("   t (s)  requests  p99 TTFT (s)  guard p99 (s)")
    for b in result["buckets"]:
        mark = " <- slow" if run.slow_at is not None and b["t_s"] <= run.slow_at < b["t_s"] + args.bucket_s \
            else (" <- disabled" if run.disabled_at is not None
                  and b["t_s"] <= run.disabled_at < b["t_s"] + args.bucket_s else "")
        print(f"  {b['t_s']:6.0f}  {b['requests']:8d}  {fmt(b['ttft_p99_s']):>12}  "
              f"{fmt(b['guard_p99_s']):>13}{mark}")
    text = json.dumps(result, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
