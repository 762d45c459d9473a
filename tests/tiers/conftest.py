"""Fixtures of the tier tests (the shared ones, regions and contexts, are in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.tiers.p2p_helpers import Peer, peer_maker


@pytest.fixture
def make_peer() -> Iterator[Callable[..., Peer]]:
    """Starts p2p peers (`p2p_helpers.peer_maker`), shut down after the test."""
    with peer_maker() as make:
        yield make
