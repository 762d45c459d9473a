"""What the raw contenders of the benchmarks share: rows laid out like a host region's, threads
released together and timed, and scatter/gather socket I/O.

A raw contender is the strongest plain-Python client of the same service that a benchmark sets
against a kvtier tier (bench_p2p's TCP copy, bench_redis's RESP socket). To be a fair reference it
moves the same bytes between the same kind of memory as the tier: `rows` gives page-aligned,
pre-touched rows (a host region is both), and `timed_threads` times `threads` workers from the
moment they are all released to the last one's end, as a tier's I/O threads are timed.
"""

from __future__ import annotations

import mmap
import socket
import threading
import time
from collections.abc import Callable

import numpy as np


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


def recv_parts(sock: socket.socket, parts: list[memoryview]) -> None:
    """Fill every buffer of `parts`, in order, from `sock` (scattered reads, MSG_WAITALL)."""
    while parts:
        got = sock.recvmsg_into(parts, 0, socket.MSG_WAITALL)[0]
        if got == 0:
            raise ConnectionError("the server closed the connection")
        parts = _advance(parts, got)


def send_parts(sock: socket.socket, parts: list[memoryview]) -> None:
    """Send every buffer of `parts`, in order (gathered writes: one system call when they fit)."""
    while parts:
        parts = _advance(parts, sock.sendmsg(parts))


def _advance(parts: list[memoryview], done: int) -> list[memoryview]:
    while parts and done >= len(parts[0]):
        done -= len(parts[0])
        parts = parts[1:]
    if parts and done:
        parts = [parts[0][done:], *parts[1:]]
    return parts
