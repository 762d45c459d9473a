"""Host-tier bookkeeping throughput: chunk operations per second, and its (in)dependence on capacity.

One chunk operation is one key taken through the scheduler's host path in a batch call: `lookup`,
then `reserve` + `commit` for the keys not found (the region is full, so every store
evicts), and in the mixed workload `pin` + `unpin` for the keys found. Rows are
never copied: this measures the tier's own cost, over an anonymous mapping of `slots * row_bytes`
bytes that is never touched.

Workloads:
- miss: every key is new; each batch evicts as many entries as it stores.
- mixed: half the batches repeat a batch from the recent past (hits, pinned then released), the
  other half are new keys.

Each run reports two rates per cell: the median of SEGMENTS equal slices (robust to another
process taking the CPU for a moment) and the whole run (every operation over all the time, slow
slices included). The conclusions printed under the table are computed from those numbers: how much
a key's cost grows from the smallest to the largest capacity, what larger batches save, and whether
the target holds at 100,000 slots in every row, by both rates.

Run from the repository root (kvtier installed, or `PYTHONPATH=.`):
`python benchmarks/bench_host.py [--slots 10000 100000 1000000] [--ops 400000]`. Prints a table and
prints (or writes with --out) the markdown section kept in BENCHMARKS.md; --json-out writes the
raw numbers.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier.host.tier import HostTier
from kvtier.policies.registry import resolve_eviction

ROW_BYTES = 4096
TARGET_OPS = 200_000
SEGMENTS = 20
TARGET_SLOTS = 100_000


@dataclass(frozen=True)
class Rates:
    """Chunk operations per second of one run: per CPU second of the calling thread and per wall
    second, each as the median of the slices and over the whole run."""

    cpu_median: float
    wall_median: float
    cpu_whole: float
    wall_whole: float


@dataclass(frozen=True)
class Row:
    workload: str
    policy: str
    batch: int
    slots: int
    rates: Rates


def make_keys(n: int, seed: int) -> list[bytes]:
    raw = random.Random(seed).randbytes(32 * n)
    return [raw[i : i + 32] for i in range(0, 32 * n, 32)]


def build(policy_name: str, slots: int) -> tuple[HostTier, mmap.mmap]:
    region = mmap.mmap(-1, slots * ROW_BYTES)
    policy = resolve_eviction(policy_name)(slots)
    tier = HostTier(memoryview(region), ROW_BYTES, policy)
    fill = make_keys(slots, seed=1)
    for i in range(0, slots, 1024):
        batch = fill[i : i + 1024]
        got = tier.reserve(batch)
        if got is None:
            raise RuntimeError("prefill could not allocate")
        tier.commit(batch, True)
    tier.take_events()
    return tier, region


def run_batches(
    tier: HostTier, batches: list[list[bytes]], mixed: bool, recent: list[list[bytes]]
) -> tuple[float, float]:
    """(CPU seconds of this thread, wall seconds) to push every batch through the host path."""
    lookup, reserve, commit = tier.lookup, tier.reserve, tier.commit
    pin, unpin, take_events = tier.pin, tier.unpin, tier.take_events
    cpu_start, wall_start = time.thread_time(), time.perf_counter()
    for i, batch in enumerate(batches):
        if mixed and i % 2 and recent:
            batch = recent[i % len(recent)]
        hit = lookup(batch)
        if hit:
            hits = batch[:hit]
            if pin(hits) is not None:
                unpin(hits)
        if hit < len(batch):
            rest = batch[hit:]
            slots = reserve(rest)
            if slots is None:
                raise RuntimeError("store failed with nothing pinned")
            commit(rest, True)
        take_events()
        if mixed:
            if len(recent) < 64:
                recent.append(batch)
            else:
                recent[i % 64] = batch
    return time.thread_time() - cpu_start, time.perf_counter() - wall_start


def measure(policy_name: str, slots: int, batch: int, ops: int, mixed: bool) -> Rates:
    """Chunk operations per second over SEGMENTS equal slices of the run: their medians and the
    whole run's rates.

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
    cpu_total = wall_total = 0.0
    for i in range(0, len(batches), per_segment):
        segment = batches[i : i + per_segment]
        cpu, wall = run_batches(tier, segment, mixed, recent)
        done = sum(map(len, segment))
        cpu_rates.append(done / max(cpu, 1e-9))
        wall_rates.append(done / wall)
        cpu_total += cpu
        wall_total += wall
    tier.check()
    del tier
    region.close()
    return Rates(statistics.median(cpu_rates), statistics.median(wall_rates),
                 ops / max(cpu_total, 1e-9), ops / wall_total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--policies", nargs="+", default=["lru", "arc"])
    parser.add_argument("--ops", type=int, default=400_000, help="chunk operations per run")
    parser.add_argument("--out", type=Path, help="also write the markdown section for BENCHMARKS.md here")
    parser.add_argument("--json-out", type=Path, help="also write the raw numbers here (JSON)")
    args = parser.parse_args()

    rows: list[Row] = []
    load_before = os.getloadavg()[0]
    print(f"{'workload':8} {'policy':6} {'batch':>5} {'slots':>9} {'CPU ops/s':>11} {'wall ops/s':>11}"
          f" {'CPU whole':>11} {'wall whole':>11}")
    for workload in ("miss", "mixed"):
        for policy_name in args.policies:
            for batch in args.batches:
                for slots in args.slots:
                    r = measure(policy_name, slots, batch, args.ops, workload == "mixed")
                    rows.append(Row(workload, policy_name, batch, slots, r))
                    print(f"{workload:8} {policy_name:6} {batch:>5} {slots:>9} {r.cpu_median:>11,.0f} "
                          f"{r.wall_median:>11,.0f} {r.cpu_whole:>11,.0f} {r.wall_whole:>11,.0f}")
    load = (load_before, os.getloadavg()[0])
    section = report(rows, args.slots, args.ops, load)
    if args.json_out is not None:
        doc = {"ops": args.ops, "segments": SEGMENTS, "row_bytes": ROW_BYTES, "loadavg": load,
               "python": platform.python_version(), "cpus": os.cpu_count(),
               "rows": [asdict(r) for r in rows]}
        args.json_out.write_text(json.dumps(doc, indent=1) + "\n")
    if args.out is None:
        print(section)
    else:
        args.out.write_text(section)
        print(f"wrote {args.out}")


def report(rows: list[Row], slot_counts: list[int], ops: int, load: tuple[float, float]) -> str:
    header = " | ".join(f"{s:,} slots" for s in slot_counts)
    lines = [
        "## Host tier bookkeeping",
        "",
        "`benchmarks/bench_host.py`: chunk operations per second through `lookup` + "
        "`reserve` + `commit` (plus `pin` + `unpin` on hits in the "
        "mixed workload), with the host region full so every store evicts. "
        f"{ops:,} chunk operations per run in {SEGMENTS} slices, "
        f"{ROW_BYTES}-byte rows (never copied), one thread, "
        f"Python {platform.python_version()} on {os.cpu_count()} CPU(s), load average "
        f"{load[0]:.1f} before and {load[1]:.1f} after. "
        f"Target: {TARGET_OPS:,} chunk ops/s at {TARGET_SLOTS:,} slots. Each cell: per CPU second "
        "of the calling thread, median slice / whole run; then per wall second, median slice / "
        "whole run.",
        "",
        f"| workload | policy | keys per call | {header} |",
        "|---|---|---|" + "---|" * len(slot_counts),
    ]
    groups: dict[tuple[str, str, int], dict[int, Rates]] = {}
    for row in rows:
        groups.setdefault((row.workload, row.policy, row.batch), {})[row.slots] = row.rates
    for (workload, policy_name, batch), rates in groups.items():
        cells = " | ".join(
            f"{rates[s].cpu_median:,.0f} / {rates[s].cpu_whole:,.0f}; "
            f"{rates[s].wall_median:,.0f} / {rates[s].wall_whole:,.0f}" for s in slot_counts)
        lines.append(f"| {workload} | {policy_name} | {batch} | {cells} |")
    lines += [
        "",
        "miss: every key is new and evicts one entry. mixed: every other batch repeats a recent "
        "one (hits are pinned and released), the rest are new keys.",
        "",
        *conclusions(groups, slot_counts),
        "",
    ]
    return "\n".join(lines)


def conclusions(groups: dict[tuple[str, str, int], dict[int, Rates]], slot_counts: list[int]) -> list[str]:
    """What the numbers say, computed from them (CPU rates: what the scheduler thread pays)."""
    out = []
    small, large = min(slot_counts), max(slot_counts)
    if small < large:
        growth = {g: r[small].cpu_whole / r[large].cpu_whole for g, r in groups.items()}
        worst = max(growth, key=lambda g: growth[g])
        out.append(
            f"- Capacity: from {small:,} to {large:,} slots ({large // small}x), a key's CPU cost "
            f"(whole run) changes by {min(growth.values()):.2f}x to {growth[worst]:.2f}x "
            f"(median {statistics.median(growth.values()):.2f}x; most: {' '.join(map(str, worst))}): "
            + (f"far below the {large // small}x a walk over the entries would cost: no call walks "
               "the capacity." if growth[worst] < (large / small) ** 0.5 else
               "more than the square root of the capacity growth: look for a walk."))
    pairs = [(w, p, s) for (w, p, _) in groups for s in slot_counts]
    batches = sorted({b for _, _, b in groups})
    if len(batches) > 1:
        lo, hi = batches[0], batches[-1]
        gain = [groups[(w, p, hi)][s].cpu_whole / groups[(w, p, lo)][s].cpu_whole
                for w, p, s in dict.fromkeys(pairs) if (w, p, hi) in groups and (w, p, lo) in groups]
        out.append(f"- Batching: {hi} keys per call instead of {lo} changes the CPU rate by "
                   f"{min(gain):.2f}x to {max(gain):.2f}x (median {statistics.median(gain):.2f}x).")
    if TARGET_SLOTS in slot_counts:
        at = {g: r[TARGET_SLOTS] for g, r in groups.items()}
        low_median = min(r.cpu_median for r in at.values())
        low_whole = min(r.cpu_whole for r in at.values())
        low_wall = min(r.wall_whole for r in at.values())
        met = sum(r.cpu_whole >= TARGET_OPS for r in at.values())
        out.append(
            f"- Target at {TARGET_SLOTS:,} slots ({TARGET_OPS:,} ops/s): "
            f"{'met' if met == len(at) else 'not met'} in {met} of {len(at)} rows by the whole-run "
            f"CPU rate (lowest {low_whole:,.0f}; lowest median slice {low_median:,.0f}; lowest "
            f"whole-run wall rate {low_wall:,.0f}, which counts the time other processes held "
            "the CPU).")
    return out


if __name__ == "__main__":
    main()
