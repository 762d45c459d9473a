"""Tenant shares of a secondary tier through the real planner, over a real memory tier process of 8
rows: a tenant's working set in that tier survives another tenant's flood once the flooder holds
its share of the full tier (its refusals counted), and is lost without shares; what each tenant
holds there is `kvtier_tenant_bytes{tier}`."""

from __future__ import annotations

from typing import Any

from kvtier.engine.planner import Planner
from tests.conftest import wait_until
from tests.engine.fakes import ROW_BYTES, FakeRequest
from tests.engine.test_planner_tenants import FLOOD, WORKING_SET, compute_prompt, flood, planner

TIER_ROWS = 8
MEM = {"type": "memory", "name": "mem", "max_bytes": TIER_ROWS * ROW_BYTES}
SHARES = {"a": {"host": 0.5, "mem": 0.5}, "b": {"mem": 0.5}}
"""Half the memory tier each for `a` (label t1) and `b` (t2)."""
CHUNKS = 3  # of each 14-token prompt: 3 full chunks of 4 tokens


def tier_bytes(s: Planner, tenant: str) -> float:
    return s.manager.metrics.value("kvtier_tenant_bytes", tenant=tenant, tier="mem")


def refused(s: Planner) -> float:
    return s.manager.metrics.value("kvtier_rejected_chunks_total", tier="mem", reason="tenant_shares")


def stored_in_mem(s: Planner, tenant: str, rows: int) -> None:
    """Wait until the memory tier reported `rows` of `tenant`'s chunks stored, and its capacity."""

    def done() -> bool:
        s.step({})  # polls the tiers and sets each tier's fill
        m = s.manager.metrics.value
        return tier_bytes(s, tenant) == rows * ROW_BYTES and m("kvtier_capacity_bytes", tier="mem") > 0

    wait_until(done, f"{rows} rows of {tenant} stored in the memory tier")


def settle(s: Planner) -> None:
    """Wait until every store to the memory tier ended."""

    def ended() -> bool:
        s.step({})
        return s.manager.in_flight == 0

    wait_until(ended, "the stores' end")


def working_set_in_mem_after_a_flood(tenants: dict[str, Any]) -> tuple[int, Planner]:
    """Tokens of `a`'s working set a lookup finds (in the memory tier: the host tier is cleared)
    after `b`'s flood of 30 chunks, and the planner (shut down) to read the metrics of."""
    with planner(secondary_tiers=[MEM], tenants=tenants, tier_lookup_wait_s=30.0,
                 promotion_wait_s=30.0) as s:
        compute_prompt(s, FakeRequest("a-0", WORKING_SET, cache_salt="a"))
        stored_in_mem(s, "t1", CHUNKS)
        flood(s, "b")
        settle(s)
        assert s.reset_cache() and s.manager.host_stats().ready == 0
        found, _ = s.lookup(FakeRequest("a-1", WORKING_SET, cache_salt="a"), 0)  # type: ignore[arg-type]
        return found or 0, s


def test_a_working_set_survives_a_flood_of_another_tenant_held_to_its_share_of_the_tier() -> None:
    found, s = working_set_in_mem_after_a_flood(SHARES)
    assert found == CHUNKS * 4  # promoted from the memory tier
    # `b` filled the room the tier had (its share and the row `a` leaves), then was refused there.
    assert tier_bytes(s, "t2") == (TIER_ROWS - CHUNKS) * ROW_BYTES
    assert tier_bytes(s, "t1") == CHUNKS * ROW_BYTES
    assert refused(s) == FLOOD * CHUNKS - (TIER_ROWS - CHUNKS)
    assert s.manager.metrics.value("kvtier_rejected_chunks_total", tier="host", reason="tenant_shares") == 0


def test_without_shares_of_the_tier_the_flood_pushes_the_working_set_out() -> None:
    found, s = working_set_in_mem_after_a_flood({"a": 0.5})  # a share of the host tier only
    assert found == 0
    assert refused(s) == 0
    assert tier_bytes(s, "t1") == 0  # still counted by tenant: the flood took the whole tier
    assert s.manager.metrics.value("kvtier_tenant_bytes", tenant="other", tier="mem") == TIER_ROWS * ROW_BYTES


def test_a_tenant_under_its_share_of_a_full_tier_is_admitted() -> None:
    """After the flood `b` holds 5 of the 8 rows and `a` 3, under its 4: `a`'s next chunk is
    admitted into the full tier, the two after it refused. The tier makes room by its own order
    (here its least recently used chunk, one of `a`'s: shares do not reorder a tier's evictions)."""
    with planner(secondary_tiers=[MEM], tenants=SHARES) as s:
        compute_prompt(s, FakeRequest("a-0", WORKING_SET, cache_salt="a"))
        stored_in_mem(s, "t1", CHUNKS)
        flood(s, "b")
        before = refused(s)
        compute_prompt(s, FakeRequest("a-1", [7, *WORKING_SET[1:]], cache_salt="a"))
        assert refused(s) == before + CHUNKS - 1
        settle(s)
        assert tier_bytes(s, "t2") == (TIER_ROWS - CHUNKS) * ROW_BYTES
