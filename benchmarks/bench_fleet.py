"""A fleet of two kvtier instances behind a router: how much of the reuse a shared tier recovers
when requests are routed round-robin.

    python -m benchmarks.bench_fleet --conversations 16 --rounds 2

Each run starts two real vLLM servers with kvtier (CPU backend, embedded SmolLM2 float32, the cpu
preset's sizes: 64-token blocks, a device cache of about 4 conversations and a host tier of about
8 per instance, each instance's engine bound to a core of its own), then drives them as one fleet
with `kvtier bench multiturn --endpoints A,B --route R` (the cpu preset's conversations: 384 +
128 tokens per turn, 6 turns, 4 in flight, 16 output tokens), and stops them (`VLLMServer`: each
server's whole process group, leaving nothing in /dev/shm; on Ctrl-C and SIGTERM too). Their
output goes to `server-<i>.log` in each run's directory. The configurations:

- `round-robin host`: no shared tier, each turn of a conversation to the instance after its
  previous turn's (the worst case for locality: no turn finds its previous turn's KV on its own
  instance; `kvtier.bench.multiturn.fleet`);
- `round-robin fs` / `redis` / `p2p`: the same, the two instances sharing an fs directory, a
  namespace of a redis-server this script starts on loopback, or each other's host tier over p2p
  (each listens, the other is its peer, one shared secret);
- `prefix-affinity host`: no shared tier, a conversation sticks to one instance (the locality
  reference).

Runs are interleaved: each round runs every configuration once, in an order rotated by one place
per round; every run gets fresh servers, a fresh fs directory and redis namespace, and the same
conversations. Writes `results.json` (the multiturn points, one per run, with the fleet-wide split
summed over the instances and each instance's own; `kvtier bench report` redraws it) and
prints one JSON summary per configuration: reused tokens (not recomputed) as a share of prompt
tokens, the split, TTFT p50/p99 (median [min-max] over the rounds), and the share of the reuse
that prefix-affinity gets over round-robin without a shared tier that the shared tier recovers.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvtier.bench.multiturn import presets, report
from kvtier.bench.multiturn.summary import repeat_summary
from kvtier.bench.multiturn.vllm_server import ServerSettings, VLLMServer, free_port
from kvtier.bench.neutral_paths import neutral_path
from kvtier.tools.models import prepare_smollm2
from tests.services.redis_server import start_server, stop_server

CONFIGS = ("round-robin host", "round-robin fs", "round-robin redis", "round-robin p2p",
           "prefix-affinity host")
REFERENCE, BASELINE = "prefix-affinity host", "round-robin host"
SERVED = "smol"


@dataclasses.dataclass(frozen=True)
class CoreSettings(ServerSettings):
    """`ServerSettings` whose engine's OpenMP threads are bound to the CPU cores `cores`."""

    cores: str = "0"

    def env(self, tmp_dir: Path) -> dict[str, str]:
        return {**super().env(tmp_dir), "VLLM_CPU_OMP_THREADS_BIND": self.cores}


def shared_tiers(tier: str, work: Path, redis_url: str | None) -> list[list[dict[str, Any]]]:
    """Each instance's secondary tiers for the shared `tier` ("host": none)."""
    if tier == "host":
        return [[], []]
    if tier == "fs":
        return [[{"type": "fs", "root_dir": str(work / "fs")}]] * 2
    if tier == "redis":
        return [[{"type": "redis", "url": redis_url, "key_prefix": f"fleet-{secrets.token_hex(4)}"}]] * 2
    secret = secrets.token_hex(16)
    listen = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    return [[{"type": "p2p", "secret": secret, "listen": listen[i], "peers": [listen[1 - i]]}]
            for i in range(2)]


