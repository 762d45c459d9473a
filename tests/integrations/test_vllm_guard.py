"""Real vLLM (CPU, float32, in-process) with a plug-in tier, loaded by `module_path`, whose loads
each take seconds: a promotion from it drives p99 TTFT over the SLO guard's budget, the guard
disables the tier once it stayed over for `sustain_s`, and serving goes on without it with identical
outputs. Under `load_policy: auto` the same engine recomputes the slow tier's chunk by choice, with
the same answer.

The guard runs on a clock of the test's (`StoppedClock`, set as the guard's `clock`): its window and
`sustain_s` pass when the test advances it, so they are steps of the test, not the machine's speed.
The TTFTs themselves are vLLM's, measured on the real clock."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli import main
from kvtier.engine.load_choice import PROBE_INTERVAL_S, LinearCost
from kvtier.format.chunks import HOST
from tests.integrations.conftest import BLOCK_SIZE, connector_halves
from tests.integrations.engine_steps import evict_host, generate
from tests.integrations.prompts import PROMPTS
from tests.integrations.shared_helpers import settle

pytestmark = pytest.mark.slow

CHUNK = BLOCK_SIZE  # one block per chunk: prompts of one chunk keep a normal TTFT short
ROW_BYTES = 30 * 2 * 3 * CHUNK * 64 * 4  # SmolLM2: 30 layers, 3 KV heads, head_dim 64, float32
HOST_SLOTS = 4
DELAY_S = 16.0
BUDGET_S = 9.0  # far above the TTFT of a one-chunk prompt (0.1 s idle, 6 s seen at load 20)
SUSTAIN_S = 2.0
WINDOW_S = 4.0
STEP_S = 0.5
"""How far the guard's clock moves for it to check again: past its check interval (0.1 s), and exact in
binary, as are the other times here, so that differences of clock readings are exact."""


class StoppedClock:
    """A clock that moves only when `advance` is called."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(scope="module")
def control_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ctl")


@pytest.fixture(scope="module")
def llm(make_llm: Callable[..., Any], control_dir: Path) -> Any:
    slow = {"type": "SlowLoadTier", "module_path": "tests.integrations.slow_tier", "name": "slow",
            "delay_s": DELAY_S}
    guard = {"ttft_p99_s": BUDGET_S, "window_s": WINDOW_S, "sustain_s": SUSTAIN_S,
             "cooldown_s": 3600}
    llm = make_llm({"cpu_bytes_to_use": HOST_SLOTS * ROW_BYTES, "blocks_per_chunk": 1,
                    "secondary_tiers": [slow], "slo_guard": guard,
                    "control_dir": str(control_dir)}, dtype="float32")
    clock = StoppedClock(1000.0)
    connector_halves(llm)[0].ops.guard.clock = clock
    # The engine's first request is slow (warm-up, seconds on a busy machine): its TTFT leaves the
    # window before the tests run (the clock stood still meanwhile: the rule never saw it sustained).
    for _ in range(2):
        generate(llm, tokens(llm, "garden"), skip_store=True)
    clock.advance(WINDOW_S + STEP_S)
    return llm


@pytest.fixture(scope="module")
def clock(llm: Any) -> StoppedClock:
    guard_clock = connector_halves(llm)[0].ops.guard.clock
    assert isinstance(guard_clock, StoppedClock)
    return guard_clock


def tokens(llm: Any, name: str) -> list[int]:
    """One chunk of the prompt plus one token (vLLM never offers the last prompt token)."""
    ids: list[int] = llm.get_tokenizer().encode(PROMPTS[name])
    return ids[: CHUNK + 1]


def evict(llm: Any, keys: list[bytes]) -> None:
    """Push `keys` out of the host tier and out of vLLM's device prefix cache."""
    evict_host(llm, keys, lambda name: tokens(llm, name))
    assert llm.reset_prefix_cache()


