"""`kvtier bench multiturn` (run a sweep) and `kvtier bench report RESULTS...` (redraw saved ones).

``kvtier bench multiturn --preset cpu`` sweeps the preset's numbers of conversations on the
embedded SmolLM2 model, point by point: at each point every configuration runs `--repeats` times
(default 3; rounds in rotated order), each run on a fresh vLLM server. It shows progress (rich) on
stderr, and writes results.json, results.csv and results.png to `--out` (default
`bench-results/multiturn-<preset>-<time>`); the table (median [min-max] over the runs) goes to
stdout. The engines' output (vLLM's logs and warnings) goes to vllm.log there, in-process
engines' to the terminal with `-v`. The vllm-native and lmcache configurations load our baselines
(vLLM's own tiering, LMCache) from benchmarks/baselines/ (run from kvtier's source tree; lmcache needs
scripts/install_lmcache.sh). Workload and cache sizes
come from the preset unless given; `--endpoint URL` drives a running server instead (one
configuration, labelled `--label`), and `--endpoints URL,URL[,...]` several running servers as one
fleet, each request sent where `--route` says (round-robin: each turn of a conversation to the
instance after its previous turn's; prefix-affinity: the conversation's own), with the split
summed over the instances' /metrics and given per instance; `--mode inprocess` uses an
in-process engine. Arguments after `--` go to every vLLM server.

Mixed traffic and a ramp (server and endpoint modes): `--mix 0.5 --mix-tokens 256` makes half of
all requests single-use one-turn prompts of 256 tokens, taken between the conversations' turns as
they fall due (deterministic), never sharing a chunk with anything; points then report them and
the conversations' turns apart (`single_use`: latency, the conversations' own token split and host
hit share). `--ramp 1,2,4,8` raises the concurrency step by step within one run: the conversations
stay active (a finished one is replaced by a new one), each step lasts `--ramp-step-requests`
requests started (default: the largest point's conversations x turns) or `--ramp-step-s` seconds,
then drains, and is reported as its own point ("16 @4": 16 conversations at concurrency 4) with
its own split.
Every point reports TTFT, ITL and end-to-end latency p50/p95/p99 and the hit-quality split.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.bench.multiturn import configs as config_registry
from kvtier.bench.multiturn import presets, report
from kvtier.bench.multiturn.fleet import ROUTES
from kvtier.bench.multiturn.workload import Mix, Ramp
from kvtier.bench.neutral_paths import neutral_path
from kvtier.config import ALWAYS, LOAD_POLICIES
from kvtier.errors import KVTierError

if TYPE_CHECKING:
    from kvtier.bench.multiturn.sweep import Plan


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of integers") from e
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: integers >= 1")
    return values


def _urls(text: str) -> tuple[str, ...]:
    urls = tuple(u.strip() for u in text.split(",") if u.strip())
    if len(urls) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: at least two comma-separated URLs (one: --endpoint)")
    return urls


def _endpoints(args: argparse.Namespace) -> tuple[str, ...]:
    """The running servers to drive (`--endpoint` or `--endpoints`); empty when the sweep starts
    its own."""
    if args.endpoints:
        urls: tuple[str, ...] = args.endpoints
        return urls
    return (args.endpoint,) if args.endpoint else ()


def _ints_one(text: str) -> int:
    values = _ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: one integer >= 1")
    return values[0]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser("bench", help="benchmarks: multi-turn tiering sweep, reports")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    p = bsub.add_parser("multiturn", help="multi-turn chat sweep over conversations x configurations",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu", help=f"one of {', '.join(presets.PRESETS)} (default cpu)")
    p.add_argument("--conversations", type=_ints, default=None, help="points, e.g. 2,4,8,16")
    p.add_argument("--configs", default=None,
                   help=f"comma-separated, from: {', '.join(config_registry.CONFIGS)}")
    for flag in ("initial-tokens", "tokens-per-turn", "turns", "max-concurrency", "output-tokens",
                 "seed", "block-size", "device-blocks", "host-chunks"):
        p.add_argument(f"--{flag}", type=int, default=None)
    p.add_argument("--repeats", type=_ints_one, default=3,
                   help="runs of each configuration at each point, interleaved (default 3)")
    p.add_argument("--mode", choices=("server", "inprocess"), default="server")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--endpoint", default=None, help="drive this running server (no engine started)")
    where.add_argument("--endpoints", type=_urls, default=None, metavar="URL,URL[,...]",
                       help="drive these running servers as one fleet, each request routed by "
                            "--route; the split is summed over their /metrics, and given per instance")
    p.add_argument("--route", choices=ROUTES, default="round-robin",
                   help="with --endpoints: round-robin (each turn to the instance after its "
                        "previous turn's) or prefix-affinity (a conversation sticks to one "
                        "instance); default round-robin")
    p.add_argument("--served-model-name", default=None, help="model name for the endpoint")
    p.add_argument("--model", type=Path, default=None, help="model dir (default: embedded SmolLM2)")
    p.add_argument("--tokenizer", default=None, help="tokenizer (default: the model's)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--label", default=None, help="name of this run in reports (and the endpoint's config)")
    p.add_argument("--out", type=Path, default=None, help="results directory")
    p.add_argument("--work-dir", type=Path, default=None, help="fs tier directories (default: a temp dir)")
    p.add_argument("--obj-endpoint", default=None)
    p.add_argument("--obj-bucket", default=None)
    p.add_argument("--redis-url", default=None)
    p.add_argument("--admission-policy", default=None)
    p.add_argument("--mix", type=float, default=None,
                   help="share of all requests that are single-use one-turn prompts, between the "
                        "conversations' turns (0.5: as many as turns; default none)")
    p.add_argument("--mix-tokens", type=int, default=256,
                   help="prompt tokens of each single-use request (default 256)")
    p.add_argument("--ramp", type=_ints, default=None,
                   help="concurrency steps within one run, e.g. 1,2,4,8: the conversations stay "
                        "active (a finished one is replaced), each step ends after "
                        "--ramp-step-requests requests started or --ramp-step-s seconds, then drains; "
                        "one point per step")
    p.add_argument("--ramp-step-requests", type=int, default=None,
                   help="requests per ramp step (default: the largest point's conversations x turns)")
    p.add_argument("--ramp-step-s", type=float, default=None, help="seconds per ramp step")
    p.add_argument("--blocks-per-chunk", type=_ints_one, default=None,
                   help="engine blocks per chunk of every kvtier configuration (default 1)")
    p.add_argument("--chunk-tokens", type=_ints_one, default=None,
                   help="chunk size in tokens of every kvtier configuration, a multiple of the "
                        "engine block (instead of --blocks-per-chunk)")
    p.add_argument("--load-policy", choices=LOAD_POLICIES, default=None,
                   help="load_policy of every kvtier configuration (default: the config's, always)")
    p.add_argument("--trace", type=Path, default=None,
                   help="write each kvtier run's connector trace (trace_path) into this directory")
    p.add_argument("--json", action="store_true", help="print the results JSON instead of the table")
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="in-process engines' output on the terminal (default: in --out's vllm.log, "
                        "where servers' output always goes), and debug logging")
    p.set_defaults(func=run_multiturn, accepts_passthrough=True)
    from kvtier.bench.chaos import cli as chaos_cli

    chaos_cli.add_parser(bsub)
    from kvtier.bench import results_page as plots

    r = bsub.add_parser("report", help="table, CSV and PNG from saved results.json files; with none, "
                                       "BENCHMARKS.md's plots from benchmarks/results/")
    r.add_argument("results", type=Path, nargs="*")
    r.add_argument("--out", type=Path, default=None,
                   help=f"CSV and PNG go here (default {plots.FILES_OUT}; with no files {plots.PAGE_DIR})")
    r.add_argument("--results-dir", type=Path, default=plots.RESULTS_DIR,
                   help=f"with no files: the raw JSON the plots read (default {plots.RESULTS_DIR})")
    r.add_argument("--title", default=None)
    r.set_defaults(func=plots.run_report)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _load_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def _model(args: argparse.Namespace) -> Path | None:
    if args.model is not None or _endpoints(args):
        given: Path | None = args.model
        return given
    from kvtier.tools.models import ModelPrepError, prepare_smollm2

    try:
        with contextlib.redirect_stdout(sys.stderr):
            model: Path = prepare_smollm2()
            return model
    except ModelPrepError as e:
        raise KVTierError(str(e)) from e


def _plan(args: argparse.Namespace, work_dir: Path, out: Path) -> tuple[Plan, dict[str, Any]]:
    from kvtier.bench.multiturn.sweep import Plan

    preset = presets.preset(args.preset)
    spec = presets.with_overrides(
        preset.workload, initial_tokens=args.initial_tokens, tokens_per_turn=args.tokens_per_turn,
        turns=args.turns, max_concurrency=max(args.ramp) if args.ramp else args.max_concurrency,
        output_tokens=args.output_tokens, seed=args.seed)
    sweep = args.conversations or preset.sweep
    mix = Mix(args.mix, args.mix_tokens) if args.mix else None
    if mix is not None:
        mix.check()
    ramp = None
    if args.ramp:
        step_requests = args.ramp_step_requests
        if step_requests is None and args.ramp_step_s is None:
            step_requests = max(sweep) * spec.turns
        ramp = Ramp(args.ramp, step_requests, args.ramp_step_s)
        ramp.check()
    endpoints = _endpoints(args)
    names = args.configs.split(",") if args.configs else list(preset.configs)
    if endpoints:
        names = [args.label or "endpoint"]
    else:
        config_registry.check_names(names)
    if args.block_size is not None:
        preset = presets.Preset(**{**preset.__dict__, "block_size": args.block_size})
    if endpoints and args.device_blocks is None and preset.device_blocks is None \
            and preset.device_conversations is None:  # the endpoint's cache is not ours to size
        preset = presets.Preset(**{**preset.__dict__, "device_blocks": 1 << 30})
    sizes = presets.sizing(preset, spec, sweep, device_blocks=args.device_blocks,
                           host_chunks=args.host_chunks)
    model = _model(args)
    dtype = args.dtype or preset.dtype
    block_bytes = presets.kv_bytes_per_token(model, dtype) * preset.block_size if model is not None else 0
    options = {k: v for k in ("obj_endpoint", "obj_bucket", "redis_url", "admission_policy")
               if (v := getattr(args, k))}
    if args.blocks_per_chunk is not None:
        options["blocks_per_chunk"] = str(args.blocks_per_chunk)
    if args.chunk_tokens is not None:
        if args.blocks_per_chunk is not None:
            raise SystemExit("kvtier bench multiturn: give --chunk-tokens or --blocks-per-chunk, not both")
        options["chunk_tokens"] = str(args.chunk_tokens)
    if args.load_policy is not None:
        options["load_policy"] = args.load_policy
    if args.trace is not None:
        args.trace.mkdir(parents=True, exist_ok=True)
        options["trace_dir"] = str(args.trace.resolve())
    context = config_registry.BenchContext(block_bytes, sizes.device_blocks, sizes.all_fits_blocks,
                                           sizes.host_chunks, work_dir, options, preset.block_size)
    tokenizer_name = args.tokenizer or (str(model) if model is not None else None)
    if tokenizer_name is None:
        raise KVTierError("--tokenizer: needed with --endpoint (the served model's tokenizer)")
    mode = "endpoint" if endpoints else args.mode
    plan = Plan(spec, tuple(sweep), names, mode, model,
                args.served_model_name or (model.name if model is not None else "model"),
                _load_tokenizer(tokenizer_name), preset.block_size, block_bytes, sizes.max_model_len,
                context, dtype, endpoints, os.environ.get("OPENAI_API_KEY"),
                tuple(args.passthrough), out, args.repeats, mix, ramp, args.route)
    meta = {
        "label": args.label or f"{platform.node()} {args.preset}", "preset": args.preset,
        "title": f"kvtier bench multiturn, preset {args.preset}: {spec.initial_tokens} + "
                 f"{spec.tokens_per_turn}/turn x {spec.turns} turns, {spec.max_concurrency} in flight, "
                 f"{model.name if model else ', '.join(endpoints)} ({dtype})",
        "workload": spec.as_json(), "mix": mix.__dict__ if mix else None,
        "ramp": ramp.__dict__ if ramp else None, "sweep": list(sweep), "configs": names,
        "repeats": args.repeats, "blocks_per_chunk": args.blocks_per_chunk or 1,
        "chunk_tokens": args.chunk_tokens,
        "load_policy": args.load_policy or ALWAYS,
        "mode": mode, "endpoints": list(endpoints),
        "route": args.route if len(endpoints) > 1 else None,
        "model": neutral_path(str(model)) if model else None, "dtype": dtype,
        "block_size": preset.block_size,
        "block_bytes": block_bytes, "sizing": None if endpoints else sizes.__dict__,
        "command": neutral_path(shlex.join(["kvtier", *sys.argv[1:]])) if sys.argv else "",
        "machine": {"node": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "loadavg_start": list(os.getloadavg()), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    return plan, meta


def run_multiturn(args: argparse.Namespace) -> int:
    from kvtier.bench.engine_log import LOG_NAME, engine_output
    from kvtier.bench.multiturn.progress import RichHooks
    from kvtier.bench.multiturn.sweep import run_sweep

    signal.signal(signal.SIGTERM, _raise_interrupt)
    out = args.out or Path("bench-results") / f"multiturn-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    with contextlib.ExitStack() as stack:
        if args.work_dir is None:
            work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-bench-")))
        else:
            work_dir = args.work_dir
            work_dir.mkdir(parents=True, exist_ok=True)
        try:
            plan, meta = _plan(args, work_dir, out)
        except ValueError as e:
            raise KVTierError(str(e)) from e
        if plan.mode == "inprocess":
            from kvtier.integrations.vllm.serving.launch import in_process_env

            vllm_tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-vllm-")))
            stack.enter_context(in_process_env(vllm_tmp))
        log_path = out / LOG_NAME if plan.mode != "endpoint" else None  # no engine: no log
        quiet = log_path is not None and not args.verbose
        terminal = stack.enter_context(engine_output(log_path if quiet else None))
        points: list[dict[str, Any]] = []
        hooks = stack.enter_context(RichHooks(plan.spec.turns, terminal if quiet else None))
        if log_path is not None and (quiet or plan.mode == "server"):
            hooks.console.log(f"vLLM's log: {log_path}")

        def emit(point: dict[str, Any]) -> None:
            points.append(point)
            hooks.point_done(point)
            report.write_all(out, {**meta, "loadavg_end": list(os.getloadavg())}, points)

        started = time.monotonic()
        try:
            run_sweep(plan, hooks, emit)
        except ValueError as e:
            raise KVTierError(str(e)) from e
        meta.update(seconds=round(time.monotonic() - started, 1), loadavg_end=list(os.getloadavg()))
        paths = report.write_all(out, meta, points)
    print(json.dumps({"meta": meta, "points": points}) if args.json else report.table(points))
    print(f"results: {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0


