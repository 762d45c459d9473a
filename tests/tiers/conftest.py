"""Fixtures of the tier tests (the shared ones, regions and contexts, are in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvtier.bench.chaos.valkey_cluster import cluster_binary
from tests.services.redis_cluster import Cluster, start_cluster
from tests.services.redis_server import fresh_prefix
from tests.tiers.p2p.helpers import Peer, peer_maker


@pytest.fixture
def make_peer() -> Iterator[Callable[..., Peer]]:
    """Starts p2p peers (`tests.tiers.p2p.helpers.peer_maker`), shut down after the test."""
    with peer_maker() as make:
        yield make


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[Cluster]:
    """One three-master Valkey (or Redis) Cluster for the session (`services.redis_cluster`). A test
    that kills a node or moves a slot leaves it whole again: every node up, every slot served."""
    if cluster_binary() is None:
        pytest.skip("neither valkey-server nor redis-server is installed")
    cluster = start_cluster()
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster_tier_options(redis_cluster: Cluster) -> dict[str, object]:
    """The redis tier's options for a fresh, empty namespace on the session's cluster (all seeds)."""
    return {"urls": redis_cluster.urls, "key_prefix": fresh_prefix()}
