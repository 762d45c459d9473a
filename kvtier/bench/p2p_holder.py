"""The p2p side of `kvtier tier-bench --tier p2p`: a holder peer, and the timed loads from it.

`holder_peer` copies the rows into a host region of its own, starts a p2p tier process over it
(exactly as a serving instance runs one) and yields a `Holder`: its address, and `hold(keys)`, which
cascades every row to it under new keys (a STORE job naming every slot, which also drops the keys
the slots held before). Everything is shut down on exit, also when startup fails.

`timed_loads` measures what an instance loading from that peer pays, in three passes over the same
rows, each under keys the tier has never seen: a warm-up (untimed: it waits until the tier's
lookups reach the holder, and opens and authenticates the data connections, which a serving
instance keeps open), then loads timed with their lookups (from the first lookup, answered RETRY,
through the peers' answers to the last load: what sits on a request's TTFT path), then loads timed
alone (the lookups settled first: the transfer). Every pass's rows are checked against what the
holder holds, outside the timers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from kvtier.host import generations
from kvtier.host.region import HostRegion
from kvtier.tiers.base import Job, JobKind, JobResult, LookupResult
from kvtier.tiers.process import TierProcess, TierSpec

RunJobs = Callable[[TierProcess, JobKind, list[bytes], int], float]
"""Submit jobs for the keys (slot i for key i), ids from a first job id (at most one id per
key), wait for all; seconds taken."""


class HolderError(RuntimeError):
    """The holder peer could not be started or did not take the chunks."""


def _wait(proc: TierProcess, done: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline or not proc.is_up:
            raise HolderError(f"the p2p holder peer did not {what} within {timeout_s} s")
        proc.poll()
        time.sleep(0.001)


class Holder:
    """A running holder peer: `address` (its control address) and `hold`."""

    def __init__(self, proc: TierProcess, chunks: int, timeout_s: float) -> None:
        self._proc = proc
        self._chunks = chunks
        self._timeout_s = timeout_s
        self._next_job = 0
        self.address = f"tcp://127.0.0.1:{urlsplit(proc.endpoints['control']).port}"

    def hold(self, keys: Sequence[bytes]) -> None:
        """Cascade row i under keys[i], for every row; returns once the holder took them."""
        if len(keys) != self._chunks:
            raise ValueError(f"{len(keys)} keys for {self._chunks} rows")
        self._next_job += 1
        self._proc.submit_store(Job(self._next_job, JobKind.STORE, tuple(keys), tuple(range(self._chunks))))
        results: list[JobResult] = []

        def stored() -> bool:
            results.extend(self._proc.get_finished_jobs())
            return bool(results)

        _wait(self._proc, stored, self._timeout_s, "store")
        if not results[0].success:
            raise HolderError("the p2p holder peer failed to take the chunks")


@contextmanager
def holder_peer(
    rows: np.ndarray[Any, np.dtype[np.uint8]], layout_fingerprint: str, options: dict[str, Any],
    timeout_s: float = 60.0,
) -> Iterator[Holder]:
    """A p2p peer process over its own copy of `rows` (one row per slot), holding nothing yet."""
    chunks, row_bytes = rows.shape
    region = HostRegion.create(rows.nbytes + generations.nbytes(chunks), key="--chunks")
    proc: TierProcess | None = None
    try:
        np.frombuffer(region.buf, dtype=np.uint8, count=rows.nbytes).reshape(rows.shape)[:] = rows
        spec = TierSpec(
            tier_name="p2p-holder", type="p2p", module_path=None, options=options,
            config_key="--tier", region_name=region.name, shm_dir=os.path.dirname(region.path),
            row_bytes=row_bytes, num_slots=chunks, layout_fingerprint=layout_fingerprint,
            generations_offset=rows.nbytes,
        )
        proc = TierProcess(spec, job_timeout_s=timeout_s)
        proc.start()
        yield Holder(proc, chunks, timeout_s)
    finally:
        if proc is not None:
            proc.shutdown()
        region.close()


def settle_lookups(proc: TierProcess, keys: Sequence[bytes], timeout_s: float = 30.0) -> list[LookupResult]:
    """Look `keys` up until no answer is RETRY (what the scheduler does over its steps)."""
    deadline = time.monotonic() + timeout_s
    while LookupResult.RETRY in (answers := proc.lookup(keys)):
        if time.monotonic() > deadline:
            raise HolderError(f"lookups still unanswered after {timeout_s} s")
        time.sleep(0.001)
    return answers


def timed_loads(
    proc: TierProcess, holder: Holder, rows: np.ndarray[Any, np.dtype[np.uint8]],
    check_rows: Callable[[], None], run_jobs: RunJobs, first_job: int,
) -> dict[str, float]:
    """The three passes of the module docstring; `rows` (the tier's region) is zeroed before each
    and `check_rows` verifies it after. Returns, in seconds: load_s (lookups settled before the
    timer), load_lookups_s (lookups and loads) and lookup_s (that pass's lookups alone)."""
    out: dict[str, float] = {}
    for n, name in enumerate(("warm-up", "load_lookups_s", "load_s")):
        if name == "warm-up":
            keys = _first_hits(proc, holder, len(rows))
        else:
            keys = [os.urandom(32) for _ in range(len(rows))]
            holder.hold(keys)
        rows[:] = 0
        if name == "load_s":
            _expect_hits(settle_lookups(proc, keys), name)
        start = time.perf_counter()
        if name == "load_lookups_s":
            _expect_hits(settle_lookups(proc, keys), name)
            out["lookup_s"] = time.perf_counter() - start
        seconds = run_jobs(proc, JobKind.LOAD, keys, first_job + n * len(keys))
        out[name] = time.perf_counter() - start if name == "load_lookups_s" else seconds
        check_rows()
    del out["warm-up"]
    return out


def _first_hits(proc: TierProcess, holder: Holder, chunks: int, tries: int = 20) -> list[bytes]:
    """Keys the holder holds and the tier has found there. The first lookups after start-up can
    miss while the tier's control connection to the holder is still being made (ZMQ connects in
    the background, and a peer not connected yet counts as holding nothing): each try uses fresh
    keys, which no cache has an answer for."""
    for _ in range(tries):
        keys = [os.urandom(32) for _ in range(chunks)]
        holder.hold(keys)
        if LookupResult.MISS not in settle_lookups(proc, keys):
            return keys
        time.sleep(0.1)
    raise HolderError(f"the tier found no chunk at the holder peer in {tries} tries")


def _expect_hits(answers: list[LookupResult], what: str) -> None:
    missed = sum(a is not LookupResult.HIT for a in answers)
    if missed:
        raise HolderError(f"{what}: the holder peer did not answer {missed} of {len(answers)} "
                          "lookups with a hit")
