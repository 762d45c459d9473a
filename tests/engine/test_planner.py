"""The planner without an engine: lookups, pins, two-phase stores."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.config import KVTierConfig
from kvtier.engine.planner import Planner
from kvtier.engine.request_options import RequestOptions, retention_priority
from kvtier.engine.step import CopyReport
from kvtier.format.layout import SKIP_BLOCK
from kvtier.policies.base import DEFAULT_PRIORITY
from tests.engine.fakes import (
    ROW_BYTES,
    FakeRequest,
    geometry,
)
from tests.integrations.shared_helpers import settle

PROMPT = list(range(100, 114))  # 14 tokens: 3 full chunks of 4


@pytest.fixture
def sched() -> Iterator[Planner]:
    s = Planner(KVTierConfig.from_dict({"cpu_bytes_to_use": 8 * ROW_BYTES}), geometry(), 1)
    blocks: dict[str, list[int]] = {}
    s.bind_block_ids(lambda req_id: (blocks[req_id],))
    s.test_blocks = blocks  # type: ignore[attr-defined]
    yield s
    s.shutdown()


def compute_prompt(s: Planner, req: FakeRequest, block_ids: list[int], ok: bool = True) -> None:
    """One step that computes the whole prompt, then the worker's acknowledgement of its stores."""
    s.test_blocks[req.request_id] = block_ids  # type: ignore[attr-defined]
    assert s.lookup(req, 0) == (0, False)
    meta = s.step({req.request_id: req.num_tokens})
    req.num_computed_tokens = req.num_tokens
    acks = {job.job_id: (1, ok) for job in meta.stores}
    s.copies_done(CopyReport(acks))
    s.finished(req)  # type: ignore[arg-type]


def host_failures(sched: Planner, op: str) -> float:
    return sched.manager.metrics.value("kvtier_failures_total", tier="host", op=op)


def test_store_is_published_only_after_the_worker_copied_it(sched: Planner) -> None:
    req = FakeRequest("a", PROMPT)
    sched.test_blocks["a"] = [7, 3, 5, 9]  # type: ignore[attr-defined]
    assert sched.lookup(req, 0) == (0, False)  # type: ignore[arg-type]
    meta = sched.step({"a": 14})
    (job,) = meta.stores
    assert job.block_ids == ((7,), (3,), (5,)) and len(job.slots) == 3
    keys = sched.hasher.keys(PROMPT)
    assert list(job.keys) == keys
    assert meta.region_name == sched.region_name
    assert all(sched.manager.host.is_pending(k) for k in keys)
    sched.copies_done(
        CopyReport({job.job_id: (1, True)})
    )
    assert all(sched.manager.host.contains(k) for k in keys)


def test_failed_store_frees_its_rows(sched: Planner) -> None:
    compute_prompt(sched, FakeRequest("a", PROMPT), [4, 1, 2, 3], ok=False)
    assert sched.manager.host.stats().used == 0
    assert host_failures(sched, "store") == 3


def test_chunks_without_room_wait_for_the_next_step(sched: Planner) -> None:
    a, b = list(range(200, 214)), list(range(300, 314))
    compute_prompt(sched, FakeRequest("a", a), [4, 1, 2, 3])
    compute_prompt(sched, FakeRequest("b", b), [4, 5, 6, 7])
    host = sched.manager.host
    pinned = sched.hasher.keys(a) + sched.hasher.keys(b)
    assert host.pin(pinned) is not None  # 6 of 8 rows pinned, as by cascades in flight
    req = FakeRequest("c", PROMPT)
    sched.test_blocks["c"] = [8, 9, 10, 11]  # type: ignore[attr-defined]
    assert sched.lookup(req, 0) == (0, False)  # type: ignore[arg-type]
    (job,) = sched.step({"c": 14}).stores
    assert job.block_ids == ((8,), (9,)) and list(job.keys) == sched.hasher.keys(PROMPT)[:2]
    assert host_failures(sched, "store") == 1
    req.num_computed_tokens = 14
    sched.copies_done(
        CopyReport({job.job_id: (1, True)})
    )
    host.unpin(pinned)
    (job,) = sched.step({"c": 1}).stores
    assert job.block_ids == ((10,),) and list(job.keys) == sched.hasher.keys(PROMPT)[2:]


