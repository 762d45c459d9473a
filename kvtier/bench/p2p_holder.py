"""A stand-alone p2p peer holding given chunks: the other side for `kvtier tier-bench --tier p2p`.

`holder_peer` copies the rows into a host region of its own, starts a p2p tier process over it
(exactly as a serving instance runs one), cascades every row to it with STORE jobs, and yields the
address peers use to reach it. Everything is shut down on exit, also when startup fails.
`settle_lookups` asks a tier until no key answers RETRY (what the scheduler does over its steps).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from kvtier.host.region import HostRegion
from kvtier.tiers.base import Job, JobKind, JobResult, LookupResult
from kvtier.tiers.process import TierProcess, TierSpec


class HolderError(RuntimeError):
    """The holder peer could not be started or did not take the chunks."""


def _wait(proc: TierProcess, done: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline or not proc.is_up:
            raise HolderError(f"the p2p holder peer did not {what} within {timeout_s} s")
        proc.poll()
        time.sleep(0.001)


@contextmanager
def holder_peer(
    rows: np.ndarray[Any, np.dtype[np.uint8]], keys: Sequence[bytes], layout_fingerprint: str,
    options: dict[str, Any], timeout_s: float = 60.0,
) -> Iterator[str]:
    """A p2p peer process holding `rows[i]` under `keys[i]`; yields its control address."""
    chunks, row_bytes = rows.shape
    region = HostRegion.create(rows.nbytes, key="--chunks")
    proc: TierProcess | None = None
    try:
        np.frombuffer(region.buf, dtype=np.uint8).reshape(rows.shape)[:] = rows
        spec = TierSpec(
            tier_name="p2p-holder", type="p2p", module_path=None, options=options,
            config_key="--tier", region_name=region.name, shm_dir=os.path.dirname(region.path),
            row_bytes=row_bytes, num_slots=chunks, layout_fingerprint=layout_fingerprint,
        )
        proc = TierProcess(spec, job_timeout_s=timeout_s)
        proc.start()
        proc.submit_store(Job(1, JobKind.STORE, tuple(keys), tuple(range(chunks))))
        results: list[JobResult] = []

        def stored() -> bool:
            results.extend(proc.get_finished_jobs())
            return bool(results)

        _wait(proc, stored, timeout_s, "store")
        if not results[0].success:
            raise HolderError("the p2p holder peer failed to take the chunks")
        yield f"tcp://127.0.0.1:{urlsplit(proc.endpoints['control']).port}"
    finally:
        if proc is not None:
            proc.shutdown()
        region.close()


def settle_lookups(proc: TierProcess, keys: Sequence[bytes], timeout_s: float = 30.0) -> list[LookupResult]:
    """Look `keys` up until no answer is RETRY."""
    deadline = time.monotonic() + timeout_s
    while LookupResult.RETRY in (answers := proc.lookup(keys)):
        if time.monotonic() > deadline:
            raise HolderError(f"lookups still unanswered after {timeout_s} s")
        time.sleep(0.001)
    return answers
