"""A prefill instance and a decode instance sharing kvtier's fs tier: the decode instance's time to
first token for a prompt the prefill instance computed, against recomputing a prompt of the same
length.

    python -m benchmarks.bench_disagg --prompts 6 --tokens 1024

Two real `kvtier serve`-built vLLM servers (CPU backend, SmolLM2 float32, 32-token blocks, one
block per chunk), both with a host tier and an fs tier on one shared directory: `prefill` with
`kv_role` `kv_producer`, `decode` with `kv_consumer`. Prompts are token ids (seeded, distinct per
prompt, so nothing is shared between prompts but what the roles move). Per prompt, in turn:

1. the client sends prompt P to the prefill instance for one token (its time: `prefill_s`), then
   waits until the fs tier holds P's chunks;
2. it sends P to the decode instance for one token (`reload_s`, TTFT as the non-streaming request's
   time): every full chunk must come from fs (the run fails otherwise), and a fresh prompt Q of the
   same length with `skip_load` (`recompute_s`); the two alternate which goes first;
3. both instances answer P with 8 greedy tokens: the replies must be equal.

Prints one JSON document: per-prompt times, medians [min-max], and reload / recompute.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvtier.bench.multiturn.presets import kv_bytes_per_token
from kvtier.bench.multiturn.vllm_server import ServerSettings, VLLMServer
from kvtier.integrations.vllm.serving.launch import connector_config
from kvtier.tools.models import prepare_smollm2

BLOCK = 32


@dataclasses.dataclass(frozen=True)
class RoleSettings(ServerSettings):
    """`ServerSettings` whose kv-transfer-config carries vLLM's `kv_role`."""

    role: str = "kv_both"

    def kv_transfer_config(self) -> dict[str, Any] | None:
        return {**connector_config(self.kvtier or {}), "kv_role": self.role}


def complete(server: VLLMServer, prompt: list[int], max_tokens: int,
             **kvtier: Any) -> tuple[float, dict[str, Any]]:
    """(seconds, reply) of one greedy completion request."""
    body: dict[str, Any] = {"model": server.settings.served_name, "prompt": prompt,
                            "max_tokens": max_tokens, "temperature": 0}
    if kvtier:
        body["kv_transfer_params"] = {"kvtier": kvtier}
    request = urllib.request.Request(f"{server.base_url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=300) as reply:
        answer: dict[str, Any] = json.loads(reply.read())
    return time.perf_counter() - start, answer


def split(answer: dict[str, Any]) -> dict[str, int]:
    return dict(((answer.get("kv_transfer_params") or {}).get("kvtier") or {}).get("tokens") or {})


def wait_for_chunks(fs_dir: Path, count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(1 for p in fs_dir.rglob("*") if p.is_file() and len(p.name) == 64) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the fs tier did not reach {count} chunks in {timeout_s} s")
        time.sleep(0.05)


def run(prompts: int, tokens: int, out_dir: Path) -> dict[str, Any]:
    model = prepare_smollm2(quiet=True)
    block_bytes = kv_bytes_per_token(model, "float32") * BLOCK
    fs_dir = out_dir / "fs"
    extra = {"cpu_bytes_to_use": 2 * (tokens // BLOCK + 1) * block_bytes, "blocks_per_chunk": 1,
             "secondary_tiers": [{"type": "fs", "root_dir": str(fs_dir)}]}
    base: dict[str, Any] = {
        "model": model, "block_size": BLOCK, "device_blocks": 3 * tokens // BLOCK,
        "max_model_len": tokens + 64, "max_num_seqs": 2, "block_bytes": block_bytes, "kvtier": extra}
    rng = random.Random(0)
    ids = [[rng.randrange(1000, 40000) for _ in range(tokens)] for _ in range(2 * prompts)]
    rows: list[dict[str, Any]] = []
    # One served model name on both: it is part of the chunk keys (the model's identity).
    with VLLMServer(RoleSettings(served_name="smol", role="kv_producer", **base),
                    out_dir / "prefill.log") as prefill, \
            VLLMServer(RoleSettings(served_name="smol", role="kv_consumer", **base),
                       out_dir / "decode.log") as decode:
        complete(prefill, ids[-1][:64], 1)  # warm-up, both instances
        complete(decode, ids[-2][:64], 1, skip_load=True, skip_store=True)
        chunks = 0
        for i in range(prompts):
            p, q = ids[2 * i], ids[2 * i + 1]
            prefill_s, _ = complete(prefill, p, 1)
            chunks += (tokens - 1) // BLOCK
            wait_for_chunks(fs_dir, chunks)
            timed: dict[str, Any] = {}
            for name in (("reload", "recompute") if i % 2 == 0 else ("recompute", "reload")):
                if name == "reload":
                    timed[name] = complete(decode, p, 1)
                else:
                    timed[name] = complete(decode, q, 1, skip_load=True)
            got = split(timed["reload"][1])
            if got.get("fs") != (tokens - 1) // BLOCK * BLOCK:
                raise RuntimeError(f"prompt {i}: the decode instance did not reload from fs: {got}")
            same = (complete(prefill, p, 8)[1]["choices"][0]["text"]
                    == complete(decode, p, 8)[1]["choices"][0]["text"])
            if not same:
                raise RuntimeError(f"prompt {i}: the two instances answer differently")
            rows.append({"prompt": i, "prefill_s": round(prefill_s, 4),
                         "reload_s": round(timed["reload"][0], 4),
                         "recompute_s": round(timed["recompute"][0], 4), "reload_split": got,
                         "replies_equal": same})
            print(f"prompt {i}: prefill {prefill_s:.3f} s, decode reload {timed['reload'][0]:.3f} s, "
                  f"recompute {timed['recompute'][0]:.3f} s", file=sys.stderr, flush=True)

    def summary(key: str) -> dict[str, float]:
        values = [r[key] for r in rows]
        return {"median": round(statistics.median(values), 4), "min": min(values), "max": max(values)}

    ratios = [r["reload_s"] / r["recompute_s"] for r in rows]
    return {"tokens": tokens, "prompts": prompts, "block_size": BLOCK, "rows": rows,
            "prefill_s": summary("prefill_s"), "reload_s": summary("reload_s"),
            "recompute_s": summary("recompute_s"),
            "reload_over_recompute": {"median": round(statistics.median(ratios), 3),
                                      "min": round(min(ratios), 3), "max": round(max(ratios), 3)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=1024, help="prompt length in tokens")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtier-disagg-") as tmp:
        result = run(args.prompts, args.tokens, Path(tmp))
    text = json.dumps(result, indent=1)
    print(text)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")


if __name__ == "__main__":
    main()
