"""Helpers for the fs tier and fsck tests: contexts over anonymous memory, job drivers, file access."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from kvtier.ops.metrics import TierCounts
from kvtier.tiers.base import Job, JobKind, JobResult, TierContext
from kvtier.tiers.fs.tier import FsTier

LAYOUT_FP = "0123456789abcdef0123456789abcdef"
OTHER_FP = "ffeeddccbbaa99887766554433221100"


def make_ctx(
    row_bytes: int, slots: int, fp: str = LAYOUT_FP, log: logging.Logger | None = None
) -> TierContext:
    """A context over fresh anonymous (page-aligned) memory; no shared segment needed."""
    region = memoryview(mmap.mmap(-1, row_bytes * slots))
    return TierContext(
        region=region, row_bytes=row_bytes, num_slots=slots, layout_fingerprint=fp,
        tier_name="fs-test", log=log or logging.getLogger("kvtier.tier.fs-test"),
    )


def payload(key: bytes, size: int) -> bytes:
    """Deterministic row content for `key`, so any process can check what it loaded."""
    block = hashlib.sha256(key).digest() * 128
    return (block * (size // len(block) + 1))[:size]


def run_job(tier: FsTier, kind: JobKind, keys: list[bytes], slots: list[int], job_id: int = 1,
            timeout_s: float = 10.0) -> JobResult:
    job = Job(job_id, kind, tuple(keys), tuple(slots))
    if kind is JobKind.STORE:
        tier.submit_store(job)
    else:
        tier.submit_load(job)
    deadline = time.monotonic() + timeout_s
    while True:
        results = tier.get_finished_jobs()
        if results:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} did not finish within {timeout_s} s")
        time.sleep(0.001)
    if [r.job_id for r in results] != [job_id]:
        raise RuntimeError(f"expected job {job_id} alone, got {results}")
    return results[0]


def store_keys(tier: FsTier, ctx: TierContext, keys: list[bytes], job_id: int = 1) -> JobResult:
    """Store `keys` from slots 0.. filled with `payload(key)`."""
    slots = list(range(len(keys)))
    for key, slot in zip(keys, slots, strict=True):
        ctx.slot_view(slot)[:] = payload(key, ctx.row_bytes)
    return run_job(tier, JobKind.STORE, keys, slots, job_id)


def load_keys(tier: FsTier, ctx: TierContext, keys: list[bytes], job_id: int = 2) -> JobResult:
    """Load `keys` into slots 0.. (zeroed first)."""
    slots = list(range(len(keys)))
    for slot in slots:
        ctx.slot_view(slot)[:] = bytes(ctx.row_bytes)
    return run_job(tier, JobKind.LOAD, keys, slots, job_id)


def chunk_path(root: Path | str, key: bytes, fp: str = LAYOUT_FP) -> Path:
    return Path(root) / fp / key.hex()[:2] / key.hex()


def all_files(root: Path | str) -> list[Path]:
    return sorted(p for p in Path(root).rglob("*") if p.is_file())


def temp_files(root: Path | str) -> list[Path]:
    return [p for p in all_files(root) if ".tmp." in p.name]




@contextlib.contextmanager
def immutable(paths: list[Path]) -> Iterator[bool]:
    """`chattr +i` on `paths` for the block; yields False when that is not permitted here."""
    done = subprocess.run(["chattr", "+i", *map(str, paths)], capture_output=True, check=False)
    try:
        yield done.returncode == 0
    finally:
        subprocess.run(["chattr", "-i", *map(str, paths)], capture_output=True, check=False)


def set_mtime(path: Path, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    os.utime(path, (t, t))


def stress_worker(root: str, seed: int, keys: list[bytes], ops: int = 100) -> tuple[TierCounts, int]:
    """Random stores and loads of `keys` against the shared `root` (runs in a spawned process).

    Returns the tier's counts and the mismatches: loads reported successful whose bytes differ.
    """
    import random

    from kvtier.tiers.base import LookupResult

    rng = random.Random(seed)
    row = 4 * 4096
    ctx = make_ctx(row, 8)
    tier = FsTier(ctx, root_dir=root, max_bytes=12 * (4096 + row), n_read_threads=2,
                  n_write_threads=2, rescan_interval_s=0.02)
    mismatches = 0
    try:
        for job_id in range(ops):
            batch = rng.sample(keys, rng.randint(1, 6))
            if rng.random() < 0.5:
                store_keys(tier, ctx, batch, job_id)
            else:
                result = load_keys(tier, ctx, batch, job_id)
                for slot, key in enumerate(batch):
                    if key in result.successful_keys and bytes(ctx.slot_view(slot)) != payload(
                        key, row
                    ):
                        mismatches += 1
            if rng.random() < 0.2:
                tier.lookup(batch)
                if rng.random() < 0.3 and tier.lookup(batch[:1]) == [LookupResult.HIT]:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(chunk_path(root, batch[0]))
    finally:
        tier.shutdown()
    return tier.counts(), mismatches