def test_slow_tier_is_rolled_back_within_sustain_s(
    llm: Any, clock: StoppedClock, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler, _ = connector_halves(llm)
    guard, value = scheduler.ops.guard, scheduler.manager.metrics.value
    slow_prompt, other = tokens(llm, "lighthouse"), tokens(llm, "bread")
    hit = CHUNK
    recomputed = generate(llm, other).outputs[0].token_ids
    generate(llm, slow_prompt)
    ref = generate(llm, slow_prompt)  # vLLM's own device prefix cache, at kvtier's hit length
    assert ref.num_cached_tokens == hit
    assert guard.rollbacks == 0 and value("kvtier_tier_enabled", tier="slow") == 1
    evict(llm, scheduler.hasher.keys(slow_prompt) + scheduler.hasher.keys(other))

    with caplog.at_level(logging.WARNING, logger="kvtier.ops.guard"):
        slow = generate(llm, slow_prompt)
        assert slow.kv_transfer_params["kvtier"]["tokens"]["slow"] == hit
        assert slow.outputs[0].token_ids == ref.outputs[0].token_ids
        # Each short request is an engine step, and each step checks the guard. At the first
        # check after the slow TTFT, p99 is over budget; the guard acts once it stayed over for
        # `sustain_s` of its clock, not before.
        clock.advance(STEP_S)
        generate(llm, tokens(llm, "chess")[:8], max_tokens=1)
        assert guard.over_since is not None and scheduler.manager.is_enabled("slow")
        clock.advance(SUSTAIN_S)
        generate(llm, tokens(llm, "chess")[:8], max_tokens=1)
        assert not scheduler.manager.is_enabled("slow")
    assert value("kvtier_tier_enabled", tier="slow") == 0
    assert value("kvtier_slo_rollbacks_total") == 1
    # The signals: the request's wait for its promotion, by source tier; health; configuration.
    assert value("kvtier_promotion_wait_seconds_count", tier="slow") == 1
    assert value("kvtier_promotion_wait_seconds_sum", tier="slow") >= DELAY_S * 0.9
    assert value("kvtier_tier_up", tier="slow") == 1
    assert value("kvtier_config_info", eviction_policy="lru", admission_policy="all",
                 tiers="slow:SlowLoadTier", cpu_bytes_to_use=str(HOST_SLOTS * ROW_BYTES),
                 blocks_per_chunk="1") == 1
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvtier.ops.guard"]
    seen = re.search(r"ttft p99 ([0-9.]+) s > budget", line)
    assert seen is not None and float(seen.group(1)) > DELAY_S and "disabled tier 'slow'" in line

    # Serving goes on without the tier: its chunks are recomputed, with the same answer.
    evict(llm, scheduler.hasher.keys(other))
    again = generate(llm, other)
    assert again.kv_transfer_params["kvtier"]["tokens"]["slow"] == 0
    assert again.outputs[0].token_ids == recomputed
    assert guard.state()["disabled"][0]["tier"] == "slow"


def ctl(control_dir: Path, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    capsys.readouterr()
    assert main(["ctl", "--dir", str(control_dir), *args]) == 0
    return capsys.readouterr().out


def test_kvtier_ctl_lists_switches_and_shows_the_guard(
    llm: Any, control_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scheduler, _ = connector_halves(llm)
    manager = scheduler.manager
    settle(scheduler)
    assert "tier slow: disabled" in ctl(control_dir, capsys, "disable", "slow")
    generate(llm, tokens(llm, "chess")[:8], max_tokens=1)  # an engine step applies it
    assert not manager.is_enabled("slow")
    rows = {line.split()[0]: line.split() for line in ctl(control_dir, capsys, "list").splitlines()[1:]}
    assert rows["slow"][1] == "disabled" and rows["host"][1] == "enabled"
    assert int(rows["slow"][2]) > 0  # its chunks are kept
    assert int(rows["host"][2]) == manager.host.stats().ready

    ctl(control_dir, capsys, "enable", "slow")
    generate(llm, tokens(llm, "chess")[:8], max_tokens=1)
    assert manager.is_enabled("slow")
    assert manager.metrics.value("kvtier_tier_enabled", tier="slow") == 1
    state = json.loads(ctl(control_dir, capsys, "guard"))
    assert state["config"]["ttft_p99_s"] == BUDGET_S
    assert state["disabled"] == []  # an operator's switch is not the guard's to undo

    # Tier health: the tier's process is killed; the next engine step sees it, and both the
    # metric and `kvtier ctl list` give the cause of the last failure.
    assert rows["slow"][6:] == ["up", "0", "-"]
    killed_at = time.time()
    os.kill(manager.tiers["slow"].pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while manager.tiers["slow"].last_failure is None or manager.metrics.value(
            "kvtier_tier_last_failure", tier="slow", cause="exited") == 0:
        assert time.monotonic() < deadline, "the dead tier process was not noticed"
        generate(llm, tokens(llm, "chess")[:8], max_tokens=1)
    at = manager.metrics.value("kvtier_tier_last_failure", tier="slow", cause="exited")
    assert killed_at - 1 <= at <= time.time()
    (slow,) = [t for t in json.loads(ctl(control_dir, capsys, "--json", "list"))["tiers"]
               if t["tier"] == "slow"]
    assert slow["last_failure"] == {"cause": "exited", "at": at}
    listing = ctl(control_dir, capsys, "list").splitlines()
    row = next(line.split() for line in listing if line.startswith("slow"))
    assert row[8] == "exited"


def stored_in_the_slow_tier_only(llm: Any, name: str) -> tuple[list[int], Any]:
    """The slow tier back up and enabled; prompt `name` computed (its greedy reply returned),
    cascaded to the slow tier, then evicted from the host tier and vLLM's device cache, with the
    slow tier out of the way (the fillers it holds are not promoted)."""
    scheduler, _ = connector_halves(llm)
    manager = scheduler.manager
    deadline = time.monotonic() + 60
    while not manager.is_enabled("slow") or not manager.tiers["slow"].is_up:
        assert time.monotonic() < deadline, "the slow tier did not come back"
        generate(llm, tokens(llm, "chess")[:8], max_tokens=1)
    prompt = tokens(llm, name)
    keys = scheduler.hasher.keys(prompt)

    def evict_past_the_slow_tier() -> None:
        manager.set_enabled("slow", False)
        try:
            evict(llm, keys)
        finally:
            manager.set_enabled("slow", True)

    evict_past_the_slow_tier()
    computed = generate(llm, prompt)
    settle(scheduler)
    evict_past_the_slow_tier()
    return prompt, computed


def recomputed_by_choice_under_auto(llm: Any, prompt: list[int], computed: Any) -> None:
    """Generate `prompt` under `load_policy: auto` (switched on in place; no probe by time): its
    chunk, which only the slow tier holds, is recomputed by choice, with the reply `computed` had."""
    choice = connector_halves(llm)[0].choice
    choice.auto, choice.probe_interval_s = True, float("inf")
    try:
        chosen = generate(llm, prompt)
    finally:
        choice.auto, choice.probe_interval_s = False, PROBE_INTERVAL_S
    split = chosen.kv_transfer_params["kvtier"]["tokens"]
    assert split["slow"] == 0 and split["recomputed_by_choice"] == CHUNK
    assert chosen.outputs[0].token_ids == computed.outputs[0].token_ids


def test_load_policy_auto_recomputes_the_slow_tier_with_the_same_answer(llm: Any) -> None:
    """The slow tier's load was measured at `DELAY_S`, far slower than recomputing one chunk at the
    prefill rate the engine's steps show: its chunk is recomputed by choice, with vLLM's answer."""
    scheduler, _ = connector_halves(llm)
    manager, choice = scheduler.manager, scheduler.choice
    prompt, computed = stored_in_the_slow_tier_only(llm, "bread")
    assert choice.prefill_rate() and choice.costs["slow"].seconds(ROW_BYTES) >= DELAY_S * 0.9
    counts = ("kvtier_recomputed_by_choice_tokens_total", "kvtier_load_probes_total")
    before = [manager.metrics.value(name, tier="slow") for name in counts]
    recomputed_by_choice_under_auto(llm, prompt, computed)
    after = [manager.metrics.value(name, tier="slow") for name in counts]
    assert [a - b for a, b in zip(after, before, strict=True)] == [CHUNK, 0]


def test_load_policy_auto_gives_up_a_load_that_turned_slow_with_the_same_answer(
    llm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slow tier measured fast (one job that took no time), so its chunk's promotion starts;
    the load takes `DELAY_S`, and the request stops waiting for it once past its patience (a few
    steps): recomputed by choice, with vLLM's own answer, and the give-up counted. Were the wait
    unbounded, the request would load the chunk `DELAY_S` later and its split would say so. The
    engine's measured costs are back as they were afterwards (the tests share the engine)."""
    scheduler, _ = connector_halves(llm)
    manager, choice = scheduler.manager, scheduler.choice
    prompt, computed = stored_in_the_slow_tier_only(llm, "garden")
    before = manager.metrics.value("kvtier_recomputed_by_choice_tokens_total", tier="slow")
    # Loads priced free (the tier's one job took no time, host copies unmeasured), so the choice
    # loads whatever prefill rate the engine's steps show; the request then waits for the load.
    monkeypatch.setitem(choice.costs, "slow", LinearCost())
    monkeypatch.setitem(choice.costs, HOST, LinearCost())
    choice.tier_loaded("slow", ROW_BYTES, 0.0)
    recomputed_by_choice_under_auto(llm, prompt, computed)
    assert manager.metrics.value("kvtier_load_give_ups_total", tier="slow") == 1
    assert manager.metrics.value("kvtier_recomputed_by_choice_tokens_total", tier="slow") == before + CHUNK
