"""`kvtier demo`: a multi-turn chat on a small device cache, with kvtier and without it.

A view of the multi-turn benchmark (`kvtier.bench.multiturn`): `--model DIR` (a model directory
with its tokenizer and chat template; by default the embedded SmolLM2-135M-Instruct, prepared by
`kvtier.tools.models` when missing; hybrid models too, such as the tiny Gemma3 of
`kvtier.tools.tiny_models`, whose sliding-window layers vLLM's hybrid manager keeps) is served by the
benchmark's in-process engine (`engine_run.InProcessEngine`) whose device KV cache holds
`--device-blocks` blocks of 32 tokens, in two of its configurations (`configs`): `host+fs` (the
KVTierConnector with a host tier of `--host-chunks` chunks and an fs tier in a temp dir, or in
`--fs-dir`) and `no-offload` (the same engine without a connector, so only vLLM's own device prefix
cache helps it). The conversations are the demo's fixed chats (`multiturn.chats`) with one request
in flight, so the benchmark's queue of conversations serves turn 1 of every conversation first,
then turn 2, ... (`round_robin`). The baseline replays the kvtier pass's replies
(`Conversation.transcript`): identical prompts, and only each turn's first token is generated.

With `--check-replies`, a third pass serves the chats on the engine alone again, generating every
reply, and the report says whether kvtier's replies are the same (`replies_match`): reloaded KV
changes no greedy token (the exit status is 1 when they differ).

With the defaults the conversations' prefixes outgrow the device cache from the first turn on and
the host tier from the third or fourth turn on, so later turns are served from host memory and
then from the fs tier. Each turn's time to first token and the sources of its prompt tokens are
printed as it runs (stderr) and side by side at the end (stdout; one JSON object with `--json`).
The engines' own output (vLLM's logs, torch's and transformers' warnings and progress bars) goes
to a log file whose path is printed first (`--log-file`, default a new file in the temp
directory; `kvtier.bench.engine_log`); with `-v` it goes to the terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.engine_log import default_log, engine_output
from kvtier.bench.multiturn.chats import CHATS, check_sizes, max_turns
from kvtier.bench.multiturn.configs import BenchContext, EngineConfig, resolve
from kvtier.bench.multiturn.conversation import Conversation, Script, WorkloadSpec
from kvtier.bench.multiturn.engine_run import InProcessEngine, OnRequest
from kvtier.bench.multiturn.presets import kv_bytes_per_token
from kvtier.bench.multiturn.summary import RequestRecord
from kvtier.bench.multiturn.vllm_server import ServerSettings
from kvtier.errors import KVTierError
from kvtier.format.chunks import DEVICE, HOST, RECOMPUTED
from kvtier.integrations.vllm.serving.launch import in_process_env

SOURCES = (DEVICE, HOST, "fs", RECOMPUTED)
Say = Callable[[str], None]


@dataclass(frozen=True)
class DemoSettings:
    """The demo's flags: the chats served, and the engine both passes share."""

    model: Path
    conversations: int
    turns: int
    device_blocks: int
    host_chunks: int
    max_model_len: int
    reply_tokens: int
    fs_dir: Path | None
    check_replies: bool = False
    log_path: Path | None = None
    """Where the engines' output goes (None: the terminal)."""
    block_size: int = 32
    dtype: str = "float32"

    def workload(self) -> WorkloadSpec:
        """The benchmark's spec of the chats: one request in flight, `reply_tokens` per reply (the
        chats' scripts give the user messages, so the generated-text sizes are 0)."""
        return WorkloadSpec(initial_tokens=0, tokens_per_turn=0, turns=self.turns,
                            conversations=self.conversations, max_concurrency=1,
                            output_tokens=self.reply_tokens)

    def engine_settings(self, config: EngineConfig, block_bytes: int) -> ServerSettings:
        """The benchmark's engine settings for `config`: one request at a time."""
        return ServerSettings(self.model, self.model.name, self.block_size, config.device_blocks,
                              self.max_model_len, 1, block_bytes, self.dtype, config.kvtier)


