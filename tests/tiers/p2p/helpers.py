"""Helpers for the p2p tier's tests: peers as real tier processes over loopback, each with its own
host region (the `make_peer` fixture in conftest.py), their addresses and stores."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

from kvtier.host import generations
from kvtier.host.region import HostRegion
from kvtier.tiers.base import Job, JobKind, TierContext
from kvtier.tiers.process import TierProcess, TierSpec
from tests.conftest import LAYOUT_FP, ROW_BYTES, SLOTS, wait_jobs

SECRET = "p2p-test-secret-0123456789"
CURVE_KEY = "D:)Q[IlAW!ahhC2ac:9*A}h:p?([4%wOTJ%JR%cs"
FP = bytes.fromhex(LAYOUT_FP)
Peer = tuple[TierProcess, HostRegion]


def address(proc: TierProcess) -> str:
    return f"tcp://127.0.0.1:{urlsplit(proc.endpoints['control']).port}"


def data_address(proc: TierProcess) -> tuple[str, int]:
    port = urlsplit(proc.endpoints["data"]).port
    assert port is not None
    return "127.0.0.1", port


@contextlib.contextmanager
def peer_maker() -> Iterator[Callable[..., Peer]]:
    """A function that starts a p2p tier process over a region of its own (its options: the
    shared secret and the keywords given); every peer started is shut down on exit."""
    made: list[Peer] = []

    def make(row_bytes: int = ROW_BYTES, slots: int = SLOTS, **options: object) -> Peer:
        region = HostRegion.create(row_bytes * slots + generations.nbytes(slots))
        spec = TierSpec(
            tier_name="p2p", type="p2p", module_path=None, options={"secret": SECRET, **options},
            config_key="secondary_tiers[0]", region_name=region.name, shm_dir="/dev/shm",
            row_bytes=row_bytes, num_slots=slots, layout_fingerprint=LAYOUT_FP,
            generations_offset=row_bytes * slots,
        )
        proc = TierProcess(spec, job_timeout_s=30)
        made.append((proc, region))
        proc.start()
        return proc, region

    try:
        yield make
    finally:
        for proc, region in made:
            proc.shutdown()
            region.close()


def ctx_of(region: HostRegion, row_bytes: int = ROW_BYTES, slots: int = SLOTS) -> TierContext:
    return TierContext(region=region.buf, row_bytes=row_bytes, num_slots=slots,
                       layout_fingerprint=LAYOUT_FP, tier_name="p2p",
                       generations=generations.view(region.buf, row_bytes * slots, slots))


def store(proc: TierProcess, keys: list[bytes], slots: list[int], job_id: int = 1) -> None:
    proc.submit_store(Job(job_id, JobKind.STORE, tuple(keys), tuple(slots)))
    [result] = wait_jobs(proc, 1)
    assert result.success
