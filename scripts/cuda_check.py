#!/usr/bin/env python3
"""Check kvtier's device copy path for every kind of cache it carries, and print a table.

`python scripts/cuda_check.py` on a GPU machine (a few minutes at most on one GPU);
`python scripts/cuda_check.py --device cpu` rehearses the same checks here, on CPU tensors. Needs
Python >= 3.10 and torch, nothing else (no vLLM): kvtier is imported from this checkout. Checks:

1. `shm`, up front: the shared-memory directory has room for the host regions the checks hold at
   once (Docker's default /dev/shm, 64 MiB, does not); else nothing else runs;
2. `pin`: the host region (a /dev/shm segment) pins with `cudaHostRegister`, torch sees it pinned;
   `pin time`: seconds per GiB to pin a pre-touched region with the transfer's pinner;
3. `queue`: a store (chunks, then a state segment) queued while the compute stream is busy returns
   at once, and is reported by `poll` only after the busy work and its copy ran;
4. `identity`: for each kind, a store writes the rows the CPU path (`CopyPlan` on CPU copies of the
   tensors) writes, byte for byte, and a load of random rows writes the blocks the CPU path writes
   and no other. Kinds: vLLM 0.32's CUDA layout `[B, H, N, 2D]` in HND, NHD and cross-layer memory
   orders, older vLLM's stacked `[2, B, N, H, D]`, a TP=2 rank's shard, several KV cache groups
   (a load leaving sliding-window blocks out), MLA latents `[B, N, 576]`, fp8 held as uint8, and
   gated delta net and Mamba2 states in vLLM's shapes (whole, and a TP=2 rank's shard), stored and
   loaded through the same stream transfer as the chunks (`add_states`), on its copy streams; and
   one-block (16-token) chunks stored by both ranks of TP 2 into the same rows;
5. `kernel`: each kind vLLM may split into kernel blocks (`--kernel-ratio` per block), stored and
   loaded through the device path, against the CPU path over unsplit tensors of the same tokens;
6. `no stores`: a load into blocks that the forward pass of an earlier step without stores writes
   (late, behind busy compute on CUDA) holds the loaded bytes: loads wait for every pass before;
7. `bandwidth`: kvtier's stores (D2H) and loads (H2D) against a plain non-blocking `copy_` of the
   same bytes between the device and a `pin_memory()` buffer, for big chunks at TP 1 and one-block
   chunks at TP 1 and on a TP 2 rank; on CUDA a ratio under `--min-ratio` (0.8) fails.

On the CPU, copies run through the same `StreamTransfer` and `StagedCopy` as on CUDA, with streams
whose events complete at once; `pin`, `pin time` and `queue` are skipped. Exit status 0 when every
check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from cuda_check_kinds import (
    KERNEL_KINDS,
    KINDS,
    STATE_KINDS,
    copy_tokens,
    job,
    kv_case,
    random_bytes,
    state_case,
)
from cuda_check_speed import (
    STATE_REGION_BYTES,
    bandwidth_jobs,
    check_bandwidth,
    check_pin_time,
    check_shm_room,
)
from cuda_check_streams import Table, guarded, same, transfer_for, verdict, wait_all

from kvtier.format.layout import TPShard
from kvtier.host.region import HostRegion
from kvtier.transfer.copy_plan import CopyPlan
from kvtier.transfer.state_copier import StateCopier
from kvtier.transfer.stream import StreamTransfer


def round_trip(
    plan: CopyPlan, src: list[torch.Tensor], a: argparse.Namespace, region: HostRegion,
    store_reference: Callable[[list[list[int]], torch.Tensor, list[int]], None],
    loaded_as_expected: Callable[[list[torch.Tensor], list[list[int]], torch.Tensor, list[int]], bool],
) -> tuple[int, bool, bool]:
    """Store `src` through the device path and load random rows back into fresh tensors; (chunks,
    the stored rows are what `store_reference(blocks, rows, slots)` writes, the loaded tensors pass
    `loaded_as_expected(tensors, blocks, rows, slots)`)."""
    chunks = min(a.identity_chunks, region.size // plan.layout.row_bytes, a.blocks // plan.blocks_per_chunk)
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
    store_reference(blocks, expected, slots)
    stored = ok_store and same(rows, expected)

    rows.copy_(random_bytes(tuple(rows.shape), torch.uint8, torch.Generator().manual_seed(2), "cpu"))
    dst = [torch.zeros_like(t) for t in src]
    load = transfer_for(plan, dst)
    load.attach(region.name, a.shm_dir)
    blocks, slots = job(plan, a.blocks, chunks, seed=3, skip=True)
    load.submit_load(2, blocks, slots)
    _, _, ok_load = wait_all(load, 1)
    loaded = ok_load and loaded_as_expected(dst, blocks, rows, slots)
    load.close()
    store.close()
    return chunks, stored, loaded


def check_kind(kind: str, a: argparse.Namespace, region: HostRegion, table: Table) -> None:
    """Store and load one kind through the device path; compare with the CPU path's bytes."""
    plan, src = kv_case(kind, a, seed=len(kind))

    def loaded_as_expected(dst: list[torch.Tensor], blocks: list[list[int]], rows: torch.Tensor,
                           slots: list[int]) -> bool:
        want = [torch.zeros_like(t, device="cpu") for t in src]
        plan.host_to_engine(want, blocks, rows, slots)
        return all(same(got, w) for got, w in zip(dst, want, strict=True))

    chunks, stored, loaded = round_trip(
        plan, src, a, region,
        lambda blocks, rows, slots: plan.engine_to_host([t.cpu() for t in src], blocks, rows, slots),
        loaded_as_expected)
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