def round_robin(conversations: int, turns: int) -> Iterator[tuple[int, int]]:
    """(conversation index, turn) pairs in serving order: every conversation's turn 1, then 2, ..."""
    for turn in range(1, turns + 1):
        for conv in range(conversations):
            yield conv, turn


def _split(record: RequestRecord) -> dict[str, int]:
    """The record's prompt-token split with every demo source (0 where none came from it)."""
    return {**dict.fromkeys(SOURCES, 0), **(record.tokens or {})}


def _turn_printer(label: str, say: Say) -> OnRequest:
    def show(r: RequestRecord) -> None:
        split = " ".join(f"{source} {count}" for source, count in _split(r).items())
        say(f"  {label:8} conversation {r.conversation} turn {r.turn}: {r.prompt_tokens:4} "
                  f"prompt tokens, TTFT {r.ttft_s * 1000:7.1f} ms  ({split})")
    return show


def serve_pass(engine_settings: ServerSettings, spec: WorkloadSpec, scripts: Sequence[Script],
               label: str, say: Say) -> tuple[list[RequestRecord], list[Conversation]]:
    """One pass of the chats on a fresh engine (after its warm-up request), each turn shown with
    `say`: the records, in serving order, and the conversations as they ended. Raises
    RuntimeError when a request failed or the turns were not served in `round_robin` order."""
    with InProcessEngine(engine_settings) as engine:
        engine.warm_up()
        chats = [Conversation(i, spec, engine.tokenizer, script=script)
                 for i, script in enumerate(scripts)]
        records, _ = engine.run_point(spec, label, _turn_printer(label, say), chats)
    for r in records:
        if r.error:
            raise RuntimeError(f"{label}: conversation {r.conversation} turn {r.turn}: {r.error}")
    order = [(r.conversation, r.turn) for r in records]
    if order != list(round_robin(spec.conversations, spec.turns)):
        raise RuntimeError(f"{label}: turns served out of round-robin order: {order}")
    return records, chats


def _turn_json(record: RequestRecord) -> dict[str, Any]:
    return {"conversation": record.conversation, "turn": record.turn,
            "prompt_tokens": record.prompt_tokens, "ttft_s": round(record.ttft_s, 4),
            "tokens": _split(record)}


def run_demo(s: DemoSettings) -> dict[str, Any]:
    """Both passes; the report `--json` prints (see the module docstring)."""
    check_sizes(s.conversations, s.turns)
    spec = s.workload()
    block_bytes = kv_bytes_per_token(s.model, s.dtype) * s.block_size
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-demo-",
                                                                   ignore_cleanup_errors=True)))
        context = BenchContext(block_bytes, s.device_blocks, s.device_blocks, s.host_chunks,
                               s.fs_dir if s.fs_dir is not None else tmp)
        kvtier, alone = resolve("host+fs", context), resolve("no-offload", context)
        stack.enter_context(in_process_env(tmp))
        terminal = stack.enter_context(engine_output(s.log_path))

        def say(msg: str) -> None:
            print(msg, file=terminal, flush=True)

        if s.log_path is not None:
            say(f"vLLM's log: {s.log_path}")
        say(f"kvtier pass: {s.device_blocks} device blocks of {s.block_size} tokens, host tier "
            f"{s.host_chunks} chunks, fs tier under {context.work_dir}")
        with_kvtier, chats = serve_pass(s.engine_settings(kvtier, block_bytes), spec,
                                        CHATS[:s.conversations], "kvtier", say)
        say("baseline pass: same engine, no connector (vLLM's own prefix cache only)")
        baseline, _ = serve_pass(s.engine_settings(alone, block_bytes), spec,
                                 [chat.transcript() for chat in chats], "baseline", say)
        check: dict[str, Any] = {}
        if s.check_replies:
            say("check pass: no connector, every reply generated")
            _, alone_chats = serve_pass(s.engine_settings(alone, block_bytes), spec,
                                        CHATS[:s.conversations], "check", say)
            check["replies_match"] = _replies(chats) == _replies(alone_chats)
    return {
        "model": s.model.name, "dtype": s.dtype, "device_blocks": s.device_blocks,
        "block_size": s.block_size, "host_chunks": s.host_chunks,
        "conversations": s.conversations, "turns": s.turns, "reply_tokens": s.reply_tokens,
        "seconds": round(time.monotonic() - started, 1),
        "kvtier": [_turn_json(r) for r in with_kvtier],
        "baseline": [_turn_json(r) for r in baseline],
        **check,
    }


