"""Time to first token of a long prompt: recomputed, reloaded from the host tier, from the fs tier.

    python -m benchmarks.bench_ttft --tokens 4096 --prompts 3

One in-process vLLM engine (CPU backend, SmolLM2 or `--model DIR`, `--dtype`: float32 unless given)
with the KVTierConnector,
a host tier that holds about 1.5 prompts and an fs tier in a temp directory on local disk. Each of `prompts`
distinct real-text prompts of exactly `tokens` tokens is served with one output token (its
generate() time is its TTFT):

1. ``first``: computed from scratch and stored (host, then cascaded to fs, given 2 s to finish);
   after all of them, the host tier holds only the last one or two.
2. per prompt, in turn:
   ``recompute``: with `skip_load` and `skip_store` (kvtier stays out; vLLM computes everything);
   ``fs``: the prompt's chunks are in the fs tier only (the host tier evicted them): promoted to
   host, then copied to the device;
   ``host``: served again, now from the host tier.

vLLM's device prefix cache is reset before every request, so nothing comes from the device. The
three kinds of request alternate prompt by prompt, so machine noise hits them alike. The fs tier
reads with O_DIRECT (no page cache). Each request's token split is checked: a run whose fs or
host request did not reload the whole prompt (less the last token vLLM always recomputes) fails.

Prints a table and one JSON document with the medians and the ratios to recompute.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.bench.multiturn.chats import CHATS
from kvtier.bench.multiturn.presets import ATTENTION_LAYER_TYPES, kv_bytes_per_token
from kvtier.integrations.vllm.serving.launch import in_process_env, transfer_config
from kvtier.tools.models import model_dir

KINDS = ("recompute", "fs", "host")


def prompt_ids(tokenizer: Any, index: int, tokens: int) -> list[int]:
    """`tokens` token ids of real English text, different from the first token on per `index`."""
    texts = [c.opening for c in CHATS]
    ids: list[int] = tokenizer.encode(f"Reading list number {index}. ")
    turn = index
    while len(ids) < tokens:
        ids += tokenizer.encode(" " + texts[turn % len(texts)])
        turn += 1
    return ids[:tokens]


def build_llm(
    model: Path, tokens: int, block_size: int, host_prompts: float, fs_dir: Path, dtype: str = "float32"
) -> Any:
    from vllm import LLM

    per_token = kv_bytes_per_token(model, dtype)
    types = json.loads((model / "config.json").read_text()).get("layer_types", [])
    recurrent = sum(t not in ATTENTION_LAYER_TYPES for t in types)  # each holds a few state blocks
    device_blocks = tokens // block_size + 4 + 3 * recurrent
    config = {
        "cpu_bytes_to_use": int(host_prompts * tokens * per_token),
        "secondary_tiers": [{"type": "fs", "root_dir": str(fs_dir)}],
    }
    return LLM(model=str(model), dtype=dtype, enforce_eager=True, block_size=block_size,
               num_gpu_blocks_override=device_blocks,
               kv_cache_memory_bytes=(device_blocks + 1) * block_size * per_token,
               max_model_len=tokens + 16, max_num_seqs=1, seed=0, kv_transfer_config=transfer_config(config))


def serve(llm: Any, prompt: list[int], kvtier: dict[str, Any] | None = None) -> tuple[float, dict[str, int]]:
    """(seconds to the one output token, the connector's token split) of `prompt`, served alone
    with vLLM's device prefix cache emptied first."""
    from vllm import SamplingParams

    llm.reset_prefix_cache()
    extra = {"kv_transfer_params": {"kvtier": kvtier}} if kvtier else None
    params = SamplingParams(temperature=0.0, max_tokens=1, extra_args=extra)
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - start
    split = (out.kv_transfer_params or {}).get("kvtier", {}).get("tokens", {})
    return seconds, {k: int(v) for k, v in split.items()}


def wait_for_cascade(llm: Any, seconds: float) -> None:
    """Give the fs tier's writes time to finish (the cascade is asynchronous); idle steps let the
    scheduler collect the finished jobs."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        llm.llm_engine.step()
        time.sleep(0.05)


def run(tokens: int, prompts: int, block_size: int, model: Path, dtype: str = "float32") -> dict[str, Any]:
    samples: dict[str, list[float]] = {kind: [] for kind in ("first", *KINDS)}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-ttft-", dir="/var/tmp")))
        stack.enter_context(in_process_env(tmp))
        llm = build_llm(model, tokens, block_size, 1.5, tmp / "fs", dtype)
        tokenizer = llm.get_tokenizer()
        serve(llm, tokenizer.encode("Warm-up request, not measured."))
        batch = [prompt_ids(tokenizer, i, tokens) for i in range(prompts + 1)]
        for prompt in batch:
            samples["first"].append(serve(llm, prompt)[0])
            wait_for_cascade(llm, 2.0)
        reloadable = tokens - 1
        for i, prompt in enumerate(batch[:prompts]):
            seconds, _ = serve(llm, prompt, {"skip_load": True, "skip_store": True})
            samples["recompute"].append(seconds)
            for kind in ("fs", "host"):
                seconds, split = serve(llm, prompt)
                got = split.get(kind, 0)
                if got < reloadable - block_size:
                    raise RuntimeError(f"prompt {i}: the {kind} request reloaded {got} of {tokens} "
                                       f"tokens from {kind} (split {split})")
                samples[kind].append(seconds)
            print(f"  prompt {i}: " + "  ".join(f"{k} {samples[k][-1]:.3f}s" for k in KINDS),
                  file=sys.stderr, flush=True)
        llm.llm_engine.engine_core.shutdown()
    med = {kind: statistics.median(values) for kind, values in samples.items()}
    return {
        "model": model.name, "tokens": tokens, "prompts": prompts, "block_size": block_size,
        "dtype": dtype,
        "median_ttft_s": {k: round(v, 4) for k, v in med.items()},
        "ttft_s": {k: [round(x, 4) for x in v] for k, v in samples.items()},
        "host_over_recompute": round(med["host"] / med["recompute"], 4),
        "fs_over_recompute": round(med["fs"] / med["recompute"], 4),
        "prefill_tokens_per_s": round(tokens / med["recompute"], 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: SmolLM2)")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16 (a gated delta net model)")
    args = parser.parse_args()
    with contextlib.redirect_stdout(sys.stderr):
        report = run(args.tokens, args.prompts, args.block_size, args.model or model_dir(), args.dtype)
    med = report["median_ttft_s"]
    print(f"{'':10} {'TTFT s':>8} {'/ recompute':>12}")
    for kind in ("recompute", "host", "fs", "first"):
        print(f"{kind:10} {med[kind]:8.3f} {med[kind] / med['recompute']:12.3f}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
