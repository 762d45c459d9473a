"""The CUDA side of the asynchronous transfer: copy streams, events, and the pinned host region.

`cuda_transfer` builds the `StreamTransfer` for KV tensors on one CUDA device:

- `CudaHostPinner` registers the host region's mapping with `cudaHostRegister` (flag
  `cudaHostRegisterPortable`: pinned for every CUDA context of the process), so torch's
  `non_blocking` copies between it and the device are DMA queued on a stream; without it, a copy
  to pageable memory returns only once done. Each TP rank pins its own mapping of the one region,
  on a thread of its own (`kvtier.transfer.pinning`); a failed call's error is cleared from the
  thread (`clear_last_error`), never left for the next kernel launch to report.
- `CudaStreams` queues stores and loads on two dedicated streams (so device → host and host →
  device copies overlap), orders them with `torch.cuda.Event`s, and times them with the events'
  device clock. The compute stream is the current stream of the calling thread: vLLM calls the
  connector's hooks on the thread and stream it runs the forward pass on.

Nothing here is imported on a machine without CUDA unless KV tensors live on a CUDA device.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from kvtier.transfer.copy_plan import CopyPlan
from kvtier.transfer.staged import DEFAULT_STAGING_BYTES
from kvtier.transfer.stream import CopyEvent, CopyStreams, Direction, StreamTransfer

log = logging.getLogger("kvtier.transfer")

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _event(timing: bool = False) -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]


@functools.cache
def _runtime_library() -> ctypes.CDLL | None:
    """The CUDA runtime library this process loaded (torch's), for what torch does not bind."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    if not paths:
        return None
    library = ctypes.CDLL(min(paths))
    library.cudaMemcpy2DAsync.restype = ctypes.c_int
    library.cudaMemcpy2DAsync.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
        ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return library


def clear_last_error() -> None:
    """Reset this thread's CUDA last error: a failed runtime call leaves it set, and the next
    kernel launch check in the thread would raise it as its own error."""
    library = _runtime_library()
    if library is not None:
        library.cudaGetLastError()


class CudaHostPinner:
    """Pins host memory with the CUDA runtime (`cudaHostRegister` / `cudaHostUnregister`), from
    any thread, in `device`'s context (a thread's default device would be device 0)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def register(self, address: int, size: int) -> None:
        with torch.cuda.device(self.device):
            err = int(_cudart().cudaHostRegister(address, size, HOST_REGISTER_PORTABLE))
            if err != 0:
                clear_last_error()
                raise RuntimeError(f"cudaHostRegister of {size} bytes at {address:#x}: cudaError {err}")

    def unregister(self, address: int) -> None:
        with torch.cuda.device(self.device):
            err = int(_cudart().cudaHostUnregister(address))
            if err != 0:
                clear_last_error()
                log.warning("cudaHostUnregister at %#x failed with cudaError %d", address, err)


class CudaStreams(CopyStreams):
    """One store stream and one load stream on `device`; events from `torch.cuda.Event`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._streams = {
            Direction.STORE: torch.cuda.Stream(device=device),  # type: ignore[no-untyped-call]
            Direction.LOAD: torch.cuda.Stream(device=device),  # type: ignore[no-untyped-call]
        }

    def stream(self, direction: Direction) -> torch.cuda.Stream:
        """The copy stream of `direction`."""
        return self._streams[direction]

    def mark_compute(self) -> CopyEvent:
        event = _event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def launch(
        self, direction: Direction, after: Sequence[CopyEvent], enqueue: Callable[[], None]
    ) -> tuple[CopyEvent, CopyEvent]:
        stream = self._streams[direction]
        for event in after:
            stream.wait_event(cast(torch.cuda.Event, event))
        start, end = _event(timing=True), _event(timing=True)
        start.record(stream)
        with torch.cuda.stream(stream):
            enqueue()
        end.record(stream)
        return start, end

    def compute_waits(self, event: CopyEvent) -> None:
        torch.cuda.current_stream(self.device).wait_event(cast(torch.cuda.Event, event))

    def seconds(self, start: CopyEvent, end: CopyEvent) -> float:
        millis: float = cast(torch.cuda.Event, start).elapsed_time(cast(torch.cuda.Event, end))
        return millis / 1000.0


MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)


def cuda_strided_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`StridedCopy` as one `cudaMemcpy2DAsync` on the current stream: torch would copy a strided
    host view through a temporary in pageable memory and wait for it. Both tensors are 2-D uint8
    with unit inner strides; the rows of each are `stride(0)` bytes apart."""
    if dst.shape != src.shape or dst.stride(1) != 1 or src.stride(1) != 1:
        raise ValueError(f"a 2-D copy of {tuple(src.shape)} into {tuple(dst.shape)} with unit inner strides")
    library = _runtime_library()
    if library is None:
        raise RuntimeError("the CUDA runtime library is not loaded in this process")
    device = dst.device if dst.device.type == "cuda" else src.device
    stream = torch.cuda.current_stream(device).cuda_stream
    height, width = dst.shape
    err = int(library.cudaMemcpy2DAsync(
        dst.data_ptr(), dst.stride(0), src.data_ptr(), src.stride(0), width, height, MEMCPY_DEFAULT, stream))
    if err != 0:
        clear_last_error()
        raise RuntimeError(f"cudaMemcpy2DAsync of {height} x {width} bytes: cudaError {err}")


def cuda_transfer(
    plan: CopyPlan, layer_tensors: Sequence[torch.Tensor], staging_bytes: int = DEFAULT_STAGING_BYTES
) -> StreamTransfer:
    """The asynchronous transfer for KV tensors on one CUDA device, pinning the host region."""
    device = layer_tensors[0].device
    return StreamTransfer(plan, layer_tensors, CudaStreams(device), CudaHostPinner(device), staging_bytes,
                          cuda_strided_copy)
