"""Resource use of the whole process tree over a run, for the soak's leak verdict.

`Sampler` takes a `Sample` every `every_s` on its own thread: this process (the engine) and all its
descendants (the tier processes; the campaign's servers run in their own sessions and hold the
tiers' data, so they are not sampled): RSS, open file descriptors, threads, processes, and the
bytes of kvtier's files in /dev/shm. `growth` compares the samples after the
warm-up: the last quarter's median against the first quarter's, per measure; a leak shows as
steady growth, a burst as noise that the medians ignore.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

MEASURES = ("rss_bytes", "open_files", "threads", "processes", "shm_bytes")


@dataclass(frozen=True)
class Sample:
    t: float
    rss_bytes: int
    open_files: int
    threads: int
    processes: int
    shm_bytes: int


def shm_bytes(shm_dir: Path = Path("/dev/shm")) -> int:
    """Bytes allocated to this process's kvtier shared-memory files (its host regions, named
    `kvtier-<pid>-...`)."""
    total = 0
    mine = f"kvtier-{os.getpid()}-"
    for entry in os.scandir(shm_dir):
        if entry.name.startswith(mine):
            try:
                total += entry.stat().st_blocks * 512
            except FileNotFoundError:
                continue
    return total


def sample(t0: float) -> Sample:
    """One sample of this process's tree."""
    root = psutil.Process()
    procs = {p.pid: p for p in (root, *root.children(recursive=True))}
    rss = files = threads = alive = 0
    for p in procs.values():
        try:
            with p.oneshot():
                rss += p.memory_info().rss
                threads += p.num_threads()
                files += p.num_fds()
            alive += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return Sample(time.monotonic() - t0, rss, files, threads, alive, shm_bytes())


@dataclass
class Sampler:
    """Samples on a thread until `stop`; `samples` in time order."""

    every_s: float
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="kvtier-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(sample(self.t0))

    def _run(self) -> None:
        while True:
            self.samples.append(sample(self.t0))
            if self._stop.wait(self.every_s):
                return


def growth(samples: list[Sample], warm_up_s: float) -> dict[str, float | None]:
    """Per measure, (median of the last quarter / median of the first quarter) - 1 over the
    samples taken after `warm_up_s`; None when fewer than 8 such samples."""
    after = [s for s in samples if s.t >= warm_up_s]
    if len(after) < 8:
        return {m: None for m in MEASURES}
    q = len(after) // 4
    out: dict[str, float | None] = {}
    for m in MEASURES:
        first = statistics.median(getattr(s, m) for s in after[:q])
        last = statistics.median(getattr(s, m) for s in after[-q:])
        out[m] = (last / first - 1.0) if first else (0.0 if not last else None)
    return out


def as_json(samples: list[Sample]) -> list[dict[str, float]]:
    return [asdict(s) for s in samples]
