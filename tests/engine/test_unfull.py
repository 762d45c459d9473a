"""Unfull chunks without an engine: a finished request's blocks past its last full chunk are
stored under their own key, and a longer request continuing the prefix loads them.

Chunks of four 4-token blocks (16 tokens). Request "a" has 30 tokens: one full chunk and three
whole blocks (12 tokens) of the next, then two tokens that fill no block.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.config import KVTierConfig
from kvtier.engine.planner import Planner
from kvtier.engine.step import CopyReport
from kvtier.format.layout import SKIP_BLOCK
from tests.engine.fakes import ROW_BYTES, FakeRequest, geometry
from tests.integrations.shared_helpers import settle

BPC = 4
PROMPT = list(range(100, 130))  # 30 tokens
A_BLOCKS = [7, 3, 5, 9, 11, 12, 13, 14]


def planner(**extra: object) -> Planner:
    config = KVTierConfig.from_dict({"cpu_bytes_to_use": 8 * ROW_BYTES, "blocks_per_chunk": BPC,
                                     "tier_lookup_wait_s": 30.0, **extra})
    s = Planner(config, geometry(blocks_per_chunk=BPC), 1)
    blocks: dict[str, list[int]] = {"a": A_BLOCKS}
    s.bind_block_ids(lambda req_id: (blocks[req_id],))
    return s


@pytest.fixture
def sched() -> Iterator[Planner]:
    s = planner()
    yield s
    s.shutdown()


def run_a(s: Planner, prompt: list[int] = PROMPT, skip_store: bool = False) -> tuple[bytes, ...]:
    """Compute request "a" whole, finish it, and store what it leaves: the keys of its stores, in
    order (the full chunk's step, then the tail's)."""
    params = {"kvtier": {"skip_store": True}} if skip_store else None
    a = FakeRequest("a", prompt, kv_transfer_params=params)
    assert s.lookup(a, 0) == (0, False)  # type: ignore[arg-type]
    stored: list[bytes] = []
    plan = s.step({"a": len(prompt)})
    a.num_computed_tokens = len(prompt)
    s.copies_done(CopyReport({job.job_id: (1, True) for job in plan.stores}))
    stored += [k for job in plan.stores for k in job.keys]
    s.finished(a)  # type: ignore[arg-type]
    plan = s.step({})
    s.copies_done(CopyReport({job.job_id: (1, True) for job in plan.stores}))
    stored += [k for job in plan.stores for k in job.keys]
    if plan.stores:
        (job,) = plan.stores
        s.test_tail_blocks = job.block_ids  # type: ignore[attr-defined]
        assert plan.releases == ("a",)  # planned: the engine may free its blocks once copied
    return tuple(stored)


def unfull_key(s: Planner, tokens: list[int]) -> bytes:
    return s.hasher.unfull_key(s.hasher.keys(PROMPT)[0], tokens[16:])


def test_a_finished_request_stores_its_unfull_chunk_and_a_longer_prompt_loads_it(sched: Planner) -> None:
    full = sched.hasher.keys(PROMPT)
    assert run_a(sched) == (full[0], unfull_key(sched, PROMPT[:28]))
    assert sched.test_tail_blocks == ((11, 12, 13, 13),)  # type: ignore[attr-defined]  # the third again
    longer = PROMPT + list(range(500, 520))  # 50 tokens: chunk 1 is full here, and a miss
    b = FakeRequest("b", longer)
    assert sched.lookup(b, 0) == (28, True)  # type: ignore[arg-type]
    sched.allocated(b, ([20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32],), 28)  # type: ignore[arg-type]
    (load,) = sched.step({}).loads
    assert list(load.keys) == [full[0], unfull_key(sched, PROMPT[:28])]
    assert load.block_ids == ((20, 21, 22, 23), (24, 25, 26, SKIP_BLOCK))
    assert sched.hit_sources(b) == {"host": 28}  # type: ignore[arg-type]
    sched.copies_done(CopyReport(loads={load.job_id: (1, True)}), {"b"})
    split = sched.finished(b)["kvtier"]["tokens"]  # type: ignore[arg-type,index]
    assert split == {"device": 0, "host": 28, "recomputed": 22}


def test_a_device_hit_inside_the_unfull_chunk_loads_the_rest_of_it(sched: Planner) -> None:
    run_a(sched)
    longer = PROMPT + list(range(500, 520))
    b = FakeRequest("b", longer)
    assert sched.lookup(b, 20) == (8, True)  # type: ignore[arg-type]
    sched.allocated(b, ([40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52],), 8)  # type: ignore[arg-type]
    (load,) = sched.step({}).loads
    assert load.block_ids == ((SKIP_BLOCK, 45, 46, SKIP_BLOCK),)
    # The device holds all three stored blocks: nothing past them to load.
    assert sched.lookup(FakeRequest("c", longer), 28) == (0, False)  # type: ignore[arg-type]


def test_an_unfull_chunk_is_found_only_by_the_same_tokens(sched: Planner) -> None:
    run_a(sched)
    differs = [*PROMPT[:27], 1, *range(500, 520)]  # the third block differs
    assert sched.lookup(FakeRequest("b", differs), 0) == (16, True)  # type: ignore[arg-type]
    salted = FakeRequest("c", PROMPT + list(range(500, 520)), cache_salt="other")
    assert sched.lookup(salted, 0) == (0, False)  # type: ignore[arg-type]
    # The same prompt again: its three blocks end before its last token.
    assert sched.lookup(FakeRequest("d", PROMPT), 0) == (28, True)  # type: ignore[arg-type]
    # A prompt that ends with them can take two blocks only, whose key was never stored: a miss.
    assert sched.lookup(FakeRequest("e", PROMPT[:28]), 0) == (16, True)  # type: ignore[arg-type]


def test_a_prompt_shorter_than_a_chunk_is_found_again(sched: Planner) -> None:
    short = PROMPT[:10]  # two whole blocks, no full chunk
    stored = run_a(sched, short)
    assert stored == (sched.hasher.unfull_key(sched.hasher.root(), short[:8]),)
    assert sched.lookup(FakeRequest("b", [*short, 1, 2, 3]), 0) == (8, True)  # type: ignore[arg-type]


def test_nothing_unfull_is_stored_when_stores_are_skipped_or_no_block_is_whole(sched: Planner) -> None:
    assert run_a(sched, skip_store=True) == ()
    assert run_a(sched, PROMPT[:19]) == (sched.hasher.keys(PROMPT)[0],)  # 3 tokens past the chunk


def test_a_failed_load_of_an_unfull_chunk_counts_its_tokens_recomputed(sched: Planner) -> None:
    run_a(sched)
    b = FakeRequest("b", PROMPT + list(range(500, 520)))
    assert sched.lookup(b, 0) == (28, True)  # type: ignore[arg-type]
    sched.allocated(b, ([20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32],), 28)  # type: ignore[arg-type]
    (load,) = sched.step({}).loads
    sched.copies_done(CopyReport(loads={load.job_id: (1, False)}), {"b"})
    split = sched.finished(b)["kvtier"]["tokens"]  # type: ignore[arg-type,index]
    assert split == {"device": 0, "host": 0, "recomputed": 50}


def test_an_unfull_chunk_a_secondary_tier_holds_is_promoted_with_the_prefix() -> None:
    s = planner(secondary_tiers=[{"type": "memory", "name": "mem"}])
    try:
        run_a(s)
        settle(s)
        assert s.reset_cache() and s.manager.host.stats().ready == 0
        b = FakeRequest("b", PROMPT + list(range(500, 520)))
        assert s.lookup(b, 0) == (None, False)  # type: ignore[arg-type]  # promoting chunk 0
        settle(s)
        assert s.lookup(b, 0) == (None, False)  # type: ignore[arg-type]  # then the unfull one
        settle(s)
        assert s.lookup(b, 0) == (28, True)  # type: ignore[arg-type]
        s.allocated(b, ([20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32],), 28)  # type: ignore[arg-type]
        assert s.hit_sources(b) == {"mem": 28}  # type: ignore[arg-type]
        (load,) = s.step({}).loads
        assert list(load.keys) == [s.hasher.keys(PROMPT)[0], unfull_key(s, PROMPT[:28])]
        s.copies_done(CopyReport(loads={load.job_id: (1, True)}), {"b"})
        s.finished(b)  # type: ignore[arg-type]
        assert s.manager.host.stats().pinned == 0  # the promotion's holds were released
    finally:
        s.shutdown()


class Remembered:
    """An integration's event translator that records what it was asked to learn."""

    def __init__(self) -> None:
        self.unfull: list[tuple[bytes, int, int]] = []

    def remember(self, request: object, keys: object, first: int = 0) -> None:
        pass

    def remember_unfull(self, request: object, key: bytes, chunk: int, blocks: int) -> None:
        self.unfull.append((key, chunk, blocks))

    def translate_all(self, events: list[object]) -> list[object]:
        return []

    def close(self) -> None:
        pass


def test_the_events_learn_the_blocks_of_an_unfull_chunk_when_it_is_left() -> None:
    config = KVTierConfig.from_dict({"cpu_bytes_to_use": 8 * ROW_BYTES, "blocks_per_chunk": BPC})
    events = Remembered()
    s = Planner(config, geometry(blocks_per_chunk=BPC), 1, events=events)  # type: ignore[arg-type]
    try:
        s.bind_block_ids(lambda req_id: (A_BLOCKS,))
        run_a(s)
        assert events.unfull == [(unfull_key(s, PROMPT[:28]), 1, 3)]
    finally:
        s.shutdown()
