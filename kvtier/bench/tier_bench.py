"""`kvtier tier-bench`: store then load K chunks through a real tier process and time both.

The rows live in a real host region, the tier runs in its own process exactly as in serving, and
every job is submitted at once so the tier's own concurrency (its `threads`) is what is measured.
Loaded rows are checked against what was stored (outside the timed part). Each store is a job of
one chunk; loads are jobs of `keys_per_job` chunks (1 by default: the most jobs, the tier's per-job
cost at its highest; the manager submits a promotion's chunks from one tier as one job).

p2p loads what only a peer holds (`p2p_holder`): a holder peer process serves the same rows, and
the load is timed twice after an untimed warm-up, alone (`load_s`, lookups settled first) and with
its lookups (`load_lookups_s`, from the first lookup answered RETRY).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import secrets
import sys
import time
from functools import partial
from typing import Any

import numpy as np
import xxhash

from kvtier.host import generations
from kvtier.host.region import PAGE, HostRegion
from kvtier.tiers.base import Job, JobKind, JobResult
from kvtier.tiers.process import TierProcess, TierSpec

BENCH_LAYOUT_FP = "62656e63682d6c61796f75742d763031"
THREAD_OPTIONS: dict[str, tuple[str, ...]] = {
    "fs": ("n_read_threads", "n_write_threads"),
    "obj": ("io_threads",),
    "redis": ("io_threads",),
    "p2p": ("io_threads",),
}


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _run_jobs(proc: TierProcess, kind: JobKind, keys: list[bytes], first_id: int, per_job: int = 1) -> float:
    """Submit the chunks (slot i for keys[i]) as jobs of `per_job` consecutive chunks, wait for
    all, return the seconds taken; fail on any failure."""
    start = time.perf_counter()
    starts = range(0, len(keys), per_job)
    for n, i in enumerate(starts):
        end = min(i + per_job, len(keys))
        job = Job(first_id + n, kind, tuple(keys[i:end]), tuple(range(i, end)))
        (proc.submit_store if kind is JobKind.STORE else proc.submit_load)(job)
    ids = range(first_id, first_id + len(starts))
    results: list[JobResult] = []
    while len(results) < len(starts):
        # Blocked on the tier's replies, as the manager waits for a promotion: polling on a timer
        # took CPU that the tier (and, for obj and redis, its server on the same host) needs on
        # small machines.
        proc.await_jobs(ids, 1.0)
        results.extend(proc.get_finished_jobs())
    seconds = time.perf_counter() - start
    failed = [r for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(starts)} {kind.value} jobs failed")
    return seconds


def run_tier_bench(
    tier: str, options: dict[str, Any], chunk_bytes: int, chunks: int, threads: int, keys_per_job: int = 1,
    fleet_key_file: str | None = None,
) -> dict[str, Any]:
    """Store then load `chunks` rows of `chunk_bytes` through tier `tier`, loads in jobs of
    `keys_per_job` chunks, chunks MACed with the fleet key in `fleet_key_file` when given;
    throughput in GiB/s."""
    row = -(-chunk_bytes // PAGE) * PAGE
    opts = dict(options)
    for name in THREAD_OPTIONS.get(tier, ()):
        opts.setdefault(name, threads)
    region = HostRegion.create(row * chunks + generations.nbytes(chunks), key="--chunks")
    proc: TierProcess | None = None
    stack = contextlib.ExitStack()
    try:
        rows = np.frombuffer(region.buf, dtype=np.uint8, count=row * chunks).reshape(chunks, row)
        rows[:] = np.random.default_rng(0).integers(0, 256, size=rows.shape, dtype=np.uint8)
        digests = [xxhash.xxh3_64_digest(rows[i]) for i in range(chunks)]

        def check_rows() -> None:
            bad = sum(xxhash.xxh3_64_digest(rows[i]) != digests[i] for i in range(chunks))
            if bad:
                raise RuntimeError(f"{bad} of {chunks} loaded chunks differ from what was stored")

        keys = [os.urandom(32) for _ in range(chunks)]
        if tier == "p2p":
            # The tier stores (indexes) its own rows, and loads other chunks with the same bytes
            # that only a peer process of ours holds: what an instance loads from p2p is what it
            # never stored, found by lookups before the load, as the scheduler does.
            from kvtier.bench import p2p_holder

            opts.setdefault("secret", secrets.token_hex(16))
            shared: dict[str, Any] = {
                k: opts[k] for k in ("secret", "curve_secret_key", "curve_secret_key_file") if k in opts}
            holder = stack.enter_context(p2p_holder.holder_peer(rows, BENCH_LAYOUT_FP, shared))
            opts.setdefault("peers", [holder.address])
        spec = TierSpec(
            tier_name=tier, type=tier, module_path=None, options=opts, config_key="--tier",
            region_name=region.name, shm_dir=os.path.dirname(region.path), row_bytes=row,
            num_slots=chunks, layout_fingerprint=BENCH_LAYOUT_FP, generations_offset=row * chunks,
            fleet_key_file=fleet_key_file,
        )
        proc = TierProcess(spec, job_timeout_s=600)
        proc.start()
        _progress(f"storing {chunks} chunks of {row} bytes to {tier} with {threads} threads")
        store_s = _run_jobs(proc, JobKind.STORE, keys, 0)
        _progress(f"loading {chunks} chunks back from {tier}")
        if tier == "p2p":
            run_jobs = partial(_run_jobs, per_job=keys_per_job)
            loads = p2p_holder.timed_loads(proc, holder, rows, check_rows, run_jobs, chunks)
        else:
            rows[:] = 0
            loads = {"load_s": _run_jobs(proc, JobKind.LOAD, keys, chunks, keys_per_job)}
            check_rows()
        gib = row * chunks / 2**30
        seen = proc.stats_version
        proc.request_stats()
        deadline = time.monotonic() + 10
        while proc.stats_version == seen and proc.is_up and time.monotonic() < deadline:
            proc.poll()
            time.sleep(0.001)
        return {
            "tier": tier, "chunk_bytes": row, "chunks": chunks, "threads": threads,
            "keys_per_job": keys_per_job, "fleet_key": fleet_key_file is not None,
            "store_s": store_s, **loads, "store_gib_s": gib / store_s,
            **{name.removesuffix("_s") + "_gib_s": gib / seconds
               for name, seconds in loads.items() if name != "lookup_s"},
            "tier_counts": proc.metrics.tier_counts(proc.name).as_json(),
            "tier_usage": None if proc.last_usage is None else dataclasses.asdict(proc.last_usage),
        }
    finally:
        if proc is not None:
            proc.shutdown()
        stack.close()
        region.close()


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("tier-bench", help="store and load chunks through a real tier process")
    p.add_argument("--tier", required=True, help="tier type (memory, fs, ...)")
    p.add_argument("--root", help="fs: the root directory")
    p.add_argument("--url", help="redis: the server URL (redis://, rediss://, unix://)")
    p.add_argument("--endpoint", help="obj: the S3 endpoint URL (default: AWS)")
    p.add_argument("--bucket", help="obj: the bucket (credentials: --option or the AWS chain)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=JSON",
                   help="any other tier option, value as JSON (repeatable)")
    p.add_argument("--chunk-bytes", type=int, default=2 << 20)
    p.add_argument("--chunks", type=int, default=256)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--keys-per-job", type=int, default=1,
                   help="chunks per LOAD job (default 1; the manager sends a promotion's chunks "
                        "from one tier as one job)")
    p.add_argument("--fleet-key-file", metavar="PATH",
                   help="MAC every chunk with the fleet key in this file (fleet_key_file)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    options: dict[str, Any] = {}
    if args.root is not None:
        options["root_dir"] = args.root
    if args.url is not None:
        options["url"] = args.url
    if args.endpoint is not None:
        options["endpoint"] = args.endpoint
    if args.bucket is not None:
        options["bucket"] = args.bucket
    for item in args.option:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--option {item!r}: expected KEY=JSON")
        try:
            options[name] = json.loads(value)
        except json.JSONDecodeError:
            options[name] = value
    for name in ("chunk_bytes", "chunks", "threads", "keys_per_job"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    report = run_tier_bench(args.tier, options, args.chunk_bytes, args.chunks, args.threads,
                            args.keys_per_job, args.fleet_key_file)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"tier {report['tier']}: {report['chunks']} chunks x {report['chunk_bytes']} bytes, "
              f"{report['threads']} threads")
        print(f"  store: {report['store_gib_s']:.2f} GiB/s ({report['store_s']:.3f} s)")
        print(f"  load:  {report['load_gib_s']:.2f} GiB/s ({report['load_s']:.3f} s)")
        if "load_lookups_s" in report:
            print(f"  load with its lookups: {report['load_lookups_gib_s']:.2f} GiB/s "
                  f"({report['load_lookups_s']:.3f} s, lookups {report['lookup_s']:.3f} s)")
    return 0
