#!/usr/bin/env python3
"""Check kvtier's device copy path for every kind of cache it carries, and print a table.

`python scripts/cuda_check.py` on a GPU machine (a few minutes at most on one GPU);
`python scripts/cuda_check.py --device cpu` rehearses the same checks here, on CPU tensors. Needs
Python >= 3.10 and torch, nothing else (no vLLM): kvtier is imported from this checkout. Checks:

1. `pin`: the host region (a /dev/shm segment) pins with `cudaHostRegister`, torch sees it pinned;
2. `queue`: a store (chunks, then a state segment) queued while the compute stream is busy returns
   at once, and is reported by `poll` only after the busy work and its copy ran;
3. `identity`: for each kind, a store writes the rows the CPU path (`CopyPlan` on CPU copies of the
   tensors) writes, byte for byte, and a load of random rows writes the blocks the CPU path writes
   and no other. Kinds: vLLM 0.32's CUDA layout `[B, H, N, 2D]` in HND, NHD and cross-layer memory
   orders, older vLLM's stacked `[2, B, N, H, D]`, a TP=2 rank's shard, several KV cache groups
   (a load leaving sliding-window blocks out), MLA latents `[B, N, 576]`, fp8 held as uint8, and
   gated delta net and Mamba2 states in vLLM's shapes (whole, and a TP=2 rank's shard), stored and
   loaded through the same stream transfer as the chunks (`add_states`), on its copy streams;
4. `bandwidth`: kvtier's stores (D2H) and loads (H2D) against a plain non-blocking `copy_` of the
   same bytes between the device and a `pin_memory()` buffer; on CUDA a ratio under `--min-ratio`
   (0.8) fails.

On the CPU, copies run through the same `StreamTransfer` and `StagedCopy` as on CUDA, with streams
whose events complete at once; `pin` and `queue` are skipped. Exit status 0 when every check
passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from cuda_check_kinds import KINDS, STATE_KINDS, job, kv_case, random_bytes, state_case

from kvtier.host.region import HostRegion
from kvtier.transfer import make_transfer
from kvtier.transfer.copy_plan import CopyPlan
from kvtier.transfer.state_copier import StateCopier
from kvtier.transfer.stream import CopyEvent, CopyStreams, Direction, StreamTransfer

GIB = 1 << 30
STATE_REGION_BYTES = 16 << 20
"""The state checks' host region: a state segment of `cuda_check_kinds.state_case` is about 6 MiB."""


class _Done:
    """An event that completed when it was made (the CPU runs copies as they are queued)."""

    def __init__(self) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CpuStreams(CopyStreams):
    """`StreamTransfer`'s streams on the CPU: copies run when queued, events complete at once."""

    def mark_compute(self) -> CopyEvent:
        return _Done()

    def launch(
        self, direction: Direction, after: Sequence[CopyEvent], enqueue: Callable[[], None]
    ) -> tuple[CopyEvent, CopyEvent]:
        start = _Done()
        enqueue()
        return start, _Done()

    def compute_waits(self, event: CopyEvent) -> None:
        return None

    def seconds(self, start: CopyEvent, end: CopyEvent) -> float:
        assert isinstance(start, _Done) and isinstance(end, _Done)
        return end.at - start.at


class Table:
    """The checks' rows, printed as they come; `failed` counts the failures."""

    def __init__(self) -> None:
        self.failed = 0
        print(f"{'check':<10} {'kind':<18} {'result':<6} detail")

    def row(self, check: str, kind: str, ok: bool | None, detail: str = "") -> None:
        result = "skip" if ok is None else "ok" if ok else "FAIL"
        self.failed += ok is False
        print(f"{check:<10} {kind:<18} {result:<6} {detail}", flush=True)


def transfer_for(plan: CopyPlan, tensors: list[torch.Tensor]) -> StreamTransfer:
    """The connector worker's transfer on CUDA (`make_transfer`); the same class on the CPU."""
    if tensors[0].is_cuda:
        transfer = make_transfer(plan, tensors)
        if not isinstance(transfer, StreamTransfer):
            raise TypeError(f"make_transfer gave {type(transfer).__name__} for CUDA tensors")
        return transfer
    return StreamTransfer(plan, tensors, CpuStreams())


def wait_all(transfer: StreamTransfer, count: int, timeout: float = 60.0) -> tuple[float, list[float], bool]:
    """Poll until `count` jobs ended: (wall seconds, each job's device seconds, all ok)."""
    start, ok = time.perf_counter(), True
    seconds: list[float] = []
    while len(seconds) < count:
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"{len(seconds)} of {count} copies ended in {timeout} s")
        for result in transfer.poll():
            seconds.append(result.seconds)
            ok = ok and result.ok
    return time.perf_counter() - start, seconds, ok


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8))


