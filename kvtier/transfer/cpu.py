"""The CPU copy path: `CpuTransfer` copies synchronously on the calling thread.

The host region is attached by name (`HostRegion.attach`), so the rank may live in another process
than the host tier that owns the region. Rows are viewed as a uint8 `[num_slots, row_bytes]` tensor
over the shared mapping (no copy); `kvtier.transfer.copy_plan.CopyPlan` copies between the engine's
blocks and those rows, in the canonical format of `kvtier.format.layout`. Each job has ended when
`submit_*` returns, and the next `poll` reports it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from kvtier.format.layout import host_rows
from kvtier.host.region import HostRegion
from kvtier.transfer.base import CopyResult, Transfer
from kvtier.transfer.copy_plan import CopyPlan

log = logging.getLogger("kvtier.transfer")


class CpuTransfer(Transfer):
    """The CPU path: copies run synchronously on the calling thread through `CopyPlan`."""

    def __init__(self, plan: CopyPlan, layer_tensors: Sequence[torch.Tensor]) -> None:
        devices = {t.device.type for t in layer_tensors}
        if devices != {"cpu"}:
            raise NotImplementedError(
                f"CpuTransfer copies KV from CPU tensors only, got devices {sorted(devices)}"
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
        self._timed(job_id, lambda: self.store(block_ids, slots))

    def submit_load(self, job_id: int, block_ids: Sequence[Sequence[int]], slots: Sequence[int]) -> None:
        self._timed(job_id, lambda: self.load(block_ids, slots))

    def submit_state_store(self, job_id: int, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        self._timed(job_id, lambda: self._states(True, block_ids, slots))

    def submit_state_load(self, job_id: int, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        self._timed(job_id, lambda: self._states(False, block_ids, slots))

    @property
    def device(self) -> torch.device:
        return self.layer_tensors[0].device

    def poll(self) -> list[CopyResult]:
        done, self._results = self._results, []
        return done

    def store(self, block_ids: Sequence[Sequence[int]], slots: Sequence[int]) -> bool:
        """`submit_store` done now: True once the rows hold the chunks, False (logged) on failure."""
        return self._run("store", len(slots), lambda rows: self.plan.engine_to_host(
            self.layer_tensors, block_ids, rows, slots))

    def load(self, block_ids: Sequence[Sequence[int]], slots: Sequence[int]) -> bool:
        """`submit_load` done now: True once the blocks hold the chunks, False (logged) on failure."""
        return self._run("load", len(slots), lambda rows: self.plan.host_to_engine(
            self.layer_tensors, block_ids, rows, slots))

    def _states(self, to_host: bool, block_ids: Sequence[int], slots: Sequence[int]) -> bool:
        what = "state store" if to_host else "state load"
        copier = self.states
        if copier is None:
            log.error("kvtier %s on a transfer without state tensors", what)
            return False
        copy = copier.engine_to_host if to_host else copier.host_to_engine
        return self._run(what, 1, lambda rows: copy(block_ids, rows, slots))

    def _timed(self, job_id: int, copy: Callable[[], bool]) -> None:
        start = time.perf_counter()
        ok = copy()
        self._results.append(CopyResult(job_id, ok, time.perf_counter() - start))

    def _run(self, what: str, chunks: int, copy: Callable[[torch.Tensor], None]) -> bool:
        if self._rows is None:
            log.error("kvtier %s of %d chunk(s) before the host region was attached", what, chunks)
            return False
        try:
            copy(self._rows)
        except Exception:
            log.exception("kvtier %s of %d chunk(s) failed", what, chunks)
            return False
        return True

    def close(self) -> None:
        self._rows = None
        if self._region is not None:
            self._region.close()
            self._region = None
