"""`kvtier demo`: a multi-turn chat on a small device cache, with kvtier and without it.

The embedded default model (SmolLM2-135M-Instruct, prepared by `kvtier.tools.models` when missing) is
served by an in-process vLLM engine whose device KV cache holds `--device-blocks` blocks of 32
tokens. The kvtier pass adds the KVTierConnector with a host tier of `--host-chunks` chunks and
an fs tier in a temp dir (or `--fs-dir`); the baseline pass is the same engine without a
connector, so only vLLM's own device prefix cache helps it. Both passes serve the same prompts
(the baseline replays the kvtier pass's replies) one request at a time, turn 1 of every
conversation first, then turn 2, ... (`kvtier.bench.workload`).

With the defaults the conversations' prefixes outgrow the device cache from the first turn on and
the host tier from the third or fourth turn on, so later turns are served from host memory and
then from the fs tier. Each turn's time to first token and the sources of its prompt tokens are
printed as it runs (stderr) and side by side at the end (stdout; one JSON object with `--json`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.bench.chat_run import (
    EngineSettings,
    TurnResult,
    kv_bytes_per_token,
    run_chat_pass,
    vllm_environment,
)
from kvtier.bench.workload import CONVERSATIONS, check_sizes, max_turns
from kvtier.config import KVTierConfig
from kvtier.errors import KVTierError

SOURCES = ("device", "host", "fs", "recomputed")


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _split_text(tokens: dict[str, int]) -> str:
    return " ".join(f"{source} {tokens.get(source, 0)}" for source in SOURCES)


def _turn_printer(label: str) -> Any:
    def show(r: TurnResult) -> None:
        _progress(f"  {label:8} conversation {r.conversation} turn {r.turn}: {r.prompt_tokens:4} "
                  f"prompt tokens, TTFT {r.ttft_s * 1000:7.1f} ms  ({_split_text(r.tokens)})")
    return show


def kvtier_config(settings: EngineSettings, host_chunks: int, fs_dir: Path) -> dict[str, Any]:
    """The connector's extra config: a host tier of `host_chunks` one-block chunks and fs."""
    row = kv_bytes_per_token(settings.model, settings.dtype) * settings.block_size
    raw = {"cpu_bytes_to_use": host_chunks * row, "eviction_policy": "lru",
           "secondary_tiers": [{"type": "fs", "root_dir": str(fs_dir)}]}
    KVTierConfig.from_dict(raw)
    return raw


