"""Device ↔ host copies of KV chunks: one engine rank's KV tensors and the shared host region.

The host region is attached by name (`HostRegion.attach`), so the rank may live in another
process than the host tier that owns the region. Rows are viewed as a uint8 `[num_slots, row_bytes]`
tensor over the shared mapping (no copy); `kvtier.layout.CopyPlan` defines the canonical format.

`Transfer` is what the connector's worker half drives, once per engine step and on vLLM's worker
thread: `before_forward` (before the step's forward pass is launched), `forward_done` then
`submit_store` for each store (after the forward pass was launched), `submit_load` for each load,
and `poll` for the jobs that ended. A job's `CopyResult` comes out of `poll` exactly once, after
its bytes are in place (or, when it failed, after no copy of it can still be running).

`make_transfer` picks the implementation by the device of the KV tensors:

- CPU: `HostTransfer` (this module) copies synchronously on the calling thread, so each job has
  ended when `submit_*` returns and the next `poll` reports it.
- CUDA: `kvtier.transfer_async.StreamTransfer` over `kvtier.transfer_cuda.CudaStreams`: the host
  region is registered as pinned memory, copies are queued on dedicated copy streams ordered by
  CUDA events, and `poll` queries those events without blocking.

Failures are values: a job that could not be copied is reported with `ok=False`, having logged the
cause; the caller fails the job and kvtier recomputes or skips the chunk.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.host.region import HostRegion
from kvtier.layout import CopyPlan, host_rows

log = logging.getLogger("kvtier.transfer")

CopyFn = Callable[[Sequence[torch.Tensor], Sequence[Sequence[int]], torch.Tensor, Sequence[int]], None]


@dataclass(frozen=True)
class CopyResult:
    """How a copy job ended: whether every chunk of it was copied, and how long the copy took."""

    job_id: int
    ok: bool
    seconds: float


class Transfer(ABC):
    """Copies chunks between one rank's KV tensors (one per layer, model order) and host rows.

    Every method is called on the engine worker's thread and returns without waiting for the
    accelerator. Job ids are unique among the jobs not yet reported by `poll`.
    """

    plan: CopyPlan

    @abstractmethod
    def attach(self, region_name: str, shm_dir: str) -> None:
        """Map the host region `region_name` (once; again only if the name changes)."""

    @abstractmethod
    def submit_store(self, job_id: int, block_ids: Sequence[Sequence[int]], slots: Sequence[int]) -> None:
        """Copy chunk i (engine blocks `block_ids[i]`) into host row `slots[i]`.

        Before: `forward_done` was called after the forward pass that wrote the blocks was launched;
        no other writer touches the rows. When `poll` reports the job ok, the rows hold this rank's
        heads in canonical format.
        """

    @abstractmethod
    def submit_load(self, job_id: int, block_ids: Sequence[Sequence[int]], slots: Sequence[int]) -> None:
        """Copy host row `slots[i]` into engine blocks `block_ids[i]`.

        Before: the rows are pinned READY and the blocks are allocated to a request outside the
        forward pass. When `poll` reports the job ok, the blocks hold the chunks' KV; until `poll`
        reports it (ok or not), the rows must stay pinned and the blocks unread.
        """

    @abstractmethod
    def poll(self) -> list[CopyResult]:
        """The jobs that ended since the last call, each reported once; never blocks."""

    def before_forward(self) -> None:
        """Called before each step's forward pass is launched; an asynchronous transfer orders the
        pass after the copies still reading blocks it may overwrite. No-op for synchronous copies."""

    def forward_done(self) -> None:
        """Called once the step's forward pass was launched, before its stores are submitted.
        No-op for synchronous copies: the pass has run when vLLM calls `wait_for_save`."""

    @abstractmethod
    def close(self) -> None:
        """Wait for copies still running, then unmap the host region. Idempotent."""


class HostTransfer(Transfer):
    """The CPU path: copies run synchronously on the calling thread through `CopyPlan`."""

    def __init__(self, plan: CopyPlan, layer_tensors: Sequence[torch.Tensor]) -> None:
        devices = {t.device.type for t in layer_tensors}
        if devices != {"cpu"}:
            raise NotImplementedError(
                f"HostTransfer copies KV from CPU tensors only, got devices {sorted(devices)}"
            )
        self.plan = plan
        self.layer_tensors = list(layer_tensors)
        self._region: HostRegion | None = None
        self._rows: torch.Tensor | None = None
        self._results: list[CopyResult] = []

    def attach(self, region_name: str, shm_dir: str) -> None:
        if self._region is not None and self._region.name == region_name:
            return
        self.close()
        region = HostRegion.attach(region_name, shm_dir=shm_dir)
        row_bytes = self.plan.layout.row_bytes
        self._rows = host_rows(region.buf, row_bytes, region.size // row_bytes)
        self._region = region

    def submit_store(self, job_id: int, block_ids: Sequence[Sequence[int]], slots: Sequence[int]) -> None:
        self._timed(job_id, self.store, block_ids, slots)

    def submit_load(self, job_id: int, block_ids: Sequence[Sequence[int]], slots: Sequence[int]) -> None:
        self._timed(job_id, self.load, block_ids, slots)

    def poll(self) -> list[CopyResult]:
        done, self._results = self._results, []
        return done

    def store(self, block_ids: Sequence[Sequence[int]], slots: Sequence[int]) -> bool:
        """`submit_store` done now: True once the rows hold the chunks, False (logged) on failure."""
        return self._run("store", self.plan.engine_to_host, block_ids, slots)

    def load(self, block_ids: Sequence[Sequence[int]], slots: Sequence[int]) -> bool:
        """`submit_load` done now: True once the blocks hold the chunks, False (logged) on failure."""
        return self._run("load", self.plan.host_to_engine, block_ids, slots)

    def _timed(
        self,
        job_id: int,
        copy: Callable[[Sequence[Sequence[int]], Sequence[int]], bool],
        block_ids: Sequence[Sequence[int]],
        slots: Sequence[int],
    ) -> None:
        start = time.perf_counter()
        ok = copy(block_ids, slots)
        self._results.append(CopyResult(job_id, ok, time.perf_counter() - start))

    def _run(
        self,
        what: str,
        copy: CopyFn,
        block_ids: Sequence[Sequence[int]],
        slots: Sequence[int],
    ) -> bool:
        if self._rows is None:
            log.error("kvtier %s of %d chunk(s) before the host region was attached", what, len(slots))
            return False
        try:
            copy(self.layer_tensors, block_ids, self._rows, slots)
        except Exception:
            log.exception("kvtier %s of %d chunk(s) failed", what, len(slots))
            return False
        return True

    def close(self) -> None:
        self._rows = None
        if self._region is not None:
            self._region.close()
            self._region = None


def make_transfer(plan: CopyPlan, layer_tensors: Sequence[torch.Tensor]) -> Transfer:
    """The transfer for the device the KV tensors live on: `HostTransfer` on the CPU, the
    asynchronous stream transfer on CUDA; NotImplementedError for any other device, or for
    tensors spread over several devices."""
    devices = {t.device for t in layer_tensors}
    if len(devices) != 1:
        raise NotImplementedError(f"kvtier needs every KV tensor of a rank on one device, got {devices}")
    device = devices.pop()
    if device.type == "cpu":
        return HostTransfer(plan, layer_tensors)
    if device.type == "cuda":
        from kvtier.transfer_cuda import cuda_transfer

        return cuda_transfer(plan, layer_tensors)
    raise NotImplementedError(f"kvtier copies KV from CPU or CUDA tensors, got device {device}")
