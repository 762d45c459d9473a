"""The host memory plan: MemTotal less the engine's needs and the host tier must leave the reserve;
a plan that does not is refused naming the key, with its arithmetic; free memory is never read."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.errors import ConfigError, KVTierError
from kvtier.host import budget
from kvtier.host.budget import GIB, MemoryPlan
from tests.host.helpers import machine_of


def test_mem_total_is_read_not_mem_available(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684096 kB\nMemFree: 1 kB\nMemAvailable:   8388608 kB\n")
    assert budget.mem_total(meminfo) == 24684096 * 1024
    meminfo.write_text("MemAvailable: 1 kB\n")
    with pytest.raises(KVTierError, match="no MemTotal"):
        budget.mem_total(meminfo)
    with pytest.raises(KVTierError, match="cannot read MemTotal"):
        budget.mem_total(tmp_path / "absent")


def test_a_plan_that_leaves_the_reserve_passes_and_one_byte_more_is_refused() -> None:
    needs = (("device cache", 4 * GIB), ("weights", 2 * GIB))
    fits = MemoryPlan(16 * GIB, needs, 8 * GIB, 2 * GIB)
    assert fits.left == 2 * GIB
    fits.check("cpu_bytes_to_use", 8 * GIB)
    assert fits.line() == ("kvtier: memory plan: MemTotal 16.00 GiB - device cache 4.00 GiB - "
                           "weights 2.00 GiB - host tier 8.00 GiB = 2.00 GiB left, the reserve for "
                           "the OS and page cache (os_reserve_bytes) 2.00 GiB")
    over = MemoryPlan(16 * GIB, needs, 8 * GIB + 1, 2 * GIB)
    with pytest.raises(ConfigError) as e:
        over.check("--cpu-gb", 8.0)
    assert e.value.key == "--cpu-gb" and e.value.value == 8.0
    assert ("MemTotal 16.00 GiB - device cache 4.00 GiB - weights 2.00 GiB - host tier 8.00 GiB "
            "= 2.00 GiB left, under the 2.00 GiB kept for the OS") in str(e.value)
    assert "os_reserve_bytes" in str(e.value)


def test_an_over_committed_host_tier_shows_a_negative_remainder() -> None:
    plan = MemoryPlan(24 * GIB, (("device cache", GIB),), 100 * GIB, 0)
    with pytest.raises(ConfigError, match=r"host tier 100.00 GiB = -77.00 GiB left"):
        plan.check("cpu_bytes_to_use", 100 * GIB)


def test_the_default_reserve_is_a_tenth_of_this_machines_memory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    machine_of(monkeypatch, tmp_path, 40 * GIB)
    assert budget.plan((), GIB, None).reserve == 4 * GIB
    assert budget.plan((), GIB, None).total == 40 * GIB
    assert budget.plan((), GIB, 0).reserve == 0
    assert budget.plan((), GIB, None, total=10 * GIB).reserve == GIB
