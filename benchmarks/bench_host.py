"""Host-tier bookkeeping throughput: chunk operations per second, and its (in)dependence on capacity.

One chunk operation is one key taken through the scheduler's host path in a batch call: `lookup`,
then `prepare_store` + `complete_store` for the keys not found (the region is full, so every store
evicts), and in the mixed workload `prepare_load` + `complete_load` for the keys found. Rows are
never copied: this measures the tier's own cost, over an anonymous mapping of `slots * row_bytes`
bytes that is never touched.

Workloads:
- miss: every key is new; each batch evicts as many entries as it stores.
- mixed: half the batches repeat a batch from the recent past (hits, pinned then released), the
  other half are new keys.

Run from the repository root (kvtier installed, or `PYTHONPATH=.`):
`python benchmarks/bench_host.py [--slots 10000 100000 1000000] [--ops 400000]`. Prints a table and
prints (or writes with --out) the markdown section kept in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import random
import statistics
import time
from pathlib import Path

from kvtier.host.tier import HostTier
from kvtier.policies.registry import resolve_eviction

ROW_BYTES = 4096
TARGET_OPS = 200_000
SEGMENTS = 20
Row = tuple[str, str, int, int, float, float]


def make_keys(n: int, seed: int) -> list[bytes]:
    raw = random.Random(seed).randbytes(32 * n)
    return [raw[i : i + 32] for i in range(0, 32 * n, 32)]


def build(policy_name: str, slots: int) -> tuple[HostTier, mmap.mmap]:
    region = mmap.mmap(-1, slots * ROW_BYTES)
    policy = resolve_eviction(policy_name)(slots)
    tier = HostTier(memoryview(region), ROW_BYTES, policy)  # type: ignore[arg-type]
    fill = make_keys(slots, seed=1)
    for i in range(0, slots, 1024):
        batch = fill[i : i + 1024]
        got = tier.prepare_store(batch)
        if got is None:
            raise RuntimeError("prefill could not allocate")
        tier.complete_store(batch, True)
    tier.take_events()
    return tier, region


def run_batches(
    tier: HostTier, batches: list[list[bytes]], mixed: bool, recent: list[list[bytes]]
) -> tuple[float, float]:
    """(CPU seconds of this thread, wall seconds) to push every batch through the host path."""
    lookup, prepare_store, complete_store = tier.lookup, tier.prepare_store, tier.complete_store
    prepare_load, complete_load, take_events = tier.prepare_load, tier.complete_load, tier.take_events
    cpu_start, wall_start = time.thread_time(), time.perf_counter()
    for i, batch in enumerate(batches):
        if mixed and i % 2 and recent:
            batch = recent[i % len(recent)]
        hit = lookup(batch)
        if hit:
            hits = batch[:hit]
            if prepare_load(hits) is not None:
                complete_load(hits)
        if hit < len(batch):
            rest = batch[hit:]
            slots = prepare_store(rest)
            if slots is None:
                raise RuntimeError("store failed with nothing pinned")
            complete_store(rest, True)
        take_events()
        if mixed:
            if len(recent) < 64:
                recent.append(batch)
            else:
                recent[i % 64] = batch
    return time.thread_time() - cpu_start, time.perf_counter() - wall_start


def measure(
    policy_name: str, slots: int, batch: int, ops: int, mixed: bool
) -> tuple[float, float]:
    """Chunk operations per second, the median over SEGMENTS equal slices: (per CPU second of the
    calling thread, per wall second).

    On a shared machine the wall rate includes the time other processes held the CPU; the CPU
    rate is what the scheduler thread pays when it has a core to itself.
    """
    tier, region = build(policy_name, slots)
    recent: list[list[bytes]] = []
    warmup = make_keys(ops // 10, seed=2 + batch)
    run_batches(tier, [warmup[i : i + batch] for i in range(0, len(warmup), batch)], mixed, recent)
    keys = make_keys(ops, seed=3 + batch)
    batches = [keys[i : i + batch] for i in range(0, ops, batch)]
    per_segment = max(1, len(batches) // SEGMENTS)
    cpu_rates, wall_rates = [], []
    for i in range(0, len(batches), per_segment):
        segment = batches[i : i + per_segment]
        cpu, wall = run_batches(tier, segment, mixed, recent)
        done = sum(map(len, segment))
        cpu_rates.append(done / max(cpu, 1e-9))
        wall_rates.append(done / wall)
    tier.check()
    del tier
    region.close()
    return statistics.median(cpu_rates), statistics.median(wall_rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--policies", nargs="+", default=["lru", "arc"])
    parser.add_argument("--ops", type=int, default=400_000, help="chunk operations per run")
    parser.add_argument("--out", type=Path, help="also write the markdown section for BENCHMARKS.md here")
    args = parser.parse_args()

    rows: list[Row] = []
    load_before = os.getloadavg()[0]
    print(f"{'workload':8} {'policy':6} {'batch':>5} {'slots':>9} {'CPU ops/s':>11} {'wall ops/s':>11}")
    for workload in ("miss", "mixed"):
        for policy_name in args.policies:
            for batch in args.batches:
                for slots in args.slots:
                    cpu, wall = measure(policy_name, slots, batch, args.ops, workload == "mixed")
                    rows.append((workload, policy_name, batch, slots, cpu, wall))
                    print(
                        f"{workload:8} {policy_name:6} {batch:>5} {slots:>9} {cpu:>11,.0f} "
                        f"{wall:>11,.0f}"
                    )
    load = (load_before, os.getloadavg()[0])
    section = report(rows, args.slots, args.ops, load)
    if args.out is None:
        print(section)
    else:
        args.out.write_text(section)
        print(f"wrote {args.out}")


def report(
    rows: list[Row], slot_counts: list[int], ops: int, load: tuple[float, float]
) -> str:
    header = " | ".join(f"{s:,} slots" for s in slot_counts)
    lines = [
        "## Host tier bookkeeping",
        "",
        "`benchmarks/bench_host.py`: chunk operations per second through `lookup` + "
        "`prepare_store` + `complete_store` (plus `prepare_load` + `complete_load` on hits in the "
        "mixed workload), with the host region full so every store evicts. "
        f"{ops:,} chunk operations per run (rate: median of {SEGMENTS} slices), "
        f"{ROW_BYTES}-byte rows (never copied), one thread, "
        f"Python {platform.python_version()} on {os.cpu_count()} CPU(s), load average "
        f"{load[0]:.1f} before and {load[1]:.1f} after. "
        f"Target: {TARGET_OPS:,} chunk ops/s at 100,000 slots. Each cell: per CPU second of the "
        "calling thread / per wall second (medians over the slices).",
        "",
        f"| workload | policy | keys per call | {header} |",
        "|---|---|---|" + "---|" * len(slot_counts),
    ]
    groups: dict[tuple[str, str, int], dict[int, tuple[float, float]]] = {}
    for workload, policy_name, batch, slots, cpu, wall in rows:
        groups.setdefault((workload, policy_name, batch), {})[slots] = (cpu, wall)
    for (workload, policy_name, batch), rates in groups.items():
        cells = " | ".join(f"{rates[s][0]:,.0f} / {rates[s][1]:,.0f}" for s in slot_counts)
        lines.append(f"| {workload} | {policy_name} | {batch} | {cells} |")
    lines += [
        "",
        "miss: every key is new and evicts one entry. mixed: every other batch repeats a recent "
        "one (hits are pinned and released), the rest are new keys.",
        "",
        "No call walks the capacity: each key costs a fixed number of hash-table operations, and "
        "100x more slots costs far less than 100x per key. What drop there is from 10k to 1M "
        "slots is memory latency: the tables outgrow the CPU caches, so each of those operations "
        "misses more often.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