def verdict(stored: bool, loaded: bool) -> str:
    return f"store {'ok' if stored else 'DIFFERS'}, load {'ok' if loaded else 'DIFFERS'}"


def check_kind(kind: str, a: argparse.Namespace, region: HostRegion, table: Table) -> None:
    """Store and load one kind through the device path; compare with the CPU path's bytes."""
    plan, src = kv_case(kind, a, seed=len(kind))
    rows_n = region.size // plan.layout.row_bytes
    chunks = min(a.identity_chunks, rows_n, a.blocks // plan.blocks_per_chunk)
    store = transfer_for(plan, src)
    store.attach(region.name, a.shm_dir)
    assert store.rows is not None
    rows = store.rows
    rows.zero_()
    blocks, slots = job(plan, a.blocks, chunks, seed=1, skip=False)
    store.forward_done()
    store.submit_store(1, blocks, slots)
    _, _, ok_store = wait_all(store, 1)
    expected = torch.zeros_like(rows)
    plan.engine_to_host([t.cpu() for t in src], blocks, expected, slots)
    stored = ok_store and same(rows, expected)

    rows.copy_(random_bytes(tuple(rows.shape), torch.uint8, torch.Generator().manual_seed(2), "cpu"))
    dst = [torch.zeros_like(t) for t in src]
    load = transfer_for(plan, dst)
    load.attach(region.name, a.shm_dir)
    blocks, slots = job(plan, a.blocks, chunks, seed=3, skip=True)
    load.submit_load(2, blocks, slots)
    _, _, ok_load = wait_all(load, 1)
    want = [torch.zeros_like(t, device="cpu") for t in src]
    plan.host_to_engine(want, blocks, rows, slots)
    loaded = ok_load and all(same(got, w) for got, w in zip(dst, want, strict=True))
    load.close()
    store.close()
    mib = chunks * plan.layout.page_bytes * plan.layout.num_layers / 2**20
    table.row(
        "identity", kind, stored and loaded, f"{chunks} chunks, {mib:.1f} MiB; {verdict(stored, loaded)}"
    )


def state_paths(
    kind: str, a: argparse.Namespace, region: HostRegion, src: list[list[torch.Tensor]] | None = None
) -> tuple[StreamTransfer, StateCopier, list[list[torch.Tensor]]]:
    """The stream transfer of a small attention case carrying `kind`'s states (`src`, or new random
    ones), attached to `region`; its copier and state tensors."""
    plan, kv = kv_case("flash_nhd", a, seed=0)
    gen = torch.Generator().manual_seed(5)
    layout, shard, made = state_case(kind, a.device, gen, 8, plan.layout.row_bytes)
    tensors = made if src is None else src
    transfer = transfer_for(plan, kv)
    copier = StateCopier(layout, tensors, shard)
    transfer.add_states(copier)
    transfer.attach(region.name, a.shm_dir)
    if transfer.rows is None or len(transfer.rows) < layout.rows:
        raise ValueError(f"{kind}: a segment of {layout.rows} rows does not fit the region")
    return transfer, copier, tensors


def check_states(kind: str, a: argparse.Namespace, region: HostRegion, table: Table) -> None:
    """Store and load one state segment through the stream path (on its copy streams, as the
    connector's worker does); compare with the CPU path's bytes."""
    store, copier, src = state_paths(kind, a, region)
    layout, shard = copier.layout, copier.shard
    assert store.rows is not None
    rows = store.rows
    rows.zero_()
    block_ids, slots = (3, 5, 1), list(range(layout.rows))[::-1]
    store.forward_done()
    store.submit_state_store(1, block_ids, slots)
    _, _, ok_store = wait_all(store, 1)
    expected = torch.zeros_like(rows)
    cpu_src = [[t.cpu() for t in parts] for parts in src]
    StateCopier(layout, cpu_src, shard).engine_to_host(block_ids, expected, slots)
    stored = ok_store and same(rows, expected) and bool(rows.any())
    store.close()

    dst = [[torch.zeros_like(t) for t in parts] for parts in src]
    load, _, _ = state_paths(kind, a, region, dst)
    assert load.rows is not None
    rows = load.rows
    rows.copy_(random_bytes(tuple(rows.shape), torch.uint8, torch.Generator().manual_seed(6), "cpu"))
    load.submit_state_load(2, block_ids, slots)
    _, _, ok_load = wait_all(load, 1)
    want = [[torch.zeros_like(t, device="cpu") for t in parts] for parts in src]
    StateCopier(layout, want, shard).host_to_engine(block_ids, rows, slots)
    loaded = ok_load and all(
        same(g, w) for gs, ws in zip(dst, want, strict=True) for g, w in zip(gs, ws, strict=True)
    )
    load.close()
    segment = f"{layout.segment_bytes / 2**20:.1f} MiB segment in {layout.rows} rows"
    table.row("identity", kind, stored and loaded, f"{segment}; {verdict(stored, loaded)}")


def check_state_queue(a: argparse.Namespace, region: HostRegion, table: Table) -> None:
    """A state store behind ~0.5 s of compute is queued at once and reported after it (CUDA)."""
    if a.device != "cuda":
        table.row("queue", "gdn state", None, "CUDA only")
        return
    transfer, copier, _ = state_paths("gdn", a, region)
    slots = list(range(copier.layout.rows))
    transfer.forward_done()
    transfer.submit_state_store(0, (0, 1, 2), slots)  # warm-up: allocators
    wait_all(transfer, 1)
    torch.cuda._sleep(1_000_000_000)  # type: ignore[no-untyped-call]  # about 0.5 s of compute
    start = time.perf_counter()
    transfer.forward_done()
    transfer.submit_state_store(1, (3, 4, 5), slots)
    queued = time.perf_counter() - start
    not_yet = transfer.poll() == []
    wall, _, ok = wait_all(transfer, 1)
    detail = f"queued in {queued * 1e3:.2f} ms behind ~0.5 s of compute, reported after {wall:.2f} s"
    table.row("queue", "gdn state", queued < 0.05 and not_yet and ok and wall > 0.1, detail)
    transfer.close()


def check_pin_and_queue(a: argparse.Namespace, region: HostRegion, table: Table) -> None:
    """The region pins; a store behind ~0.5 s of compute is queued at once and reported after it."""
    if a.device != "cuda":
        table.row("pin", "host region", None, "CUDA only")
        table.row("queue", "flash_nhd", None, "CUDA only")
        return
    plan, src = kv_case("flash_nhd", a, seed=0)
    transfer = transfer_for(plan, src)
    start = time.perf_counter()
    transfer.attach(region.name, a.shm_dir)
    took = time.perf_counter() - start
    rows = transfer.rows
    pinned = rows is not None and rows.is_pinned()
    table.row(
        "pin", "host region", pinned, f"cudaHostRegister of {region.size / 2**20:.0f} MiB in {took:.3f} s"
    )
    transfer.forward_done()
    transfer.submit_store(0, [list(range(plan.blocks_per_chunk))], [0])  # warm-up: allocators
    wait_all(transfer, 1)
    torch.cuda._sleep(1_000_000_000)  # type: ignore[no-untyped-call]  # about 0.5 s of compute
    start = time.perf_counter()
    transfer.forward_done()
    transfer.submit_store(1, [list(range(plan.blocks_per_chunk))], [1])
    queued = time.perf_counter() - start
    not_yet = transfer.poll() == []
    wall, _, ok = wait_all(transfer, 1)
    detail = f"queued in {queued * 1e3:.2f} ms behind ~0.5 s of compute, reported after {wall:.2f} s"
    table.row("queue", "flash_nhd", queued < 0.05 and not_yet and ok and wall > 0.1, detail)
    transfer.close()


def plain_copy_seconds(dst: torch.Tensor, src: torch.Tensor, repeat: int = 3) -> float:
    """Seconds of one `dst.copy_(src, non_blocking=True)`, the best of `repeat` (device time on CUDA)."""
    best = float("inf")
    for _ in range(repeat + 1):  # the first one warms up
        if dst.is_cuda or src.is_cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000.0
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    return best


def check_bandwidth(a: argparse.Namespace, table: Table) -> None:
    """kvtier's store (D2H) and load (H2D) of `--bw-chunks` chunks against a plain pinned copy."""
    bw = argparse.Namespace(
        **{**vars(a), "layers": a.bw_layers, "blocks": a.bw_chunks * a.bw_bpc, "bpc": a.bw_bpc}
    )
    plan, src = kv_case("flash_nhd", bw, seed=9)
    nbytes = a.bw_chunks * plan.layout.row_bytes
    region = HostRegion.create(nbytes, shm_dir=a.shm_dir, key="--bw-chunks", pretouch=False)
    try:
        transfer = transfer_for(plan, src)
        transfer.attach(region.name, a.shm_dir)
        blocks = [list(range(c * a.bw_bpc, (c + 1) * a.bw_bpc)) for c in range(a.bw_chunks)]
        slots = list(range(a.bw_chunks))
        best_store = best_load = float("inf")
        for i in range(3):  # the first round warms up allocators and pinned index buffers
            transfer.forward_done()
            transfer.submit_store(10 + i, blocks, slots)
            _, [store_s], ok_s = wait_all(transfer, 1)
            transfer.submit_load(20 + i, blocks, slots)
            _, [load_s], ok_l = wait_all(transfer, 1)
            if not (ok_s and ok_l):
                table.row("bandwidth", "flash_nhd", False, "a copy failed")
                return
            if i:
                best_store, best_load = min(best_store, store_s), min(best_load, load_s)
        transfer.close()
        moved = a.bw_chunks * plan.layout.num_layers * plan.layout.page_bytes
        dev = torch.empty(moved, dtype=torch.uint8, device=a.device)
        host = torch.empty(moved, dtype=torch.uint8, pin_memory=a.device == "cuda")
        plain_d2h, plain_h2d = plain_copy_seconds(host, dev), plain_copy_seconds(dev, host)
    finally:
        region.close()
    ratios = (plain_d2h / best_store, plain_h2d / best_load)
    for what, seconds, ratio in (("store D2H", best_store, ratios[0]), ("load H2D", best_load, ratios[1])):
        gibs, plain = moved / GIB / seconds, moved / GIB / seconds * (1 / ratio)
        ok = ratio >= a.min_ratio if a.device == "cuda" else True
        detail = f"{what}: kvtier {gibs:.1f} GiB/s, plain pinned copy_ {plain:.1f} GiB/s, ratio {ratio:.2f}"
        table.row(
            "bandwidth",
            f"{moved / 2**20:.0f} MiB",
            ok,
            detail + ("" if a.device == "cuda" else " (no threshold on CPU)"),
        )


def guarded(table: Table, check: str, kind: str, run: Callable[[], None]) -> None:
    """Run one check; an exception is a failed row naming it, and the next check runs."""
    try:
        run()
    except Exception as exc:
        table.row(check, kind, False, f"raised {exc!r}"[:300])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--layers", type=int, default=4, help="layers of the identity checks")
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--bpc", type=int, default=2, help="blocks per chunk of the identity checks")
    p.add_argument("--blocks", type=int, default=64, help="device blocks per layer of the identity checks")
    p.add_argument("--identity-chunks", type=int, default=8)
    p.add_argument("--bw-layers", type=int, help="layers of the bandwidth check (32 on CUDA, 8 on CPU)")
    p.add_argument("--bw-bpc", type=int, default=16, help="blocks per chunk of the bandwidth check")
    p.add_argument(
        "--bw-chunks", type=int, help="chunks of the bandwidth job (16 on CUDA: 512 MiB; 2 on CPU)"
    )
    p.add_argument("--min-ratio", type=float, default=0.8, help="least kvtier/plain bandwidth on CUDA")
    p.add_argument("--shm-dir", default="/dev/shm", help="where the host regions are created")
    a = p.parse_args()
    cuda = a.device == "cuda"
    a.bw_layers = a.bw_layers or (32 if cuda else 8)
    a.bw_chunks = a.bw_chunks or (16 if cuda else 2)
    if cuda and not torch.cuda.is_available():
        print("FAIL no CUDA device visible to torch (--device cpu rehearses the checks on the CPU)")
        return 1
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"device {name}, torch {torch.__version__}, python {sys.version.split()[0]}")
    table = Table()
    region = HostRegion.create(
        a.identity_chunks << 20, shm_dir=a.shm_dir, key="--identity-chunks", pretouch=False
    )
    states = HostRegion.create(STATE_REGION_BYTES, shm_dir=a.shm_dir, key="--shm-dir", pretouch=False)
    try:
        guarded(table, "pin/queue", "flash_nhd", lambda: check_pin_and_queue(a, region, table))
        for kind in KINDS:
            guarded(table, "identity", kind, partial(check_kind, kind, a, region, table))
        guarded(table, "queue", "gdn state", lambda: check_state_queue(a, states, table))
        for kind in STATE_KINDS:
            guarded(table, "identity", kind, partial(check_states, kind, a, states, table))
    finally:
        region.close()
        states.close()
    guarded(table, "bandwidth", "flash_nhd", lambda: check_bandwidth(a, table))
    print("all checks passed" if not table.failed else f"{table.failed} check(s) failed")
    return 1 if table.failed else 0


if __name__ == "__main__":
    sys.exit(main())
