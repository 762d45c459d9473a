"""`kvtier bench chaos --preset soak --duration 90` (slow): 90 s of conversations at
concurrency with host eviction and cascades into fs, obj and redis, the engine's process tree
sampled throughout. After the warm-up its RSS, open files, threads, processes and /dev/shm use
grow by under 5 % (the warm-up is the first round: every conversation stored once), every reply
is vLLM alone's, and the host tier ends clean with nothing pinned. The 30-minute run is the same
command with `--duration 1800` (RELIABILITY.md). It starts as the test run begins and runs beside
the fast tests (`tests/early_start.py`): its measures are of its own process tree."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvtier.bench.chaos.sampler import MEASURES
from tests.early_start import Started


def _soak(work: Path) -> list[str]:
    return [sys.executable, "-m", "kvtier.cli", "bench", "chaos", "--preset", "soak", "--duration",
            "90", "--json", "--work-dir", str(work / "work"), "--out", str(work / "soak.json")]


@pytest.mark.slow
@pytest.mark.early_start(argv_of=_soak, timeout_s=900)
def test_a_short_soak_keeps_resources_flat(early_run: Started) -> None:
    done = early_run.finish()
    out = early_run.work_dir / "soak.json"
    assert done.stdout.strip(), (done.returncode, done.stderr[-3000:])
    summary = json.loads(done.stdout)
    assert done.returncode == 0, (summary["checks"], summary["growth"], done.stderr[-3000:])
    assert set(summary["growth"]) == set(MEASURES)
    assert all(g is not None and g < 0.05 for g in summary["growth"].values()), summary["growth"]
    assert summary["wrong_replies"] == 0 and summary["failed_or_hung"] == 0
    assert summary["host"] == {"pinned": 0, "check": "clean"}
    samples = json.loads(out.read_text())["raw"]["samples"]
    assert all(s["processes"] >= 4 for s in samples)  # the engine and its 3 tier processes
    assert summary["corruptions"]["injected"] == 0 and not summary["faults"]
