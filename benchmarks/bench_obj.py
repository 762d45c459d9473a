"""obj tier throughput next to plain boto3 (and obstore when installed), on one SeaweedFS, in one run.

    python -m benchmarks.bench_obj --chunks 128 --chunk-mib 2 --threads 8 --repeats 5

Starts a real SeaweedFS (`weed mini`, as the tests do) in a temp dir and makes one bucket, warmed
once (SeaweedFS allocates a bucket's volumes on its first writes). Then, for each repeat, every
contender puts `chunks` objects of `chunk_mib` MiB with `threads` requests in flight, then gets them
back, timed from the first request to the last answer; throughput counts payload bytes (the tier
also moves its 4 KiB header per chunk and verifies an xxh3-128 checksum on every load). The
contenders' order rotates each repeat; each one's objects are deleted after it (not timed).

Contenders:
- boto3: one shared client, `max_pool_connections = threads`, default settings otherwise;
  `put_object(Body=bytes)`, `get_object()["Body"].read()`.
- boto3-tuned: the same with the settings the tier uses (no SigV4 payload hashing, no CRC32
  request/response checksums).
- obstore (if importable): one S3Store, sync `put` / `get().bytes()` from `threads` threads.
- kvtier obj: `kvtier tier-bench --tier obj --endpoint URL --bucket NAME --chunk-bytes ... --chunks
  ... --threads ... --json` in a subprocess (credentials through the environment, the AWS chain):
  the tier runs in its own tier process, rows in a real host region, exactly as in serving.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.services.s3 import REGION, SeaweedServer

MiB = 1 << 20
Pass = tuple[float, float]
"""(store MiB/s, load MiB/s)"""


def timed_pass(threads: int, chunks: int, put: Callable[[int], object],
               get: Callable[[int], object], chunk_bytes: int) -> Pass:
    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(put, range(chunks)))
        store_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        sizes = list(pool.map(get, range(chunks)))
        load_s = time.perf_counter() - t0
    if any(n != chunk_bytes for n in sizes):
        raise RuntimeError("a get returned the wrong number of bytes")
    mib = chunks * chunk_bytes / MiB
    return mib / store_s, mib / load_s


def boto3_client(server: SeaweedServer, threads: int, tuned: bool) -> Any:
    import boto3
    from botocore.config import Config

    extra: dict[str, Any] = {}
    if tuned:
        extra = {"s3": {"payload_signing_enabled": False},
                 "request_checksum_calculation": "when_required",
                 "response_checksum_validation": "when_required"}
    return boto3.client(
        "s3", endpoint_url=server.endpoint, region_name=REGION,
        aws_access_key_id=server.access_key_id, aws_secret_access_key=server.secret_access_key,
        config=Config(max_pool_connections=threads, retries={"total_max_attempts": 1}, **extra),
    )


class Bench:
    def __init__(self, server: SeaweedServer, bucket: str, args: argparse.Namespace) -> None:
        self.server, self.bucket, self.args = server, bucket, args
        self.chunk_bytes = args.chunk_mib * MiB
        self.data = [os.urandom(self.chunk_bytes) for _ in range(args.chunks)]
        self.boto3 = boto3_client(server, args.threads, tuned=False)
        self.boto3_tuned = boto3_client(server, args.threads, tuned=True)
        self.obstore: Any = None
        try:
            from obstore.store import S3Store

            self.obstore = S3Store(
                bucket, endpoint=server.endpoint, region=REGION,
                access_key_id=server.access_key_id, secret_access_key=server.secret_access_key,
                client_options={"allow_http": True},
            )
        except ImportError:
            pass

    def contenders(self) -> dict[str, Callable[[str], Pass]]:
        out = {"boto3": lambda tag: self.run_boto3(self.boto3, tag),
               "boto3-tuned": lambda tag: self.run_boto3(self.boto3_tuned, tag)}
        if self.obstore is not None:
            out["obstore"] = self.run_obstore
        out["kvtier obj"] = self.run_tier
        return out

    def run_boto3(self, client: Any, tag: str) -> Pass:
        a = self.args

        def put(i: int) -> None:
            client.put_object(Bucket=self.bucket, Key=f"{tag}/{i}", Body=self.data[i])

        def get(i: int) -> int:
            return len(client.get_object(Bucket=self.bucket, Key=f"{tag}/{i}")["Body"].read())

        return timed_pass(a.threads, a.chunks, put, get, self.chunk_bytes)

    def run_obstore(self, tag: str) -> Pass:
        import obstore

        a = self.args

        def put(i: int) -> None:
            obstore.put(self.obstore, f"{tag}/{i}", self.data[i])

        def get(i: int) -> int:
            return len(obstore.get(self.obstore, f"{tag}/{i}").bytes())

        return timed_pass(a.threads, a.chunks, put, get, self.chunk_bytes)

    def run_tier(self, tag: str) -> Pass:
        a = self.args
        cmd = [sys.executable, "-m", "kvtier.cli", "tier-bench", "--tier", "obj",
               "--endpoint", self.server.endpoint, "--bucket", self.bucket,
               "--option", f"prefix={tag}", "--option", f"region={REGION}",
               "--chunk-bytes", str(self.chunk_bytes), "--chunks", str(a.chunks),
               "--threads", str(a.threads), "--json"]
        env = dict(os.environ, AWS_ACCESS_KEY_ID=self.server.access_key_id,
                   AWS_SECRET_ACCESS_KEY=self.server.secret_access_key)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"tier-bench failed:\n{done.stderr[-3000:]}")
        report = json.loads(done.stdout.strip().splitlines()[-1])
        return report["store_gib_s"] * 1024, report["load_gib_s"] * 1024

    def clear(self) -> None:
        """Delete every object of the bucket (between contenders, not timed)."""
        pages = self.boto3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket)
        for page in pages:
            keys = [{"Key": o["Key"]} for o in page.get("Contents", ())]
            if keys:
                self.boto3.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", type=int, default=128)
    p.add_argument("--chunk-mib", type=int, default=2)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-obj-") as tmp:
        server = SeaweedServer(Path(tmp))
        server.start()
        try:
            bucket = server.new_bucket()
            bench = Bench(server, bucket, args)
            print(f"SeaweedFS at {server.endpoint}, bucket {bucket}; warming up", file=sys.stderr)
            bench.run_boto3(bench.boto3, "warmup")
            bench.clear()
            names = list(bench.contenders())
            samples: dict[str, list[Pass]] = {n: [] for n in names}
            loads: list[float] = []
            for r in range(args.repeats):
                order = names[r % len(names):] + names[: r % len(names)]
                for name in order:
                    loads.append(os.getloadavg()[0])
                    sample = bench.contenders()[name](f"r{r}-{name.replace(' ', '-')}")
                    samples[name].append(sample)
                    bench.clear()
                    print(f"repeat {r} {name}: store {sample[0]:.0f} MiB/s, load {sample[1]:.0f} "
                          f"MiB/s", file=sys.stderr, flush=True)
        finally:
            server.kill()
    report(args, samples, loads)


def report(args: argparse.Namespace, samples: dict[str, list[Pass]], loads: list[float]) -> None:
    med = {n: (statistics.median(s for s, _ in v), statistics.median(ld for _, ld in v))
           for n, v in samples.items()}
    print(f"\n| MiB/s (median of {args.repeats}) | store (put) | load (get) | store samples | "
          "load samples |\n|---|---|---|---|---|")
    for n, v in samples.items():
        print(f"| {n} | {med[n][0]:.0f} | {med[n][1]:.0f} | "
              f"{', '.join(f'{s:.0f}' for s, _ in v)} | {', '.join(f'{ld:.0f}' for _, ld in v)} |")
    ours = med["kvtier obj"]
    raw = [n for n in med if n != "kvtier obj"]
    best_store = max(raw, key=lambda n: med[n][0])
    best_load = max(raw, key=lambda n: med[n][1])
    print(f"\nkvtier store / best raw put ({best_store}) = {ours[0] / med[best_store][0]:.2f}; "
          f"kvtier load / best raw get ({best_load}) = {ours[1] / med[best_load][1]:.2f}")
    for n in raw:
        print(f"  vs {n}: store {ours[0] / med[n][0]:.2f}, load {ours[1] / med[n][1]:.2f}")
    print(f"1-min load average during the run: min {min(loads):.1f}, max {max(loads):.1f}")
    print(json.dumps({"chunks": args.chunks, "chunk_bytes": args.chunk_mib * MiB,
                      "threads": args.threads, "repeats": args.repeats,
                      "median_mib_s": {n: {"store": s, "load": ld} for n, (s, ld) in med.items()},
                      "samples_mib_s": samples, "loadavg": [min(loads), max(loads)]}, indent=2))


if __name__ == "__main__":
    main()