def check_kernel_blocks(kind: str, a: argparse.Namespace, region: HostRegion, table: Table) -> None:
    """Store and load one kind split into `--kernel-ratio` kernel blocks per block through the device
    path; compare with the CPU path over unsplit tensors of the same tokens."""
    ratio = a.kernel_ratio
    plan, src = kv_case(kind, a, seed=len(kind), ratio=ratio)
    twin = argparse.Namespace(**{**vars(a), "block_size": a.block_size * ratio, "device": "cpu"})
    whole_plan, whole = kv_case(kind, twin, seed=0)
    copy_tokens(plan, src, whole_plan, whole, to_whole=True)

    def loaded_as_expected(dst: list[torch.Tensor], blocks: list[list[int]], rows: torch.Tensor,
                           slots: list[int]) -> bool:
        want, got = [torch.zeros_like(t) for t in whole], [torch.zeros_like(t) for t in whole]
        whole_plan.host_to_engine(want, blocks, rows, slots)
        copy_tokens(plan, dst, whole_plan, got, to_whole=True)
        return all(same(g, w) for g, w in zip(got, want, strict=True))

    chunks, stored, loaded = round_trip(
        plan, src, a, region,
        lambda blocks, rows, slots: whole_plan.engine_to_host(whole, blocks, rows, slots), loaded_as_expected)
    detail = f"blocks of {a.block_size * ratio} tokens as {ratio} of {a.block_size}, {chunks} chunks"
    table.row("kernel", f"{kind} x{ratio}", stored and loaded, f"{detail}; {verdict(stored, loaded)}")


def rank_tensors(whole: list[torch.Tensor], shard: TPShard) -> list[torch.Tensor]:
    """A TP rank's own tensors of its heads of `whole` (vLLM's NHD memory order)."""
    out = []
    for kv in whole:
        b, _, n, c = kv.shape
        mine = torch.empty(b, n, shard.num_heads, c, dtype=kv.dtype, device=kv.device).transpose(1, 2)
        out.append(mine.copy_(kv[:, shard.head_start : shard.head_end]))
    return out


