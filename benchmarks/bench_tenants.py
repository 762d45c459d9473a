"""Tenant shares of the host tier (`tenants`): a tenant's working set against another's flood.

    python -m benchmarks.bench_tenants --rounds 2 --out /var/tmp/kvtier-bench/tenants.json

One real engine (`vllm serve` with kvtier, SmolLM2-135M on the CPU backend) per scenario, scraped by a
real Prometheus. Tenant A (`cache_salt` "tenant-a", label t1) cycles through a working set of
`A_PROMPTS` prompts of `PROMPT_CHUNKS` chunks (48 chunks: more than the device cache holds, so
its reuse comes from the host tier, and under its share of it); tenant B ("tenant-b", t2) sends
`FLOOD_PER_A` one-off prompts of the same length after each of A's requests. The host tier holds
`HOST_CHUNKS` chunks; over the measured cycles B sends 5.6 times that. One warm-up cycle of A
alone fills the host tier with A's working set; then `CYCLES` measured cycles. Scenarios:

- `alone`: A without the flood, with the shares of `shared`;
- `shared`: A + flood, `tenants` {"tenant-a": 0.5, "tenant-b": 0.4, "default": 0.05};
- `uncapped`: A + flood, every share 1 (caps that never bind: the host tier's plain LRU order,
  with the per-tenant metrics still labelled);
- `no-shares`: A + flood, no `tenants` at all (no per-tenant metrics: from the replies only);
- `short-share`: A + flood, A's share 0.25 (32 chunks) under its working set.

A's host hit rate over the measured cycles: host tokens / prompt tokens, from Prometheus (the
increase of `kvtier_tenant_prompt_tokens_total{tenant="t1"}` by source between a scrape after the
warm-up and one after the last request, each waited for until its sum matches the prompt tokens
A's replies counted) and from the replies' own splits (`kv_transfer_params.kvtier.tokens`).
Scenarios rotate order each round. Writes one JSON document to `--out` and prints the summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvtier.bench.multiturn.presets import kv_bytes_per_token
from kvtier.bench.multiturn.summary import spread
from kvtier.bench.multiturn.vllm_server import ServerSettings, VLLMServer
from kvtier.bench.neutral_paths import neutral_path
from kvtier.format.chunks import HOST
from kvtier.tools.models import prepare_smollm2
from tests.integrations.prometheus_helpers import Prometheus

BLOCK = 32
PROMPT_CHUNKS = 8
A_PROMPTS = 6
DEVICE_BLOCKS = 24
HOST_CHUNKS = 128
FLOOD_PER_A = 3
CYCLES = 5
SALT_A, SALT_B = "tenant-a", "tenant-b"
LABEL_A, LABEL_B = "t1", "t2"
SHARES = {SALT_A: 0.5, SALT_B: 0.4, "default": 0.05}
SCENARIOS: dict[str, tuple[bool, dict[str, float] | None]] = {
    "alone": (False, SHARES),
    "shared": (True, SHARES),
    "uncapped": (True, {SALT_A: 1.0, SALT_B: 1.0, "default": 1.0}),
    "no-shares": (True, None),
    "short-share": (True, {SALT_A: 0.25, SALT_B: 0.65, "default": 0.05}),
}
"""name: (with B's flood, `tenants`)."""
WAIT_S = 120.0


def random_prompt(rng: random.Random) -> list[int]:
    """A prompt of `PROMPT_CHUNKS` chunks of random token ids: its first chunk, and so all of its
    chunks (keys chain), is no other prompt's."""
    return [rng.randrange(1000, 40000) for _ in range(PROMPT_CHUNKS * BLOCK)]


def complete(base: str, prompt: list[int], salt: str) -> dict[str, Any]:
    """One greedy one-token completion of `prompt` for tenant `salt`; the reply."""
    body = {"model": "smol", "prompt": prompt, "max_tokens": 1, "temperature": 0, "cache_salt": salt}
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        reply: dict[str, Any] = json.loads(resp.read())
    return reply


def a_series(prom: Prometheus, want_total: int) -> dict[str, float]:
    """A's `tenant_prompt_tokens` by source from Prometheus, once a scrape shows `want_total` tokens."""
    deadline = time.monotonic() + WAIT_S
    while True:
        series = prom.query(f'kvtier_tenant_prompt_tokens_total{{tenant="{LABEL_A}"}}')
        values = {s["metric"]["source"]: float(s["value"][1]) for s in series}
        if sum(values.values()) == want_total:
            return values
        if time.monotonic() > deadline:
            raise TimeoutError(f"Prometheus has {values} for {LABEL_A}, want {want_total} tokens in all")
        time.sleep(0.5)


def host_bytes(prom: Prometheus) -> dict[str, float]:
    series = prom.query('kvtier_tenant_bytes{tier="host"}')
    return {s["metric"]["tenant"]: float(s["value"][1]) for s in series}


def scenario(name: str, model: Path, block_bytes: int, tmp: Path, seed: int) -> dict[str, Any]:
    """Serve one scenario on a fresh engine and Prometheus; A's hit rates and the series read."""
    flood, tenants = SCENARIOS[name]
    kvtier: dict[str, Any] = {"cpu_bytes_to_use": HOST_CHUNKS * block_bytes, "eviction_policy": "lru"}
    if tenants is not None:
        kvtier["tenants"] = tenants
    settings = ServerSettings(model, "smol", BLOCK, DEVICE_BLOCKS, 10 * BLOCK, 2, block_bytes, kvtier=kvtier)
    rng = random.Random(seed)
    working_set = [random_prompt(rng) for _ in range(A_PROMPTS)]
    run_dir = tmp / name
    run_dir.mkdir()
    with VLLMServer(settings, run_dir / "vllm.log") as server:
        prom = Prometheus(run_dir, server.base_url.removeprefix("http://"))
        try:
            prom.wait_scraped(time.time(), time.monotonic() + WAIT_S)
            sent = 0
            for prompt in working_set:  # warm-up: A's working set into the host tier
                sent += complete(server.base_url, prompt, SALT_A)["usage"]["prompt_tokens"]
            before = a_series(prom, sent) if tenants is not None else {}
            splits: list[dict[str, int]] = []
            flood_tokens = 0
            for _ in range(CYCLES):
                for prompt in working_set:
                    reply = complete(server.base_url, prompt, SALT_A)
                    sent += reply["usage"]["prompt_tokens"]
                    splits.append(reply["kv_transfer_params"]["kvtier"]["tokens"])
                    for _ in range(FLOOD_PER_A if flood else 0):
                        one_off = complete(server.base_url, random_prompt(rng), SALT_B)
                        flood_tokens += one_off["usage"]["prompt_tokens"]
            after = a_series(prom, sent) if tenants is not None else {}
            held = host_bytes(prom) if tenants is not None else {}
        finally:
            prom.close()
    measured = {s: after.get(s, 0.0) - before.get(s, 0.0) for s in after}
    replies: dict[str, int] = {}
    for split in splits:
        for source, tokens in split.items():
            replies[source] = replies.get(source, 0) + tokens
    prompt_tokens = sum(replies.values())
    return {
        "scenario": name, "tenants": tenants, "flood": flood,
        "a_prompt_tokens": prompt_tokens, "flood_tokens": flood_tokens,
        "flood_over_host": flood_tokens / (HOST_CHUNKS * BLOCK),
        "a_host_hit_rate_replies": replies.get(HOST, 0) / prompt_tokens,
        "a_tokens_replies": replies,
        "a_host_hit_rate_prometheus": measured[HOST] / sum(measured.values()) if measured else None,
        "prometheus": {"query": f'kvtier_tenant_prompt_tokens_total{{tenant="{LABEL_A}"}}',
                       "after_warm_up": before, "at_end": after, "measured": measured,
                       "tenant_host_bytes_at_end": held},
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per scenario run: A's host hit rate, median [min-max] over rounds, and its ratio to `alone`'s."""
    out: dict[str, Any] = {}
    for name in SCENARIOS:
        mine = [r for r in runs if r["scenario"] == name]
        if not mine:
            continue
        key = "a_host_hit_rate_prometheus" if SCENARIOS[name][1] is not None else "a_host_hit_rate_replies"
        out[name] = {"a_host_hit_rate": spread([r[key] for r in mine]).as_json(), "from": key}
    alone = out["alone"]["a_host_hit_rate"]["median"] if "alone" in out else None
    for name, entry in out.items():
        if name != "alone":
            entry["of_alone"] = entry["a_host_hit_rate"]["median"] / alone if alone else None
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated, from {', '.join(SCENARIOS)} (default all)")
    parser.add_argument("--out", type=Path, required=True)
    opts = parser.parse_args()
    names = opts.scenarios.split(",")
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        parser.error(f"--scenarios: unknown {', '.join(sorted(unknown))} (known: {', '.join(SCENARIOS)})")
    model = prepare_smollm2()
    block_bytes = kv_bytes_per_token(model, "float32") * BLOCK
    command = shlex.join(["python", "-m", "benchmarks.bench_tenants", *sys.argv[1:]])
    meta = {"command": neutral_path(command), "block_size": BLOCK, "prompt_tokens": PROMPT_CHUNKS * BLOCK,
            "a_prompts": A_PROMPTS, "device_blocks": DEVICE_BLOCKS, "host_chunks": HOST_CHUNKS,
            "block_bytes": block_bytes, "flood_per_a_request": FLOOD_PER_A, "measured_cycles": CYCLES,
            "scenarios": {k: {"flood": f, "tenants": t} for k, (f, t) in SCENARIOS.items()},
            "machine": {"node": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                        "shared": "2 cores shared with other engineers' tests and benchmarks"},
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-tenants-") as tmp:
        for round_ in range(opts.rounds):
            for i in range(len(names)):
                name = names[(i + round_) % len(names)]
                run_tmp = Path(tmp) / f"r{round_}"
                run_tmp.mkdir(exist_ok=True)
                runs.append({"round": round_, **scenario(name, model, block_bytes, run_tmp, seed=round_)})
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    document = {"meta": meta, "runs": runs, "summary": summarize(runs)}
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(document, indent=1) + "\n")
    print(json.dumps(document["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
