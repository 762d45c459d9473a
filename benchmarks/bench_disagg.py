"""A prefill instance and a decode instance sharing kvtier's tiers: the decode instance's time to
first token for a prompt the prefill instance computed, reloaded through fs, redis or p2p, against
recomputing a prompt of the same length.

    python -m benchmarks.bench_disagg --prompts 6 --tokens 1024

Two real `kvtier serve`-built vLLM servers (CPU backend, SmolLM2 float32, 32-token blocks, one
block per chunk), both with a host tier and the shared tiers given (`--tiers`, default all three):
an fs tier on one directory, a redis tier on one namespace of a redis-server this script starts on
loopback, and a p2p tier (the prefill instance listens, the decode instance has it as its peer,
one shared secret). `prefill` has `kv_role` `kv_producer`, `decode` `kv_consumer`, and both the
same served model name (it is part of the chunk keys). Prompts are token ids (seeded, distinct per
prompt, so nothing is shared between prompts but what the roles move). Per round, in turn:

1. the client sends one prompt per tier to the prefill instance for one token (`prefill_s`), then
   waits until the fs and redis tiers hold their chunks (p2p serves the prefill instance's host
   tier: nothing to wait for);
2. it sends each prompt to the decode instance for one token (`reload_s`, TTFT as the
   non-streaming request's time) allowing only its tier to load it (`load_tiers`): every full
   chunk must come from that tier (the run fails otherwise); and a fresh prompt of the same length
   with `skip_load` (`recompute_s`). The order of these requests rotates from round to round;
3. both instances answer each prompt with 8 greedy tokens: the replies must be equal.

Prints one JSON document: per-round times, and per tier the median [min-max] reload time and
reload / recompute ratio (each round's reload over the same round's recompute).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import secrets
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from kvtier.bench.multiturn.presets import kv_bytes_per_token
from kvtier.bench.multiturn.vllm_server import ServerSettings, VLLMServer, free_port
from kvtier.integrations.vllm.serving.launch import connector_config
from kvtier.tools.models import prepare_smollm2
from tests.services.redis_server import start_server, stop_server

BLOCK = 32
TIERS = ("fs", "redis", "p2p")
REPLY_TOKENS = 8


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


def wait_until(count: Callable[[], int], target: int, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while count() < target:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {what} tier did not reach {target} chunks in {timeout_s} s")
        time.sleep(0.05)


def fs_chunks(fs_dir: Path) -> int:
    return sum(1 for p in fs_dir.rglob("*") if p.is_file() and len(p.name) == 64)


def tier_configs(tiers: tuple[str, ...], fs_dir: Path, redis_url: str | None,
                 p2p_address: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The prefill and decode instances' secondary tiers: the same fs directory and redis
    namespace; p2p listening on the prefill side, asking it on the decode side."""
    prefill: list[dict[str, Any]] = []
    decode: list[dict[str, Any]] = []
    secret = secrets.token_hex(16)
    for tier in tiers:
        if tier == "fs":
            prefill.append({"type": "fs", "root_dir": str(fs_dir)})
            decode.append(prefill[-1])
        elif tier == "redis":
            prefill.append({"type": "redis", "url": redis_url, "key_prefix": "disagg"})
            decode.append(prefill[-1])
        else:
            prefill.append({"type": "p2p", "secret": secret, "listen": p2p_address})
            decode.append({"type": "p2p", "secret": secret, "peers": [p2p_address]})
    return prefill, decode


