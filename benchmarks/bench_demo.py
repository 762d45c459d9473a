"""The demo's chats (`kvtier demo`) served by three engines in interleaved rounds: TTFT by turn.

    python -m benchmarks.bench_demo --rounds 3
    python -m benchmarks.bench_demo --rounds 3 --turns 1 --configs host+fs@auto,host+fs,no-offload

`kvtier demo` serves its chats once with kvtier and then once without it, always in that order, so
a single run cannot tell the connector's cost on a miss (turn 1) from the order's. Here each round
serves all of the demo's chats on a fresh engine for each of `host+fs` (the demo's kvtier
configuration), `host` (kvtier without a secondary tier) and `no-offload` (vLLM alone), the order
rotating every round, with the demo's engine settings. The first pass's replies are replayed by
every later pass, so all passes serve identical prompts. `--configs` picks others; a name ending
in `@auto` is that configuration with `load_policy: auto` (`kvtier.engine.load_choice`).

Prints each pass's mean TTFT by turn as it ends, then per configuration and turn the median and
range over the rounds and the median's ratio to `no-offload`; the last line is one JSON document.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvtier.bench import demo
from kvtier.bench.multiturn.chats import CHATS, max_turns
from kvtier.bench.multiturn.configs import BenchContext, EngineConfig, resolve
from kvtier.bench.multiturn.conversation import Script
from kvtier.bench.multiturn.presets import kv_bytes_per_token
from kvtier.integrations.vllm.serving.launch import in_process_env
from kvtier.tools.models import prepare_smollm2

CONFIGS = ("host+fs", "host", "no-offload")
AUTO_SUFFIX = "@auto"


def config_of(name: str, ctx: BenchContext) -> EngineConfig:
    """Configuration `name`, or with `@auto` the one before it with `load_policy: auto`."""
    if not name.endswith(AUTO_SUFFIX):
        return resolve(name, ctx)
    config = resolve(name.removesuffix(AUTO_SUFFIX), ctx)
    if config.kvtier is None:
        raise ValueError(f"{name!r}: vLLM alone has no load policy")
    return replace(config, kvtier={**config.kvtier, "load_policy": "auto"})


def demo_defaults() -> argparse.Namespace:
    """`kvtier demo`'s own flag defaults, read from its parser."""
    parser = argparse.ArgumentParser()
    demo.add_parser(parser.add_subparsers())
    return parser.parse_args(["demo"])


def run(rounds: int, turns: int, configs: tuple[str, ...] = CONFIGS
        ) -> tuple[dict[str, list[dict[int, float]]], list[tuple[str, float]]]:
    """Per configuration, one {turn: mean TTFT in ms} per round; the 1-minute load average before
    each pass."""
    d = demo_defaults()
    s = demo.DemoSettings(prepare_smollm2(), d.conversations, turns, d.device_blocks, d.host_chunks,
                          d.max_model_len, d.reply_tokens, fs_dir=None)
    spec = s.workload()
    block_bytes = kv_bytes_per_token(s.model, s.dtype) * s.block_size
    ttft: dict[str, list[dict[int, float]]] = {name: [] for name in configs}
    loads: list[tuple[str, float]] = []
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-bench-demo-")))
        stack.enter_context(in_process_env(tmp))
        stack.enter_context(contextlib.redirect_stdout(sys.stderr))  # vLLM logs to stdout
        scripts: list[Script] = list(CHATS[: s.conversations])
        replayed = False
        for r in range(rounds):
            for name in configs[r % len(configs):] + configs[: r % len(configs)]:
                loads.append((f"round {r} {name}", round(os.getloadavg()[0], 2)))
                ctx = BenchContext(block_bytes, s.device_blocks, s.device_blocks, s.host_chunks,
                                   tmp / f"round{r}-{name.replace('+', '-').replace('@', '-')}")
                records, chats = demo.serve_pass(s.engine_settings(config_of(name, ctx), block_bytes),
                                                 spec, scripts, name, lambda _line: None)
                if not replayed:
                    scripts, replayed = [chat.transcript() for chat in chats], True
                by_turn = {t: statistics.mean(x.ttft_s for x in records if x.turn == t) * 1000
                           for t in range(1, turns + 1)}
                ttft[name].append(by_turn)
                print(f"round {r} {name}: " + ", ".join(f"turn {t} {v:.0f} ms" for t, v in by_turn.items()),
                      file=sys.stderr, flush=True)
    return ttft, loads


def summary(ttft: dict[str, list[dict[int, float]]]) -> dict[str, Any]:
    """Per configuration and turn: median, min, max over rounds, and the median / no-offload's."""
    base = ttft["no-offload"]
    base_median = {turn: statistics.median(p[turn] for p in base) for turn in base[0]}
    out: dict[str, Any] = {}
    for name, passes in ttft.items():
        out[name] = {}
        for turn in passes[0]:
            values = [p[turn] for p in passes]
            median = statistics.median(values)
            ref = base_median[turn]
            out[name][turn] = {"median_ms": round(median), "min_ms": round(min(values)),
                               "max_ms": round(max(values)), "vs_no_offload": round(median / ref, 3),
                               "by_round_vs_no_offload": [round(p[turn] / b[turn], 3)
                                                          for p, b in zip(passes, base, strict=True)]}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--turns", type=int, default=max_turns(), help=f"1-{max_turns()}")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated; must include no-offload; NAME@auto: with load_policy auto")
    args = p.parse_args()
    configs = tuple(args.configs.split(","))
    if "no-offload" not in configs:
        p.error("--configs must include no-offload (the ratios' reference)")
    ttft, loads = run(args.rounds, args.turns, configs)
    result = summary(ttft)
    for name, turns in result.items():
        cells = ", ".join(f"turn {t}: {v['median_ms']} ms [{v['min_ms']}-{v['max_ms']}] "
                          f"{v['vs_no_offload']}x" for t, v in turns.items())
        print(f"{name}: {cells}")
    print(json.dumps({"rounds": args.rounds, "turns": args.turns, "configs": list(configs), "summary": result,
                      "passes": {k: [{str(t): round(v, 1) for t, v in p.items()} for p in ps]
                                 for k, ps in ttft.items()}, "loadavg_before_pass": loads}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
