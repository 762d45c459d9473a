"""What the raw contenders of the benchmarks share: rows laid out like a host region's, threads
released together and timed, and scatter/gather socket I/O (the p2p tier's own `recv_parts` and
`send_parts`: the same system calls the tier makes).

A raw contender is the strongest plain-Python client of the same service that a benchmark sets
against a kvtier tier (bench_p2p's TCP copy, bench_redis's RESP socket). To be a fair reference it
moves the same bytes between the same kind of memory as the tier: `rows` gives page-aligned,
pre-touched rows (a host region is both), and `timed_threads` times `threads` workers from the
moment they are all released to the last one's end, as a tier's I/O threads are timed.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Callable

import numpy as np

from kvtier.tiers.p2p.protocol import recv_parts, send_parts

__all__ = ["recv_parts", "rows", "send_parts", "timed_threads"]


def rows(count: int, row_bytes: int, offset: int = 0) -> memoryview:
    """`count * row_bytes` pre-touched bytes starting `offset` bytes into fresh pages (0: page
    aligned, like a host region; 16: where a large numpy array's data starts)."""
    view = memoryview(mmap.mmap(-1, count * row_bytes + offset))[offset:]
    np.frombuffer(view, dtype=np.uint8)[:] = 1
    return view


def timed_threads(threads: int, work: Callable[[int], object]) -> float:
    """Seconds from releasing `threads` threads running `work(t)` to the last one's end; re-raises
    the first error."""
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        barrier.wait()
        try:
            work(t)
        except BaseException as e:
            errors.append(e)

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    barrier.wait()
    start = time.perf_counter()
    for th in pool:
        th.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start
