"""What every check of `cuda_check.py` runs on: the transfer (CUDA's, or the same class over CPU
streams whose events complete at once), polling it to the end, comparing bytes, and the table the
checks print their rows into. Needs torch and kvtier only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from kvtier.transfer import make_transfer
from kvtier.transfer.copy_plan import CopyPlan
from kvtier.transfer.stream import CopyEvent, CopyStreams, Direction, StreamTransfer

GIB = 1 << 30


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


def guarded(table: Table, check: str, kind: str, run: Callable[[], None]) -> None:
    """Run one check; an exception is a failed row naming it, and the next check runs."""
    try:
        run()
    except Exception as exc:
        table.row(check, kind, False, f"raised {exc!r}"[:300])


def transfer_for(plan: CopyPlan, tensors: Sequence[torch.Tensor]) -> StreamTransfer:
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
