"""Pinning the host region: on a thread of its own, so the engine thread never waits for the
driver to lock a large region; copies go on meanwhile (pageable, still correct); closing waits for
it before unpinning."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest

from kvtier.engine.copies import ChunkCopy
from kvtier.host.region import HostRegion
from kvtier.transfer.pinning import RegionPin
from kvtier.transfer.stream import StreamTransfer
from tests.engine.fakes import KEYS, ROW_BYTES
from tests.transfer.test_transfer_async import ScriptedStreams, async_worker, meta


class SlowPinner:
    """A driver that takes until `release` to pin, recording the thread that asked."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.threads: list[str] = []
        self.unregistered: list[int] = []

    def register(self, address: int, size: int) -> None:
        self.threads.append(threading.current_thread().name)
        assert self.release.wait(30)

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


@pytest.fixture
def region() -> Iterator[HostRegion]:
    r = HostRegion.create(8 * ROW_BYTES)
    yield r
    r.close()


def test_pinning_runs_beside_the_engine_thread_and_close_waits_for_it(
    region: HostRegion, caplog: pytest.LogCaptureFixture
) -> None:
    streams, pinner = ScriptedStreams(), SlowPinner()
    worker = async_worker(streams, pinner)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="kvtier.transfer"):
        worker.save(meta(region, stores=(ChunkCopy(1, "r", KEYS, ((1,), (2,)), (0, 1)),)))
        transfer = worker.transfer
        assert isinstance(transfer, StreamTransfer) and transfer.pin is not None
        assert not transfer.pin.done  # the step went on while the driver pins
        streams.complete_all()
        report = worker.take_report()
        assert report is not None and report.stores == {1: (1, True)}
        pinner.release.set()
        assert transfer.pin.wait(30) and transfer.pin.seconds is not None
    assert pinner.threads and pinner.threads[0] != threading.current_thread().name
    assert "in the background" in caplog.text and "per GiB" in caplog.text
    worker.shutdown()
    assert len(pinner.unregistered) == 1


def test_close_during_pinning_waits_then_unpins(region: HostRegion) -> None:
    pinner = SlowPinner()
    attached = HostRegion.attach(region.name)
    pin = RegionPin(attached, pinner)
    timer = threading.Timer(0.2, pinner.release.set)
    timer.start()
    assert pin.wait(30) and attached.pinned
    attached.close()
    timer.join()
    assert len(pinner.unregistered) == 1
