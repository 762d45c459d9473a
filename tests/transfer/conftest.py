"""The host region the copy-path tests write rows into."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.host.region import HostRegion
from tests.transfer.helpers import NUM_SLOTS


@pytest.fixture
def region() -> Iterator[HostRegion]:
    """A region of NUM_SLOTS rows of 8 KiB (every case's rows fit), closed after the test."""
    r = HostRegion.create(NUM_SLOTS * 8192)
    yield r
    r.close()
