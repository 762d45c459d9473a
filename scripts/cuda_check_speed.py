"""The resource and speed rows of `cuda_check.py`: room in the shared-memory directory, checked up
front for the largest set of host regions the checks hold at once; the time to pin a host region
with the transfer's own pinner, per GiB; and the bandwidth of kvtier's stores and loads against a
plain non-blocking `copy_` of the same bytes between the device and pinned host memory, for big
chunks at TP 1 and for one-block chunks (16 tokens with vLLM's default block size) at TP 1 and on a
TP 2 rank, whose copies are the smallest. Needs torch and kvtier only.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch
from cuda_check_kinds import kv_case
from cuda_check_streams import GIB, Table, transfer_for, wait_all

from kvtier.format.layout import CanonicalLayout
from kvtier.host.region import HostRegion

STATE_REGION_BYTES = 16 << 20
"""The state checks' host region: a state segment of `cuda_check_kinds.state_case` is about 6 MiB."""


@dataclass(frozen=True)
class BandwidthJob:
    """One bandwidth row pair: `chunks` chunks of `bpc` blocks of the `kind` case (`flash_nhd` for
    TP 1, `tp2_rank1` for a TP 2 rank), `--bw-layers` layers."""

    kind: str
    bpc: int
    chunks: int

    def args(self, a: argparse.Namespace) -> argparse.Namespace:
        return argparse.Namespace(
            **{**vars(a), "layers": a.bw_layers, "blocks": self.chunks * self.bpc, "bpc": self.bpc}
        )

    def label(self, a: argparse.Namespace) -> str:
        return f"{a.block_size * self.bpc}tok tp{2 if self.kind == 'tp2_rank1' else 1}"

    def region_bytes(self, a: argparse.Namespace) -> int:
        layout = CanonicalLayout(a.bw_layers, a.heads, a.head_dim, a.block_size * self.bpc, torch.bfloat16)
        return self.chunks * layout.row_bytes


def bandwidth_jobs(a: argparse.Namespace) -> list[BandwidthJob]:
    """`--bw-chunks` chunks of `--bw-bpc` blocks at TP 1; `--bw16-chunks` one-block chunks at TP 1
    and on a TP 2 rank."""
    return [
        BandwidthJob("flash_nhd", a.bw_bpc, a.bw_chunks),
        BandwidthJob("flash_nhd", 1, a.bw16_chunks),
        BandwidthJob("tp2_rank1", 1, a.bw16_chunks),
    ]


def check_shm_room(a: argparse.Namespace, table: Table) -> bool:
    """Whether `--shm-dir` has room now for the most host-region bytes the checks hold at once
    (the identity and state regions together, or one bandwidth region, or the pin region)."""
    phases = {"identity and state regions": (a.identity_chunks << 20) + STATE_REGION_BYTES}
    for job in bandwidth_jobs(a):
        phases[f"bandwidth {job.label(a)}"] = job.region_bytes(a)
    if a.device == "cuda":
        phases["pin time"] = a.pin_mib << 20
    phase, need = max(phases.items(), key=lambda item: item[1])
    st = os.statvfs(a.shm_dir)
    free = st.f_bavail * st.f_frsize
    detail = f"needs {need / 2**20:.0f} MiB at most ({phase}), {free / 2**20:.0f} MiB free"
    if need > free:
        detail += (
            f"; {a.shm_dir} cannot hold the check's host regions (Docker's default /dev/shm is 64 MiB): "
            "run the container with --shm-size=2g, give --shm-dir on a larger tmpfs, or smaller sizes"
        )
    fits = bool(need <= free)
    table.row("shm", a.shm_dir[-18:], fits, detail)
    return fits


def check_pin_time(a: argparse.Namespace, table: Table) -> None:
    """Seconds per GiB to pin a pre-touched region of `--pin-mib` with the transfer's pinner, as
    the connector pins the host tier's region (CUDA only)."""
    if a.device != "cuda":
        table.row("pin time", "host region", None, "not applicable on the CPU (no pinner)")
        return
    plan, src = kv_case("flash_nhd", a, seed=0)
    pinner = transfer_for(plan, src).pinner
    if pinner is None:
        table.row("pin time", "host region", False, "the CUDA transfer has no pinner")
        return
    region = HostRegion.create(a.pin_mib << 20, shm_dir=a.shm_dir, key="--pin-mib")
    try:
        start = time.perf_counter()
        pinner.register(region.address, region.size)
        took = time.perf_counter() - start
        pinner.unregister(region.address)
    finally:
        region.close()
    per_gib = took / (region.size / GIB)
    pinned = f"{took:.3f} s with {type(pinner).__name__}"
    detail = f"{per_gib:.2f} s/GiB ({pinned}); 100 GiB: {100 * per_gib:.0f} s"
    table.row("pin time", f"{region.size >> 20} MiB", True, detail)


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


def check_bandwidth(job: BandwidthJob, a: argparse.Namespace, table: Table) -> None:
    """kvtier's store (D2H) and load (H2D) of `job` against a plain pinned copy of its bytes (this
    rank's share of the rows); on CUDA a ratio under `--min-ratio` fails."""
    plan, src = kv_case(job.kind, job.args(a), seed=9)
    region = HostRegion.create(job.region_bytes(a), shm_dir=a.shm_dir, key="--bw-chunks", pretouch=False)
    try:
        transfer = transfer_for(plan, src)
        transfer.attach(region.name, a.shm_dir)
        blocks = [list(range(c * job.bpc, (c + 1) * job.bpc)) for c in range(job.chunks)]
        slots = list(range(job.chunks))
        best_store = best_load = float("inf")
        for i in range(3):  # the first round warms up allocators and pinned index buffers
            transfer.forward_done()
            transfer.submit_store(10 + i, blocks, slots)
            _, [store_s], ok_s = wait_all(transfer, 1)
            transfer.submit_load(20 + i, blocks, slots)
            _, [load_s], ok_l = wait_all(transfer, 1)
            if not (ok_s and ok_l):
                table.row("bandwidth", job.label(a), False, "a copy failed")
                return
            if i:
                best_store, best_load = min(best_store, store_s), min(best_load, load_s)
        transfer.close()
        lay = plan.layout
        moved = job.chunks * lay.num_layers * lay.page_bytes * plan.shard.num_heads // lay.num_kv_heads
        dev = torch.empty(moved, dtype=torch.uint8, device=a.device)
        host = torch.empty(moved, dtype=torch.uint8, pin_memory=a.device == "cuda")
        plain_d2h, plain_h2d = plain_copy_seconds(host, dev), plain_copy_seconds(dev, host)
    finally:
        region.close()
    kind = f"{job.label(a)} {moved / 2**20:.1f} MiB"
    for what, seconds, plain in (("store D2H", best_store, plain_d2h), ("load H2D", best_load, plain_h2d)):
        ratio = plain / seconds
        ok = ratio >= a.min_ratio if a.device == "cuda" else True
        detail = (
            f"{what}: kvtier {moved / GIB / seconds:.1f} GiB/s, plain pinned copy_ "
            f"{moved / GIB / plain:.1f} GiB/s, ratio {ratio:.2f}"
        )
        table.row("bandwidth", kind, ok, detail + ("" if a.device == "cuda" else " (no threshold on CPU)"))
