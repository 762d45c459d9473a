"""The SLO guard's rule on a controlled clock, its config errors, and a disabled tier in the manager
(real tier processes): no lookup, no cascade, data kept."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.manager import PrefixLookup, TieringManager
from kvtier.ops.guard import SLOGuard, SLOGuardConfig, p99
from kvtier.ops.metrics import KVTierMetrics
from tests.conftest import random_key
from tests.manager_helpers import drain, settle, start, store_in_host


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Switch:
    """The three manager methods the guard uses, over a list of names."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.enabled = dict.fromkeys(names, True)

    def tier_names(self) -> list[str]:
        return self.names

    def is_enabled(self, name: str) -> bool:
        return self.enabled[name]

    def set_enabled(self, name: str, enabled: bool) -> None:
        self.enabled[name] = enabled


def guard(**raw: Any) -> tuple[SLOGuard, Switch, Clock, KVTierMetrics]:
    clock, switch, metrics = Clock(), Switch(["fs", "redis", "slow"]), KVTierMetrics()
    config = SLOGuardConfig.from_dict({"window_s": 10, "sustain_s": 3, "cooldown_s": 20, **raw})
    return SLOGuard(config, switch, metrics, clock=clock), switch, clock, metrics


def run(g: SLOGuard, clock: Clock, seconds: float, ttft: float, itl: float = 0.01) -> None:
    """Feed one TTFT and one ITL sample and check, every 0.5 s for `seconds`."""
    end = clock.now + seconds
    while clock.now < end:
        clock.now += 0.5
        g.observe_ttft(ttft)
        g.observe_itl(itl)
        g.check()


def test_p99_is_the_nearest_rank() -> None:
    assert p99([3.0]) == 3.0
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([float(i) for i in range(1, 201)]) == 198.0


def test_a_sustained_overrun_disables_the_newest_tier_then_cooldown_restores_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    g, switch, clock, metrics = guard(ttft_p99_s=1.0)
    run(g, clock, 2.0, ttft=2.5)
    assert all(switch.enabled.values())  # over budget for 2 s < sustain_s
    assert metrics.value("kvtier_slo_over_budget") == 1
    with caplog.at_level(logging.WARNING, logger="kvtier.ops.guard"):
        run(g, clock, 1.5, ttft=2.5)
    assert switch.enabled == {"fs": True, "redis": True, "slow": False}
    assert metrics.value("kvtier_slo_rollbacks_total") == 1
    (line,) = [r.getMessage() for r in caplog.records]
    assert "ttft p99 2.500 s > budget 1.0 s" in line and "'slow'" in line
    # Still over: after another sustain_s the next newest goes too.
    run(g, clock, 3.5, ttft=2.5)
    assert switch.enabled == {"fs": True, "redis": False, "slow": False}
    # Back under budget: one tier back per cooldown, the last one disabled first.
    run(g, clock, 19.0, ttft=0.2)
    assert not switch.enabled["redis"]
    run(g, clock, 1.5, ttft=0.2)
    assert switch.enabled == {"fs": True, "redis": True, "slow": False}
    assert metrics.value("kvtier_slo_over_budget") == 0
    run(g, clock, 20.0, ttft=0.2)
    assert all(switch.enabled.values())
    assert g.state()["rollbacks"] == 2 and g.state()["disabled"] == []


def test_a_short_spike_inside_the_window_is_not_sustained() -> None:
    g, switch, clock, _ = guard(itl_p99_s=0.1, window_s=1)
    run(g, clock, 1.0, ttft=9.0, itl=0.5)  # TTFT has no budget here
    run(g, clock, 10.0, ttft=9.0, itl=0.01)
    assert all(switch.enabled.values())
    assert g.p99s["itl"] == 0.01


def test_alert_switches_nothing() -> None:
    g, switch, clock, metrics = guard(itl_p99_s=0.1, action="alert")
    run(g, clock, 4.0, ttft=0.0, itl=0.5)
    assert all(switch.enabled.values())
    assert metrics.value("kvtier_slo_alerts_total") == 1
    assert metrics.value("kvtier_slo_rollbacks_total") == 0


def test_a_tier_switched_by_hand_is_not_restored() -> None:
    g, switch, clock, _ = guard(ttft_p99_s=1.0)
    run(g, clock, 4.0, ttft=5.0)
    assert not switch.enabled["slow"]
    g.forget("slow")
    run(g, clock, 30.0, ttft=0.1)
    assert not switch.enabled["slow"]


@pytest.mark.parametrize(("raw", "key", "hint"), [
    ({}, "slo_guard", "ttft_p99_s and/or itl_p99_s"),
    ({"ttft_p99_s": 0}, "slo_guard.ttft_p99_s", "> 0"),
    ({"itl_p99_s": -1}, "slo_guard.itl_p99_s", "> 0"),
    ({"ttft_p99_s": 1, "window_s": 0}, "slo_guard.window_s", "> 0"),
    ({"ttft_p99_s": 1, "sustain_s": float("inf")}, "slo_guard.sustain_s", "finite"),
    ({"ttft_p99_s": 1, "action": "panic"}, "slo_guard.action", "disable_newest_tier, alert"),
    ({"ttft_p99_s": 1, "cooldown": 5}, "slo_guard.cooldown", "did you mean 'cooldown_s'"),
    ({"ttft_p99_s": True}, "slo_guard.ttft_p99_s", "> 0"),
])
def test_bad_guard_config_names_the_key(raw: dict[str, Any], key: str, hint: str) -> None:
    with pytest.raises(ConfigError, match=hint) as e:
        KVTierConfig.from_dict({"cpu_bytes_to_use": 1 << 20, "slo_guard": raw})
    assert e.value.key == key


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[TieringManager]:
    m = start("lru", [{"type": "memory"}, {"type": "fs", "root_dir": str(tmp_path / "fs")}])
    yield m
    m.shutdown()


def test_a_disabled_tier_takes_no_load_nor_store_and_keeps_its_data(manager: TieringManager) -> None:
    m = manager
    kept = [random_key() for _ in range(2)]
    store_in_host(m, kept)
    drain(m)
    m.set_enabled("memory", False)
    assert [m.is_enabled(n) for n in m.tier_names()] == [False, True]
    assert m.metrics.value("kvtier_tier_enabled", tier="memory") == 0
    later = [random_key() for _ in range(2)]
    store_in_host(m, later)
    drain(m)
    chunks = m.metrics.value
    assert chunks("kvtier_transfer_chunks_total", tier="memory", op="store") == 2
    assert chunks("kvtier_transfer_chunks_total", tier="fs", op="store") == 4
    m.host.clear()
    assert settle(m, kept, tiers={"memory"}) == PrefixLookup(0, pending=False)
    m.set_enabled("memory", True)
    assert settle(m, kept, tiers={"memory"}) == PrefixLookup(2, pending=False)
    m.release(kept)
    with pytest.raises(KeyError, match="known: memory, fs"):
        m.set_enabled("nope", False)