def run_one(config: str, args: argparse.Namespace, model: Path, redis_url: str | None,
            work: Path, out: Path) -> list[dict[str, Any]]:
    """Start the fleet for `config`, drive it with `kvtier bench multiturn --endpoints`; its points."""
    route, tier = config.split(" ")
    preset = presets.preset("cpu")
    spec = preset.workload
    sizes = presets.sizing(preset, spec, (args.conversations,))
    block_bytes = presets.kv_bytes_per_token(model, preset.dtype) * preset.block_size
    cores = os.cpu_count() or 1
    with contextlib.ExitStack() as stack:
        servers = []
        for i, secondary in enumerate(shared_tiers(tier, work, redis_url)):
            kvtier = {"cpu_bytes_to_use": sizes.host_chunks * block_bytes, "blocks_per_chunk": 1,
                      "secondary_tiers": secondary}
            settings = CoreSettings(model, SERVED, preset.block_size, sizes.device_blocks,
                                    sizes.max_model_len, spec.max_concurrency, block_bytes,
                                    preset.dtype, kvtier, cores=str(i % cores))
            servers.append(VLLMServer(settings, out / f"server-{i}.log"))
            stack.callback(servers[-1].stop)
        with ThreadPoolExecutor(len(servers)) as pool:  # both start at once
            list(pool.map(VLLMServer.__enter__, servers))
        argv = [sys.executable, "-m", "kvtier.cli", "bench", "multiturn", "--preset", "cpu",
                "--endpoints", ",".join(s.base_url for s in servers), "--route", route,
                "--conversations", str(args.conversations), "--repeats", "1", "--label", config,
                "--served-model-name", SERVED, "--tokenizer", str(model), "--out", str(out)]
        with (out / "bench.log").open("w") as log:
            subprocess.run(argv, check=True, stdout=log, stderr=subprocess.STDOUT)
    points: list[dict[str, Any]] = json.loads((out / "results.json").read_text())["points"]
    return points


def recovered(summary: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Per configuration: (its reused tokens - round-robin host's) / (prefix-affinity's -
    round-robin host's), from the medians; None without both references."""
    def reused(config: str) -> float | None:
        entry = summary.get(config)
        return None if entry is None else entry["metrics"]["reused_tokens"]["median"]

    low, high = reused(BASELINE), reused(REFERENCE)
    out: dict[str, float | None] = {}
    for config in summary:
        value = reused(config)
        ok = low is not None and high is not None and value is not None and high != low
        out[config] = round((value - low) / (high - low), 3) if ok else None  # type: ignore[operator]
    return out


def digest(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-configuration summary the module docstring describes."""
    rows = {row["config"]: row for row in repeat_summary(points)}
    share = recovered(rows)
    out = {}
    for config, row in rows.items():
        m = row["metrics"]
        runs = [p for p in points if p["config"] == config]
        fractions = sorted(p["reused_tokens"] / p["prompt_tokens"] for p in runs)
        out[config] = {
            "runs": row["runs"], "prompt_tokens": runs[0]["prompt_tokens"],
            "reused_fraction": [round(f, 3) for f in fractions],
            "tokens": {k[len("tokens."):]: v["median"] for k, v in m.items() if k.startswith("tokens.")},
            "ttft_p50_s": m["ttft_s.p50"], "ttft_p99_s": m["ttft_s.p99"],
            "recovered_share": share[config],
            "failed_requests": sum(p["failed_requests"] for p in runs)}
    return out


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    signal.signal(signal.SIGTERM, _raise_interrupt)  # stop the servers on the way out
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, from: {', '.join(CONFIGS)}")
    parser.add_argument("--out", type=Path,
                        default=Path("bench-results") / f"fleet-{time.strftime('%Y%m%d-%H%M%S')}")
    args = parser.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown} (known: {', '.join(CONFIGS)})")
    model = prepare_smollm2(quiet=True)
    redis = start_server("redis-server") if any(c.endswith(" redis") for c in configs) else None
    points: list[dict[str, Any]] = []
    meta = {"label": "fleet", "title": f"2 instances, {args.conversations} conversations (cpu preset)",
            "command": neutral_path(shlex.join(["python", "-m", "benchmarks.bench_fleet", *sys.argv[1:]])),
            "conversations": args.conversations, "rounds": args.rounds, "configs": configs,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count()}
    print(f"vLLM's logs: {args.out}/round<r>-<config>/server-<i>.log", file=sys.stderr, flush=True)
    try:
        for r in range(args.rounds):
            for config in configs[r % len(configs):] + configs[: r % len(configs)]:
                with tempfile.TemporaryDirectory(prefix="kvtier-fleet-") as tmp:
                    run_dir = args.out / f"round{r}-{config.replace(' ', '-')}"
                    started = time.monotonic()
                    for point in run_one(config, args, model, redis.url if redis else None,
                                         Path(tmp), run_dir):
                        points.append({**point, "repeat": r, "run": len(points)})
                    last = points[-1]
                    print(f"round {r} {config}: reused {last['reused_tokens']}/{last['prompt_tokens']}, "
                          f"TTFT p50 {last['ttft_s']['p50']:.3f} s p99 {last['ttft_s']['p99']:.3f} s "
                          f"({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
                report.save(args.out / "results.json", meta, points)
    finally:
        if redis is not None:
            stop_server(redis)
    print(json.dumps(digest(points), indent=1))


if __name__ == "__main__":
    main()
