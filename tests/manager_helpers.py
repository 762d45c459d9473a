"""Driving a TieringManager over a real host region and real tier processes, for the tests."""

from __future__ import annotations

import os
import time

import pytest

from kvtier.config import KVTierConfig
from kvtier.engine.tiering_start import start_manager
from kvtier.manager import PrefixLookup, TieringManager
from tests.conftest import LAYOUT_FP, random_key

ROW = 2 * 4096
HOST_SLOTS = 8


def start(policy: str, tiers: list[dict], **extra) -> TieringManager:
    cfg = KVTierConfig.from_dict(
        {"cpu_bytes_to_use": ROW * HOST_SLOTS, "eviction_policy": policy,
         "secondary_tiers": tiers, **extra}
    )
    return start_manager(cfg, ROW, LAYOUT_FP)


def store_in_host(m: TieringManager, keys: list[bytes]) -> dict[bytes, bytes]:
    """What the engine does after a device → host copy: write rows, publish, cascade."""
    slots = m.host.reserve(keys)
    assert slots is not None
    rows = {}
    for key, slot in slots.items():
        rows[key] = os.urandom(ROW)
        m.host.slot_view(slot)[:] = rows[key]
    m.host.commit(list(slots), success=True)
    m.cascade(list(slots))
    return rows


def drain(m: TieringManager, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while m.in_flight:
        m.poll()
        if time.monotonic() > deadline:
            pytest.fail(f"{m.in_flight} transfers still in flight")
        time.sleep(0.002)


def settle(
    m: TieringManager, keys: list[bytes], tiers=None, timeout_s: float = 10, promote: bool = True
) -> PrefixLookup:
    deadline = time.monotonic() + timeout_s
    while True:
        m.poll()
        found = m.lookup_prefix(keys, tiers, promote)
        if not found.pending:
            return found
        if time.monotonic() > deadline:
            pytest.fail("lookup still pending")
        time.sleep(0.002)


def chunks(m: TieringManager, tier: str, op: str) -> float:
    """Chunks the manager moved for `tier` and `op`, as its metrics count them."""
    return m.metrics.value("kvtier_transfer_chunks_total", tier=tier, op=op)


def changes(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The samples of a metrics snapshot that moved, by how much."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def evict_all(m: TieringManager) -> None:
    store_in_host(m, [random_key() for _ in range(HOST_SLOTS)])
    drain(m)
