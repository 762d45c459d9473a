"""`load_policy: auto` against `always` on healthy tiers: the multi-turn benchmark, interleaved rounds.

    python -m benchmarks.bench_load_choice --rounds 4 --out /var/tmp/kvtier-bench/load_choice.json

Two regimes of `kvtier bench multiturn --preset cpu --mode inprocess` at 8 conversations (the
device cache holds about 4): `host` (the preset's host tier, about 8 conversations: it holds them
all) and `host+fs` with a host tier of `FS_REGIME_HOST_CHUNKS` chunks (about 2 conversations), so
that most reloads come from the fs tier. Each round runs every regime under both policies
(`--load-policy`), each run on a fresh in-process engine, the policies' order alternating from
round to round, after one unrecorded warm-up run of the smoke preset (the process's first engine
pays one-time start-up costs). Per run: TTFT median and p90 over its requests, the prompt tokens
reloaded (host and secondary tiers), recomputed by choice and recomputed. Summary per regime: each
policy's median [min-max] over the rounds, and the median over rounds of the per-round ratios
auto / always (reloaded tokens, TTFT median, TTFT p90). Writes one JSON document to `--out` and
prints the summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.bench.engine_log import engine_output
from kvtier.bench.multiturn import cli as multiturn_cli
from kvtier.bench.multiturn.summary import RequestRecord, percentile, spread
from kvtier.bench.multiturn.sweep import Hooks, run_sweep
from kvtier.bench.neutral_paths import neutral_path
from kvtier.config import ALWAYS, AUTO
from kvtier.format.chunks import DEVICE, RECOMPUTED
from kvtier.integrations.vllm.serving.launch import in_process_env
from kvtier.ops.metrics import RECOMPUTED_BY_CHOICE

FS_REGIME_HOST_CHUNKS = 34
REGIMES: tuple[tuple[str, int, int | None], ...] = (("host", 8, None), ("host+fs", 8, FS_REGIME_HOST_CHUNKS))
"""(configuration, conversations, host chunks or None for the preset's): the host and fs regimes."""
NOT_RELOADED = (DEVICE, RECOMPUTED_BY_CHOICE, RECOMPUTED)
SUMMARIZED = ("ttft_median_ms", "ttft_p90_ms", "reloaded_tokens", "recomputed_by_choice_tokens")


class Recorder(Hooks):
    """Keeps the requests of the point being served."""

    def __init__(self) -> None:
        self.records: list[RequestRecord] = []

    def point_starting(self, config: str, conversations: int, requests: int) -> None:
        self.records = []

    def request_done(self, record: RequestRecord) -> None:
        self.records.append(record)


def one_run(config: str, conversations: int, host_chunks: int | None, policy: str, preset: str,
            work_dir: Path, log_dir: Path) -> dict[str, Any]:
    """One run of `config` at `conversations` under `policy` on a fresh in-process engine."""
    parser = argparse.ArgumentParser()
    multiturn_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "multiturn", "--preset", preset, "--conversations", str(conversations),
                              "--configs", config, "--repeats", "1", "--mode", "inprocess",
                              "--load-policy", policy,
                              *(["--host-chunks", str(host_chunks)] if host_chunks else [])])
    args.passthrough = []
    plan, _ = multiturn_cli._plan(args, work_dir, log_dir)
    recorder, points = Recorder(), list[dict[str, Any]]()
    run_sweep(plan, recorder, points.append)
    ok = [r for r in recorder.records if not r.error]
    ttfts = [r.ttft_s for r in ok]
    split: dict[str, int] = {}
    for r in ok:
        for source, tokens in (r.tokens or {}).items():
            split[source] = split.get(source, 0) + tokens
    return {
        "config": config, "conversations": conversations, "host_chunks": plan.context.host_chunks,
        "policy": policy,
        "requests": len(ok), "failed_requests": len(recorder.records) - len(ok),
        "ttft_median_ms": 1e3 * percentile(ttfts, 50), "ttft_p90_ms": 1e3 * percentile(ttfts, 90),
        "tokens": split, "reloaded_tokens": sum(v for k, v in split.items() if k not in NOT_RELOADED),
        "recomputed_by_choice_tokens": split.get(RECOMPUTED_BY_CHOICE, 0),
        "duration_s": points[0]["duration_s"] if points else None, "loadavg": list(os.getloadavg()),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per regime: each policy's median [min-max] over rounds, and the per-round ratios' medians."""
    out: dict[str, Any] = {}
    for config, _, _ in REGIMES:
        mine = [r for r in runs if r["config"] == config]
        by_policy = {p: [r for r in mine if r["policy"] == p] for p in (ALWAYS, AUTO)}
        entry: dict[str, Any] = {p: {key: spread([r[key] for r in rs]).as_json() for key in SUMMARIZED}
                                 for p, rs in by_policy.items()}
        pairs = list(zip(by_policy[ALWAYS], by_policy[AUTO], strict=True))
        for key in ("reloaded_tokens", "ttft_median_ms", "ttft_p90_ms"):
            ratios = [b[key] / a[key] for a, b in pairs if a[key]]
            entry[f"auto_over_always_{key}"] = spread(ratios).as_json()
        out[config] = entry
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--out", type=Path, required=True)
    opts = parser.parse_args()
    command = shlex.join(["python", "-m", "benchmarks.bench_load_choice", *sys.argv[1:]])
    meta = {"command": neutral_path(command),
            "regimes": [list(r) for r in REGIMES], "preset": opts.preset, "rounds": opts.rounds,
            "machine": {"node": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                        "shared": "2 cores shared with other engineers' tests and benchmarks"},
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg_start": list(os.getloadavg())}
    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-load-choice-")))
        (tmp / "vllm").mkdir()
        stack.enter_context(in_process_env(tmp / "vllm"))
        terminal = stack.enter_context(engine_output(tmp / "vllm.log"))
        one_run("host", 4, None, ALWAYS, "smoke", tmp / "work", tmp / "out")  # warm-up, not recorded
        for round_ in range(opts.rounds):
            order = (ALWAYS, AUTO) if round_ % 2 == 0 else (AUTO, ALWAYS)
            for config, conversations, host_chunks in REGIMES:
                for policy in order:
                    run = one_run(config, conversations, host_chunks, policy, opts.preset, tmp / "work",
                                  tmp / "out")
                    runs.append({"round": round_, **run})
                    print(json.dumps(runs[-1]), file=terminal, flush=True)
    meta.update(loadavg_end=list(os.getloadavg()))
    document = {"meta": meta, "runs": runs, "summary": summarize(runs)}
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(document, indent=1) + "\n")
    print(json.dumps(document["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
