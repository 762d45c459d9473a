"""I/O threads for tiers that move one key per task, and job completion tracking.

`IoPool` runs one task per key. Read threads take loads first and write threads stores first, and
either kind of thread takes the other kind of task when its own queue is empty, so a burst of loads
(promotions, on the critical path of a request) can use every thread, and so can a burst of stores.
`JobTracker` counts a job's keys down; whichever thread finishes the last key reports the job.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from kvtier.tiers.base import Job

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


class IoPool:
    """`n_read` load-first threads and `n_write` store-first threads over two task queues."""

    def __init__(self, n_read: int, n_write: int, name: str) -> None:
        self._loads: deque[Task] = deque()
        self._stores: deque[Task] = deque()
        self._cv = threading.Condition(threading.Lock())
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._work, args=(i < n_read,), daemon=True,
                             name=f"{name}-{'r' if i < n_read else 'w'}{i}")
            for i in range(n_read + n_write)
        ]
        for t in self._threads:
            t.start()

    def submit(self, load: bool, tasks: Iterable[Task]) -> bool:
        """Queue tasks (loads or stores); False, queuing nothing, once the pool is shut down."""
        with self._cv:
            if self._stopping:
                return False
            queue = self._loads if load else self._stores
            before = len(queue)
            queue.extend(tasks)
            self._cv.notify(len(queue) - before)
            return True

    def shutdown(self) -> None:
        """Stop taking tasks, wait for the running ones, then run the ones never started on this
        thread (each records its own outcome, so every job submitted is reported). Idempotent."""
        with self._cv:
            self._stopping = True
            abandoned = [*self._loads, *self._stores]
            self._loads.clear()
            self._stores.clear()
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        for task in abandoned:
            task()

    def _work(self, prefers_loads: bool) -> None:
        first, second = (self._loads, self._stores) if prefers_loads else (self._stores, self._loads)
        while True:
            with self._cv:
                while not (self._stopping or first or second):
                    self._cv.wait()
                if self._stopping:
                    return
                task = first.popleft() if first else second.popleft()
            task()
