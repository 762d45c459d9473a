"""`kvtier plan`'s predicted host hit ratio against runs of those host sizes, cpu preset.

    python -m benchmarks.bench_plan_accuracy --out bench-results/plan-acc --sizes 64,96,128 \\
        --lock bench.lock --json benchmarks/results/plan_accuracy_$(date +%F).json

Runs `kvtier bench multiturn --preset cpu --conversations 8 --configs host --repeats 1 --mode
inprocess` with tracing, one run after the other: once with the preset's host tier (152
chunks: it holds the whole working set), then with a host tier of each of `--sizes` chunks. The
first run's trace is planned with `--at` those sizes (`predict[].host_hit_ratio`, the replay of
the host tier behind the device); each sized run's own trace gives the measured host share of the
chunk references' tokens (`observed_hit_ratio.host`), and is replayed at its own size too
(`self_replay`: the model's error on the very run it is compared with, free of run-to-run
differences). Each prediction carries the plan's range over the sizes around it, the requests
whose outcome changed from the traced run and its `cliff` mark. With `--lock PATH` each run holds
`flock -x PATH` (and only the run). One chunk is one 64-token block (2.95 MB of SmolLM2 float32 KV).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvtier.trace.plan import plan
from kvtier.trace.records import read_traces
from kvtier.trace.replay import host_hit_ratios

BENCH = ["bench", "multiturn", "--preset", "cpu", "--conversations", "8", "--configs", "host",
         "--repeats", "1", "--mode", "inprocess", "--json"]


def run(out: Path, label: str, host_chunks: int | None,
        lock: Path | None) -> tuple[Path, dict[str, Any]]:
    """One traced run; its trace file and its benchmark point (with the load average before and
    after it)."""
    traces = out / f"traces-{label}"
    argv = [*(["flock", "-x", str(lock)] if lock else []), sys.executable, "-m", "kvtier.cli",
            *BENCH, "--trace", str(traces), "--out", str(out / f"run-{label}")]
    if host_chunks is not None:
        argv += ["--host-chunks", str(host_chunks)]
    with open(out / f"run-{label}.err", "w") as err:
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=err, text=True, check=True)
    (point,) = json.loads(done.stdout)["points"]
    (trace,) = sorted(traces.glob("*.jsonl"))
    return trace, {**point, "loadavg_end": list(os.getloadavg())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sizes", default="64,96,128", help="host tier sizes in chunks, predicted")
    ap.add_argument("--runs", default=None, help="the sizes also run and measured (default: all)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--lock", type=Path, default=None, help="hold flock -x on it during each run")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    runs = sizes if args.runs is None else [int(s) for s in args.runs.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    load = [list(os.getloadavg())]
    trace_path, trace_point = run(args.out, "trace", None, args.lock)
    trace = read_traces([trace_path])
    row = int(trace.header.chunk_bytes or 0)
    predicted = plan(trace, host_bytes_per_s=1e10, at=[s * row for s in sizes]).report
    result: dict[str, Any] = {"row_bytes": row, "trace_run": {
        "observed": predicted["observed_hit_ratio"],
        "working_set_chunks": predicted["working_set_bytes"] // row,
        "plan_predict": predicted["predict"], "bench": trace_point}, "runs": {}}
    for size, guess in zip(sizes, predicted["predict"], strict=True):
        if size not in runs:
            continue
        path, point = run(args.out, str(size), size, args.lock)
        measured = read_traces([path])
        observed = plan(measured, host_bytes_per_s=1e10).report["observed_hit_ratio"]
        result["runs"][str(size)] = {
            "predicted_host": guess["host_hit_ratio"], "predicted_range": guess["hit_ratio_range"],
            "cliff": guess["cliff"], "changed_requests": guess["changed_requests"],
            "measured_host": observed.get("host", 0.0),
            "error_points": 100 * (guess["host_hit_ratio"] - observed.get("host", 0.0)),
            "self_replay_host": host_hit_ratios(measured, [size])[0], "observed": observed,
            "bench": point}
    load.append(list(os.getloadavg()))
    result["loadavg_start_end"] = load
    for size, r in result["runs"].items():
        lo, hi = r["predicted_range"]
        print(f"host {size} chunks: predicted {r['predicted_host']:.1%} ({lo:.1%}-{hi:.1%}"
              f"{', cliff' if r['cliff'] else ''}), measured {r['measured_host']:.1%} "
              f"({r['error_points']:+.1f} points), replay of its own trace {r['self_replay_host']:.1%}")
    text = json.dumps(result, indent=1)
    if args.json is not None:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
