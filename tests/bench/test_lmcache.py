"""LMCache through `kvtier bench multiturn`'s `lmcache` configuration (`benchmarks/baselines/
lmcache_cpu.py` on vLLM's CPU backend), in process on real SmolLM2: the same round as vLLM alone,
on the same engine settings. LMCache's hits are real: it reloads tokens (counted by vLLM as
external), recomputes fewer than vLLM alone, and every greedy reply is the one vLLM alone gives;
and once its engine is shut down no LMCache thread is left to keep the process alive.

Skipped where LMCache is not installed, an optional need (`tests.optional.LMCACHE`).
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.multiturn import configs, presets, sweep
from kvtier.bench.multiturn.conversation import Conversation, WorkloadSpec
from kvtier.integrations.vllm.serving.launch import in_process_env
from tests.optional import LMCACHE

pytestmark = [pytest.mark.slow, LMCACHE.skipif(importlib.util.find_spec("lmcache") is None)]

BLOCK_SIZE = 32
SPEC = WorkloadSpec(160, 64, 3, 4, 2, 4)  # the smoke preset's workload


@pytest.fixture(scope="module")
def vllm_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with in_process_env(tmp_path_factory.mktemp("vllm")) as tmp:
        yield tmp


class ReplyLog(sweep.Hooks):
    """Knows which configuration is running (the replies are logged under it)."""

    def __init__(self) -> None:
        self.config = ""

    def engine_starting(self, config: str) -> None:
        self.config = config


def test_lmcache_reloads_real_hits_with_vllm_alones_replies(
        vllm_tmp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoTokenizer

    from kvtier.tools.models import prepare_smollm2

    model = prepare_smollm2(quiet=True)
    sizes = presets.sizing(presets.preset("smoke"), SPEC, (4,))
    block_bytes = presets.kv_bytes_per_token(model, "float32") * BLOCK_SIZE
    ctx = configs.BenchContext(block_bytes, sizes.device_blocks, sizes.all_fits_blocks,
                               sizes.host_chunks, tmp_path / "work", block_size=BLOCK_SIZE)
    plan = sweep.Plan(SPEC, (4,), ["no-offload", "lmcache"], "inprocess", model, "m",
                      AutoTokenizer.from_pretrained(str(model)), BLOCK_SIZE, block_bytes,
                      sizes.max_model_len, ctx)
    hooks = ReplyLog()
    replies: dict[str, dict[tuple[str, int, int], str]] = {"no-offload": {}, "lmcache": {}}
    answer = Conversation.answer

    def logged_answer(conv: Conversation, reply: str) -> None:
        if conv.tag != "warm-up":
            replies[hooks.config][(conv.tag, conv.index, conv.turn)] = reply
        answer(conv, reply)

    monkeypatch.setattr(Conversation, "answer", logged_answer)
    threads = set(threading.enumerate())
    points: list[dict[str, Any]] = []
    sweep.run_sweep(plan, hooks, points.append)

    alone, lmcache = (next(p for p in points if p["config"] == name) for name in ("no-offload", "lmcache"))
    assert lmcache["failed_requests"] == 0 and lmcache["tokens_from"] == "vllm_metrics"
    assert sum(lmcache["tokens"].values()) == lmcache["prompt_tokens"] == alone["prompt_tokens"]
    assert lmcache["reloaded_tokens"] > 0
    assert lmcache["tokens"]["recomputed"] < alone["tokens"]["recomputed"]
    assert len(replies["lmcache"]) == 4 * SPEC.turns
    assert replies["lmcache"] == replies["no-offload"]  # every greedy reply, token for token
    left = [t.name for t in threading.enumerate() if t not in threads and not t.daemon]
    assert not left, f"threads left running after the engine shut down: {left}"