def run_demo(settings: EngineSettings, conversations: int, turns: int, host_chunks: int,
             fs_dir: Path | None) -> dict[str, Any]:
    """Both passes; the report `--json` prints (see the module docstring)."""
    check_sizes(conversations, turns)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        tmp = Path(tempfile.mkdtemp(prefix="kvtier-demo-"))
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        fs_root = fs_dir if fs_dir is not None else tmp / "fs"
        fs_root.mkdir(parents=True, exist_ok=True)
        config = kvtier_config(settings, host_chunks, fs_root)
        stack.enter_context(vllm_environment(tmp))
        stack.enter_context(contextlib.redirect_stdout(sys.stderr))
        _progress(f"kvtier pass: {settings.device_blocks} device blocks of {settings.block_size} "
                  f"tokens, host tier {host_chunks} chunks, fs tier in {fs_root}")
        with_kvtier = run_chat_pass(settings, config, conversations, turns,
                                    progress=_turn_printer("kvtier"))
        replies = {(r.conversation, r.turn): r.reply for r in with_kvtier}
        _progress("baseline pass: same engine, no connector (vLLM's own prefix cache only)")
        baseline = run_chat_pass(settings, None, conversations, turns, replies=replies,
                                 baseline_sources=["host", "fs"],
                                 progress=_turn_printer("baseline"))
    return {
        "model": settings.model.name, "dtype": settings.dtype,
        "device_blocks": settings.device_blocks, "block_size": settings.block_size,
        "host_chunks": host_chunks, "conversations": conversations, "turns": turns,
        "reply_tokens": settings.reply_tokens, "seconds": round(time.monotonic() - started, 1),
        "kvtier": [r.as_json() for r in with_kvtier],
        "baseline": [r.as_json() for r in baseline],
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def format_report(report: dict[str, Any]) -> str:
    """Per turn number: mean TTFT with kvtier and without, and kvtier's token sources."""
    lines = [
        f"kvtier demo: {report['model']} ({report['dtype']}), {report['conversations']} "
        f"conversations x {report['turns']} turns, device cache {report['device_blocks']} blocks "
        f"of {report['block_size']} tokens, host tier {report['host_chunks']} chunks, fs tier",
        "",
        "| turn | prompt tokens | TTFT kvtier (ms) | TTFT baseline (ms) | speed-up "
        "| kvtier: device / host / fs / recomputed | baseline: device / recomputed |",
        "|---|---|---|---|---|---|---|",
    ]
    for turn in range(1, report["turns"] + 1):
        kv = [r for r in report["kvtier"] if r["turn"] == turn]
        base = [r for r in report["baseline"] if r["turn"] == turn]
        kv_ms = _mean([r["ttft_s"] for r in kv]) * 1000
        base_ms = _mean([r["ttft_s"] for r in base]) * 1000
        sums = {s: sum(r["tokens"].get(s, 0) for r in kv) for s in SOURCES}
        base_dev = sum(r["tokens"]["device"] for r in base)
        base_rec = sum(r["tokens"]["recomputed"] for r in base)
        lines.append(
            f"| {turn} | {sum(r['prompt_tokens'] for r in kv)} | {kv_ms:.0f} | {base_ms:.0f} "
            f"| {base_ms / kv_ms if kv_ms else 0:.1f}x | {' / '.join(str(sums[s]) for s in SOURCES)} "
            f"| {base_dev} / {base_rec} |")
    kv_all = _mean([r["ttft_s"] for r in report["kvtier"]]) * 1000
    base_all = _mean([r["ttft_s"] for r in report["baseline"]]) * 1000
    lines += ["", f"mean TTFT over all turns: kvtier {kv_all:.0f} ms, baseline {base_all:.0f} ms "
              f"({base_all / kv_all if kv_all else 0:.1f}x); total {report['seconds']} s"]
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="multi-turn chat on a small device cache, with and without kvtier")
    p.add_argument("--conversations", type=int, default=len(CONVERSATIONS),
                   help=f"chats served round-robin (1-{len(CONVERSATIONS)})")
    p.add_argument("--turns", type=int, default=max_turns(), help=f"turns per chat (1-{max_turns()})")
    p.add_argument("--device-blocks", type=int, default=40, help="device KV cache, blocks of 32 tokens")
    p.add_argument("--host-chunks", type=int, default=64, help="host tier size, chunks of 32 tokens")
    p.add_argument("--max-model-len", type=int, default=1024, help="longest prompt + reply")
    p.add_argument("--reply-tokens", type=int, default=12, help="tokens generated per turn")
    p.add_argument("--fs-dir", type=Path, default=None, help="fs tier directory (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    from kvtier.tools.models import ModelPrepError, prepare_smollm2

    for flag in ("device_blocks", "host_chunks", "reply_tokens", "max_model_len"):
        if getattr(args, flag) < 1:
            raise KVTierError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
    least = -(-args.max_model_len // 32) + 1  # vLLM wants one max-length request plus a block
    if args.device_blocks < least:
        raise KVTierError(f"--device-blocks {args.device_blocks}: must hold one --max-model-len "
                          f"{args.max_model_len} request (at least {least})")
    try:
        check_sizes(args.conversations, args.turns)
        with contextlib.redirect_stdout(sys.stderr):
            model = prepare_smollm2()
    except (ValueError, ModelPrepError) as e:
        raise KVTierError(str(e)) from e
    settings = EngineSettings(model=model, device_blocks=args.device_blocks,
                              max_model_len=args.max_model_len, reply_tokens=args.reply_tokens)
    report = run_demo(settings, args.conversations, args.turns, args.host_chunks, args.fs_dir)
    print(json.dumps(report) if args.json else format_report(report), flush=True)
    return 0
