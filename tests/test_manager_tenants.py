"""Tenant shares in the manager over a real host region and a real tier process: a promotion's host
rows are held by the tenant that asked for it, and count against that tenant's share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.manager import PrefixLookup, TieringManager
from kvtier.policies.tenants import NO_SALT
from tests.conftest import random_key, wait_until
from tests.manager_helpers import ROW, drain, evict_all, start, store_in_host

A = 2  # the tenant id of the first named salt


@pytest.fixture(params=["lru", "arc"])
def manager(request: pytest.FixtureRequest) -> Iterator[TieringManager]:
    m = start(request.param, [{"type": "memory"}], tenants={"a": 0.5})
    yield m
    m.shutdown()


def promote_for(m: TieringManager, keys: list[bytes], tenant: int) -> PrefixLookup:
    """Look `keys` up for `tenant` until the promotion it started has ended."""

    def ended() -> PrefixLookup | None:
        m.poll()
        found = m.lookup_prefix(keys, tenant=tenant)
        return None if found.pending else found

    return wait_until(ended, "the promotion's end")


def test_a_promotion_is_held_by_the_tenant_that_asked(manager: TieringManager) -> None:
    keys = [random_key() for _ in range(3)]
    store_in_host(manager, keys)  # stored without a salt, cascaded to the memory tier
    drain(manager)
    evict_all(manager)
    assert manager.host.lookup(keys) == 0
    assert manager.host.stats().tenant_bytes[A] == 0
    assert promote_for(manager, keys, A).ready == 3
    held = manager.host.stats().tenant_bytes
    assert held[A] == 3 * ROW and held[NO_SALT] == 5 * ROW
    manager.host.check()


def test_reserved_rows_count_for_their_tenant(manager: TieringManager) -> None:
    slots, fitted = manager.reserve_rows([random_key(), random_key()], A)
    assert fitted == 2 and manager.host.stats().tenant_bytes[A] == 2 * ROW
    manager.abandon_rows(list(slots))
    assert manager.host.stats().tenant_bytes == (0, 0, 0)
