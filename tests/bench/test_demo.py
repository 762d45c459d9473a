"""`kvtier demo`: the chat workload, bad flags, the report table, and (slow) a small real run whose
JSON has per-turn TTFT and token splits that add up, with host/fs hits only in the kvtier run, and
whose terminal shows kvtier's lines only, vLLM's in the log file it names (that run beside the fast
tests, `tests/early_start.py`)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.demo import format_report, round_robin
from kvtier.bench.multiturn.chats import CHATS as CONVERSATIONS
from kvtier.bench.multiturn.chats import check_sizes, max_turns
from kvtier.bench.multiturn.conversation import Conversation, WorkloadSpec
from kvtier.cli import main
from tests.early_start import Started

SOURCES = {"device", "host", "fs", "recomputed"}
VLLM_LINE = re.compile(r"(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d \d\d:\d\d:\d\d \[")
"""A line of vLLM's logger (its format: level, date, time, [file:line])."""
KVTIER_LINES = ("vLLM's log: ", "kvtier pass: ", "baseline pass: ", "  kvtier   conversation ",
                "  baseline conversation ")


def test_round_robin_serves_every_conversation_before_the_next_turn() -> None:
    assert list(round_robin(2, 3)) == [(0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (1, 3)]


def test_session_grows_by_user_messages_and_replies() -> None:
    spec = WorkloadSpec(0, 0, turns=2, conversations=1, max_concurrency=1, output_tokens=1)
    chat = Conversation(0, spec, tokenizer=None, script=CONVERSATIONS[0])
    chat.ask()
    chat.answer("A reply.")
    chat.ask()
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user"]
    assert chat.messages[1]["content"] == CONVERSATIONS[0].opening
    assert chat.messages[3]["content"] == CONVERSATIONS[0].followups[0]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--turns", str(max_turns() + 1)], f"--turns {max_turns() + 1}"),
        (["--conversations", "0"], "--conversations 0"),
        (["--device-blocks", "8"], "--device-blocks 8"),
        (["--host-chunks", "0"], "--host-chunks 0"),
        (["--model", "/nonexistent/model"], "--model /nonexistent/model"),
    ],
)
def test_bad_flags_name_the_flag(argv: list[str], named: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *argv]) == 2
    assert named in capsys.readouterr().err
    with pytest.raises(ValueError, match="--turns 0"):
        check_sizes(1, 0)


def _turn(conv: int, turn: int, ttft: float, **tokens: int) -> dict[str, Any]:
    split = {s: tokens.get(s, 0) for s in ("device", "host", "fs", "recomputed")}
    return {"conversation": conv, "turn": turn, "prompt_tokens": sum(split.values()),
            "ttft_s": ttft, "tokens": split}


def test_report_table_means_per_turn() -> None:
    report = {
        "model": "m", "dtype": "float32", "conversations": 2, "turns": 2, "device_blocks": 16,
        "block_size": 32, "host_chunks": 8, "seconds": 1.0,
        "kvtier": [_turn(0, 1, 0.4, recomputed=100), _turn(1, 1, 0.6, recomputed=100),
                   _turn(0, 2, 0.1, host=96, recomputed=30), _turn(1, 2, 0.1, fs=96, recomputed=30)],
        "baseline": [_turn(0, 1, 0.5, recomputed=100), _turn(1, 1, 0.5, recomputed=100),
                     _turn(0, 2, 0.4, recomputed=126), _turn(1, 2, 0.4, recomputed=126)],
    }
    table = format_report(report)
    assert "| 1 | 200 | 500 | 500 | 1.0x | 0 / 0 / 0 / 200 | 0 / 200 |" in table
    assert "| 2 | 252 | 100 | 400 | 4.0x | 0 / 96 / 96 / 60 | 0 / 252 |" in table


def _small_demo(work: Path) -> list[str]:
    return [sys.executable, "-m", "kvtier.cli", "demo", "--json", "--conversations", "2",
            "--turns", "3", "--device-blocks", "16", "--max-model-len", "480",
            "--host-chunks", "12", "--reply-tokens", "8", "--log-file", str(work / "vllm.log")]


@pytest.mark.slow
@pytest.mark.early_start(argv_of=_small_demo, timeout_s=400)
def test_small_real_demo_json(early_run: Started) -> None:
    log = early_run.work_dir / "vllm.log"
    done = early_run.finish()
    assert done.returncode == 0, (done.stderr[-3000:], log.read_text()[-3000:] if log.exists() else "")
    assert "conversation 1 turn 3" in done.stderr  # progress while it runs
    assert not VLLM_LINE.search(done.stderr + done.stdout)
    lines = done.stderr.splitlines()
    assert lines[0] == f"vLLM's log: {log}"
    assert [line for line in lines if not line.startswith(KVTIER_LINES)] == []
    assert VLLM_LINE.search(log.read_text()), "vLLM's lines are in the log"
    report = json.loads(done.stdout)
    runs = {name: report[name] for name in ("kvtier", "baseline")}
    for name, turns in runs.items():
        assert [(t["conversation"], t["turn"]) for t in turns] == list(round_robin(2, 3)), name
        for t in turns:
            assert set(t["tokens"]) == SOURCES, (name, t)
            assert sum(t["tokens"].values()) == t["prompt_tokens"], (name, t)
            assert t["ttft_s"] > 0
    assert [t["prompt_tokens"] for t in runs["kvtier"]] == [t["prompt_tokens"]
                                                           for t in runs["baseline"]]
    later = [t for t in runs["kvtier"] if t["turn"] > 1]
    assert all(t["tokens"]["host"] + t["tokens"]["fs"] > 0 for t in later), later
    assert all(t["tokens"]["host"] == t["tokens"]["fs"] == 0 for t in runs["baseline"])


@pytest.mark.slow
def test_demo_on_a_hybrid_model_reloads_and_keeps_the_replies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """`kvtier demo --model` on the tiny Gemma3 (sliding-window + full attention layers, vLLM's
    hybrid manager on): later turns reload from host or fs, and `--check-replies` finds every
    reply equal to the engine's alone. vLLM wants room for a max-length request in each of the
    four KV cache groups (a sliding group's estimate is the whole length here): 64 blocks for 480
    tokens; four conversations outgrow them. The command runs in this process (its engines are
    in-process ones; the embedded model's run above is the command as a user starts it)."""
    from kvtier.tools.tiny_models import build_tiny_model

    model = build_tiny_model("gemma3")
    argv = ["demo", "--model", str(model), "--json", "--check-replies", "--conversations", "4",
            "--turns", "3", "--device-blocks", "64", "--max-model-len", "480", "--host-chunks", "12",
            "--reply-tokens", "8", "--log-file", str(tmp_path / "vllm.log")]
    capsys.readouterr()
    assert main(argv) == 0
    shown = capsys.readouterr()
    assert not VLLM_LINE.search(shown.err) and VLLM_LINE.search((tmp_path / "vllm.log").read_text())
    report = json.loads(shown.out)
    assert report["model"] == model.name and report["replies_match"] is True
    later = [t for t in report["kvtier"] if t["turn"] > 1]
    assert all(t["tokens"]["host"] + t["tokens"]["fs"] > 0 for t in later), later
    assert all(t["tokens"]["host"] == t["tokens"]["fs"] == 0 for t in report["baseline"])
