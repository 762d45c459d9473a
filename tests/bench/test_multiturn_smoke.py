"""`kvtier bench multiturn --preset smoke` end to end (slow): real vLLM servers (no offload, then
kvtier's host tier, each on a fresh server) on a 16-block device cache, driven over HTTP with
streaming. The host tier promotes tokens, vLLM alone has nothing but device hits and recompute,
every point's split adds up to its prompt tokens, and no server is left running. The command runs
beside the fast tests (`tests/early_start.py`). The rounds of `--repeats` (rotated order, a fresh
engine per run, median and spread) are tested without servers in `test_multiturn_repeats.py`: a
second round here would start two more servers to check the same schedule."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest

from tests.early_start import Started, running_with

NAME = f"smoke-{uuid.uuid4().hex[:8]}"
"""The servers' model name, which only this run's processes carry on their command lines."""


def _sweep(work: Path) -> list[str]:
    return [sys.executable, "-m", "kvtier.cli", "bench", "multiturn", "--preset", "smoke", "--json",
            "--served-model-name", NAME, "--out", str(work / "out"), "--repeats", "1"]


@pytest.mark.slow
@pytest.mark.early_start(argv_of=_sweep, timeout_s=900)
def test_smoke_sweep_end_to_end(early_run: Started) -> None:
    done = early_run.finish()
    assert done.returncode == 0, done.stderr[-4000:]
    assert not running_with(NAME), "a benchmark server was left running"
    result = json.loads(done.stdout)
    points = {p["config"]: p for p in result["points"]}
    assert set(points) == {"no-offload", "host"}
    order = [(p["config"], p["repeat"]) for p in result["points"]]
    assert order == [("no-offload", 0), ("host", 0)]
    for p in result["points"]:
        assert p["conversations"] == 4 and p["requests"] == 12 and p["failed_requests"] == 0
        assert p["tokens_sum_ok"], p["tokens"]
        assert sum(p["tokens"].values()) == p["prompt_tokens"]
        assert p["output_tokens"] == 12 * 4
        assert p["prompt_tokens_per_s"] > 0 and p["ttft_s"]["p50"] <= p["ttft_s"]["p99"]
        assert p["client"]["loop_lag_ms"]["p99"] < 1000
    # the same prompts reach both servers (greedy replies of one model)
    assert points["host"]["prompt_tokens"] == points["no-offload"]["prompt_tokens"]
    off, host = points["no-offload"]["tokens"], points["host"]["tokens"]
    assert set(off) == {"device", "recomputed"} and off["device"] > 0
    assert host["host"] > 0 and points["host"]["reloaded_tokens"] == host["host"]
    assert host["recomputed"] < off["recomputed"]
    out = early_run.work_dir / "out"
    assert (out / "results.png").stat().st_size > 10_000
    assert json.loads((out / "results.json").read_text())["points"] == result["points"]
    assert "TTFT" in done.stderr  # progress while it ran