def test_lookup_goes_past_the_device_hit_and_never_offers_the_last_token(
    sched: Planner,
) -> None:
    compute_prompt(sched, FakeRequest("a", PROMPT), [4, 1, 2, 3])
    assert sched.lookup(FakeRequest("b", PROMPT), 0) == (12, True)  # type: ignore[arg-type]
    assert sched.lookup(FakeRequest("c", PROMPT), 4) == (8, True)  # type: ignore[arg-type]
    # 12 tokens: 3 chunks are stored, but the last token must be computed: 2 chunks.
    assert sched.lookup(FakeRequest("d", PROMPT[:12]), 0) == (8, True)  # type: ignore[arg-type]
    assert sched.lookup(FakeRequest("e", PROMPT), 12) == (0, False)  # type: ignore[arg-type]
    other = [1, *PROMPT[1:]]
    assert sched.lookup(FakeRequest("f", other), 0) == (0, False)  # type: ignore[arg-type]


def test_load_pins_rows_until_the_worker_finished(sched: Planner) -> None:
    compute_prompt(sched, FakeRequest("a", PROMPT), [4, 1, 2, 3])
    req = FakeRequest("b", PROMPT)
    keys = sched.hasher.keys(PROMPT)
    assert sched.lookup(req, 4) == (8, True)  # type: ignore[arg-type]
    sched.allocated(req, ([0, 11, 12, 13],), 8)  # type: ignore[arg-type]
    assert [sched.manager.host.pin_count(k) for k in keys] == [0, 1, 1]
    meta = sched.step({})
    (load,) = meta.loads
    assert load.req_id == "b" and load.block_ids == ((11,), (12,)) and list(load.keys) == keys[1:]
    assert sched.step({}).loads == ()
    sched.copies_done(None, {"b"})
    assert [sched.manager.host.pin_count(k) for k in keys] == [0, 0, 0]


def test_a_synchronous_load_is_released_when_the_workers_reported_it() -> None:
    """With `sync_loads`, a load the host tier alone serves is synchronous (its request is scheduled
    in the same step) and its pins go with the workers' report: vLLM sends no finished request."""
    config = KVTierConfig.from_dict({"cpu_bytes_to_use": 8 * ROW_BYTES})
    s = Planner(config, geometry(), 1, sync_loads=True)
    blocks: dict[str, list[int]] = {}
    s.bind_block_ids(lambda req_id: (blocks[req_id],))
    s.test_blocks = blocks  # type: ignore[attr-defined]
    try:
        compute_prompt(s, FakeRequest("a", PROMPT), [4, 1, 2, 3])
        req = FakeRequest("b", PROMPT)
        keys = s.hasher.keys(PROMPT)
        assert s.lookup(req, 4) == (8, False)  # type: ignore[arg-type]
        blocks["b"] = [0, 11, 12, 13]
        s.allocated(req, (blocks["b"],), 8)  # type: ignore[arg-type]
        (load,) = s.step({"b": 6}).loads
        assert load.sync and load.block_ids == ((11,), (12,))
        assert [s.manager.host.pin_count(k) for k in keys] == [0, 1, 1]
        copied = CopyReport({}, {load.job_id: (1, True)})
        s.copies_done(copied)
        assert [s.manager.host.pin_count(k) for k in keys] == [0, 0, 0]
    finally:
        s.shutdown()


def test_a_finished_request_makes_its_prefix_the_most_recent_in_the_host_tier(
    sched: Planner,
) -> None:
    """Device hits count too: a prefix the device served is what the next turn needs from the host
    tier once the device evicts it (vLLM's own CPU tier ranks the same way)."""
    compute_prompt(sched, FakeRequest("a", PROMPT), [4, 1, 2, 3])
    keys, host = sched.hasher.keys(PROMPT), sched.manager.host
    others = [bytes([i]) * 16 for i in range(5)]  # stored after the prompt: the host tier is full
    assert host.reserve(others) is not None
    host.commit(others, success=True)
    req = FakeRequest("b", PROMPT)
    assert sched.lookup(req, 12) == (0, False)  # type: ignore[arg-type]
    sched.allocated(req, ([4, 1, 2, 3],), 0)  # type: ignore[arg-type]
    sched.finished(req)  # type: ignore[arg-type]
    host.take_events()
    assert host.reserve([b"new" * 8]) is not None
    (removed,) = host.take_events()
    assert list(removed.keys) == others[:1] and host.lookup(keys) == 3


