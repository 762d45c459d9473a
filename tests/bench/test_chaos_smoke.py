"""`kvtier bench chaos --preset smoke` end to end (slow): a real in-process vLLM engine with host
+ fs + obj (SeaweedFS) + redis + cluster (a three-master Valkey Cluster) + p2p (a peer process)
tiers serves conversations while stored chunks are corrupted in every way the campaign knows and
tier processes, redis-server, SeaweedFS, a cluster node and the peer are killed, stopped and
restarted, and the fs tier's disk is filled. No reply may differ from vLLM alone's, no request
may fail or hang, no corruption may be served, every corruption a tier read must be counted by
kvtier's own metric, and nothing the run started may outlive it. The command runs beside the fast
tests (`tests/early_start.py`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvtier.bench.chaos.faults import FAULTS
from tests.early_start import Started, running_with


def _smoke(work: Path) -> list[str]:
    return [sys.executable, "-m", "kvtier.cli", "bench", "chaos", "--preset", "smoke", "--json",
            "--work-dir", str(work / "work"), "--out", str(work / "chaos.json")]


@pytest.mark.slow
@pytest.mark.early_start(argv_of=_smoke, timeout_s=600)
def test_chaos_smoke_serves_nothing_wrong(early_run: Started) -> None:
    done = early_run.finish()
    assert not running_with(str(early_run.work_dir / "work")), "a server or tier process outlived the run"
    assert done.stdout.strip(), (done.returncode, done.stderr[-3000:])
    summary = json.loads(done.stdout)
    assert done.returncode == 0, (summary["checks"], done.stderr[-3000:])
    assert summary["wrong_replies"] == 0 and summary["failed_or_hung"] == 0
    c = summary["corruptions"]
    assert c["injected"] > 0 and c["served"] == 0
    # every corruption read was detected; more only for injections that raised yet may have landed
    assert 0 < c["read"] <= c["detected"] <= c["read"] + sum(c["failed_injections"].values()), c
    assert set(c["by_kind"]) == {"header_flip", "payload_flip", "truncate", "extend", "swap",
                                 "stale_layout"}
    ran = summary["faults"]
    assert all(ran.get(kind, {}).get("survived", 0) >= 1 for kind in FAULTS), ran
    tiers = summary["tiers"]
    assert set(tiers) == {"fs", "obj", "redis", "cluster", "p2p"}
    assert all(t["served"] == 0 and t["wrong_replies"] == 0 and t["detected"] <= t["counted"]
               for t in tiers.values()), tiers
    assert tiers["cluster"]["injected"] > 0 and tiers["p2p"]["injected"] > 0, tiers
    assert summary["host"] == {"pinned": 0, "check": "clean"}
    assert summary["temps"]["left"] > 0 and summary["temps"]["remaining"] == 0
    assert sum(v for k, v in summary["prompt_tokens"].items() if k not in ("device", "recomputed")) > 0
    out = early_run.work_dir / "chaos.json"
    assert json.loads(out.read_text())["summary"] == summary
