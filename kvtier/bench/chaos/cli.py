"""`kvtier bench chaos --preset smoke|full|soak [--duration S] [--out FILE] [--json]`.

Runs one campaign (`kvtier.bench.chaos.runner.run`) on the embedded SmolLM2 model (or `--model`),
prints the table (or the summary as JSON with `--json`), writes the summary and the raw results to
`--out` (default `bench-results/chaos-<preset>-<time>.json`), and exits 0 when the run passed, 1
when a check failed (`kvtier.bench.chaos.report`). `--duration` makes any preset run rounds for that
many seconds (the soak's mode). The fs tier goes on a tmpfs it mounts (root needed; otherwise a
plain directory and no ENOSPC fault). The engines' output (vLLM's logs and warnings) goes to a log
beside the results (`<out>` with `.vllm.log` for `.json`), to the terminal with `-v`.
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

from kvtier.bench.neutral_paths import neutral_path
from kvtier.errors import KVTierError


def add_parser(bsub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvtier.bench.chaos.presets import PRESETS

    p = bsub.add_parser("chaos", help="fault campaign under load: corruptions, kills, full disk",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="smoke", help=f"one of {', '.join(PRESETS)} (default smoke)")
    p.add_argument("--duration", type=float, default=None, help="run rounds for this many seconds")
    p.add_argument("--model", type=Path, default=None, help="model dir (default: embedded SmolLM2)")
    p.add_argument("--seed", type=int, default=0, help="the injectors' random seed")
    p.add_argument("--out", type=Path, default=None, help="results JSON file")
    p.add_argument("--work-dir", type=Path, default=None, help="servers' data (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="the engines' output on the terminal, and debug logging")
    p.set_defaults(func=run_chaos)


def _model(given: Path | None) -> Path:
    if given is not None:
        return given
    from kvtier.tools.models import ModelPrepError, prepare_smollm2

    try:
        with contextlib.redirect_stdout(sys.stderr):
            return prepare_smollm2()
    except ModelPrepError as e:
        raise KVTierError(str(e)) from e


def run_chaos(args: argparse.Namespace) -> int:
    from kvtier.bench.chaos import presets, report, runner
    from kvtier.bench.engine_log import engine_output
    from kvtier.integrations.vllm.serving.launch import in_process_env

    try:
        preset = presets.preset(args.preset, args.duration)
    except ValueError as e:
        raise KVTierError(str(e)) from e
    model = _model(args.model)
    out = args.out or Path("bench-results") / f"chaos-{preset.name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    meta: dict[str, Any] = {
        "preset": preset.name, "duration_s": preset.duration_s, "seed": args.seed,
        "model": neutral_path(str(model)), "workload": preset.spec.as_json(),
        "command": neutral_path(shlex.join(["kvtier", *sys.argv[1:]])),
        "machine": {"node": platform.node(), "cpus": os.cpu_count()},
        "loadavg_start": list(os.getloadavg()), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    with contextlib.ExitStack() as stack:
        work = args.work_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-chaos-")))
        vllm_tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-vllm-")))
        stack.enter_context(in_process_env(vllm_tmp))
        log_path = None if args.verbose else out.with_suffix(".vllm.log")
        terminal = stack.enter_context(engine_output(log_path))
        if log_path is not None:
            print(f"vLLM's log: {log_path}", file=terminal, flush=True)
        raw = runner.run(preset, model, work, args.seed)
    meta["loadavg_end"] = list(os.getloadavg())
    summary = report.summarize(raw, expect_corruptions=preset.pace is not None,
                               soak=preset.sample_every_s is not None,
                               min_detected={t: preset.min_detected for t in preset.detect_tiers})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "summary": summary, "raw": raw}, indent=1))
    print(json.dumps(summary, indent=1) if args.json else report.table(summary))
    print(f"results: {out}", file=sys.stderr)
    return 0 if summary["passed"] else 1
