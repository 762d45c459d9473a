"""Device ↔ host copies of KV chunks: one engine rank's KV tensors and the shared host region.

The host region is attached by name (`HostRegion.attach`), so the rank may live in another
process than the host tier that owns the region. Rows are viewed as a uint8 `[num_slots, row_bytes]`
tensor over the shared mapping (no copy); `kvtier.layout.CopyPlan` does the gathers and scatters in
the canonical format.

CPU path (this module today): copies run synchronously on the calling thread (vLLM's worker
thread), so when `store` or `load` returns the bytes are in place. A device other than the CPU is
refused at construction with a clear error until the CUDA path (pinned region, copy stream, events)
lands.

Failures are values: `store` and `load` return False, having logged the cause; the caller fails
the job and kvtier recomputes or skips the chunk.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from kvtier.host.region import HostRegion
from kvtier.layout import CopyPlan, host_rows

log = logging.getLogger("kvtier.transfer")

CopyFn = Callable[[Sequence[torch.Tensor], Sequence[Sequence[int]], torch.Tensor, Sequence[int]], None]


class HostTransfer:
    """Copies chunks between `layer_tensors` (one per layer, model order) and host rows."""

    def __init__(self, plan: CopyPlan, layer_tensors: Sequence[torch.Tensor]) -> None:
        devices = {t.device.type for t in layer_tensors}
        if devices != {"cpu"}:
            raise NotImplementedError(
                f"kvtier copies KV from CPU tensors only for now, got devices {sorted(devices)}"
            )
        self.plan = plan
        self.layer_tensors = list(layer_tensors)
        self._region: HostRegion | None = None
        self._rows: torch.Tensor | None = None

    def attach(self, region_name: str, shm_dir: str) -> None:
        """Map the host region `region_name` (once; again only if the name changes)."""
        if self._region is not None and self._region.name == region_name:
            return
        self.close()
        region = HostRegion.attach(region_name, shm_dir=shm_dir)
        row_bytes = self.plan.layout.row_bytes
        self._rows = host_rows(region.buf, row_bytes, region.size // row_bytes)
        self._region = region

    def store(self, block_ids: Sequence[Sequence[int]], slots: Sequence[int]) -> bool:
        """Copy chunk i (engine blocks `block_ids[i]`) into host row `slots[i]`.

        Before: the blocks hold computed KV and no other writer touches the rows. After (True): the
        rows hold this rank's heads in canonical format; the blocks may be reused.
        """
        return self._run("store", self.plan.engine_to_host, block_ids, slots)

    def load(self, block_ids: Sequence[Sequence[int]], slots: Sequence[int]) -> bool:
        """Copy host row `slots[i]` into engine blocks `block_ids[i]`.

        Before: the rows are pinned READY and the blocks are allocated to the loading request.
        After (True): the blocks hold the chunk's KV; the rows may be released.
        """
        return self._run("load", self.plan.host_to_engine, block_ids, slots)

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
        """Drop the mapping of the host region. Idempotent."""
        self._rows = None
        if self._region is not None:
            self._region.close()
            self._region = None