def test_one_off_prompts_do_not_evict_a_hot_prefix_under_frequency_admission() -> None:
    config = KVTierConfig.from_dict({"cpu_bytes_to_use": 8 * ROW_BYTES, "admission_policy": "frequency"})
    s = Planner(config, geometry(), 1)
    blocks: dict[str, list[int]] = {}
    s.bind_block_ids(lambda req_id: (blocks[req_id],))
    s.test_blocks = blocks  # type: ignore[attr-defined]
    try:
        m = s.manager.metrics.value
        hot = s.hasher.keys(PROMPT)
        compute_prompt(s, FakeRequest("hot0", PROMPT), [8, 1, 2, 3])
        assert s.manager.host.lookup(hot) == 3  # first sighting: stored, on probation
        assert all(s.manager.host.on_probation(key) for key in hot)
        again = FakeRequest("hot1", PROMPT)
        assert s.lookup(again, 0) == (12, True)  # type: ignore[arg-type]
        assert not any(s.manager.host.on_probation(key) for key in hot)  # reused: settled
        assert m("kvtier_probation_reused_chunks_total", tier="host") == 3
        for i in range(20):  # one-off prompts: on probation, they push out each other only
            compute_prompt(s, FakeRequest(f"once{i}", [1000 + i, *PROMPT[1:]]), [4, 5, 6, 7])
        assert s.manager.host.lookup(hot) == 3
        once = s.hasher.keys([1019, *PROMPT[1:]])
        assert s.manager.host.lookup(once) == 3 and s.manager.host.on_probation(once[0])
        assert m("kvtier_probation_chunks_total", tier="host", reason="frequency") == 3 + 20 * 3
        assert m("kvtier_rejected_chunks_total", tier="host", reason="frequency") == 0
        s.manager.host.check()
    finally:
        s.shutdown()


def test_stores_carry_the_request_priority_and_reuse_raises_it(sched: Planner) -> None:
    low = FakeRequest("a", PROMPT, kv_transfer_params={"kvtier": {"priority": 10}})
    compute_prompt(sched, low, [4, 1, 2, 3])
    keys = sched.hasher.keys(PROMPT)
    assert [sched.manager.host.priority_of(k) for k in keys] == [10, 10, 10]
    urgent = FakeRequest("b", PROMPT, priority=-30)  # vLLM serves it first: retention 80
    assert sched.lookup(urgent, 4) == (8, True)  # type: ignore[arg-type]
    sched.allocated(urgent, ([0, 11, 12, 13],), 8)  # type: ignore[arg-type]
    assert [sched.manager.host.priority_of(k) for k in keys] == [10, 80, 80]


def test_chunks_filled_during_decode_are_stored_when_computed(sched: Planner) -> None:
    req = FakeRequest("a", PROMPT[:6])  # one full chunk, then decode
    sched.test_blocks["a"] = [4, 2]  # type: ignore[attr-defined]
    assert sched.lookup(req, 0) == (0, False)  # type: ignore[arg-type]
    (first,) = sched.step({"a": 6}).stores
    req.num_computed_tokens = 6
    req.output_token_ids = [7]  # sampled; its KV is computed by the next step
    assert sched.step({"a": 1}).stores == ()
    req.num_computed_tokens = 7
    req.output_token_ids = [7, 8, 9]  # with one draft token: not final, not stored
    (second,) = sched.step({"a": 2}, {"a": [9]}).stores
    assert second.block_ids == ((2,),)
    assert list(first.keys + second.keys) == sched.hasher.keys([*PROMPT[:6], 7, 8])


def test_per_request_options_skip_load_and_store(sched: Planner) -> None:
    compute_prompt(sched, FakeRequest("a", PROMPT), [4, 1, 2, 3])
    no_load = FakeRequest("b", PROMPT, kv_transfer_params={"kvtier": {"skip_load": True}})
    assert sched.lookup(no_load, 0) == (0, False)  # type: ignore[arg-type]
    other = [9, *PROMPT[1:]]
    no_store = FakeRequest("c", other, kv_transfer_params={"kvtier": {"skip_store": True}})
    sched.test_blocks["c"] = [5, 6, 7, 8]  # type: ignore[attr-defined]
    assert sched.lookup(no_store, 0) == (0, False)  # type: ignore[arg-type]
    assert sched.step({"c": 14}).stores == ()