def run(prompts: int, tokens: int, tiers: tuple[str, ...], out_dir: Path,
        redis_url: str | None) -> dict[str, Any]:
    model = prepare_smollm2(quiet=True)
    block_bytes = kv_bytes_per_token(model, "float32") * BLOCK
    fs_dir = out_dir / "fs"
    prefill_tiers, decode_tiers = tier_configs(tiers, fs_dir, redis_url,
                                               f"tcp://127.0.0.1:{free_port()}")
    # The prefill host tier holds a round's prompts: p2p serves them from there.
    host_bytes = (len(tiers) + 1) * (tokens // BLOCK + 1) * block_bytes
    base: dict[str, Any] = {
        "model": model, "block_size": BLOCK, "device_blocks": 3 * tokens // BLOCK,
        "max_model_len": tokens + 64, "max_num_seqs": 2, "block_bytes": block_bytes}

    def extra(secondary: list[dict[str, Any]]) -> dict[str, Any]:
        return {"cpu_bytes_to_use": host_bytes, "blocks_per_chunk": 1, "secondary_tiers": secondary}

    client = redis.Redis.from_url(redis_url) if redis_url else None
    full = (tokens - 1) // BLOCK * BLOCK
    rng = random.Random(0)
    rounds: list[dict[str, Any]] = []
    # One served model name on both: it is part of the chunk keys (the model's identity).
    with VLLMServer(RoleSettings(served_name="smol", role="kv_producer", kvtier=extra(prefill_tiers),
                                 **base), out_dir / "prefill.log") as prefill, \
            VLLMServer(RoleSettings(served_name="smol", role="kv_consumer", kvtier=extra(decode_tiers),
                                    **base), out_dir / "decode.log") as decode:
        complete(prefill, [rng.randrange(1000, 40000) for _ in range(64)], 1)  # warm-up, both
        complete(decode, [rng.randrange(1000, 40000) for _ in range(64)], 1, skip_load=True,
                 skip_store=True)
        chunks = 0
        for i in range(prompts):
            ids = {name: [rng.randrange(1000, 40000) for _ in range(tokens)]
                   for name in (*tiers, "recompute")}
            row: dict[str, Any] = {"round": i, "prefill_s": {}, "reload_s": {}, "reload_split": {},
                                   "replies_equal": {}}
            for tier in tiers:
                row["prefill_s"][tier] = round(complete(prefill, ids[tier], 1)[0], 4)
            chunks += len(tiers) * (tokens - 1) // BLOCK
            if "fs" in tiers:
                wait_until(lambda: fs_chunks(fs_dir), chunks, "fs")
            if client is not None:
                wait_until(lambda: int(client.dbsize()), chunks, "redis")
            order = [*tiers, "recompute"]
            order = order[i % len(order):] + order[: i % len(order)]
            for name in order:
                if name == "recompute":
                    row["recompute_s"] = round(complete(decode, ids[name], 1, skip_load=True)[0], 4)
                    continue
                seconds, answer = complete(decode, ids[name], 1, load_tiers=[name])
                got = split(answer)
                if got.get(name) != full:
                    raise RuntimeError(f"round {i}: the decode instance did not reload from {name}: {got}")
                row["reload_s"][name], row["reload_split"][name] = round(seconds, 4), got
            for tier in tiers:
                texts = [complete(server, ids[tier], REPLY_TOKENS)[1]["choices"][0]["text"]
                         for server in (prefill, decode)]
                row["replies_equal"][tier] = texts[0] == texts[1]
                if not row["replies_equal"][tier]:
                    raise RuntimeError(f"round {i}, {tier}: the two instances answer differently")
            rounds.append(row)
            print(f"round {i}: decode reload " + ", ".join(
                f"{t} {row['reload_s'][t]:.3f} s" for t in tiers)
                + f"; recompute {row['recompute_s']:.3f} s", file=sys.stderr, flush=True)

    def spread(values: list[float], digits: int = 4) -> dict[str, float]:
        return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
                "max": round(max(values), digits)}

    per_tier = {tier: {
        "prefill_s": spread([r["prefill_s"][tier] for r in rounds]),
        "reload_s": spread([r["reload_s"][tier] for r in rounds]),
        "reload_over_recompute": spread([r["reload_s"][tier] / r["recompute_s"] for r in rounds], 3),
        "replies_equal": all(r["replies_equal"][tier] for r in rounds)} for tier in tiers}
    return {"tokens": tokens, "rounds_run": prompts, "block_size": BLOCK, "tiers": list(tiers),
            "reloaded_tokens": full, "recompute_s": spread([r["recompute_s"] for r in rounds]),
            "per_tier": per_tier, "rounds": rounds}


def _tiers(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in names if t not in TIERS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list from {', '.join(TIERS)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6, help="rounds (one prompt per tier each)")
    parser.add_argument("--tokens", type=int, default=1024, help="prompt length in tokens")
    parser.add_argument("--tiers", type=_tiers, default=TIERS, help="default fs,redis,p2p")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    server = start_server("redis-server") if "redis" in args.tiers else None
    try:
        with tempfile.TemporaryDirectory(prefix="kvtier-disagg-") as tmp:
            result = run(args.prompts, args.tokens, args.tiers, Path(tmp),
                         server.url if server is not None else None)
    finally:
        if server is not None:
            stop_server(server)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")


if __name__ == "__main__":
    main()
