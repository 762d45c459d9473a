"""Tenant shares through the real planner and host tier: a tenant's reused working set within its
share survives another tenant's flood of one-off prompts (without shares it does not), and the
per-tenant metrics keep their labels bounded by the config."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.engine.planner import Planner
from kvtier.engine.step import CopyReport
from tests.engine.fakes import ROW_BYTES, FakeRequest, geometry

SLOTS = 8
WORKING_SET = list(range(100, 114))  # 14 tokens: 3 full chunks of 4
FLOOD = 10  # one-off prompts of 3 chunks each: 30 chunks, nearly 4 times the host tier's 8 rows


@contextmanager
def planner(**extra: Any) -> Iterator[Planner]:
    s = Planner(KVTierConfig.from_dict({"cpu_bytes_to_use": SLOTS * ROW_BYTES, **extra}), geometry(), 1)
    s.bind_block_ids(lambda req_id: ([4, 1, 2, 3],))
    try:
        yield s
    finally:
        s.shutdown()


def compute_prompt(s: Planner, req: FakeRequest) -> None:
    """One step that computes the whole prompt, then the worker's acknowledgement of its stores."""
    assert s.lookup(req, 0) == (0, False)  # type: ignore[arg-type]
    meta = s.step({req.request_id: req.num_tokens})
    req.num_computed_tokens = req.num_tokens
    s.copies_done(CopyReport({job.job_id: (1, True) for job in meta.stores}))
    s.finished(req)  # type: ignore[arg-type]


def reuse(s: Planner, req: FakeRequest) -> dict[str, int]:
    """A request whose prompt the host tier holds: its load, then its split by source."""
    assert s.lookup(req, 0) == (12, True)  # type: ignore[arg-type]
    s.allocated(req, ([5, 6, 7, 8],), 12)  # type: ignore[arg-type]
    s.step({})
    s.copies_done(None, {req.request_id})
    req.num_computed_tokens = req.num_tokens
    params = s.finished(req)  # type: ignore[arg-type]
    assert params is not None
    split: dict[str, int] = params["kvtier"]["tokens"]
    return split


def flood(s: Planner, salt: str | None) -> None:
    for i in range(FLOOD):
        prompt = [1000 * (i + 1) + t for t in range(14)]
        compute_prompt(s, FakeRequest(f"flood-{i}", prompt, cache_salt=salt))


def working_set_hit_after_a_flood(**extra: Any) -> int:
    """Tokens the working set of tenant `a` loads from the host tier after tenant `b`'s flood."""
    with planner(**extra) as s:
        compute_prompt(s, FakeRequest("a-0", WORKING_SET, cache_salt="a"))
        assert reuse(s, FakeRequest("a-1", WORKING_SET, cache_salt="a"))["host"] == 12
        flood(s, "b")
        found, _ = s.lookup(FakeRequest("a-2", WORKING_SET, cache_salt="a"), 0)  # type: ignore[arg-type]
        return found or 0


def test_a_working_set_within_its_share_keeps_its_hits_through_a_flood_and_loses_them_without() -> None:
    assert working_set_hit_after_a_flood(tenants={"a": 0.5}) == 12
    assert working_set_hit_after_a_flood() == 0


def test_tenant_metrics_are_labelled_by_configured_names_then_other_and_none() -> None:
    with planner(tenants={"a": 0.5, "default": 0.25}) as s:
        compute_prompt(s, FakeRequest("a-0", WORKING_SET, cache_salt="a"))
        assert reuse(s, FakeRequest("a-1", WORKING_SET, cache_salt="a")) == {
            "device": 0, "host": 12, "recomputed": 2}
        compute_prompt(s, FakeRequest("b-0", [7, *WORKING_SET[1:]], cache_salt="unnamed-b"))
        compute_prompt(s, FakeRequest("n-0", [8, *WORKING_SET[1:]]))
        s.step({})
        m = s.manager.metrics
        assert m.value("kvtier_tenant_prompt_tokens_total", tenant="t1", source="host") == 12
        assert m.value("kvtier_tenant_prompt_tokens_total", tenant="t1", source="recomputed") == 14 + 2
        assert m.value("kvtier_tenant_prompt_tokens_total", tenant="other", source="recomputed") == 14
        assert m.value("kvtier_tenant_prompt_tokens_total", tenant="none", source="recomputed") == 14
        assert m.value("kvtier_tenant_bytes", tenant="t1", tier="host") == 3 * ROW_BYTES
        # `other` stored 3 rows while rows were free (over its 2), then gave one back to `none`'s store.
        assert m.value("kvtier_tenant_bytes", tenant="other", tier="host") == 2 * ROW_BYTES
        assert m.value("kvtier_tenant_bytes", tenant="none", tier="host") == 3 * ROW_BYTES
        labels = {key for key in m.snapshot() if key.startswith("kvtier_tenant_")}
        assert not any("unnamed-b" in key or 'tenant="a"' in key for key in labels)  # no salt shown
        assert {key.split('tenant="')[1].split('"')[0] for key in labels} == {"t1", "other", "none"}


def test_without_tenants_no_tenant_metric_is_counted() -> None:
    with planner() as s:
        compute_prompt(s, FakeRequest("a-0", WORKING_SET, cache_salt="a"))
        s.step({})
        assert not [key for key in s.manager.metrics.snapshot() if key.startswith("kvtier_tenant_")]