def _replies(chats: Sequence[Conversation]) -> list[tuple[str, ...]]:
    return [chat.transcript().replies for chat in chats]


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
        base_dev = sum(r["tokens"][DEVICE] for r in base)
        base_rec = sum(r["tokens"][RECOMPUTED] for r in base)
        lines.append(
            f"| {turn} | {sum(r['prompt_tokens'] for r in kv)} | {kv_ms:.0f} | {base_ms:.0f} "
            f"| {base_ms / kv_ms if kv_ms else 0:.1f}x | {' / '.join(str(sums[s]) for s in SOURCES)} "
            f"| {base_dev} / {base_rec} |")
    kv_all = _mean([r["ttft_s"] for r in report["kvtier"]]) * 1000
    base_all = _mean([r["ttft_s"] for r in report["baseline"]]) * 1000
    lines += ["", f"mean TTFT over all turns: kvtier {kv_all:.0f} ms, baseline {base_all:.0f} ms "
              f"({base_all / kv_all if kv_all else 0:.1f}x); total {report['seconds']} s"]
    if "replies_match" in report:
        lines.append("replies: kvtier's " + ("equal" if report["replies_match"] else "DIFFER FROM")
                     + " those of the engine alone")
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="multi-turn chat on a small device cache, with and without kvtier")
    p.add_argument("--model", type=Path, default=None,
                   help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--conversations", type=int, default=len(CHATS),
                   help=f"chats served round-robin (1-{len(CHATS)})")
    p.add_argument("--turns", type=int, default=max_turns(), help=f"turns per chat (1-{max_turns()})")
    p.add_argument("--device-blocks", type=int, default=40, help="device KV cache, blocks of 32 tokens")
    p.add_argument("--host-chunks", type=int, default=64, help="host tier size, chunks of 32 tokens")
    p.add_argument("--max-model-len", type=int, default=1024, help="longest prompt + reply")
    p.add_argument("--reply-tokens", type=int, default=12, help="tokens generated per turn")
    p.add_argument("--fs-dir", type=Path, default=None,
                   help="the fs tier's files go under this directory (default: a temp dir)")
    p.add_argument("--check-replies", action="store_true",
                   help="serve the chats once more without kvtier and compare the replies")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--log-file", type=Path, default=None,
                   help="the engines' output (vLLM's logs, warnings) goes to this file "
                        "(default: a new file in the temp directory)")
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="the engines' output on the terminal, and debug logging")
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
        model = args.model
        if model is None:
            with contextlib.redirect_stdout(sys.stderr):
                model = prepare_smollm2()
        elif not (model / "config.json").is_file():
            raise KVTierError(f"--model {model}: not a model directory (no config.json)")
        log_path = None if args.verbose else args.log_file or default_log("kvtier-demo-")
        settings = DemoSettings(model, args.conversations, args.turns, args.device_blocks,
                                args.host_chunks, args.max_model_len, args.reply_tokens, args.fs_dir,
                                args.check_replies, log_path)
        report = run_demo(settings)
    except (ValueError, ModelPrepError) as e:
        raise KVTierError(str(e)) from e
    print(json.dumps(report) if args.json else format_report(report), flush=True)
    return 0 if report.get("replies_match", True) else 1