def test_malformed_options_fall_back_to_defaults() -> None:
    opts = RequestOptions.from_params(
        "r", {"kvtier": {"skip_load": "yes", "priority": True, "load_tiers": ["fs"], "bogus": 1}}
    )
    assert opts == RequestOptions(load_tiers=frozenset({"fs"}))
    assert RequestOptions.from_params("r", {"kvtier": ["skip_load"]}) == RequestOptions()
    assert RequestOptions.from_params("r", None) == RequestOptions()
    assert RequestOptions.from_params("r", {"kvtier": {"priority": 3}}).priority == 3
    for bad in (-1, 101, 50.0):
        assert RequestOptions.from_params("r", {"kvtier": {"priority": bad}}).priority is None


def test_retention_priority_from_the_option_else_vllms_priority() -> None:
    assert retention_priority(RequestOptions(priority=7), vllm_priority=-20) == 7
    assert retention_priority(RequestOptions(), vllm_priority=0) == DEFAULT_PRIORITY == 50
    assert retention_priority(RequestOptions(), vllm_priority=-20) == 70  # served first: kept longer
    assert retention_priority(RequestOptions(), vllm_priority=10) == 40
    assert retention_priority(RequestOptions(), vllm_priority=-500) == 100
    assert retention_priority(RequestOptions(), vllm_priority=500) == 0


def test_host_admission_gate_frequency_and_priority() -> None:
    config = KVTierConfig.from_dict({
        "cpu_bytes_to_use": 8 * ROW_BYTES, "admission_policy": ["frequency", "priority"],
        "host_min_retention_priority": 20})
    s = Planner(config, geometry(), 1)
    blocks: dict[str, list[int]] = {}
    s.bind_block_ids(lambda req_id: (blocks[req_id],))
    s.test_blocks = blocks  # type: ignore[attr-defined]
    try:
        m = s.manager.metrics.value
        compute_prompt(s, FakeRequest("first", PROMPT), [4, 1, 2, 3])
        assert s.manager.host.stats().ready == 3  # seen once: admitted on probation
        assert m("kvtier_probation_chunks_total", tier="host", reason="frequency") == 3
        assert m("kvtier_admitted_chunks_total", tier="host") == 3
        other = [7, *PROMPT[1:]]
        low = FakeRequest("low", other, kv_transfer_params={"kvtier": {"priority": 10}})
        compute_prompt(s, low, [4, 1, 2, 3])
        assert s.manager.host.stats().ready == 3
        assert m("kvtier_rejected_chunks_total", tier="host", reason="priority") == 3
        assert m("kvtier_admitted_chunks_total", tier="host") == 3
    finally:
        s.shutdown()


def test_requests_that_cannot_be_keyed_are_left_alone(sched: Planner) -> None:
    req = FakeRequest("mm", PROMPT, mm_features=["image"])
    assert sched.lookup(req, 0) == (0, False)  # type: ignore[arg-type]
    assert sched.step({"mm": 14}).stores == ()


def test_worker_metadata_aggregates_over_ranks() -> None:
    a = CopyReport({1: (1, True), 2: (1, True)})
    b = CopyReport({1: (1, False), 3: (1, True)})
    merged = a.merged(b)
    assert isinstance(merged, CopyReport)
    assert merged.stores == {1: (2, False), 2: (1, True), 3: (1, True)}


def test_chunks_of_two_blocks() -> None:
    config = KVTierConfig.from_dict({"cpu_bytes_to_use": 8 * ROW_BYTES, "blocks_per_chunk": 2})
    s = Planner(config, geometry(blocks_per_chunk=2), 1)
    try:
        s.bind_block_ids({"a": ([6, 1, 8, 3],)}.__getitem__)
        prompt = list(range(17))  # two full chunks of 8 tokens
        req = FakeRequest("a", prompt)
        assert s.lookup(req, 0) == (0, False)  # type: ignore[arg-type]
        (job,) = s.step({"a": 17}).stores
        assert job.block_ids == ((6, 1), (8, 3))
        acks = CopyReport({job.job_id: (1, True)})
        s.copies_done(acks)
        assert s.lookup(FakeRequest("b", prompt), 0) == (16, True)  # type: ignore[arg-type]
        assert s.lookup(FakeRequest("c", prompt), 8) == (8, True)  # type: ignore[arg-type]
    finally:
        s.shutdown()


