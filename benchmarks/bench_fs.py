"""fs tier throughput next to fio and vLLM's own fs tier, on one directory, in one run.

    python -m benchmarks.bench_fs --dir /var/tmp/kvbench --chunks 256 --chunk-mib 2 --threads 8

For each repeat and each contender, a fresh directory receives `chunks` chunks of `chunk_mib` MiB
(stores), then they are read back (loads); the page cache is dropped before each read phase when
/proc/sys/vm/drop_caches is writable (all contenders use O_DIRECT anyway). Stores and loads are
submitted as jobs of `job_chunks` chunks, all at once, and timed from the first submit to the last
completion. Throughput counts payload bytes only. Prints a table and a JSON document (medians).

The contenders' order rotates from one repeat to the next, with a sync and a pause before each, so
none always follows another's writes or deletes.

Concurrency is the same for all three: `threads` I/Os in flight. fio runs `numjobs=threads`; both
tiers get `n_read_threads = n_write_threads = threads / 2`, and both let all their threads serve a
burst of one kind (kvtier's IoPool and vLLM's DualQueueThreadPool are both two-priority pools).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import mmap
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvtier.tiers.base import Job, JobKind, TierContext
from kvtier.tiers.fs.tier import FsTier

MiB = 1 << 20


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def settle() -> None:
    """Let the disk finish the previous contender's writes and deletes (discards) first."""
    os.sync()
    time.sleep(1.0)