def check_tp2_small_chunks(a: argparse.Namespace, region: HostRegion, table: Table) -> None:
    """One-block chunks at TP 2: both ranks' stores into the same rows write the rows the CPU path
    writes from all heads; each rank's load writes its heads of the blocks the CPU path writes."""
    whole_plan, whole = kv_case("flash_nhd", argparse.Namespace(**{**vars(a), "bpc": 1}), seed=11)
    shards = [TPShard(a.heads, 2, rank) for rank in range(2)]
    plans = [CopyPlan(whole_plan.layout, whole_plan.engine, s, a.block_size) for s in shards]
    chunks = min(a.identity_chunks, region.size // whole_plan.layout.row_bytes, a.blocks)
    blocks, slots = job(whole_plan, a.blocks, chunks, seed=4, skip=False)
    stores = [transfer_for(p, rank_tensors(whole, s)) for p, s in zip(plans, shards, strict=True)]
    for transfer in stores:
        transfer.attach(region.name, a.shm_dir)
    rows = stores[0].rows
    assert rows is not None
    rows.zero_()
    ok_store = True
    for transfer in stores:
        transfer.forward_done()
        transfer.submit_store(1, blocks, slots)
        ok_store = wait_all(transfer, 1)[2] and ok_store
    expected = torch.zeros_like(rows)
    whole_plan.engine_to_host([t.cpu() for t in whole], blocks, expected, slots)
    stored = ok_store and same(rows, expected)

    rows.copy_(random_bytes(tuple(rows.shape), torch.uint8, torch.Generator().manual_seed(5), "cpu"))
    want = [torch.zeros_like(t, device="cpu") for t in whole]
    whole_plan.host_to_engine(want, blocks, rows, slots)
    loaded = True
    for p, s in zip(plans, shards, strict=True):
        dst = [torch.zeros_like(t) for t in rank_tensors(whole, s)]
        load = transfer_for(p, dst)
        load.attach(region.name, a.shm_dir)
        load.submit_load(2, blocks, slots)
        ok = wait_all(load, 1)[2]
        heads = [w[:, s.head_start : s.head_end] for w in want]
        loaded = loaded and ok and all(same(d, w) for d, w in zip(dst, heads, strict=True))
        load.close()
    for transfer in stores:
        transfer.close()
    detail = f"{chunks} chunks of {a.block_size} tokens, ranks 0 and 1; {verdict(stored, loaded)}"
    table.row("identity", f"tp2 {a.block_size}tok", stored and loaded, detail)


def check_step_without_stores(a: argparse.Namespace, region: HostRegion, table: Table) -> None:
    """Step 1 stores blocks A; step 2 has no stores and its forward pass (behind ~0.5 s of compute on
    CUDA) writes blocks B; step 3 loads A's row into B. B must hold A's bytes. The transfer is
    called as the worker's copier calls it: `forward_done` only in a step with stores."""
    plan, src = kv_case("flash_nhd", a, seed=12)
    bpc = plan.blocks_per_chunk
    transfer = transfer_for(plan, src)
    transfer.attach(region.name, a.shm_dir)
    stored = [t[:bpc].clone() for t in src]
    transfer.before_forward()
    transfer.forward_done()
    transfer.submit_store(1, [list(range(bpc))], [0])
    ok_store = wait_all(transfer, 1)[2]
    transfer.before_forward()  # step 2: its pass writes blocks B, late
    if src[0].is_cuda:
        torch.cuda._sleep(1_000_000_000)  # type: ignore[no-untyped-call]
    for t in src:
        t[bpc : 2 * bpc].zero_()
    transfer.before_forward()  # step 3: the load into B
    transfer.submit_load(2, [list(range(bpc, 2 * bpc))], [0])
    ok_load = wait_all(transfer, 1)[2]
    if src[0].is_cuda:
        torch.cuda.synchronize()
    held = all(same(t[bpc : 2 * bpc], s) for t, s in zip(src, stored, strict=True))
    transfer.close()
    detail = "the loaded blocks hold the stored bytes" if held else "the step's pass overwrote the load"
    table.row("no stores", "flash_nhd", ok_store and ok_load and held, detail)



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
    p.add_argument("--kernel-ratio", type=int, default=4, help="kernel blocks per block of the kernel checks")
    p.add_argument("--bw-layers", type=int, help="layers of the bandwidth check (32 on CUDA, 8 on CPU)")
    p.add_argument("--bw-bpc", type=int, default=16, help="blocks per chunk of the bandwidth check")
    p.add_argument(
        "--bw-chunks", type=int, help="chunks of the bandwidth job (16 on CUDA: 512 MiB; 2 on CPU)"
    )
    p.add_argument("--bw16-chunks", type=int, help="one-block chunks of the TP 1 and TP 2 bandwidth jobs "
                   "(256 on CUDA: 512 MiB; 4 on CPU)")
    p.add_argument("--pin-mib", type=int, default=1024, help="the region the pin time check pins (CUDA)")
    p.add_argument("--min-ratio", type=float, default=0.8, help="least kvtier/plain bandwidth on CUDA")
    p.add_argument("--shm-dir", default="/dev/shm", help="where the host regions are created")
    a = p.parse_args()
    cuda = a.device == "cuda"
    a.bw_layers = a.bw_layers or (32 if cuda else 8)
    a.bw_chunks = a.bw_chunks or (16 if cuda else 2)
    a.bw16_chunks = a.bw16_chunks or (256 if cuda else 4)
    if cuda and not torch.cuda.is_available():
        print("FAIL no CUDA device visible to torch (--device cpu rehearses the checks on the CPU)")
        return 1
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"device {name}, torch {torch.__version__}, python {sys.version.split()[0]}")
    table = Table()
    if not check_shm_room(a, table):
        print("1 check(s) failed: nothing else ran")
        return 1
    guarded(table, "pin time", "host region", lambda: check_pin_time(a, table))
    region = HostRegion.create(
        a.identity_chunks << 20, shm_dir=a.shm_dir, key="--identity-chunks", pretouch=False
    )
    states = HostRegion.create(STATE_REGION_BYTES, shm_dir=a.shm_dir, key="--shm-dir", pretouch=False)
    try:
        guarded(table, "pin/queue", "flash_nhd", lambda: check_pin_and_queue(a, region, table))
        for kind in KINDS:
            guarded(table, "identity", kind, partial(check_kind, kind, a, region, table))
        guarded(table, "identity", f"tp2 {a.block_size}tok", lambda: check_tp2_small_chunks(a, region, table))
        for kind in KERNEL_KINDS:
            guarded(table, "kernel", kind, partial(check_kernel_blocks, kind, a, region, table))
        guarded(table, "no stores", "flash_nhd", lambda: check_step_without_stores(a, region, table))
        guarded(table, "queue", "gdn state", lambda: check_state_queue(a, states, table))
        for kind in STATE_KINDS:
            guarded(table, "identity", kind, partial(check_states, kind, a, states, table))
    finally:
        region.close()
        states.close()
    for bw in bandwidth_jobs(a):
        guarded(table, "bandwidth", bw.label(a), partial(check_bandwidth, bw, a, table))
    print("all checks passed" if not table.failed else f"{table.failed} check(s) failed")
    return 1 if table.failed else 0


if __name__ == "__main__":
    sys.exit(main())
