"""The CUDA runtime calls torch does not bind, with a stand-in runtime (no CPU machine can run the
real one): a refused pin leaves no error set for the thread's next kernel launch, and a strided
copy is one `cudaMemcpy2DAsync` whose pitches, width and height move exactly the rank's spans."""

from __future__ import annotations

import contextlib
import ctypes
from types import SimpleNamespace

import pytest
import torch

from kvtier.transfer import cuda


class FakeRuntime:
    """cudaHostRegister refused, the thread's last error as the runtime keeps it, and 2-D copies
    done between host addresses."""

    def __init__(self) -> None:
        self.last_error = 0
        self.copies = 0

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        self.last_error = 2
        return 2

    def cudaGetLastError(self) -> int:
        error, self.last_error = self.last_error, 0
        return error

    def cudaMemcpy2DAsync(
        self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind: int,
        stream: int,
    ) -> int:
        self.copies += 1
        assert kind == cuda.MEMCPY_DEFAULT and stream == 7
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)
        return 0


def test_a_refused_pin_clears_the_threads_cuda_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure no CPU machine can cause: the runtime stands in, the pinner's calls are real."""
    runtime = FakeRuntime()
    monkeypatch.setattr(cuda, "_cudart", lambda: runtime)
    monkeypatch.setattr(cuda, "_runtime_library", lambda: runtime)
    monkeypatch.setattr(cuda.torch.cuda, "device", lambda device: contextlib.nullcontext())
    with pytest.raises(RuntimeError, match="cudaError 2"):
        cuda.CudaHostPinner(torch.device("cuda", 1)).register(4096, 4096)
    assert runtime.last_error == 0


def test_a_strided_copy_is_one_2d_copy_of_the_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = FakeRuntime()
    monkeypatch.setattr(cuda, "_runtime_library", lambda: runtime)
    monkeypatch.setattr(cuda.torch.cuda, "current_stream", lambda device: SimpleNamespace(cuda_stream=7))
    rows = torch.zeros(5, 64, dtype=torch.uint8)
    staging = torch.arange(3 * 16, dtype=torch.uint8).view(3, 16)
    spans = rows.view(-1).as_strided((3, 16), (64, 1), 64 + 8)  # rows 1-3, bytes 8-23 of each
    cuda.cuda_strided_copy(spans, staging)
    assert runtime.copies == 1
    assert torch.equal(rows[1:4, 8:24], staging) and not rows[0].any() and not rows[4].any()
    assert rows[1:4, :8].sum() == 0 and rows[1:4, 24:].sum() == 0
    back = torch.zeros_like(staging)
    cuda.cuda_strided_copy(back, spans)
    assert torch.equal(back, staging)
    with pytest.raises(ValueError, match="unit inner strides"):
        cuda.cuda_strided_copy(spans.t(), staging.t())
