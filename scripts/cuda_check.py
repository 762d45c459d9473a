#!/usr/bin/env python3
"""Check kvtier's CUDA copy path on a GPU machine and print what it measured.

Run from the repository root with the project's venv: `.venv/bin/python scripts/cuda_check.py`
(a minute or less; `--help` for the model geometry). It checks, in order:

1. the host region (a /dev/shm segment) pins with `cudaHostRegister` and torch sees it pinned;
2. a store queued while the compute stream is busy returns at once, runs after the busy work
   (it waits for the "forward pass"), and is reported by `poll` only once done;
3. device -> host -> device round trips through kvtier's transfer are byte-identical, for vLLM's
   CUDA layouts (FlashAttention-style `[B, H, N, 2D]` in HND and NHD memory order, stacked K/V),
   each recognised from its shape and copied by `make_transfer`, as the connector's worker does;
4. bandwidth: kvtier's stores (D2H) and loads (H2D) in GiB/s against a plain `tensor.copy_` of the
   same bytes between the device and a pinned host buffer (`pin_memory()`), and against a plain
   copy into the registered region itself.

Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from kvtier.format.layout import CanonicalLayout, TPShard, host_rows
from kvtier.host.region import HostRegion
from kvtier.integrations.vllm.model.backend_layouts import engine_layout, engine_layout_name
from kvtier.transfer import make_transfer
from kvtier.transfer.copy_plan import CopyPlan
from kvtier.transfer.cuda import cuda_transfer
from kvtier.transfer.stream import StreamTransfer

GIB = 1 << 30


def layer_tensors(kind: str, a: argparse.Namespace, seed: int) -> list[torch.Tensor]:
    """Random per-layer KV tensors in one of vLLM's CUDA layouts and memory orders."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b, h, n, d = a.blocks, a.heads, a.block_size, a.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(torch.bfloat16)

    if kind == "flash_hnd":
        return [rand(b, h, n, 2 * d) for _ in range(a.layers)]
    if kind == "flash_nhd":
        return [rand(b, n, h, 2 * d).transpose(1, 2) for _ in range(a.layers)]
    return [rand(2, b, n, h, d) for _ in range(a.layers)]


def wait_all(transfer: StreamTransfer, count: int) -> tuple[float, list[float], bool]:
    """Poll until `count` jobs ended: (wall seconds, each job's device seconds, all ok)."""
    start, ok = time.perf_counter(), True
    seconds: list[float] = []
    while len(seconds) < count:
        for result in transfer.poll():
            seconds.append(result.seconds)
            ok = ok and result.ok
    return time.perf_counter() - start, seconds, ok


