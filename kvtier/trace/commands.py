"""`kvtier plan TRACE... [--json] [--out DIR]`: the plan of one or more trace files.

Without `--json` a short summary is printed, its first line the verdict (offload, offload with
admission, or will not help, and why); `--json` prints the whole plan as JSON; `--out DIR` writes
`plan.json` and the PNG plots there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvtier.trace.plan import GIB, plan
from kvtier.trace.records import read_traces

SUMMARY = """\
verdict: {verdict}: {verdict_reason}
requests {requests}, prompt tokens {prompt_tokens} (per request p50/p95/p99 {ctx}), \
{chunk_references} chunk references
(1) reusable prompt tokens {reusable_token_fraction:.1%}; requests with a shared prefix \
{requests_with_shared_prefix_fraction:.1%}
(2) reuse time p50/p95/p99 {rt}
(3) chunk size rows (tokens: reused tokens, of them in unfull chunks, bytes moved per reused \
token): {cs}
(4) never-reused chunks {never_reused_chunk_fraction:.1%}
sizing: working set {ws:.3f} GiB, reachable hit ratio {reachable_hit_ratio:.1%}
recommend: cpu_bytes_to_use {cpu} (hit ratio {cpu_hit:.1%}), max_bytes {mb} (hit ratio {mb_hit:.1%}), \
eviction_policy {policy}, chunk_tokens {ct} (blocks_per_chunk {bpc}), admission {adm}"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="answer the four sizing questions from kvtier traces",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", metavar="TRACE", help="trace files (rotated parts too)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--out", type=Path, help="write plan.json and PNG plots into this folder")
    p.add_argument("--host-gib-s", type=float,
                   help="host transfer budget in GiB/s (default: measured by a quick copy)")
    p.add_argument("--at", type=_sizes, default=(), metavar="BYTES[,BYTES...]",
                   help="host sizes to predict the hit ratio of (plan.json `predict`)")
    p.add_argument("--bytes-per-token", type=int,
                   help="KV bytes per token, for traces that do not say (kv-events traces)")
    p.add_argument("--host-bytes", type=_size, metavar="BYTES",
                   help="the most host memory the host tier may take: caps cpu_bytes_to_use")
    p.add_argument("--prefill-tok-s", type=float, metavar="TOKENS",
                   help="the engine's prefill rate (default: from the trace's TTFTs)")
    p.set_defaults(func=run)


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(float(v)) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated byte counts") from None
    if min(sizes) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: byte counts >= 0")
    return sizes


def _size(text: str) -> int:
    sizes = _sizes(text)
    if len(sizes) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: one byte count")
    return sizes[0]


def summary(report: dict[str, Any]) -> str:
    """The human-readable lines of a plan."""
    rt = report["reuse_time_s"]
    rec = report["recommend"]
    cs = ", ".join(
        f"{r['chunk_tokens']}: {r['reused_tokens']}, {r['unfull_tokens']}, "
        f"{r['bytes_per_reused_token'] or 0:.0f} B" for r in report["chunk_size"]
    )
    lines = SUMMARY.format(
        **report, rt="/".join("-" if v is None else f"{v:.2f}s" for v in rt.values()), cs=cs,
        ctx="/".join("-" if v is None else f"{v:.0f}" for v in report["context_length_tokens"].values()),
        ws=report["working_set_bytes"] / GIB, cpu=rec["cpu_bytes_to_use"], cpu_hit=rec["cpu_hit_ratio"],
        mb=rec["max_bytes"], mb_hit=rec["max_bytes_hit_ratio"], policy=rec["eviction_policy"],
        ct=rec["chunk_tokens"], bpc=rec["blocks_per_chunk"], adm=json.dumps(rec["admission"]),
    )
    if rec["cpu_cliff"]["cliff"]:
        lines += f"\n  cpu_bytes_to_use is on a cliff of the LRU curve: {_cliff(rec['cpu_cliff'])}"
    for p in report.get("predict", ()):
        lines += (f"\nhost tier of {p['bytes']} bytes: LRU hit ratio {p['lru_hit_ratio']:.1%}, "
                  f"host share behind the device {p['host_hit_ratio']:.1%}")
        if p["cliff"]:
            lines += f"\n  on a cliff: {_cliff(p)}; not a forecast, size away from it"
    return lines


def _cliff(row: dict[str, Any]) -> str:
    lo, hi = row["hit_ratio_range"]
    return f"{lo:.1%} to {hi:.1%} between {row['range_bytes'][0]} and {row['range_bytes'][1]} bytes"


def run(args: argparse.Namespace) -> int:
    chunk_bytes = None
    trace = read_traces(args.traces)
    if args.bytes_per_token:
        chunk_bytes = args.bytes_per_token * trace.header.chunk_tokens
    host = args.host_gib_s * GIB if args.host_gib_s else None
    result = plan(trace, chunk_bytes, host, args.at, args.host_bytes, args.prefill_tok_s)
    text = json.dumps(result.report, indent=1)
    if args.out is not None:
        from kvtier.trace.plots import write_plots

        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "plan.json").write_text(text + "\n")
        try:
            write_plots(result.report, result.reuse_times, args.out)
        except ImportError as e:
            print(f"kvtier plan: no plots ({e}); plan.json is written", file=sys.stderr)
    print(text if args.json else summary(result.report))
    return 0