def fio(directory: Path, rw: str, total: int, threads: int) -> float:
    """Bytes per second of one fio sequential pass (direct=1, bs=2M, numjobs=threads)."""
    cmd = [
        "fio", "--name=seq", f"--directory={directory}", f"--rw={rw}", "--bs=2M", "--direct=1",
        "--ioengine=psync", f"--numjobs={threads}", f"--size={total // threads}",
        "--group_reporting", "--output-format=json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return float(job["write" if rw == "write" else "read"]["bw_bytes"])


def run_jobs(submit: Callable[[int, list[int]], None], poll: Callable[[], list[Any]],
             chunks: int, job_chunks: int) -> tuple[float, int]:
    """Submit every job, wait for all; returns (seconds, failed jobs)."""
    jobs = [list(range(i, min(i + job_chunks, chunks))) for i in range(0, chunks, job_chunks)]
    start = time.perf_counter()
    for job_id, slots in enumerate(jobs):
        submit(job_id, slots)
    done, failed = 0, 0
    while done < len(jobs):
        for r in poll():
            done += 1
            failed += not r.success
        time.sleep(0.0002)
    return time.perf_counter() - start, failed


def ours(directory: Path, region: memoryview, chunk: int, chunks: int, threads: int,
         job_chunks: int) -> tuple[float, float, bool]:
    ctx = TierContext(region=region, row_bytes=chunk, num_slots=chunks,
                      layout_fingerprint=secrets.token_hex(16), tier_name="bench",
                      log=logging.getLogger("bench"))
    half = max(1, threads // 2)
    tier = FsTier(ctx, root_dir=str(directory), n_read_threads=half, n_write_threads=half)
    keys = [secrets.token_bytes(32) for _ in range(chunks)]
    try:
        def store(job_id: int, slots: list[int]) -> None:
            tier.submit_store(Job(job_id, JobKind.STORE, tuple(keys[s] for s in slots), tuple(slots)))

        def load(job_id: int, slots: list[int]) -> None:
            tier.submit_load(Job(job_id, JobKind.LOAD, tuple(keys[s] for s in slots), tuple(slots)))

        t_store, failed = run_jobs(store, tier.get_finished_jobs, chunks, job_chunks)
        if failed:
            raise RuntimeError(f"ours: {failed} store jobs failed: {tier.stats()}")
        drop_caches()
        t_load, failed = run_jobs(load, tier.get_finished_jobs, chunks, job_chunks)
        if failed:
            raise RuntimeError(f"ours: {failed} load jobs failed: {tier.stats()}")
        return chunks * chunk / t_store, chunks * chunk / t_load, tier.direct_io
    finally:
        tier.shutdown()


def vllm_fs(directory: Path, region: memoryview, chunk: int, chunks: int, threads: int,
            job_chunks: int) -> tuple[float, float]:
    """vLLM's FileSystemTierManager driven through its own submit/get_finished_jobs API."""
    import numpy as np
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

    config = SimpleNamespace(
        model=SimpleNamespace(name="bench", dtype="bfloat16"),
        cache=SimpleNamespace(tokens_per_hash=16),
        groups=[SimpleNamespace(tokens_per_block=16, layer_names=["l0"])],
        parallel=SimpleNamespace(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0,
                                 is_parallelism_agnostic=True),
        canonical_layout=False, replicated_layout=False, kv_cache_layout=None,
    )
    spec = SimpleNamespace(config=config, blocks_per_chunk=1,
                           kv_events_config=SimpleNamespace(enable_kv_cache_events=False))
    view = region.cast("B", (chunks, chunk))
    half = max(1, threads // 2)
    tier = FileSystemTierManager(spec, view, "fs", str(directory),  # type: ignore[arg-type]
                                 n_read_threads=half, n_write_threads=half)
    keys = [make_offload_key(secrets.token_bytes(32), 0) for _ in range(chunks)]
    req = ReqContext(req_id="bench")
    try:
        def submit(promotion: bool) -> Callable[[int, list[int]], None]:
            def go(job_id: int, slots: list[int]) -> None:
                job = TransferJob(job_id, [keys[s] for s in slots], np.array(slots, dtype=np.int64),
                                  promotion, req)
                (tier.submit_load if promotion else tier.submit_store)(job)
            return go

        def poll() -> list[Any]:
            return list(tier.get_finished_jobs())

        t_store, failed = run_jobs(submit(False), poll, chunks, job_chunks)
        if failed:
            raise RuntimeError(f"vllm: {failed} store jobs failed")
        drop_caches()
        t_load, failed = run_jobs(submit(True), poll, chunks, job_chunks)
        if failed:
            raise RuntimeError(f"vllm: {failed} load jobs failed")
        return chunks * chunk / t_store, chunks * chunk / t_load
    finally:
        tier.shutdown()
        view.release()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default=f"/var/tmp/kvtier-bench-{os.getpid()}",
                   help="scratch directory on the disk under test (not tmpfs)")
    p.add_argument("--chunks", type=int, default=256)
    p.add_argument("--chunk-mib", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=8, help="I/Os in flight (fio numjobs)")
    p.add_argument("--job-chunks", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-fio", action="store_true")
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--json-out", help="also write the JSON document here")
    args = p.parse_args(argv)

    chunk = int(args.chunk_mib * MiB) // 4096 * 4096
    total = chunk * args.chunks
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    mm = mmap.mmap(-1, total)
    region = memoryview(mm)
    seed = os.urandom(chunk)
    for i in range(args.chunks):
        region[i * chunk:(i + 1) * chunk] = seed
        region[i * chunk:i * chunk + 8] = i.to_bytes(8, "little")

    samples: dict[str, list[float]] = {}
    direct = None
    try:
        for rep in range(args.repeats):
            def fresh(name: str, rep: int = rep) -> Path:
                d = base / f"{name}-{rep}"
                shutil.rmtree(d, ignore_errors=True)
                d.mkdir()
                return d

            contenders = ["ours", *([] if args.no_fio else ["fio"]),
                          *([] if args.no_vllm else ["vllm"])]
            shift = rep % len(contenders)
            for name in contenders[shift:] + contenders[:shift]:
                settle()
                d = fresh(name)
                if name == "fio":
                    w = fio(d, "write", total, args.threads)
                    drop_caches()
                    r = fio(d, "read", total, args.threads)
                elif name == "ours":
                    w, r, direct = ours(d, region, chunk, args.chunks, args.threads,
                                        args.job_chunks)
                else:
                    w, r = vllm_fs(d, region, chunk, args.chunks, args.threads, args.job_chunks)
                write_name, read_name = ("write", "read") if name == "fio" else ("store", "load")
                samples.setdefault(f"{name}_{write_name}", []).append(w)
                samples.setdefault(f"{name}_{read_name}", []).append(r)
                shutil.rmtree(d)
            print(f"repeat {rep + 1}: " + ", ".join(
                f"{k} {v[-1] / MiB:.0f}" for k, v in samples.items()) + " MiB/s", file=sys.stderr)
    finally:
        region.release()
        mm.close()
        with contextlib.suppress(OSError):
            base.rmdir()

    med = {k: statistics.median(v) for k, v in samples.items()}
    ratios: dict[str, float] = {}
    for op, fio_op, vllm_op in (("store", "write", "store"), ("load", "read", "load")):
        if f"fio_{fio_op}" in med:
            ratios[f"ours_{op}_vs_fio_{fio_op}"] = med[f"ours_{op}"] / med[f"fio_{fio_op}"]
        if f"vllm_{vllm_op}" in med:
            ratios[f"ours_{op}_vs_vllm_{vllm_op}"] = med[f"ours_{op}"] / med[f"vllm_{vllm_op}"]
    doc = {
        "chunk_bytes": chunk, "chunks": args.chunks, "threads": args.threads,
        "job_chunks": args.job_chunks, "repeats": args.repeats, "dir": str(base),
        "ours_direct_io": direct, "page_cache_dropped": drop_caches(),
        "median_MiB_per_s": {k: round(v / MiB, 1) for k, v in med.items()},
        "samples_MiB_per_s": {k: [round(x / MiB, 1) for x in v] for k, v in samples.items()},
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
    }
    print(f"{'':12}{'store/write':>14}{'load/read':>14}  (MiB/s, median of {args.repeats})")
    rows = (("fio", "fio_write", "fio_read"), ("kvtier fs", "ours_store", "ours_load"),
            ("vLLM fs", "vllm_store", "vllm_load"))
    for label, w_key, r_key in rows:
        if w_key in med:
            print(f"{label:12}{med[w_key] / MiB:14.0f}{med[r_key] / MiB:14.0f}")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")
    print(json.dumps(doc, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
