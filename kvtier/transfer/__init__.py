"""Device <-> host copies of KV chunks, at one face: `make_transfer`.

- `base`: the copy contract (`Transfer`, `CopyResult`);
- `copy_plan`: the block mapping and copies between engine tensors and canonical rows (`CopyPlan`);
- `cpu`: the CPU path (`CpuTransfer`, synchronous copies through `CopyPlan`);
- `stream`: the asynchronous machinery (copy streams, events, the hazards they order);
- `cuda`: CUDA streams and events behind `stream`, the host region registered as pinned memory;
- `staged`: batched copies through a device staging buffer, by `CopyPlan`'s block mapping;
- `state_copier`: the same for recurrent-state segments.

`make_transfer` picks the implementation by the device of the KV tensors. Nothing CUDA-specific is
imported unless the KV tensors live on a CUDA device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.transfer.base import CopyResult, Transfer
from kvtier.transfer.copy_plan import CopyPlan
from kvtier.transfer.cpu import CpuTransfer

__all__ = ["CopyResult", "CpuTransfer", "Transfer", "make_transfer"]


def make_transfer(plan: CopyPlan, layer_tensors: Sequence[torch.Tensor]) -> Transfer:
    """The transfer for the device the KV tensors live on: `CpuTransfer` on the CPU, the
    asynchronous stream transfer on CUDA; NotImplementedError for any other device, or for
    tensors spread over several devices."""
    devices = {t.device for t in layer_tensors}
    if len(devices) != 1:
        raise NotImplementedError(f"kvtier needs every KV tensor of a rank on one device, got {devices}")
    device = devices.pop()
    if device.type == "cpu":
        return CpuTransfer(plan, layer_tensors)
    if device.type == "cuda":
        from kvtier.transfer.cuda import cuda_transfer

        return cuda_transfer(plan, layer_tensors)
    raise NotImplementedError(f"kvtier copies KV from CPU or CUDA tensors, got device {device}")
