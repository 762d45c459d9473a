"""A request's bounded wait for a promotion (`kvtier.engine.load_choice.GiveUps`): the real planner
over a real tier process whose loads are slowed while a flag file exists (`benchmarks.slow_tier`). Waits are
timed on the planner's clock, moved by the tests; a streamed batch's wait on the real clock."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.engine.copies import ChunkCopy
from kvtier.engine.planner import Planner
from kvtier.engine.step import CopyReport
from tests.engine.fakes import FakeRequest
from tests.engine.test_load_choice import PROMPT, Clock, ask, metric, planner
from tests.integrations.shared_helpers import settle


@pytest.fixture
def flag(tmp_path: Path) -> Path:
    return tmp_path / "slow"


@pytest.fixture
def measured(flag: Path) -> Iterator[tuple[Planner, Clock]]:
    """`auto`, the tier's loads measured fast twice, then slowed (3 s: a given-up load is still in
    flight while a test looks, however busy the machine): the fit still expects them fast."""
    s, clock = planner(flag, "auto", slow_s=3.0)
    assert ask(s, "fast-1") == (None, False) and ask(s, "fast-2") == (None, False)
    flag.touch()
    s.reset_cache()
    yield s, clock
    s.shutdown()


def test_a_request_gives_up_a_promotion_past_its_patience(measured: tuple[Planner, Clock]) -> None:
    s, clock = measured
    req = FakeRequest("slow", PROMPT)
    assert s.lookup(req, 0) == (None, False)  # type: ignore[arg-type]  # expected fast: waited for
    clock.now += 0.01
    assert s.lookup(req, 0) == (None, False)  # type: ignore[arg-type]  # within its patience
    clock.now += 0.5  # recomputing the 12 tokens takes 0.5 s: the longest patience there is
    assert s.lookup(req, 0) == (0, False)  # type: ignore[arg-type]
    assert s.lookup(req, 0) == (0, False)  # type: ignore[arg-type]  # and stays given up
    s.finished(req)  # type: ignore[arg-type]
    split = s.accounting.finished["slow"]
    assert split["recomputed_by_choice"] == 12 and split["mem"] == 0
    assert metric(s, "kvtier_load_give_ups_total") == 1
    assert s.manager.in_flight == 1  # the promotion goes on in the background


def test_a_give_up_is_evidence_until_the_tiers_next_job_ends(measured: tuple[Planner, Clock]) -> None:
    s, clock = measured
    req = FakeRequest("slow", PROMPT)
    assert s.lookup(req, 0) == (None, False)  # type: ignore[arg-type]
    clock.now += 0.6
    assert s.lookup(req, 0) == (0, False)  # type: ignore[arg-type]
    s.finished(req)  # type: ignore[arg-type]
    other = [7, *PROMPT[1:]]  # other chunks in the same tier, which the fit still expects fast
    host = s.manager.host
    for key in s.hasher.keys(other):
        assert host.reserve([key]) is not None
        host.commit([key], success=True)
    s.manager.cascade(s.hasher.keys(other))
    while s.manager.in_flight > 1:
        s.manager.poll()
    s.reset_cache()
    behind = FakeRequest("behind", other)
    assert s.lookup(behind, 0) == (0, False)  # type: ignore[arg-type]  # not promoted
    assert s.accounting.finished.get("behind") is None and s.manager.in_flight == 1
    settle(s)  # the given-up promotion ends and is measured: the tier is judged by it
    assert s.choice.costs["mem"].seconds(3 * s.manager.row_bytes) >= 0.2
    assert ask(s, "after") == (0, False)


def test_a_request_waiting_on_another_requests_promotion_gives_up_too(
    measured: tuple[Planner, Clock],
) -> None:
    s, clock = measured
    first, second = FakeRequest("first", PROMPT), FakeRequest("second", PROMPT)
    assert s.lookup(first, 0) == (None, False)  # type: ignore[arg-type]
    assert s.lookup(second, 0) == (None, False)  # type: ignore[arg-type]  # first's chunks pending
    clock.now += 0.6
    assert s.lookup(second, 0) == (0, False)  # type: ignore[arg-type]
    s.finished(second)  # type: ignore[arg-type]
    assert s.accounting.finished["second"]["recomputed_by_choice"] == 12
    assert metric(s, "kvtier_load_give_ups_total") >= 1
    settle(s)  # first's promotion ends: its chunks stay held for first, whoever gave up on them
    s.reset_cache()
    assert s.lookup(first, 0) == (12, True)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy, measured_first", [("auto", False), ("always", True)])
def test_a_slow_load_is_waited_for_when_nothing_bounds_the_wait(
    flag: Path, policy: str, measured_first: bool,
) -> None:
    """`auto` before anything is measured of the tier (its first load), and `always` at any time:
    however long the slowed load takes, the request waits for it and loads."""
    s, clock = planner(flag, policy)
    try:
        if measured_first:
            assert ask(s, "fast") == (None, False)
        flag.touch()
        s.reset_cache()
        req = FakeRequest("slow", PROMPT)
        assert s.lookup(req, 0) == (None, False)  # type: ignore[arg-type]
        clock.now += 100.0
        assert s.lookup(req, 0) == (None, False)  # type: ignore[arg-type]
        settle(s)
        assert s.lookup(req, 0) == (12, True)  # type: ignore[arg-type]
        assert metric(s, "kvtier_load_give_ups_total") == 0
    finally:
        s.shutdown()


def test_a_stream_stops_waiting_for_a_slow_batch_and_counts_it_by_choice(flag: Path) -> None:
    """A host tier of 2 rows, a prefix of 3 chunks: the third is streamed. Its promotion is slow
    (1 s against a patience of a few hundredths: 4 tokens recompute in 0.17 s), so the stream ends
    with a failed last part whose tokens are recomputed by choice, not counted as a failure."""
    s, _ = planner(flag, "auto", host_rows=2)
    try:
        host = s.manager.host
        for key in s.hasher.keys(PROMPT):  # the tier holds all three (the first store kept two)
            if host.reserve([key]) is not None:
                host.commit([key], success=True)
                s.manager.cascade([key])
                settle(s)
        assert ask(s, "fast") == (None, False)
        flag.touch()
        s.reset_cache()
        req = FakeRequest("streamed", PROMPT)
        deadline = time.monotonic() + 10
        while (found := s.lookup(req, 0))[0] is None:  # type: ignore[arg-type]
            assert time.monotonic() < deadline
            s.manager.poll()  # the head's promotion: waited for (the planner's clock stands still)
            time.sleep(0.002)
        assert found == (12, True)
        s.allocated(req, ([1, 2, 3, 4],), 12)  # type: ignore[arg-type]
        parts: list[ChunkCopy] = []
        while not parts or not parts[-1].last:
            assert time.monotonic() < deadline, "the stream did not end"
            for load in s.step({}).loads:
                parts.append(load)
                if load.slots:
                    s.copies_done(CopyReport(loads={load.job_id: (1, True)}))
            time.sleep(0.01)
        assert not parts[-1].slots  # the given-up rest: no rows, recomputed by vLLM
        s.finished(req)  # type: ignore[arg-type]
        split = s.accounting.finished["streamed"]
        assert split["recomputed_by_choice"] == 4 * len(parts[-1].keys)
        assert metric(s, "kvtier_load_give_ups_total") == 1
        assert s.manager.metrics.value("kvtier_failures_total", tier="host", op="load") == 0
    finally:
        s.shutdown()