@pytest.mark.parametrize("ok", [True, False])
def test_a_device_hit_inside_a_chunk_loads_the_rest_of_it(ok: bool) -> None:
    """Chunks of two 4-token blocks; the device holds the first block: the load ends on a chunk
    boundary, skips the block the device holds, and the split counts each token once."""
    config = KVTierConfig.from_dict({"cpu_bytes_to_use": 8 * ROW_BYTES, "blocks_per_chunk": 2})
    s = Planner(config, geometry(blocks_per_chunk=2), 1)
    try:
        s.bind_block_ids({"a": ([6, 1, 8, 3, 9],)}.__getitem__)
        prompt = list(range(21))  # 2 full chunks of 8 tokens, then 5 more
        a = FakeRequest("a", prompt)
        assert s.lookup(a, 0) == (0, False)  # type: ignore[arg-type]
        (job,) = s.step({"a": 21}).stores
        s.copies_done(CopyReport({job.job_id: (1, True)}))
        keys = s.hasher.keys(prompt)
        for hit, loaded in ((4, 12), (12, 4)):
            assert s.lookup(FakeRequest(f"h{hit}", prompt), hit) == (loaded, True)  # type: ignore[arg-type]
        b = FakeRequest("b", prompt)
        assert s.lookup(b, 4) == (12, True)  # type: ignore[arg-type]
        s.allocated(b, ([6, 21, 22, 23],), 12)  # type: ignore[arg-type]
        (load,) = s.step({}).loads
        assert load.block_ids == ((SKIP_BLOCK, 21), (22, 23)) and list(load.keys) == keys
        assert s.hit_sources(b) == {"host": 12}  # type: ignore[arg-type]
        worker_meta = CopyReport(loads={load.job_id: (1, ok)})
        s.copies_done(
            worker_meta, {"b"})
        split = {"device": 4, "host": 12, "recomputed": 5} if ok else \
            {"device": 4, "host": 0, "recomputed": 17}
        assert s.finished(b) == {"kvtier": {"tokens": split}}  # type: ignore[arg-type]
        # A hit that is not a whole number of engine blocks is never continued.
        assert s.lookup(FakeRequest("c", prompt), 6) == (0, False)  # type: ignore[arg-type]
    finally:
        s.shutdown()


def test_prompt_tokens_split_by_source_and_metrics(sched: Planner) -> None:
    compute_prompt(sched, FakeRequest("a", PROMPT), [4, 1, 2, 3])
    req = FakeRequest("b", PROMPT)
    assert sched.lookup(req, 4) == (8, True)  # type: ignore[arg-type]
    sched.allocated(req, ([0, 11, 12, 13],), 8)  # type: ignore[arg-type]
    meta = sched.step({})
    (load,) = meta.loads
    worker_meta = CopyReport(loads={load.job_id: (1, True)}, seconds={load.job_id: 0.5})
    sched.copies_done(
        worker_meta, {"b"}
    )
    assert sched.hit_sources(req) == {"host": 8}  # type: ignore[arg-type]
    params = sched.finished(req)  # type: ignore[arg-type]
    assert params == {"kvtier": {"tokens": {"device": 4, "host": 8, "recomputed": 2}}}
    assert sched.accounting.finished["b"] == {"device": 4, "host": 8, "recomputed": 2}
    m = sched.accounting.metrics
    assert m.value("kvtier_prompt_tokens_total", source="host") == 8
    assert m.value("kvtier_prompt_tokens_total", source="device") == 4
    assert m.value("kvtier_prompt_tokens_total", source="recomputed") == 14 + 2  # "a" computed all
    assert m.value("kvtier_transfer_chunks_total", tier="host", op="store") == 3
    assert m.value("kvtier_transfer_bytes_total", tier="host", op="store") == 3 * ROW_BYTES
    assert m.value("kvtier_transfer_chunks_total", tier="host", op="load") == 2
    assert m.value("kvtier_transfer_seconds_total", tier="host", op="load") == 0.5
    assert m.value("kvtier_hit_chunks_total", tier="host") == 2
    assert m.value("kvtier_lookup_chunks_total") == 2  # "a" was never allocated by this driver