def plain_copy_gibs(dst: torch.Tensor, src: torch.Tensor, repeat: int = 5) -> float:
    """GiB/s of `dst.copy_(src, non_blocking=True)` timed with events on the current stream."""
    dst.copy_(src, non_blocking=True)
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(repeat):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    millis: float = start.elapsed_time(end)
    return repeat * src.numel() / GIB / (millis / 1000)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--blocks-per-chunk", type=int, default=16)
    p.add_argument("--chunks", type=int, default=16, help="chunks per job (16: 512 MiB by default)")
    p.add_argument("--blocks", type=int, default=512, help="device blocks per layer")
    p.add_argument("--shm-dir", default="/dev/shm", help="where the host region is created")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("FAIL no CUDA device visible to torch")
        return 1
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(("ok   " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__}")
    layout = CanonicalLayout(a.layers, a.heads, a.head_dim, a.block_size * a.blocks_per_chunk, torch.bfloat16)
    chunk_bytes = a.layers * layout.page_bytes
    print(f"chunk {layout.chunk_tokens} tokens, {chunk_bytes / 2**20:.1f} MiB; job {a.chunks} chunks")
    bpc = a.blocks_per_chunk
    if a.chunks * bpc > a.blocks:
        p.error(f"--chunks {a.chunks} x --blocks-per-chunk {bpc} exceeds --blocks {a.blocks}")
    region = HostRegion.create(a.chunks * layout.row_bytes, shm_dir=a.shm_dir, key="--chunks")
    kinds = ["flash_hnd", "flash_nhd", "stacked"]
    tensors = {kind: layer_tensors(kind, a, seed) for seed, kind in enumerate(kinds)}
    transfers: dict[str, StreamTransfer] = {}
    for kind, kv in tensors.items():
        name = engine_layout_name(kv[0].device.type, kv[0].shape)  # as the connector's worker does
        plan = CopyPlan(layout, engine_layout(name), TPShard(a.heads), a.block_size)
        transfer = make_transfer(plan, kv)
        if not isinstance(transfer, StreamTransfer):
            print(f"FAIL make_transfer gave {type(transfer).__name__} for CUDA tensors")
            return 1
        transfers[kind] = transfer
        start = time.perf_counter()
        transfers[kind].attach(region.name, a.shm_dir)
        if kind == "flash_hnd":
            took = time.perf_counter() - start
            print(f"     cudaHostRegister of {region.size / GIB:.2f} GiB: {took:.3f} s")
    rows = transfers["flash_hnd"].rows
    check(rows is not None and rows.is_pinned(), "1 host region pinned (torch sees its rows as pinned)")

    hnd = transfers["flash_hnd"]
    blocks = [list(range(c * bpc, (c + 1) * bpc)) for c in range(a.chunks)]
    slots = list(range(a.chunks))
    hnd.forward_done()
    hnd.submit_store(0, blocks[:1], slots[:1])  # warm-up: allocators, pinned index buffers
    wait_all(hnd, 1)
    torch.cuda._sleep(1_000_000_000)  # type: ignore[no-untyped-call]
    start = time.perf_counter()
    hnd.forward_done()
    hnd.submit_store(1, blocks[:1], slots[:1])
    queued = time.perf_counter() - start
    not_yet = hnd.poll() == []
    wall, _, ok = wait_all(hnd, 1)
    what = f"2 store queued in {queued * 1e3:.2f} ms behind ~0.5 s of compute, reported after {wall:.2f} s"
    check(queued < 0.05 and not_yet and ok and wall > 0.1, what)

    for kind, transfer in transfers.items():
        src = tensors[kind]
        transfer.forward_done()
        transfer.submit_store(2, blocks, slots)
        wall_s, dev_s, ok_s = wait_all(transfer, 1)
        dst = layer_tensors(kind, a, seed=99)
        for t in dst:
            t.zero_()
        loader = cuda_transfer(transfer.plan, dst)
        loader.attach(region.name, a.shm_dir)
        loader.submit_load(3, blocks, slots)
        wall_l, dev_l, ok_l = wait_all(loader, 1)
        ids = [b for chunk in blocks for b in chunk]
        views = zip(dst, src, strict=True)
        same = all(
            torch.equal(g[ids].view(torch.int16), w[ids].view(torch.int16))
            for got, want in views
            for g, w in zip(transfer.plan.engine_views(got), transfer.plan.engine_views(want), strict=True)
        )
        check(ok_s and ok_l and same, f"3 round trip device->host->device byte-identical ({kind})")
        nbytes = a.chunks * chunk_bytes
        print(
            f"     {kind}: kvtier store (D2H) {nbytes / GIB / dev_s[0]:.1f} GiB/s device time, "
            f"{nbytes / GIB / wall_s:.1f} wall; load (H2D) {nbytes / GIB / dev_l[0]:.1f} GiB/s, "
            f"{nbytes / GIB / wall_l:.1f} wall"
        )
        loader.close()

    nbytes = a.chunks * chunk_bytes
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    shm = rows.view(-1)[:nbytes] if rows is not None else host_rows(region.buf, nbytes, 1).view(-1)
    print(f"     plain copy_, pinned_memory(): D2H {plain_copy_gibs(pinned, dev):.1f} GiB/s, "
          f"H2D {plain_copy_gibs(dev, pinned):.1f} GiB/s")
    print(f"     plain copy_, registered region: D2H {plain_copy_gibs(shm, dev):.1f} GiB/s, "
          f"H2D {plain_copy_gibs(dev, shm):.1f} GiB/s")
    for transfer in transfers.values():
        transfer.close()
    region.close()
    print("all checks passed" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
