"""`load_policy`: the real planner over a real tier process whose loads can be slowed (the memory
tier of `benchmarks.slow_tier`, slow while a flag file exists). The engine's prefill rate is set by
the steps the tests plan, on a clock of their own; tier loads are timed as they really run."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.config import KVTierConfig
from kvtier.engine.load_choice import PROBE_EVERY, PROBE_INTERVAL_S, LinearCost, LoadChoice
from kvtier.engine.planner import Planner
from kvtier.engine.step import CopyReport
from kvtier.ops.metrics import KVTierMetrics
from tests.engine.fakes import ROW_BYTES, FakeRequest, geometry
from tests.integrations.shared_helpers import settle

PROMPT = list(range(100, 114))  # 14 tokens: 3 full chunks of 4, 12 tokens a lookup may offer
TOKENS_PER_S = 24.0
"""The prefill rate the tests' steps show: 12 tokens recompute in 0.5 s."""
SLOW_S = 1.0
"""A slowed load: 3 chunks come back in 1 s, slower than recomputing them."""


class Clock:
    """The planner's clock for step times and probe intervals, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def flag(tmp_path: Path) -> Path:
    return tmp_path / "slow"


def planner(flag: Path, policy: str, host_rows: int = 8, slow_s: float = SLOW_S) -> tuple[Planner, Clock]:
    """A planner with `load_policy` `policy` over a host tier of `host_rows` rows and a tier "mem"
    whose loads take `slow_s` while `flag` exists; its prefill rate measured at `TOKENS_PER_S`."""
    config = KVTierConfig.from_dict({
        "cpu_bytes_to_use": host_rows * ROW_BYTES, "tier_lookup_wait_s": 30.0, "load_policy": policy,
        "secondary_tiers": [{"type": "FlaggedSlowTier", "module_path": "benchmarks.slow_tier",
                             "name": "mem", "flag_path": str(flag), "delay_s": slow_s}]})
    s = Planner(config, geometry(), 1)
    clock = Clock()
    s.choice.clock = clock
    s.bind_block_ids(lambda req_id: ([1, 2, 3, 4],))
    req = FakeRequest("first", PROMPT)
    assert s.lookup(req, 0) == (0, False)  # type: ignore[arg-type]
    plan = s.step({req.request_id: len(PROMPT)})
    clock.now += len(PROMPT) / TOKENS_PER_S
    req.num_computed_tokens = len(PROMPT)
    s.copies_done(CopyReport({job.job_id: (1, True) for job in plan.stores}))
    s.finished(req)  # type: ignore[arg-type]
    settle(s)  # cascaded to "mem"
    return s, clock


@pytest.fixture
def auto(flag: Path) -> Iterator[tuple[Planner, Clock]]:
    s, clock = planner(flag, "auto")
    yield s, clock
    s.shutdown()


def ask(s: Planner, name: str) -> tuple[int | None, bool]:
    """A new request for the prompt, the host tier emptied first: what its first lookup offers.
    A promotion it starts is waited for and its request finished, so the load is measured."""
    s.reset_cache()
    req = FakeRequest(name, PROMPT)
    first = s.lookup(req, 0)  # type: ignore[arg-type]
    if first[0] is None:
        settle(s)
        assert s.lookup(req, 0) == (12, True)  # type: ignore[arg-type]
    s.finished(req)  # type: ignore[arg-type]
    return first


def metric(s: Planner, name: str, tier: str = "mem") -> float:
    return s.manager.metrics.value(name, tier=tier)


def test_the_prefill_rate_is_measured_from_the_steps(auto: tuple[Planner, Clock]) -> None:
    s, _ = auto
    assert s.choice.prefill_rate() == pytest.approx(TOKENS_PER_S)
    assert s.manager.metrics.value("kvtier_prefill_tokens_per_second") == pytest.approx(TOKENS_PER_S)


def test_a_slow_tier_is_recomputed_and_counted(auto: tuple[Planner, Clock], flag: Path) -> None:
    s, _ = auto
    flag.touch()
    assert ask(s, "measured") == (None, False)  # nothing measured yet: loaded, and timed
    assert metric(s, "kvtier_load_fixed_seconds") + 3 * ROW_BYTES / metric(
        s, "kvtier_load_bytes_per_second") >= SLOW_S
    host_hit = FakeRequest("host-hit", PROMPT)
    assert s.lookup(host_hit, 0) == (12, True)  # type: ignore[arg-type]  # the host tier's: loaded
    s.finished(host_hit)  # type: ignore[arg-type]
    assert ask(s, "recomputed") == (0, False)
    split = s.accounting.finished["recomputed"]
    assert split["recomputed_by_choice"] == 12 and split["mem"] == 0 and split["recomputed"] == 2
    assert metric(s, "kvtier_recomputed_by_choice_tokens_total") == 12
    assert s.manager.metrics.value("kvtier_prompt_tokens_total", source="recomputed_by_choice") == 12
    waiting = FakeRequest("waiting", PROMPT)
    for _ in range(PROBE_EVERY):  # a request asked again on many steps is chosen for once
        assert s.lookup(waiting, 0) == (0, False)  # type: ignore[arg-type]
    assert metric(s, "kvtier_load_probes_total") == 0


def prefill_step(s: Planner, clock: Clock, name: str, tokens: int, seconds: float) -> None:
    """A request of `tokens` prompt tokens never seen before, computed in one step that takes
    `seconds`."""
    first = 1000 + 100 * len(s.accounting.finished)
    req = FakeRequest(name, list(range(first, first + tokens)))
    assert s.lookup(req, 0) == (0, False)  # type: ignore[arg-type]
    plan = s.step({req.request_id: tokens})
    clock.now += seconds
    req.num_computed_tokens = tokens
    s.copies_done(CopyReport({job.job_id: (1, True) for job in plan.stores}))
    s.finished(req)  # type: ignore[arg-type]


def test_a_steps_fixed_cost_is_no_price_of_a_prefix(auto: tuple[Planner, Clock], flag: Path) -> None:
    """Steps that cost 0.93 s however few their tokens, and 1/30 s per token beyond: the 12 tokens a
    load saves take 0.4 s of a step, not the 1.6 s tokens over seconds gave. A slowed load (1 s) of
    them is then slower than recomputing them, and they are recomputed."""
    s, clock = auto
    for i in range(3):
        prefill_step(s, clock, f"small-{i}", 2, 1.0)
        prefill_step(s, clock, f"large-{i}", 14, 1.5)
    flag.touch()
    assert ask(s, "measured") == (None, False)
    assert ask(s, "recomputed") == (0, False)
    assert s.accounting.finished["recomputed"]["recomputed_by_choice"] == 12
    assert s.choice.prefill_rate() == pytest.approx(30.3, rel=0.01)


def test_a_tier_that_turns_slow_is_judged_so_from_its_first_slow_job(
    auto: tuple[Planner, Clock], flag: Path
) -> None:
    """Loads timed fast four times, then one that takes 1 s where recomputing takes 0.5 s: the next
    request recomputes (the decayed fit alone would still expect 0.3 s and load again)."""
    s, _ = auto
    for i in range(4):
        assert ask(s, f"fast-{i}") == (None, False)
    flag.touch()
    assert ask(s, "first-slow") == (None, False)
    assert ask(s, "recomputed") == (0, False)
    assert s.accounting.finished["recomputed"]["recomputed_by_choice"] == 12


def test_a_fast_tier_is_loaded(auto: tuple[Planner, Clock]) -> None:
    s, _ = auto
    assert ask(s, "measured") == (None, False)
    assert ask(s, "loaded") == (None, False)
    assert s.accounting.finished["loaded"]["recomputed_by_choice"] == 0
    assert metric(s, "kvtier_recomputed_by_choice_tokens_total") == 0
    assert metric(s, "kvtier_load_probes_total") == 0


def test_a_slow_tier_is_probed_and_used_again_once_it_recovered(
    auto: tuple[Planner, Clock], flag: Path
) -> None:
    s, clock = auto
    flag.touch()
    ask(s, "measured")
    for i in range(PROBE_EVERY - 1):
        assert ask(s, f"skipped-{i}") == (0, False)
    # 1 in PROBE_EVERY candidates still loads, as a measurement: its request waits for nothing
    assert ask(s, "probe") == (0, False)
    assert s.accounting.finished["probe"]["recomputed_by_choice"] == 12
    assert metric(s, "kvtier_load_probes_total") == 1 and metric(s, "kvtier_load_give_ups_total") == 0
    settle(s)
    assert ask(s, "still-slow") == (0, False)
    flag.unlink()
    clock.now += PROBE_INTERVAL_S  # and one per PROBE_INTERVAL_S, however few candidates came
    assert ask(s, "second-probe") == (0, False)
    assert metric(s, "kvtier_load_probes_total") == 2
    settle(s)
    assert ask(s, "recovered") == (None, False)
    assert ask(s, "again") == (None, False)
    assert metric(s, "kvtier_load_probes_total") == 2


def test_always_loads_from_a_slow_tier(flag: Path) -> None:
    s, _ = planner(flag, "always")
    try:
        flag.touch()
        ask(s, "measured")
        assert ask(s, "loaded") == (None, False)
        assert "recomputed_by_choice" not in s.accounting.finished["loaded"]
        assert metric(s, "kvtier_recomputed_by_choice_tokens_total") == 0
    finally:
        s.shutdown()


def test_the_fit_separates_a_fixed_cost_from_a_throughput() -> None:
    cost = LinearCost()
    assert cost.fit() is None and cost.seconds(100) == 0
    for size in (1000, 2000, 4000, 1000, 3000):
        cost.add(size, 0.5 + size / 1000)
    fixed, per_byte = cost.fit()  # type: ignore[misc]
    assert fixed == pytest.approx(0.5) and per_byte == pytest.approx(1e-3)
    alike = LinearCost()
    alike.add(1000, 2.0)
    assert alike.seconds(3000) == pytest.approx(6.0)  # one size: taken as proportional


def test_the_choice_follows_the_run_length() -> None:
    """A tier with a fixed cost per job (0.3 s) and 0.1 s per chunk, against 1/6 s per chunk to
    recompute: a short run is recomputed, a long one loaded, a run that goes on in a far slower tier
    cut where that tier begins."""
    manager = SimpleNamespace(metrics=KVTierMetrics(), row_bytes=1000, tiers={"t": 0, "u": 0},
                              load_timer=None)
    clock = Clock()
    choice = LoadChoice("auto", manager, 4, clock)  # type: ignore[arg-type]
    choice.step_planned(24)
    clock.now += 1.0
    choice.step_ended()
    assert manager.load_timer == choice.tier_loaded
    choice.tier_loaded("t", 1000, 0.4)
    choice.tier_loaded("t", 4000, 0.7)
    choice.tier_loaded("u", 1000, 5.0)  # a tier far too slow
    short, long = Counter[str](), Counter[str]()
    assert choice.choose(short, ["t"] * 3) == 0 and short == {"t": 12}
    assert choice.choose(long, ["t"] * 10) == 10 and not long
    mixed = Counter[str]()
    assert choice.choose(mixed, ["t"] * 10 + ["u"] * 2) == 10 and mixed == {"u": 8}


def test_a_short_slow_job_does_not_make_long_loads_look_dear() -> None:
    """A tier with 0.3 s per job and 0.01 s per chunk, timed once on a 20-chunk job (so far taken
    as proportional), then on a 1-chunk job of 0.31 s, slower than recomputing the chunk (1/6 s):
    short runs are recomputed, but a 10-chunk run (0.4 s against 1.67 s) is still loaded."""
    manager = SimpleNamespace(metrics=KVTierMetrics(), row_bytes=1000, tiers={"t": 0}, load_timer=None)
    clock = Clock()
    choice = LoadChoice("auto", manager, 4, clock)  # type: ignore[arg-type]
    choice.step_planned(24)
    clock.now += 1.0
    choice.step_ended()
    choice.tier_loaded("t", 20000, 0.5)
    choice.tier_loaded("t", 1000, 0.31)
    assert choice.choose(Counter(), ["t"]) == 0
    assert choice.choose(Counter(), ["t"] * 10) == 10
