"""I/O threads for tiers that move one key per task, and job completion tracking.

`DualQueue` holds load and store work for I/O threads; `IoPool` runs one task per key over one.
Read threads take loads first and write threads stores first, and either kind of thread takes the
other kind of task when its own queue is empty, so a burst of loads (promotions, on the critical
path of a request) can use every thread, and so can a burst of stores.
`JobTracker` counts a job's keys down; whichever thread finishes the last key reports the job.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from kvtier.tiers.base import Job

T = TypeVar("T")
Task = Callable[[], None]
"""One key's work. It must not raise: it records its own outcome."""


class JobTracker:
    """One job in flight. `finish_key` is called exactly once per key, from any thread."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.start = time.perf_counter()
        self.ok = [False] * len(job.keys)
        self._remaining = len(job.keys)
        self._lock = threading.Lock()

    def finish_key(self, index: int, ok: bool) -> bool:
        """Record the outcome of key `index`; True for the one call that completes the job."""
        with self._lock:
            self.ok[index] = ok
            self._remaining -= 1
            return self._remaining == 0


class DualQueue(Generic[T]):
    """Load and store work waiting for I/O threads. A thread takes from the queue of its preferred
    kind, or from the other one when that is empty, so either kind can use every thread. Any
    thread; `take` blocks."""

    def __init__(self) -> None:
        self._loads: deque[T] = deque()
        self._stores: deque[T] = deque()
        self._cv = threading.Condition(threading.Lock())
        self._stopping = False

    def put(self, load: bool, items: Iterable[T]) -> bool:
        """Queue items (loads or stores); False, queuing nothing, once stopped."""
        with self._cv:
            if self._stopping:
                return False
            queue = self._loads if load else self._stores
            before = len(queue)
            queue.extend(items)
            self._cv.notify(len(queue) - before)
            return True

    def take(self, prefers_loads: bool, more: Callable[[int], bool] = lambda n: False) -> list[T]:
        """Wait for work: the first item of the preferred kind (else of the other), followed by
        items of the same kind while `more(items taken so far)`. Empty once stopped."""
        first, second = (self._loads, self._stores) if prefers_loads else (self._stores, self._loads)
        with self._cv:
            while not (self._stopping or first or second):
                self._cv.wait()
            if self._stopping:
                return []
            source = first if first else second
            batch = [source.popleft()]
            while source and more(len(batch)):
                batch.append(source.popleft())
            return batch

    def stop(self) -> list[T]:
        """Refuse new work, wake every waiting thread; returns the items never taken."""
        with self._cv:
            self._stopping = True
            abandoned = [*self._loads, *self._stores]
            self._loads.clear()
            self._stores.clear()
            self._cv.notify_all()
        return abandoned


class IoPool:
    """`n_read` load-first threads and `n_write` store-first threads over a `DualQueue` of tasks."""

    def __init__(self, n_read: int, n_write: int, name: str) -> None:
        self._queue: DualQueue[Task] = DualQueue()
        self._threads = [
            threading.Thread(target=self._work, args=(i < n_read,), daemon=True,
                             name=f"{name}-{'r' if i < n_read else 'w'}{i}")
            for i in range(n_read + n_write)
        ]
        for t in self._threads:
            t.start()

    def submit(self, load: bool, tasks: Iterable[Task]) -> bool:
        """Queue tasks (loads or stores); False, queuing nothing, once the pool is shut down."""
        return self._queue.put(load, tasks)

    def shutdown(self) -> None:
        """Stop taking tasks, wait for the running ones, then run the ones never started on this
        thread (each records its own outcome, so every job submitted is reported). Idempotent."""
        abandoned = self._queue.stop()
        for t in self._threads:
            t.join()
        for task in abandoned:
            task()

    def _work(self, prefers_loads: bool) -> None:
        while tasks := self._queue.take(prefers_loads):
            tasks[0]()