def test_a_failed_load_is_counted_as_recomputed(sched: Planner) -> None:
    compute_prompt(sched, FakeRequest("a", PROMPT), [4, 1, 2, 3])
    req = FakeRequest("b", PROMPT)
    assert sched.lookup(req, 0) == (12, True)  # type: ignore[arg-type]
    sched.allocated(req, ([10, 11, 12, 13],), 12)  # type: ignore[arg-type]
    (load,) = sched.step({}).loads
    worker_meta = CopyReport(loads={load.job_id: (1, False)})
    sched.copies_done(
        worker_meta, {"b"}
    )
    assert sched.finished(req) == {  # type: ignore[arg-type]
        "kvtier": {"tokens": {"device": 0, "host": 0, "recomputed": 14}}
    }
    assert sched.accounting.metrics.value("kvtier_failures_total", tier="host", op="load") == 3


def test_reset_cache_empties_the_host_tier(sched: Planner) -> None:
    compute_prompt(sched, FakeRequest("a", PROMPT), [4, 1, 2, 3])
    assert sched.manager.host.stats().ready == 3
    assert sched.reset_cache() is True
    assert sched.manager.host.stats().ready == 0
    assert sched.lookup(FakeRequest("b", PROMPT), 0) == (0, False)  # type: ignore[arg-type]


def memory_tier_scheduler(**extra: object) -> Planner:
    """A planner over a host tier of 8 rows and a real memory tier process named "mem". A lookup
    waits for the tier's answer however loaded the machine is: these tests are about what the
    planner does with an answer, not about an answer that comes late."""
    config = KVTierConfig.from_dict({
        "cpu_bytes_to_use": 8 * ROW_BYTES, "secondary_tiers": [{"type": "memory", "name": "mem"}],
        "tier_lookup_wait_s": 30.0, **extra})
    s = Planner(config, geometry(), 1)
    blocks: dict[str, list[int]] = {}
    s.bind_block_ids(lambda req_id: (blocks[req_id],))
    s.test_blocks = blocks  # type: ignore[attr-defined]
    return s


def test_operator_signals_each_step(tmp_path: Path) -> None:
    s = memory_tier_scheduler(control_dir=str(tmp_path / "ctl"))
    try:
        compute_prompt(s, FakeRequest("a", PROMPT), [4, 1, 2, 3])
        s.step({})
        m = s.manager.metrics.value
        assert m("kvtier_tier_up", tier="mem") == 1 and m("kvtier_tier_restarts", tier="mem") == 0
        assert m("kvtier_tier_enabled", tier="mem") == 1
        assert m("kvtier_jobs_in_flight", tier="mem") == s.manager.jobs_in_flight()["mem"]
        assert m("kvtier_host_pinned_chunks") == s.manager.host.stats().pinned
        assert m("kvtier_config_info", eviction_policy="lru", admission_policy="all",
                 tiers="mem:memory", cpu_bytes_to_use=str(8 * ROW_BYTES), blocks_per_chunk="1") == 1
        assert s.ops.control.path.parent == tmp_path / "ctl"
    finally:
        s.shutdown()
    assert not list((tmp_path / "ctl").glob("*.sock"))  # the socket goes with the engine


@pytest.mark.parametrize("wait_s", [0.0, 10.0])
def test_a_promotion_waited_for_loads_in_the_step_of_its_lookup(wait_s: float) -> None:
    """With `promotion_wait_s`, a prefix only a secondary tier holds is promoted and offered in the
    step of its first lookup; without, that lookup says "ask again" (None) and the next offers it."""
    s = memory_tier_scheduler(promotion_wait_s=wait_s)
    try:
        compute_prompt(s, FakeRequest("a", PROMPT), [4, 1, 2, 3])
        settle(s)
        assert s.reset_cache() and s.manager.host.stats().ready == 0
        req = FakeRequest("b", PROMPT)
        first = s.lookup(req, 0)  # type: ignore[arg-type]
        if wait_s:
            assert first == (12, True)
        else:
            assert first == (None, False)
            settle(s)
            assert s.lookup(req, 0) == (12, True)  # type: ignore[arg-type]
        s.allocated(req, ([10, 11, 12, 13],), 12)  # type: ignore[arg-type]
        (load,) = s.step({}).loads
        assert list(load.keys) == s.hasher.keys(PROMPT)
        assert s.hit_sources(req) == {"mem": 12}  # type: ignore[arg-type]
    finally:
        s.shutdown()
