"""One pass of the multi-turn chat workload through an in-process vLLM engine (CPU backend).

`run_chat_pass` builds an `LLM` (with the KVTierConnector when given a kvtier config, else vLLM
alone with its own device prefix cache), serves the workload's turns one request at a time in
round-robin order (after one unmeasured warm-up request), and measures each turn's time to first
token: from just before the request is added to the engine to the engine step that returns its
first output token. That interval holds
everything the request waited for: kvtier's lookups and promotions, the host → device copy and the
prefill of what was not reloaded. One request at a time keeps turns from sharing a batch.

Where each turn's prompt came from (`TurnResult.tokens`, prompt tokens adding up to
`prompt_tokens`): with kvtier, the split the connector returns in the finished request's
`kv_transfer_params["kvtier"]["tokens"]`; without it, vLLM's own `num_cached_tokens` as
"device" and the rest as "recomputed" (zero for the host and every secondary tier).

The engine must run in this process: the caller sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and
friends (`vllm_environment`) before vLLM is imported.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.bench.workload import round_robin, sessions


@dataclass(frozen=True)
class EngineSettings:
    """The engine both passes share: a small device KV cache of `device_blocks` blocks."""

    model: Path
    device_blocks: int
    block_size: int = 32
    max_model_len: int = 1024
    reply_tokens: int = 16
    dtype: str = "float32"


@dataclass
class TurnResult:
    """One served turn: its prompt length, time to first token and prompt-token sources."""

    conversation: int
    turn: int
    prompt_tokens: int
    ttft_s: float
    tokens: dict[str, int]
    reply: str = field(default="", repr=False)

    def as_json(self) -> dict[str, Any]:
        return {"conversation": self.conversation, "turn": self.turn,
                "prompt_tokens": self.prompt_tokens, "ttft_s": round(self.ttft_s, 4),
                "tokens": dict(self.tokens)}


Progress = Callable[[TurnResult], None]


@contextlib.contextmanager
def vllm_environment(tmp: Path) -> Iterator[None]:
    """An in-process vLLM engine that keeps its temp files, sockets and caches under `tmp` and
    never goes online; the previous environment is restored on exit."""
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TMPDIR": str(tmp),
        "VLLM_RPC_BASE_PATH": str(tmp),
        "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
        "VLLM_NO_USAGE_STATS": "1",
    }
    saved = {key: os.environ.get(key) for key in env}
    saved_tempdir = tempfile.tempdir
    os.environ.update(env)
    tempfile.tempdir = str(tmp)
    try:
        yield
    finally:
        tempfile.tempdir = saved_tempdir
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def kv_bytes_per_token(model: Path, dtype: str) -> int:
    """KV bytes per token of `model` in `dtype` (all layers, K and V)."""
    import json

    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return int(config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * itemsize)


def _build_llm(settings: EngineSettings, kvtier_config: dict[str, Any] | None) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    block_bytes = kv_bytes_per_token(settings.model, settings.dtype) * settings.block_size
    options: dict[str, Any] = {
        "dtype": settings.dtype, "enforce_eager": True, "block_size": settings.block_size,
        "num_gpu_blocks_override": settings.device_blocks,
        "kv_cache_memory_bytes": (settings.device_blocks + 1) * block_bytes,
        "max_model_len": settings.max_model_len, "max_num_seqs": 1, "seed": 0,
    }
    if kvtier_config is not None:
        options["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=kvtier_config,
        )
    return LLM(model=str(settings.model), **options)


def _serve_one(llm: Any, req_id: str, prompt: list[int], max_tokens: int) -> tuple[float, Any]:
    """Serve one request alone; return (seconds to its first output token, its final output)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(req_id, {"prompt_token_ids": prompt}, params)
    first: float | None = None
    final: Any = None
    while final is None:
        for out in engine.step():
            if out.request_id != req_id:
                continue
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter() - start
            if out.finished:
                final = out
    if first is None:
        raise RuntimeError(f"request {req_id} finished without an output token")
    return first, final


def _split(final: Any, prompt_len: int, sources: list[str], with_kvtier: bool) -> dict[str, int]:
    if with_kvtier:
        params = final.kv_transfer_params or {}
        tokens = params.get("kvtier", {}).get("tokens")
        if tokens is None:
            raise RuntimeError("the finished request carries no kvtier token split")
        return {key: int(value) for key, value in tokens.items()}
    device = int(final.num_cached_tokens or 0)
    return {"device": device, **dict.fromkeys(sources, 0), "recomputed": prompt_len - device}


def run_chat_pass(
    settings: EngineSettings,
    kvtier_config: dict[str, Any] | None,
    conversations: int,
    turns: int,
    *,
    replies: dict[tuple[int, int], str] | None = None,
    baseline_sources: list[str] | None = None,
    progress: Progress | None = None,
) -> list[TurnResult]:
    """Serve `conversations` x `turns` chat turns; one `TurnResult` per turn, in serving order.

    `replies` (from an earlier pass) replaces the model's replies in the conversation history, so
    two passes send identical prompts; such a pass generates only the first token of each turn
    (its TTFT), which spares the decode time and leaves vLLM's device cache no reply blocks to
    evict (if anything, in the baseline's favour). Without kvtier, `baseline_sources` names the
    zero entries of each split ("host", "fs").
    """
    llm = _build_llm(settings, kvtier_config)
    try:
        tokenizer = llm.get_tokenizer()
        # The first request pays one-time costs (kernel and allocator warm-up): keep it out.
        _serve_one(llm, "warm-up", tokenizer.encode("Warm-up request, not measured."), 2)
        chats = sessions(conversations)
        results: list[TurnResult] = []
        for conv, turn in round_robin(conversations, turns):
            chat = chats[conv]
            chat.ask(turn)
            prompt = chat.prompt_ids(tokenizer)
            if len(prompt) + settings.reply_tokens > settings.max_model_len:
                raise RuntimeError(f"conversation {conv} turn {turn}: {len(prompt)} prompt tokens "
                                   f"do not fit max_model_len {settings.max_model_len}")
            max_tokens = settings.reply_tokens if replies is None else 1
            ttft, final = _serve_one(llm, f"c{conv}-t{turn}", prompt, max_tokens)
            reply = final.outputs[0].text if replies is None else replies[(conv, turn)]
            chat.answer(reply.strip())
            tokens = _split(final, len(prompt), baseline_sources or [], kvtier_config is not None)
            result = TurnResult(conv, turn, len(prompt), ttft, tokens, reply)
            results.append(result)
            if progress is not None:
                progress(result)
        return results
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
