"""fs tier throughput next to fio and vLLM's own fs tier, on one directory, in one run.

    python -m benchmarks.bench_fs --dir /var/tmp/kvbench --chunks 256 --chunk-mib 2 --threads 8

For each repeat and each contender, a fresh directory receives `chunks` chunks of `chunk_mib` MiB
(stores), then they are read back (loads); the page cache is dropped before each read phase when
/proc/sys/vm/drop_caches is writable (all contenders use O_DIRECT anyway). Stores and loads are
submitted as jobs of `job_chunks` chunks, all at once, and timed from the first submit to the last
completion. Throughput counts payload bytes only. Prints a table and a JSON document (medians,
spreads, every sample).

Both tiers are timed the same way, twice per repeat (`timed_pass`): cold (a fresh directory; the
store time includes building the tier, so each pays for every directory it creates, ours its 256
fan-out directories at construction, vLLM's about two per chunk inside its stores) and warm (the
directories exist for both: an untimed pass stored the same keys and its files were deleted).

The contenders' order rotates from one repeat to the next, and so does the order of the cold and
warm passes, with a sync and a pause before each, so none always follows another's writes or
deletes.

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
from typing import Protocol

import numpy as np

from kvtier.tiers.base import Job, JobKind, TierContext
from kvtier.tiers.fs.tier import FsTier

MiB = 1 << 20
LAYOUT_FP = secrets.token_hex(16)


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


def run_jobs(tier: TierDriver, load: bool, chunks: int, job_chunks: int) -> tuple[float, int]:
    """Submit every job, wait for all; returns (seconds, failed jobs)."""
    jobs = [list(range(i, min(i + job_chunks, chunks))) for i in range(0, chunks, job_chunks)]
    start = time.perf_counter()
    for job_id, slots in enumerate(jobs):
        tier.submit(job_id, slots, load)
    done, failed = 0, 0
    while done < len(jobs):
        for ok in tier.poll():
            done += 1
            failed += not ok
        time.sleep(0.0002)
    return time.perf_counter() - start, failed


class TierDriver(Protocol):
    """One tier instance over `directory`, driven through its own submit / poll API."""

    def submit(self, job_id: int, slots: list[int], load: bool) -> None: ...

    def poll(self) -> list[bool]: ...

    def close(self) -> None: ...


class Ours:
    """kvtier's FsTier; its constructor creates the 256 fan-out directories."""

    def __init__(self, directory: Path, region: memoryview, chunk: int, keys: list[bytes],
                 threads: int) -> None:
        ctx = TierContext(region=region, row_bytes=chunk, num_slots=len(keys),
                          layout_fingerprint=LAYOUT_FP, tier_name="bench", log=logging.getLogger("bench"))
        half = max(1, threads // 2)
        self.tier = FsTier(ctx, root_dir=str(directory), n_read_threads=half, n_write_threads=half)
        self.keys = keys

    def submit(self, job_id: int, slots: list[int], load: bool) -> None:
        job = Job(job_id, JobKind.LOAD if load else JobKind.STORE, tuple(self.keys[s] for s in slots),
                  tuple(slots))
        (self.tier.submit_load if load else self.tier.submit_store)(job)

    def poll(self) -> list[bool]:
        return [r.success for r in self.tier.get_finished_jobs()]

    def close(self) -> None:
        self.tier.shutdown()


class VllmFs:
    """vLLM's FileSystemTierManager; its stores create their two-level directories as needed."""

    def __init__(self, directory: Path, region: memoryview, chunk: int, keys: list[bytes],
                 threads: int) -> None:
        from vllm.v1.kv_offload.base import ReqContext, make_offload_key
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
        self.view = region.cast("B", (len(keys), chunk))
        half = max(1, threads // 2)
        self.tier = FileSystemTierManager(spec, self.view, "fs", str(directory),  # type: ignore[arg-type]
                                          n_read_threads=half, n_write_threads=half)
        self.keys = [make_offload_key(k, 0) for k in keys]
        self.req = ReqContext(req_id="bench")

    def submit(self, job_id: int, slots: list[int], load: bool) -> None:
        from vllm.v1.kv_offload.tiering.base import TransferJob

        job = TransferJob(job_id, [self.keys[s] for s in slots], np.array(slots, dtype=np.int64),
                          load, self.req)
        (self.tier.submit_load if load else self.tier.submit_store)(job)

    def poll(self) -> list[bool]:
        return [r.success for r in self.tier.get_finished_jobs()]

    def close(self) -> None:
        self.tier.shutdown()
        self.view.release()


Make = Callable[[Path], TierDriver]


def timed_pass(make: Make, directory: Path, chunk: int, chunks: int, job_chunks: int,
               warm: bool) -> tuple[float, float]:
    """(store, load) bytes per second of one tier over `directory`.

    cold: `directory` is empty; the store is timed from just before the tier is built (ours makes
    its fan-out directories there, vLLM's makes its directories inside its stores), so both pay for
    every directory they need. warm: an untimed pass first stores the same keys, its chunk files
    are deleted (the directories stay), and a new tier instance is built before the timer: neither
    pays for a directory.
    """
    if warm:
        tier = make(directory)
        try:
            if run_jobs(tier, False, chunks, job_chunks)[1]:
                raise RuntimeError(f"{directory.name}: the warm-up stores failed")
        finally:
            tier.close()
        for f in directory.rglob("*"):
            if f.is_file() and f.stat().st_size >= chunk:
                f.unlink()
        settle()
    start = time.perf_counter()
    tier = make(directory)
    try:
        built = time.perf_counter() - start
        t_store, failed = run_jobs(tier, False, chunks, job_chunks)
        if failed:
            raise RuntimeError(f"{directory.name}: {failed} store jobs failed")
        drop_caches()
        t_load, failed = run_jobs(tier, True, chunks, job_chunks)
        if failed:
            raise RuntimeError(f"{directory.name}: {failed} load jobs failed")
    finally:
        tier.close()
    return chunks * chunk / (t_store + (0.0 if warm else built)), chunks * chunk / t_load


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
    direct: dict[str, bool] = {}
    keys = [secrets.token_bytes(32) for _ in range(args.chunks)]

    def make_ours(d: Path) -> TierDriver:
        ours = Ours(d, region, chunk, keys, args.threads)
        direct["ours"] = ours.tier.direct_io
        return ours

    makers: dict[str, Make] = {
        "ours": make_ours, "vllm": lambda d: VllmFs(d, region, chunk, keys, args.threads)}
    contenders = [*([] if args.no_fio else ["fio"]), "ours", *([] if args.no_vllm else ["vllm"])]
    try:
        for name in contenders:  # imports, the native helper's first load: outside every timer
            if name in makers:
                d = base / f"{name}-first"
                d.mkdir()
                makers[name](d).close()
                shutil.rmtree(d)
        for rep in range(args.repeats):
            shift = rep % len(contenders)
            modes = ("cold", "warm") if rep % 2 == 0 else ("warm", "cold")
            for name in contenders[shift:] + contenders[:shift]:
                for mode in (modes if name in makers else ("",)):
                    settle()
                    d = base / f"{name}-{mode}-{rep}"
                    shutil.rmtree(d, ignore_errors=True)
                    d.mkdir()
                    if name == "fio":
                        w = fio(d, "write", total, args.threads)
                        drop_caches()
                        r = fio(d, "read", total, args.threads)
                        names = ("fio_write", "fio_read")
                    else:
                        w, r = timed_pass(makers[name], d, chunk, args.chunks, args.job_chunks,
                                          mode == "warm")
                        names = (f"{name}_store_{mode}", f"{name}_load_{mode}")
                    for k, v in zip(names, (w, r), strict=True):
                        samples.setdefault(k, []).append(v)
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
    for mode in ("cold", "warm"):
        for op, fio_op in (("store", "write"), ("load", "read")):
            ours = med[f"ours_{op}_{mode}"]
            if f"fio_{fio_op}" in med:
                ratios[f"ours_{op}_{mode}_vs_fio_{fio_op}"] = ours / med[f"fio_{fio_op}"]
            if f"vllm_{op}_{mode}" in med:
                ratios[f"ours_{op}_{mode}_vs_vllm_{op}_{mode}"] = ours / med[f"vllm_{op}_{mode}"]
    doc = {
        "chunk_bytes": chunk, "chunks": args.chunks, "threads": args.threads,
        "job_chunks": args.job_chunks, "repeats": args.repeats, "dir": str(base),
        "ours_direct_io": direct.get("ours"), "page_cache_dropped": drop_caches(),
        "loadavg": os.getloadavg(),
        "median_MiB_per_s": {k: round(v / MiB, 1) for k, v in med.items()},
        "spread_MiB_per_s": {k: [round(min(v) / MiB, 1), round(max(v) / MiB, 1)]
                             for k, v in samples.items()},
        "samples_MiB_per_s": {k: [round(x / MiB, 1) for x in v] for k, v in samples.items()},
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
    }
    print(f"{'':16}{'store/write':>14}{'load/read':>14}  (MiB/s, median of {args.repeats})")
    rows = [("fio", "fio_write", "fio_read")] + [
        (f"{label} {mode}", f"{name}_store_{mode}", f"{name}_load_{mode}")
        for name, label in (("ours", "kvtier fs"), ("vllm", "vLLM fs")) for mode in ("cold", "warm")]
    for label, w_key, r_key in rows:
        if w_key in med:
            print(f"{label:16}{med[w_key] / MiB:14.0f}{med[r_key] / MiB:14.0f}")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")
    print(json.dumps(doc, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
